//! One TCP connection to a remote engine: receive and transmit buffers, the
//! ordered queue of responses to send, and the requester QPs that send on it.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::lock;
use super::mr::MrTable;
use super::packet::{encode_hello, Header, Opcode, HEADER_LEN, HELLO_LEN};
use super::wire::Wire;
use crate::provider::AccessFlags;

/// Stop generating packets once this many bytes wait to be written.
pub(crate) const TX_HIGH: usize = 256 * 1024;
/// Initial receive buffer size; it grows to hold a packet that is not
/// received directly into registered memory.
const RX_CAP: usize = 64 * 1024;

/// A packet payload sent straight from registered memory (no copy): it
/// follows the bytes in `tx`, and nothing is queued after it until it is gone.
/// Shared with the QP (under the engine lock only), which snapshots the unsent rest
/// into `copy` before any completion could tell the application that the
/// memory is free again.
pub(crate) struct TxMem {
    /// The requester QP whose WR this is.
    pub qpn: u32,
    pub lkey: u32,
    pub pd: u32,
    pub addr: u64,
    pub len: usize,
    pub pos: usize,
    /// Bytes `[pos..len]` copied out of the memory, once the QP failed.
    pub copy: Option<Vec<u8>>,
}

/// Shared handle to a zero-copy payload.
pub(crate) type TxMemRef = Arc<std::sync::Mutex<TxMem>>;

impl TxMem {
    /// Copies the unsent rest out of the registered memory (zeros if the
    /// registration is gone), so the memory is no longer needed.
    pub fn snapshot(&mut self, mrs: &MrTable) {
        if self.copy.is_some() || self.pos == self.len {
            return;
        }
        let rest = self.len - self.pos;
        let mut v = vec![0u8; rest];
        let at = self.addr + self.pos as u64;
        if let Some(span) = mrs.local(self.lkey, self.pd, at, rest as u64, false) {
            span.read_into(&mut v);
        }
        // Positions now index into the copy.
        self.copy = Some(v);
    }
}

/// A WRITE payload being received straight into registered memory.
pub(crate) struct RxDirect {
    /// The responder QP: once it is in ERR, the rest is discarded.
    pub qp: std::sync::Arc<super::qp::QpShared>,
    pub hdr: Header,
    pub pd: u32,
    /// Where the next byte goes.
    pub addr: u64,
    pub remaining: usize,
    /// The region went away: the rest is discarded and the request fails.
    pub broken: bool,
}

/// A response the responder owes, sent in order.
#[derive(Debug)]
pub(crate) enum Resp {
    Ack {
        dst: u32,
        src: u32,
        psn: u32,
    },
    Nak {
        dst: u32,
        src: u32,
        psn: u32,
        syndrome: u8,
        timer: u8,
    },
    Atomic {
        dst: u32,
        src: u32,
        psn: u32,
        orig: u64,
    },
    Read(ReadJob),
}

/// An RDMA READ being answered, segment by segment.
#[derive(Debug)]
pub(crate) struct ReadJob {
    pub dst: u32,
    pub src: u32,
    pub psn: u32,
    pub pd: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}

/// A direct WRITE payload at least this large still to come raises the
/// socket's `SO_RCVLOWAT` (see `Conn::read_direct`).
const LOWAT_MIN: usize = 128 * 1024;
/// The highest `SO_RCVLOWAT` used.
const LOWAT_MAX: usize = 256 * 1024;

