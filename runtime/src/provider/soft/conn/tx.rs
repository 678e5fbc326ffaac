//! Transmission: writing the transmit buffer and a zero-copy payload
//! from registered memory to the socket (or, for the loopback connection,
//! into its own receive buffer).

use std::io;
use std::sync::Arc;

use super::super::dma::Span;
use super::super::lock;
use super::super::mr::MrTable;
use super::super::packet::{Header, Opcode, NAK_REM_ACCESS};
use super::{Conn, Flush, TX_HIGH};
use crate::provider::AccessFlags;

/// The READ a response's last segment queued behind its segment from
/// memory ends (see `Conn::read_tail`): what its refusal names.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadTail {
    /// The requester QP.
    pub dst: u32,
    /// The responder QP.
    pub src: u32,
    /// The READ's PSN.
    pub psn: u32,
}

/// A packet payload sent straight from registered memory (no copy): it
/// follows the bytes in `tx`, and nothing is queued after it until it is gone.
/// Shared with the QP (under the engine lock only), which snapshots the unsent rest
/// into `copy` before any completion could tell the application that the
/// memory is free again.
pub(crate) struct TxMem {
    /// The QP whose memory this is: the requester of a WR's payload, the
    /// responder of a READ response's.
    pub qpn: u32,
    /// How the memory is checked before every write.
    pub key: TxKey,
    pub pd: u32,
    pub addr: u64,
    pub len: usize,
    pub pos: usize,
    /// Bytes `[pos..len]` copied out of the memory, once the QP failed.
    pub copy: Option<Vec<u8>>,
    /// A READ response's memory went away while it was being sent: the
    /// rest went as zeros, and the READ is refused after this segment
    /// (`gen_resp`).
    pub lost: bool,
}

impl std::fmt::Debug for TxMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxMem")
            .field("qpn", &self.qpn)
            .field("key", &self.key)
            .field("len", &self.len)
            .field("pos", &self.pos)
            .field("copied", &self.copy.is_some())
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

/// Which registration a zero-copy payload is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxKey {
    /// A send WR's local memory (lkey): lost, the requester QP fails.
    Local(u32),
    /// Memory a peer's READ names (rkey, an MR's or a window's bound over
    /// the responder QP), with remote READ access: lost, the READ fails.
    Remote(u32),
}

/// Shared handle to a zero-copy payload.
pub(crate) type TxMemRef = Arc<std::sync::Mutex<TxMem>>;

impl TxMem {
    /// `[at, at + len)` of the memory, if its registration still allows
    /// the access (`None`: deregistered, or a window unbound).
    fn span<'t>(&self, mrs: &'t MrTable, at: u64, len: u64) -> Option<Span<'t>> {
        match self.key {
            TxKey::Local(lkey) => mrs.local(lkey, self.pd, at, len, false),
            TxKey::Remote(rkey) => mrs
                .remote(self.qpn, rkey, self.pd, at, len, AccessFlags::REMOTE_READ)
                .ok(),
        }
    }

    /// The memory went away mid-payload: a WR's QP fails (listed in
    /// `broken`), a READ is refused after this segment.
    fn lose(&mut self, broken: &mut Vec<u32>) {
        match self.key {
            TxKey::Local(_) => broken.push(self.qpn),
            TxKey::Remote(_) => self.lost = true,
        }
    }

    /// Copies the unsent rest out of the registered memory (zeros if the
    /// registration is gone), so the memory is no longer needed.
    pub fn snapshot(&mut self, mrs: &MrTable) {
        if self.copy.is_some() || self.pos == self.len {
            return;
        }
        let rest = self.len - self.pos;
        let mut v = vec![0u8; rest];
        let at = self.addr + self.pos as u64;
        if let Some(span) = self.span(mrs, at, rest as u64) {
            span.read_into(&mut v);
        }
        // Positions now index into the copy.
        self.copy = Some(v);
    }
}

