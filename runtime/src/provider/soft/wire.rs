//! The socket of a connection to a remote engine, shared by the engine and
//! the threads that post work requests.
//!
//! A posting thread may write a small request packet to the socket itself
//! (see `direct.rs`) while the engine has nothing to write on this
//! connection: `busy` is set by the engine (under the lock) before it
//! produces any output for the connection and cleared only once all of its
//! output is written, so the two never interleave and what the engine
//! writes after a poster's packet was produced after it. Bytes a poster
//! could not write (socket full) are left in `spill`; the engine writes them
//! before anything else. Of a large payload written from registered memory,
//! what the socket did not take stays in that memory (`spill_mem`): the
//! engine writes it from there, right after the spill (the WR, which is not
//! complete before its payload is acknowledged, keeps the memory the
//! application's; a QP that fails first copies it out, as for the engine's
//! own zero-copy payloads).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use mio::unix::SourceFd;
use mio::{Interest, Registry};

use smallvec::SmallVec;

use super::conn::ACK_SCAN;
use super::conn::{TxKey, TxMem, TxMemRef};
use super::dma::Span;
use super::lock;
use super::mr::MrTable;
use super::packet::{merge_ack, HEADER_LEN};

/// The unsent rest of a poster's payload is left in its memory for the
/// engine (not copied) from this size on.
pub(crate) const SPILL_MEM_MIN: usize = 16 * 1024;

/// Whose memory the last span of a poster's gathered payload is (see
/// [`Wire::try_write_gather`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SpillTail {
    /// The posting QP.
    pub qpn: u32,
    /// The span's registration and PD.
    pub lkey: u32,
    pub pd: u32,
    /// The span's first byte (a registered address).
    pub addr: u64,
}

/// Result of a poster's attempt to write a packet.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DirectWrite {
    /// Written completely.
    Sent,
    /// Written in part or not at all (the socket is full or failed); the
    /// rest waits in the spill: the engine must be woken to write it.
    Spilled,
}

struct WireState {
    /// The engine has (or is producing) output for this connection.
    busy: bool,
    /// The engine closed the connection.
    closed: bool,
    /// Bytes a poster could not write, to be written before anything else.
    spill: Vec<u8>,
    /// The unsent rest of a poster's payload in registered memory, written
    /// from there right after `spill` (see [`Wire::try_write_gather`]).
    spill_mem: Option<TxMemRef>,
    /// ACKs the engine holds back for a request to ride with: a poster
    /// writes them before its packet (one write, one wakeup of the peer).
    held: Vec<u8>,
    /// Small request packets posters corked: written after `held` and
    /// before anything else (see [`Wire::try_write_or_cork`]).
    corked: Vec<u8>,
}

/// A poster's small request waits corked while its QP has requests in
/// flight, until the corked bytes would pass this (then all go in one
/// write) or a flush (see [`Wire::try_write_or_cork`]).
pub(crate) const CORK_MAX: usize = 8 * 1024;

/// Result of [`Wire::try_write_or_cork`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Posted {
    /// Written now (with everything corked before it).
    Wrote(DirectWrite),
    /// Corked. `first`: the wire had nothing corked before (the caller
    /// lists it for a flush, see `Shared::flush_corked`).
    Corked { first: bool },
}

/// What [`Wire::unmute_expired`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseCheck {
    /// The lease lasts: the socket stays muted.
    Muted,
    /// The engine watches the socket's input (again). `unread`: its lease
    /// ended now with data waiting that no application had read.
    Unmuted { unread: bool },
}

/// A connection's socket, shared between the engine and posting threads.
pub(crate) struct Wire {
    /// The engine reads from it; writes follow the protocol above.
    pub stream: mio::net::TcpStream,
    st: Mutex<WireState>,
    /// Its token in the engine's poll.
    token: mio::Token,
    /// While an application drives this connection's receives (see
    /// `drive.rs`): until when ([`Shared::nanos_at`]; 0 = no lease). Renewed
    /// by every driving poll.
    ///
    /// [`Shared::nanos_at`]: super::context::Shared::nanos_at
    lease_until: AtomicU64,
    /// True while the engine does not watch the socket's input (the
    /// interest is WRITABLE only). Changed, together with the registration,
    /// only under this lock.
    muted: Mutex<bool>,
    /// Mirror of `muted`, read without the lock (a hint: the lock decides).
    muted_hint: AtomicBool,
    /// Mirror of `!st.held.is_empty()`, read without the lock (a hint).
    held_hint: AtomicBool,
    /// Mirror of `!st.corked.is_empty()`, read without the lock (a hint).
    corked_hint: AtomicBool,
    /// A poster wrote a request since the engine last asked (see
    /// `Conn::hold_pays`).
    request_sent: AtomicBool,
    /// `send` system calls made by posters and flushes (not the engine's;
    /// tests, diagnostics).
    writes: AtomicU64,
}