pub(crate) struct Conn {
    /// The socket; `None` for the loopback connection of an engine to itself
    /// (QPs of one device talking to each other, like a NIC's internal loopback).
    pub stream: Option<Arc<Wire>>,
    /// The remote engine's listener address (target of our connect, or from its HELLO).
    pub peer: Option<SocketAddr>,
    /// TCP connect finished.
    pub connected: bool,
    /// The remote's HELLO arrived.
    pub got_hello: bool,
    pub rx: Vec<u8>,
    pub rx_start: usize,
    pub rx_end: usize,
    pub tx: Vec<u8>,
    pub tx_pos: usize,
    pub tx_mem: Option<TxMemRef>,
    /// QPs whose zero-copy payload lost its registration while being sent.
    pub broken: Vec<u32>,
    /// Bytes the packet at `rx_start` needs in the buffer.
    pub rx_need: usize,
    pub rx_direct: Option<RxDirect>,
    /// The socket's `SO_RCVLOWAT` (see [`read_direct`](Self::read_direct)).
    rcvlowat: usize,
    pub resp: VecDeque<Resp>,
    /// Requester QPs with packets to send on this connection.
    pub senders: VecDeque<u32>,
    /// Listed in the engine's active list.
    pub active: bool,
    /// While only ACKs of messages that completed a receive are pending
    /// (queued, or parked on the wire), they may wait until then (the
    /// oldest one's deadline) for a request to ride with them (the
    /// receiver's application usually answers at once): one write and one
    /// wakeup of the peer instead of two.
    pub ack_hold: Option<Instant>,
    /// The CQs its packets complete WRs of, with their handles (see
    /// `drive.rs`).
    pub cqs: smallvec::SmallVec<[(u32, std::sync::Weak<super::cq::CqShared>); 2]>,
}

/// Result of trying to write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Flush {
    /// Everything written.
    Done,
    /// The socket is full; wait for WRITABLE.
    Blocked,
    /// The connection failed.
    Closed,
}

impl Conn {
    pub fn new(stream: Option<Arc<Wire>>, local: SocketAddr, connected: bool) -> Conn {
        let mut c = Conn {
            stream,
            peer: None,
            connected,
            got_hello: false,
            rx: vec![0; RX_CAP],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(2 * TX_HIGH),
            tx_pos: 0,
            tx_mem: None,
            broken: Vec::new(),
            rx_need: 0,
            rx_direct: None,
            rcvlowat: 1,
            resp: VecDeque::new(),
            senders: VecDeque::new(),
            active: false,
            ack_hold: None,
            cqs: smallvec::SmallVec::new(),
        };
        let mut h = Header::new(Opcode::Hello);
        h.payload_len = HELLO_LEN as u32;
        c.tx.extend_from_slice(&h.encode());
        c.tx.extend_from_slice(&encode_hello(local));
        c
    }

    pub fn tx_pending(&self) -> usize {
        self.tx.len() - self.tx_pos
    }

    /// True if more packets may be appended now.
    pub fn tx_room(&self) -> bool {
        self.tx_mem.is_none() && self.tx_pending() < TX_HIGH
    }

    /// Queues an ACK. `hold_until`: it may wait until then for a request
    /// to go out with it (see `ack_hold`); `None` = send it at once.
    pub fn push_ack(&mut self, dst: u32, src: u32, psn: u32, hold_until: Option<Instant>) {
        match hold_until {
            // (ACKs parked on the wire keep their hold's deadline; once a
            // poster took them along, the deadline was theirs, not this
            // ACK's: a new hold starts.)
            Some(t) if self.resp.is_empty() && (self.ack_hold.is_none() || self.parked_gone()) => {
                self.ack_hold = Some(t)
            }
            // Keep what is pending: held ACKs stay held, anything else
            // (`ack_hold` is `None` then) goes out at once anyway.
            Some(_) => {}
            None => self.ack_hold = None,
        }
        self.push_resp(Resp::Ack { dst, src, psn });
    }

    /// True if no ACKs wait parked on the wire (a posting thread took them
    /// along, or none were parked).
    fn parked_gone(&self) -> bool {
        match &self.stream {
            // (Only the hold's deadline depends on it.)
            Some(w) => w.held_gone_hint(),
            None => true,
        }
    }

    /// True while the pending output is only held ACKs, not yet due.
    pub fn holding(&self, now: Instant) -> bool {
        self.ack_hold.is_some_and(|t| now < t)
            && self.senders.is_empty()
            && self.tx_pending() == 0
            && self.tx_mem.is_none()
    }