impl Conn {
    /// Writes as much of the transmit buffer (and the zero-copy payload
    /// after it) as the socket takes. `mrs` is the locked MR table: the
    /// payload's registration is checked before every write.
    pub fn flush(&mut self, mrs: &MrTable) -> Flush {
        if !self.connected {
            return Flush::Blocked;
        }
        let Some(wire) = &self.stream else {
            self.loop_back(mrs);
            return Flush::Done;
        };
        // What a posting thread could not write goes first (the rest of
        // its payload from memory, if it left it there).
        wire.take_spill_mem(
            &mut self.tx,
            self.tx_pos,
            &mut self.tx_mem,
            &mut self.tx_after,
            mrs,
        );
        wire.take_spill(&mut self.tx, self.tx_pos);
        let fd = wire.fd();
        loop {
            let head = self.tx.len() - self.tx_pos;
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 3];
            let mut n = 0;
            if head > 0 {
                iov[0] = libc::iovec {
                    // SAFETY: `tx_pos < tx.len()`, so the pointer is in bounds.
                    iov_base: unsafe { self.tx.as_mut_ptr().add(self.tx_pos) }.cast(),
                    iov_len: head,
                };
                n = 1;
            }
            if let Some(mr) = &self.tx_mem {
                let m = lock(mr);
                let rest = m.len - m.pos;
                if let Some(copy) = &m.copy {
                    let done = copy.len() - rest;
                    iov[n] = libc::iovec {
                        // SAFETY: `done <= copy.len()`.
                        iov_base: unsafe { copy.as_ptr().add(done) } as *mut libc::c_void,
                        iov_len: rest,
                    };
                    n += 1;
                } else {
                    let at = m.addr + m.pos as u64;
                    match m.span(mrs, at, rest as u64) {
                        Some(p) => {
                            // (Sent below, while `mrs` is still borrowed.)
                            iov[n] = libc::iovec {
                                iov_base: p.as_ptr().cast(),
                                iov_len: rest,
                            };
                            n += 1;
                        }
                        None => {
                            // Deregistered under an outstanding WR (or a
                            // READ): keep the framing with zeros and fail
                            // the QP (or the READ).
                            let mut m = m;
                            m.lose(&mut self.broken);
                            let read = matches!(m.key, TxKey::Remote(_));
                            drop(m);
                            if read {
                                self.refuse_read_tail();
                            }
                            self.tx.resize(self.tx.len() + rest, 0);
                            self.tx_mem = None;
                            self.tx.append(&mut self.tx_after);
                            continue;
                        }
                    }
                }
            }
            if self.tx_mem.is_some() && !self.tx_after.is_empty() {
                // What follows the payload goes in the same write.
                iov[n] = libc::iovec {
                    iov_base: self.tx_after.as_mut_ptr().cast(),
                    iov_len: self.tx_after.len(),
                };
                n += 1;
            }
            if n == 0 {
                self.tx.clear();
                self.tx_pos = 0;
                return Flush::Done;
            }
            // SAFETY: an all-zero msghdr is valid (no name, no control data).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            // SAFETY: `iov[..n]` describes the live tx buffer and memory of a
            // registration validated under the MR-table lock the caller holds
            // for the duration of the call (only read). MSG_NOSIGNAL: a peer
            // gone away is an error here, not a SIGPIPE for the process.
            let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            self.writes += 1;
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.compact_tx();
                        return Flush::Blocked;
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: write failed");
                        return Flush::Closed;
                    }
                }
            }
            if r == 0 {
                return Flush::Closed;
            }
            let mut k = r as usize;
            let h = head.min(k);
            self.tx_pos += h;
            k -= h;
            if let Some(mr) = &self.tx_mem {
                let mut m = lock(mr);
                let d = (m.len - m.pos).min(k);
                m.pos += d;
                k -= d;
                if m.pos == m.len {
                    drop(m);
                    self.tx_mem = None;
                    // (A READ's memory was read to its segment's end: its
                    // tail stands.)
                    self.read_tail = None;
                    if !self.tx_after.is_empty() {
                        // (`tx` is all written: the payload came after it;
                        // `k` bytes of what follows went with it.)
                        debug_assert_eq!(self.tx_pos, self.tx.len());
                        std::mem::swap(&mut self.tx, &mut self.tx_after);
                        self.tx_after.clear();
                        self.tx_pos = k;
                    }
                }
            }
            if self.tx_pos == self.tx.len() {
                self.tx.clear();
                self.tx_pos = 0;
            }
        }
    }

    /// A READ response's segment from memory lost its memory: the READ's
    /// queued tail (see `read_tail`) must not complete it, so a NAK
    /// refusing the READ takes its place, and its responder QP fails.
    fn refuse_read_tail(&mut self) {
        let Some(t) = self.read_tail.take() else {
            return;
        };
        let mut h = Header::new(Opcode::Nak);
        (h.dst_qpn, h.src_qpn, h.psn) = (t.dst, t.src, t.psn);
        h.syndrome = NAK_REM_ACCESS;
        // (Only the tail is queued behind a READ's segment from memory.)
        self.tx_after.clear();
        self.tx_after.extend_from_slice(&h.encode());
        self.refused_reads.push(t.src);
    }

    /// Loopback: moves everything queued for sending into the receive buffer.
    fn loop_back(&mut self, mrs: &MrTable) {
        let head = self.tx.len() - self.tx_pos;
        let mem = self.tx_mem.as_ref().map_or(0, |m| {
            let m = lock(m);
            m.len - m.pos
        });
        // (At most this much follows: a READ's tail refused below is
        // shorter.)
        let n = head + mem + self.tx_after.len();
        if n == 0 {
            return;
        }
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
        if self.rx.len() - self.rx_end < n {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
            if self.rx.len() - self.rx_end < n {
                self.rx.resize(self.rx_end + n, 0);
            }
        }
        let at = self.rx_end;
        self.rx[at..at + head].copy_from_slice(&self.tx[self.tx_pos..]);
        if let Some(mr) = self.tx_mem.take() {
            let mut m = lock(&mr);
            let dst = &mut self.rx[at + head..at + head + mem];
            let mut lost_read = false;
            if let Some(copy) = &m.copy {
                dst.copy_from_slice(&copy[copy.len() - mem..]);
            } else {
                match m.span(mrs, m.addr + m.pos as u64, mem as u64) {
                    Some(span) => span.read_into(dst),
                    None => {
                        dst.fill(0);
                        m.lose(&mut self.broken);
                        lost_read = matches!(m.key, TxKey::Remote(_));
                    }
                }
            }
            m.pos = m.len;
            drop(m);
            if lost_read {
                self.refuse_read_tail();
            }
            self.read_tail = None;
        }
        let after = self.tx_after.len();
        let from = at + head + mem;
        self.rx[from..from + after].copy_from_slice(&self.tx_after);
        self.tx_after.clear();
        self.rx_end = from + after;
        self.tx.clear();
        self.tx_pos = 0;
    }

    fn compact_tx(&mut self) {
        if self.tx_pos > TX_HIGH / 2 {
            self.tx.drain(..self.tx_pos);
            self.tx_pos = 0;
        }
    }
}