impl Wire {
    /// A new connection: busy until the engine has written its first
    /// packet (its HELLO, or a verifier's VERIFY, see `engine/port.rs`).
    pub fn new(stream: mio::net::TcpStream, token: mio::Token) -> Wire {
        Wire {
            stream,
            token,
            lease_until: AtomicU64::new(0),
            muted: Mutex::new(false),
            muted_hint: AtomicBool::new(false),
            held_hint: AtomicBool::new(false),
            corked_hint: AtomicBool::new(false),
            request_sent: AtomicBool::new(false),
            writes: AtomicU64::new(0),
            st: Mutex::new(WireState {
                busy: true,
                closed: false,
                spill: Vec::new(),
                spill_mem: None,
                held: Vec::new(),
                corked: Vec::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, WireState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The engine's id of the connection.
    pub fn cid(&self) -> usize {
        self.token.0 - super::engine::CONN_BASE
    }

    /// True while the engine has output for this connection not yet
    /// written (or closed it).
    pub fn engine_busy(&self) -> bool {
        self.state().busy
    }

    /// True once the engine closed the connection.
    pub fn is_closed(&self) -> bool {
        self.state().closed
    }

    /// Engine: it is about to produce output; posters queue from now on.
    pub fn claim(&self) {
        self.state().busy = true;
    }

    /// Engine: moves bytes a poster could not write to `tx` at `at` (the
    /// unsent start of the engine's buffer: they go first), the spilled
    /// rest of a poster's packet before any held ACKs.
    pub fn take_spill(&self, tx: &mut Vec<u8>, at: usize) {
        let mut st = self.state();
        let st = &mut *st;
        // A poster's write takes the held ACKs along, but the engine may
        // park ACKs after a poster spilled (its own buffer is empty then):
        // the spill is the tail of a packet whose head is on the wire, so it
        // goes first, the ACKs (whole packets) after it, then corked
        // requests (whole packets, before any the engine makes).
        if !st.corked.is_empty() {
            tx.splice(at..at, st.corked.drain(..));
            self.corked_hint.store(false, Ordering::Relaxed);
        }
        if !st.held.is_empty() {
            tx.splice(at..at, st.held.drain(..));
            self.held_hint.store(false, Ordering::Relaxed);
        }
        if !st.spill.is_empty() {
            tx.splice(at..at, st.spill.drain(..));
        }
    }

    /// Engine: adopts the unsent rest of a poster's payload in registered
    /// memory, if one waits, as the connection's zero-copy payload (which
    /// goes right after `tx`'s unsent bytes, so nothing else may be queued
    /// behind them yet: `engine_mem` must be free): the bytes a poster could
    /// not write replace the engine's unsent ones in `tx` (from `at`), and
    /// those (after the held ACKs) go to `after`, to follow the payload.
    /// With `engine_mem` taken, the rest is copied out of the memory into
    /// the spill instead (`mrs`: the locked MR table), for
    /// [`take_spill`](Self::take_spill).
    pub fn take_spill_mem(
        &self,
        tx: &mut Vec<u8>,
        at: usize,
        engine_mem: &mut Option<TxMemRef>,
        after: &mut Vec<u8>,
        mrs: &MrTable,
    ) {
        let mut st = self.state();
        let st = &mut *st;
        let Some(mem) = st.spill_mem.take() else {
            return;
        };
        if engine_mem.is_some() {
            let mut m = lock(&mem);
            m.snapshot(mrs);
            if let Some(copy) = &m.copy {
                let done = copy.len() - (m.len - m.pos);
                st.spill.extend_from_slice(&copy[done..]);
            }
            m.pos = m.len;
            return;
        }
        debug_assert!(after.is_empty());
        after.clear();
        after.append(&mut st.held);
        self.held_hint.store(false, Ordering::Relaxed);
        // (A poster's write that spilled took what was corked along, and
        // none corks while the spill waits: empty, kept for the order.)
        after.append(&mut st.corked);
        self.corked_hint.store(false, Ordering::Relaxed);
        after.extend_from_slice(&tx[at..]);
        tx.truncate(at);
        tx.append(&mut st.spill);
        *engine_mem = Some(mem);
    }

    /// Engine: parks encoded ACKs for a poster to take along (see `held`)
    /// and lets posters write if nothing else is pending. An ACK of the
    /// same two QPs as one already parked replaces that one's PSN instead
    /// of following it (`merge_ack`; parked ACKs are ACKs only, so their
    /// order across QPs is free): a QP's messages that arrive in several
    /// reads while the ACKs wait cost one ACK on the wire, not one per
    /// read.
    pub fn hold(&self, acks: &[u8]) {
        let mut st = self.state();
        let mut rest = acks;
        while rest.len() >= HEADER_LEN {
            let (next, more) = rest.split_at(HEADER_LEN);
            // (Only ACKs are parked: their order across QPs is free.)
            let merged = st
                .held
                .rchunks_exact_mut(HEADER_LEN)
                .take(ACK_SCAN)
                .any(|last| merge_ack(last, next));
            if !merged {
                st.held.extend_from_slice(next);
            }
            rest = more;
        }
        st.held.extend_from_slice(rest);
        self.held_hint.store(true, Ordering::Relaxed);
        if st.spill.is_empty() && st.spill_mem.is_none() && !st.closed {
            st.busy = false;
        }
    }

    /// Engine: true once the held ACKs were written.
    pub fn held_gone(&self) -> bool {
        self.state().held.is_empty()
    }

    /// Like [`held_gone`](Self::held_gone), without the lock: a hint (for
    /// what only guides a heuristic).
    pub fn held_gone_hint(&self) -> bool {
        !self.held_hint.load(Ordering::Relaxed)
    }

    /// Engine: `idle` = it has nothing left to write; posters may write
    /// again if no spilled bytes wait either.
    pub fn release(&self, idle: bool) {
        let mut st = self.state();
        if idle && st.spill.is_empty() && st.spill_mem.is_none() && !st.closed {
            st.busy = false;
        }
    }

    /// True while the engine does not watch the socket's input.
    #[cfg(test)]
    pub fn is_muted(&self) -> bool {
        *lock(&self.muted)
    }

    /// The lease's end (0 = none).
    pub fn lease_until(&self) -> u64 {
        self.lease_until.load(Ordering::Relaxed)
    }

    /// Application: it drives this connection's receives until `until`
    /// (see `lease_until`).
    pub fn renew_lease(&self, until: u64) {
        self.lease_until.store(until, Ordering::Relaxed);
    }

    /// Engine (or an application arming a CQ whose channel now wakes for
    /// the socket): stops watching the socket's input while the lease lasts
    /// (`now`, like the lease, in [`Shared::nanos_at`] units), unless
    /// `armed()`: an application sleeps until a CQ fed by this connection
    /// has a completion, so only the engine would read what arrives. True
    /// if it muted the socket now.
    ///
    /// [`Shared::nanos_at`]: super::context::Shared::nanos_at
    pub fn mute(&self, registry: &Registry, now: u64, armed: impl FnOnce() -> bool) -> bool {
        if self.lease_until.load(Ordering::Relaxed) <= now
            || self.muted_hint.load(Ordering::Relaxed)
        {
            return false;
        }
        let mut muted = lock(&self.muted);
        // (The lease is read again under the lock: `revoke` ends it there.)
        if *muted || self.lease_until.load(Ordering::Relaxed) <= now || armed() {
            return false;
        }
        let fd = self.fd();
        match registry.reregister(&mut SourceFd(&fd), self.token, Interest::WRITABLE) {
            Ok(()) => {
                *muted = true;
                self.muted_hint.store(true, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: cannot mute a socket");
                false
            }
        }
    }

    /// Engine: watches the socket's input again once the lease is over.
    pub fn unmute_expired(&self, registry: &Registry, now: u64) -> LeaseCheck {
        let mut muted = lock(&self.muted);
        if !*muted {
            return LeaseCheck::Unmuted { unread: false };
        }
        if self.lease_until.load(Ordering::Relaxed) > now {
            return LeaseCheck::Muted;
        }
        let unread = super::fd_readable(self.fd());
        self.unmute(registry, &mut muted);
        LeaseCheck::Unmuted { unread }
    }

    /// Application, arming a CQ this connection feeds (it is going to sleep
    /// until the engine delivers): ends the lease and hands the socket's
    /// input back to the engine at once.
    pub fn revoke(&self, registry: &Registry) {
        let mut muted = lock(&self.muted);
        self.lease_until.store(0, Ordering::Relaxed);
        if *muted {
            self.unmute(registry, &mut muted);
        }
    }

    /// Registers for input again. Data already waiting makes the engine's
    /// poll report the socket at once (epoll checks readiness on MOD).
    fn unmute(&self, registry: &Registry, muted: &mut bool) {
        *muted = false;
        self.muted_hint.store(false, Ordering::Relaxed);
        let fd = self.fd();
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = registry.reregister(&mut SourceFd(&fd), self.token, interest) {
            // (The connection was closed meanwhile: nothing to watch.)
            tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: cannot unmute a socket");
        }
    }

    /// Engine: the connection is gone; posters queue (and the engine fails
    /// their QPs). The socket is shut down so the peer sees the end at once.
    pub fn close(&self) {
        *lock(&self.muted) = false;
        self.muted_hint.store(false, Ordering::Relaxed);
        self.lease_until.store(0, Ordering::Relaxed);
        let mut st = self.state();
        st.closed = true;
        st.busy = true;
        st.spill.clear();
        st.spill_mem = None;
        st.held.clear();
        self.held_hint.store(false, Ordering::Relaxed);
        st.corked.clear();
        self.corked_hint.store(false, Ordering::Relaxed);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Poster: the connection's state if a poster may write now (the
    /// engine has nothing pending and does not hold the lock); the write
    /// that follows is a request (see [`Wire::take_request_sent`]).
    fn poster_lock(&self) -> Option<MutexGuard<'_, WireState>> {
        let st = match self.st.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        if st.busy || st.closed {
            return None;
        }
        self.request_sent.store(true, Ordering::Relaxed);
        Some(st)
    }

    /// Application going to sleep (arming a CQ this connection feeds):
    /// writes the ACKs held for a request of its to take along, since none
    /// will come before it wakes (its peer may wait for them: a requester
    /// whose next request waits for this one's completion). Not a request
    /// (holds keep paying). `None` if nothing was held or the engine has
    /// output pending (it is awake and writes them first); `Spilled`: the
    /// engine must be rung to write the rest.
    pub fn flush_held(&self) -> Option<DirectWrite> {
        if self.held_gone_hint() && !self.corked_hint.load(Ordering::Relaxed) {
            return None;
        }
        let mut st = match self.st.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        if st.busy || st.closed || (st.held.is_empty() && st.corked.is_empty()) {
            return None;
        }
        Some(self.write_locked(&mut st, &[]))
    }

    /// `send` system calls posters and flushes made on this connection.
    #[cfg(test)]
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// True while requests wait corked (a hint, read without the lock).
    pub fn corked_hint(&self) -> bool {
        self.corked_hint.load(Ordering::Relaxed)
    }

    /// Writes the corked requests (and the held ACKs before them), waiting
    /// for the lock a poster or the engine holds only for a write. `None`:
    /// nothing corked, or the engine has output pending (its next write
    /// takes them first, see [`take_spill`](Self::take_spill)) or closed
    /// the connection; `Spilled`: the engine must be rung for the rest.
    pub fn flush_corked(&self) -> Option<DirectWrite> {
        if !self.corked_hint() {
            return None;
        }
        let mut st = self.state();
        if st.busy || st.closed || st.corked.is_empty() {
            return None;
        }
        Some(self.write_locked(&mut st, &[]))
    }

    /// Writes the held ACKs, the corked requests and `pkt`, in that order,
    /// in one `send` (under the poster's lock): what the socket did not
    /// take is spilled, for the engine.
    fn write_locked(&self, st: &mut WireState, pkt: &[u8]) -> DirectWrite {
        // One buffer (the held one, or the corked one, which keep their
        // allocations): cheaper for the kernel than gathering pieces.
        let from_held = !st.held.is_empty();
        let mut out = if from_held {
            self.held_hint.store(false, Ordering::Relaxed);
            let mut out = std::mem::take(&mut st.held);
            out.extend_from_slice(&st.corked);
            st.corked.clear();
            out
        } else {
            std::mem::take(&mut st.corked)
        };
        self.corked_hint.store(false, Ordering::Relaxed);
        let buf: &[u8] = if out.is_empty() {
            pkt
        } else {
            out.extend_from_slice(pkt);
            &out
        };
        let done = self.send_some(buf);
        let total = buf.len();
        if done < total {
            st.spill.extend_from_slice(&buf[done..]);
            st.busy = true;
        }
        out.clear();
        if from_held {
            st.held = out;
        } else {
            st.corked = out;
        }
        if done == total {
            DirectWrite::Sent
        } else {
            DirectWrite::Spilled
        }
    }

    /// Writes what the socket takes of `buf` now (non-blocking): how much.
    fn send_some(&self, buf: &[u8]) -> usize {
        let mut done = 0;
        while done < buf.len() {
            let rest = &buf[done..];
            self.writes.fetch_add(1, Ordering::Relaxed);
            // SAFETY: sends from a live byte slice (only read); the fd stays
            // open while `self` lives (the Wire owns the stream). A plain
            // system call: `send` is not a cancellation point here (no
            // thread is cancelled), so libc's wrapper would only add work.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_sendto,
                    self.fd(),
                    rest.as_ptr(),
                    rest.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                    std::ptr::null::<libc::sockaddr>(),
                    0,
                )
            };
            if r > 0 {
                done += r as usize;
                continue;
            }
            if r < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // Full (or failed: the engine finds the error when it writes
            // the rest, and fails the connection's QPs).
            break;
        }
        done
    }

    /// Poster: writes `pkt` if the engine has nothing pending (`None`
    /// otherwise, or while the engine holds the lock: queue the WR then).
    pub fn try_write(&self, pkt: &[u8]) -> Option<DirectWrite> {
        let mut st = self.poster_lock()?;
        Some(self.write_locked(&mut st, pkt))
    }

    /// Poster: like [`try_write`](Self::try_write), but with `cork` (its
    /// QP has requests in flight, whose ACKs come back) a packet that fits
    /// in [`CORK_MAX`] with those corked before it is corked instead of
    /// written: it goes out with the next write on this connection (a
    /// poster's, the engine's) or at a flush (`Shared::flush_corked`: an
    /// application's poll or arming of a CQ, the end of the engine's or an
    /// application's receive, which the ACKs bring), so that a burst of
    /// small posts costs one `send` and one wake-up of the peer, not one
    /// each.
    pub fn try_write_or_cork(&self, pkt: &[u8], cork: bool) -> Option<Posted> {
        let mut st = self.poster_lock()?;
        if cork && st.corked.len() + pkt.len() <= CORK_MAX {
            let first = st.corked.is_empty();
            st.corked.extend_from_slice(pkt);
            self.corked_hint.store(true, Ordering::Relaxed);
            return Some(Posted::Corked { first });
        }
        Some(Posted::Wrote(self.write_locked(&mut st, pkt)))
    }
}

impl Wire {
    /// Engine: true if a poster wrote a request since the last call.
    pub fn take_request_sent(&self) -> bool {
        self.request_sent.swap(false, Ordering::Relaxed)
    }

    /// Poster: [`Wire::try_write`] of a packet whose header is `head` and
    /// whose payload is the registered memory `body`, written from where it
    /// lies in one `sendmsg` (the held ACKs first). What the socket did not
    /// take of the last span (`tail` says whose memory it is), if at least
    /// [`SPILL_MEM_MIN`] bytes, is left where it lies for the engine to
    /// write from there (returned: the WR holds it, see `TxMem`); the rest
    /// is copied into the spill.
    pub fn try_write_gather(
        &self,
        head: &[u8],
        body: &[Span<'_>],
        tail: SpillTail,
    ) -> Option<(DirectWrite, Option<TxMemRef>)> {
        let mut st = self.poster_lock()?;
        let st = &mut *st;
        let mut out = std::mem::take(&mut st.held);
        if !out.is_empty() {
            self.held_hint.store(false, Ordering::Relaxed);
        }
        out.extend_from_slice(&st.corked);
        st.corked.clear();
        self.corked_hint.store(false, Ordering::Relaxed);
        out.extend_from_slice(head);
        let mut iov: SmallVec<[libc::iovec; 8]> = SmallVec::new();
        iov.push(libc::iovec {
            iov_base: out.as_ptr() as *mut libc::c_void,
            iov_len: out.len(),
        });
        iov.extend(body.iter().map(|s| libc::iovec {
            iov_base: s.as_ptr().cast(),
            iov_len: s.len(),
        }));
        let total: usize = iov.iter().map(|v| v.iov_len).sum();
        let mut done = 0;
        let mut first = 0;
        while done < total {
            // SAFETY: a zeroed msghdr is valid (no address, no control data).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov[first..].as_mut_ptr();
            msg.msg_iovlen = (iov.len() - first) as _;
            self.writes.fetch_add(1, Ordering::Relaxed);
            // SAFETY: every iovec points into `out` (alive and unchanged
            // here) or into a span, whose registered memory stays valid
            // while the MR table's lock, which the spans borrow, is held
            // (the kernel only reads it); the fd stays open while `self`
            // lives.
            let r =
                unsafe { libc::sendmsg(self.fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if r > 0 {
                let mut n = r as usize;
                done += n;
                // Skip what was sent.
                while n > 0 && first < iov.len() {
                    let v = &mut iov[first];
                    if n >= v.iov_len {
                        n -= v.iov_len;
                        first += 1;
                    } else {
                        // SAFETY: `n` is within this iovec.
                        v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n).cast() };
                        v.iov_len -= n;
                        n = 0;
                    }
                }
                continue;
            }
            let e = io::Error::last_os_error();
            if r < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // Full (or failed: the engine finds the error when it writes
            // the rest, and fails the connection's QPs).
            break;
        }
        let mut mem = None;
        if done < total {
            // The unsent rest, in order: of the head, then of each span
            // (the last one's left in memory if large).
            let mut skip = done;
            if skip < out.len() {
                st.spill.extend_from_slice(&out[skip..]);
                skip = 0;
            } else {
                skip -= out.len();
            }
            for (i, s) in body.iter().enumerate() {
                if skip >= s.len() {
                    skip -= s.len();
                    continue;
                }
                if i + 1 == body.len() && s.len() - skip >= SPILL_MEM_MIN {
                    let m = Arc::new(Mutex::new(TxMem {
                        qpn: tail.qpn,
                        key: TxKey::Local(tail.lkey),
                        pd: tail.pd,
                        addr: tail.addr + skip as u64,
                        len: s.len() - skip,
                        pos: 0,
                        copy: None,
                        lost: false,
                    }));
                    st.spill_mem = Some(m.clone());
                    mem = Some(m);
                } else {
                    s.append_from(skip, &mut st.spill);
                }
                skip = 0;
            }
        }
        out.clear();
        st.held = out;
        if done == total {
            return Some((DirectWrite::Sent, None));
        }
        st.busy = true;
        Some((DirectWrite::Spilled, mem))
    }
}

/// For tests: a wire (token `CONN_BASE + n`) over a nonblocking loopback
/// connection, the connection's other end, and the wire's local address.
#[cfg(test)]
pub(super) fn loopback_wire(n: usize) -> (Wire, std::net::TcpStream, std::net::SocketAddr) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let local = l.local_addr().expect("addr");
    let peer = std::net::TcpStream::connect(local).expect("connect");
    let (s, _) = l.accept().expect("accept");
    s.set_nonblocking(true).expect("nonblocking");
    let wire = Wire::new(
        mio::net::TcpStream::from_std(s),
        mio::Token(super::engine::CONN_BASE + n),
    );
    (wire, peer, local)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_posters_write_takes_the_held_acks_along_in_order() {
        let (wire, mut peer, _) = loopback_wire(0);
        // Busy until the engine says otherwise.
        assert_eq!(wire.try_write(b"x"), None);
        wire.hold(b"ack1");
        wire.hold(b"ack2");
        assert!(!wire.held_gone() && !wire.held_gone_hint());
        assert_eq!(wire.try_write(b"packet"), Some(DirectWrite::Sent));
        assert!(wire.held_gone() && wire.held_gone_hint());
        assert_eq!(wire.try_write(b"next"), Some(DirectWrite::Sent));
        let mut got = [0u8; 18];
        peer.read_exact(&mut got).expect("read");
        assert_eq!(&got, b"ack1ack2packetnext");
    }

    #[test]
    fn corked_requests_go_after_the_held_acks_and_before_the_next_packet() {
        let (wire, mut peer, _) = loopback_wire(0);
        wire.hold(b"ack1");
        assert_eq!(
            wire.try_write_or_cork(b"req1", true),
            Some(Posted::Corked { first: true })
        );
        assert_eq!(
            wire.try_write_or_cork(b"req2", true),
            Some(Posted::Corked { first: false })
        );
        assert!(wire.corked_hint());
        assert_eq!(wire.writes(), 0, "nothing written yet");
        // Not to be corked: written with all before it, in one `send`.
        assert_eq!(
            wire.try_write_or_cork(b"req3", false),
            Some(Posted::Wrote(DirectWrite::Sent))
        );
        assert_eq!(wire.writes(), 1);
        assert!(!wire.corked_hint() && wire.held_gone());
        // Corked past `CORK_MAX`: written, with what was corked.
        let big = vec![b'x'; CORK_MAX - 2];
        assert!(matches!(
            wire.try_write_or_cork(&big, true),
            Some(Posted::Corked { first: true })
        ));
        assert_eq!(
            wire.try_write_or_cork(b"req4", true),
            Some(Posted::Wrote(DirectWrite::Sent))
        );
        // A flush writes what is corked (and nothing when nothing is).
        assert!(matches!(
            wire.try_write_or_cork(b"req5", true),
            Some(Posted::Corked { first: true })
        ));
        assert_eq!(wire.flush_corked(), Some(DirectWrite::Sent));
        assert_eq!(wire.flush_corked(), None);
        assert_eq!(wire.writes(), 3);
        let mut want = b"ack1req1req2req3".to_vec();
        want.extend_from_slice(&big);
        want.extend_from_slice(b"req4req5");
        let mut got = vec![0u8; want.len()];
        peer.read_exact(&mut got).expect("read");
        assert!(got == want, "bytes out of order");
    }

    #[test]
    fn the_engine_writes_corked_requests_after_the_spill_and_before_its_own() {
        let (wire, _peer, _) = loopback_wire(0);
        wire.release(true);
        assert!(matches!(
            wire.try_write_or_cork(b"req1", true),
            Some(Posted::Corked { .. })
        ));
        wire.hold(b"ack1");
        // The engine claims the connection: no poster writes or corks now,
        // and a flush leaves the corked request to the engine.
        wire.claim();
        assert_eq!(wire.try_write_or_cork(b"req2", true), None);
        assert_eq!(wire.flush_corked(), None);
        let mut tx = b"sent|engine".to_vec();
        wire.take_spill(&mut tx, 5);
        assert_eq!(&tx, b"sent|ack1req1engine");
        assert!(!wire.corked_hint());
    }

    #[test]
    fn a_spilled_packet_tail_goes_before_acks_held_after_it() {
        let (wire, _peer, _) = loopback_wire(0);
        wire.release(true);
        // A packet larger than the socket takes: its tail is spilled.
        let big = vec![7u8; 64 << 20];
        assert_eq!(wire.try_write(&big), Some(DirectWrite::Spilled));
        let spilled = wire.state().spill.len();
        assert!(spilled > 0 && spilled < big.len());
        // The engine parks ACKs meanwhile (its own buffer is empty).
        wire.hold(b"ack1");
        let mut tx = b"engine".to_vec();
        wire.take_spill(&mut tx, 0);
        assert_eq!(tx.len(), spilled + 4 + 6);
        assert!(
            tx[..spilled].iter().all(|&b| b == 7),
            "the packet's tail first"
        );
        assert_eq!(&tx[spilled..], b"ack1engine");
    }
}