    /// Queues a response, coalescing consecutive ACKs of one QP.
    pub fn push_resp(&mut self, r: Resp) {
        if !matches!(r, Resp::Ack { .. }) {
            self.ack_hold = None;
        }
        if let Resp::Ack { dst, src, psn } = r {
            if let Some(Resp::Ack {
                dst: d,
                src: s,
                psn: p,
            }) = self.resp.back_mut()
            {
                if *d == dst && *s == src {
                    *p = psn;
                    return;
                }
            }
        }
        self.resp.push_back(r);
    }

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
        // What a posting thread could not write goes first.
        wire.take_spill(&mut self.tx, self.tx_pos);
        let fd = wire.fd();
        loop {
            let head = self.tx.len() - self.tx_pos;
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2];
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
                    match mrs.local(m.lkey, m.pd, at, rest as u64, false) {
                        Some(p) => {
                            // (Sent below, while `mrs` is still borrowed.)
                            iov[n] = libc::iovec {
                                iov_base: p.as_ptr().cast(),
                                iov_len: rest,
                            };
                            n += 1;
                        }
                        None => {
                            // Deregistered under an outstanding WR: keep the
                            // framing with zeros and fail the QP.
                            self.broken.push(m.qpn);
                            drop(m);
                            self.tx.resize(self.tx.len() + rest, 0);
                            self.tx_mem = None;
                            continue;
                        }
                    }
                }
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
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.compact_tx();
                        return Flush::Blocked;
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        tracing::debug!(error = %e, "soft engine: write failed");
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
                m.pos += k;
                if m.pos == m.len {
                    drop(m);
                    self.tx_mem = None;
                }
            }
            if self.tx_pos == self.tx.len() {
                self.tx.clear();
                self.tx_pos = 0;
            }
        }
    }

    /// Loopback: moves everything queued for sending into the receive buffer.
    fn loop_back(&mut self, mrs: &MrTable) {
        let head = self.tx.len() - self.tx_pos;
        let mem = self.tx_mem.as_ref().map_or(0, |m| {
            let m = lock(m);
            m.len - m.pos
        });
        let n = head + mem;
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
            let dst = &mut self.rx[at + head..at + n];
            if let Some(copy) = &m.copy {
                dst.copy_from_slice(&copy[copy.len() - mem..]);
            } else {
                match mrs.local(m.lkey, m.pd, m.addr + m.pos as u64, mem as u64, false) {
                    Some(span) => span.read_into(dst),
                    None => {
                        dst.fill(0);
                        self.broken.push(m.qpn);
                    }
                }
            }
            m.pos = m.len;
        }
        self.rx_end += n;
        self.tx.clear();
        self.tx_pos = 0;
    }

    /// Tells posting threads whether they may write to the socket again:
    /// only once everything the engine has for it is written.
    pub fn settle(&self) {
        if let Some(w) = &self.stream {
            let idle = self.connected
                && self.tx_pending() == 0
                && self.tx_mem.is_none()
                && self.resp.is_empty()
                && self.senders.is_empty();
            w.release(idle);
        }
    }

    /// While holding: parks the held ACKs on the wire, where a posting
    /// thread's write takes them along. False once that happened (or for
    /// the loopback connection, which keeps them queued): the hold is over.
    pub fn park_acks(&mut self) -> bool {
        let Some(w) = &self.stream else {
            return true;
        };
        if self.resp.is_empty() {
            // (What arrived meanwhile produced no output: posters may write.)
            w.release(true);
            return !w.held_gone();
        }
        if !self.resp.iter().all(|r| matches!(r, Resp::Ack { .. })) {
            return true;
        }
        let mut bytes = [0u8; 4 * HEADER_LEN];
        let mut n = 0;
        while let Some(Resp::Ack { dst, src, psn }) = self.resp.front() {
            if n == bytes.len() {
                w.hold(&bytes[..n]);
                n = 0;
            }
            let mut h = Header::new(Opcode::Ack);
            (h.dst_qpn, h.src_qpn, h.psn) = (*dst, *src, *psn);
            bytes[n..n + HEADER_LEN].copy_from_slice(&h.encode());
            n += HEADER_LEN;
            self.resp.pop_front();
        }
        w.hold(&bytes[..n]);
        true
    }

    /// Engine: about to produce output for this connection.
    pub fn claim(&self) {
        if let Some(w) = &self.stream {
            w.claim();
        }
    }

    /// True for the engine's connection to itself.
    pub fn is_loopback(&self) -> bool {
        self.stream.is_none()
    }

    /// Reads the rest of a direct WRITE payload straight into registered
    /// memory (or into the buffer, discarded, if the region went away).
    /// Returns bytes read (0 = end of stream) and whether the read was full.
    pub fn read_direct(&mut self, mrs: &MrTable) -> io::Result<(usize, bool)> {
        let Some(d) = &mut self.rx_direct else {
            return Ok((0, false));
        };
        let want = d.remaining;
        let Some(wire) = &self.stream else {
            return Ok((0, false));
        };
        let fd = wire.fd();
        if d.qp.state() == crate::provider::QpState::Err {
            d.broken = true;
        }
        let target = if d.broken {
            None
        } else {
            mrs.remote(
                d.hdr.rkey,
                d.pd,
                d.addr,
                want as u64,
                AccessFlags::REMOTE_WRITE,
            )
            .ok()
        };
        let r = match target {
            // SAFETY: `p` is `want` bytes of registered memory, under the
            // MR-table lock (`Span`'s invariant).
            Some(p) => unsafe { libc::read(fd, p.as_ptr().cast(), want) },
            None => {
                d.broken = true;
                let n = want.min(self.rx.len());
                // SAFETY: the buffer holds at least `n` bytes.
                unsafe { libc::read(fd, self.rx.as_mut_ptr().cast(), n) }
            }
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let r = r as usize;
        d.addr += r as u64;
        d.remaining -= r;
        // While much of a payload is still to come, the socket reports
        // input only once a large part of it is there: fewer wake-ups and
        // larger reads, as a blocking reader gets. Never more than what is
        // still to come (the last part must wake us), and back to 1 byte
        // once the payload is in (packet headers).
        let lowat = if d.remaining >= LOWAT_MIN {
            d.remaining.min(LOWAT_MAX)
        } else {
            1
        };
        if r > 0 && lowat != self.rcvlowat {
            self.set_rcvlowat(fd, lowat);
        }
        Ok((r, r == want))
    }

    /// Sets the socket's `SO_RCVLOWAT` (Linux re-checks readiness at once,
    /// so lowering it never strands data already there).
    fn set_rcvlowat(&mut self, fd: std::os::fd::RawFd, n: usize) {
        let v = n.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: `v` is a live c_int of the size passed; `fd` is the open
        // socket of this connection.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            self.rcvlowat = n;
        } else {
            tracing::debug!(error = %io::Error::last_os_error(), "soft engine: SO_RCVLOWAT");
        }
    }

    fn compact_tx(&mut self) {
        if self.tx_pos > TX_HIGH / 2 {
            self.tx.drain(..self.tx_pos);
            self.tx_pos = 0;
        }
    }

    /// Reads once into the receive buffer: bytes read (0 = end of stream)
    /// and whether the read filled all the space offered.
    pub fn read_some(&mut self) -> io::Result<(usize, bool)> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx.len() - self.rx_start < self.rx_need.max(HEADER_LEN)
            || self.rx_end == self.rx.len()
        {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        if self.rx.len() < self.rx_need {
            self.rx.resize(self.rx_need, 0);
        }
        let end = self.rx_end;
        let space = self.rx.len() - end;
        let Some(wire) = &self.stream else {
            return Err(io::ErrorKind::WouldBlock.into());
        };
        let buf = &mut self.rx[end..];
        // SAFETY: reads into a live, writable byte slice; the fd stays open
        // while `wire` lives. A plain system call (the socket is
        // non-blocking; `recv` is not a cancellation point here: no thread
        // is cancelled, so libc's wrapper would only add work).
        let r = unsafe {
            libc::syscall(
                libc::SYS_recvfrom,
                wire.fd(),
                buf.as_mut_ptr(),
                buf.len(),
                0,
                std::ptr::null_mut::<libc::sockaddr>(),
                std::ptr::null_mut::<libc::socklen_t>(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = r as usize;
        self.rx_end += n;
        Ok((n, n == space))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn conn() -> Conn {
        let mut c = Conn::new(None, "127.0.0.1:1".parse().expect("addr"), true);
        c.tx.clear(); // the HELLO
        c
    }

    #[test]
    fn an_ack_after_parked_acks_were_taken_along_gets_its_own_hold() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let local = l.local_addr().expect("addr");
        let _peer = std::net::TcpStream::connect(local).expect("connect");
        let (s, _) = l.accept().expect("accept");
        s.set_nonblocking(true).expect("nonblocking");
        let wire = Arc::new(Wire::new(
            mio::net::TcpStream::from_std(s),
            mio::Token(super::super::engine::CONN_BASE),
        ));
        let mut c = Conn::new(Some(wire.clone()), local, true);
        c.tx.clear(); // the HELLO
        let now = Instant::now();
        let first = now + Duration::from_micros(50);
        c.push_ack(1, 2, 3, Some(first));
        assert!(c.park_acks(), "parked on the wire");
        assert!(c.resp.is_empty() && !wire.held_gone());
        // Another ACK while the first still waits parked: the hold keeps
        // the first one's deadline.
        c.push_ack(1, 2, 4, Some(first + Duration::from_micros(30)));
        assert!(!c.holding(first));
        assert!(c.park_acks());
        // A poster's request takes them along.
        let mut h = Header::new(Opcode::Send);
        h.payload_len = 0;
        assert_eq!(
            wire.try_write(&h.encode()),
            Some(super::super::wire::DirectWrite::Sent)
        );
        assert!(wire.held_gone());
        // The next message's ACK may wait its own full delay.
        let second = first + Duration::from_micros(100);
        c.push_ack(1, 2, 5, Some(second));
        assert!(c.holding(first), "held until its own deadline");
        assert!(!c.holding(second));
    }

    #[test]
    fn held_acks_wait_only_while_nothing_else_is_pending() {
        let now = Instant::now();
        let until = now + Duration::from_millis(10);
        let mut c = conn();
        assert!(!c.holding(now));
        c.push_ack(1, 2, 3, Some(until));
        c.push_ack(1, 2, 4, Some(until + Duration::from_millis(5)));
        assert_eq!(c.resp.len(), 1, "consecutive ACKs coalesce");
        assert!(c.holding(now));
        assert!(!c.holding(until), "due at the first hold's deadline");
        // A request to send ends the hold: the ACK rides with it.
        c.senders.push_back(9);
        assert!(!c.holding(now));
        c.senders.clear();
        // Bytes waiting in the transmit buffer end it too.
        c.tx.push(0);
        assert!(!c.holding(now));
        c.tx.clear();
        // An ACK that must go at once ends it, and a later delayable ACK
        // does not start a new hold behind it.
        c.push_ack(5, 6, 1, None);
        assert!(!c.holding(now));
        c.push_ack(1, 2, 5, Some(until));
        assert!(!c.holding(now));
        // Any other response ends a hold.
        let mut c = conn();
        c.push_ack(1, 2, 3, Some(until));
        c.push_resp(Resp::Nak {
            dst: 1,
            src: 2,
            psn: 4,
            syndrome: 0,
            timer: 0,
        });
        assert!(!c.holding(now));
    }
}
