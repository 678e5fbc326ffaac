//! One TCP connection to a remote engine: receive and transmit buffers, the
//! ordered queue of responses to send, and the requester QPs that send on it.
//!
//! This file holds the connection's state; `tx.rs` writes it out (and holds
//! the zero-copy payload type), `rx.rs` reads it in (including payloads
//! received straight into memory), `acks.rs` coalesces and holds ACKs, and
//! `resp.rs` lists the responses a responder owes.

mod acks;
mod probe;
mod resp;
mod rx;
mod tx;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::handshake::{encode, Expect, Message, PRE_PROOF_BUF};
use super::wire::Wire;
pub(crate) use acks::ACK_SCAN;
pub(crate) use probe::Probe;
pub(crate) use resp::{ReadJob, Resp};
pub(crate) use rx::{DirectInto, RxDirect};
pub(crate) use tx::{ReadTail, TxKey, TxMem, TxMemRef};

/// Stop generating packets once this many bytes wait to be written.
pub(crate) const TX_HIGH: usize = 256 * 1024;
/// Receive buffer size once the peer is proven; it grows to hold a packet
/// that is not received directly into registered memory, and shrinks back
/// once it went unused for [`BIG_BUF_KEEP`].
pub(crate) const RX_CAP: usize = 64 * 1024;
/// A buffer that grew for large packets (receive past [`RX_CAP`], transmit
/// past `4 * TX_HIGH`) is kept while large packets keep coming and shrinks
/// back once it went unused this long (between one and two of these after
/// its last use: the port's sweep looks at it). Shrinking it after every
/// packet made each large packet pay for a fresh allocation and its page
/// faults.
pub(crate) const BIG_BUF_KEEP: std::time::Duration = std::time::Duration::from_millis(100);

/// Where a connection stands in proving which engine is at its other end
/// (see `engine/port.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Auth {
    /// The engine's connection to itself.
    Loopback,
    /// This engine dialed `peer`; its HELLO has not come yet.
    Dialed,
    /// Accepted; nothing came yet.
    Accepted,
    /// Accepted; its HELLO claimed `claimed`, which this engine is checking
    /// by asking the engine there (its input waits meanwhile).
    Proving,
    /// `peer` is proven: the engine this one dialed, or one that proved its
    /// claim.
    Proven,
    /// A connection this engine dialed to ask whether connection `of` (with
    /// serial `serial`) is the dialed engine's.
    Verifier { of: usize, serial: u64 },
    /// Accepted; it asked a VERIFY, which was answered. Nothing may follow.
    Answered,
}

impl Auth {
    /// What an unproven connection may receive next (`None`: nothing, or
    /// it is proven).
    pub fn expect(self, got_hello: bool) -> Option<Expect> {
        match self {
            Auth::Dialed => Some(Expect::Hello),
            Auth::Accepted => Some(Expect::HelloOrVerify),
            Auth::Verifier { .. } if got_hello => Some(Expect::VerifyReply),
            Auth::Verifier { .. } => Some(Expect::Hello),
            _ => None,
        }
    }
}

/// A HELLO packet announcing `local`.
fn hello(local: SocketAddr) -> Vec<u8> {
    encode(Message::Hello(local))
}

pub(crate) struct Conn {
    /// The socket; `None` for the loopback connection of an engine to itself
    /// (QPs of one device talking to each other, like a NIC's internal loopback).
    pub stream: Option<Arc<Wire>>,
    /// The remote engine's listener address: the target of our connect, or
    /// the one its HELLO claimed once that claim is proven.
    pub peer: Option<SocketAddr>,
    /// How far the remote engine proved who it is.
    pub auth: Auth,
    /// We dialed this connection (to `peer`).
    pub dialed: bool,
    /// Accepted: where it came from.
    pub src: Option<SocketAddr>,
    /// While `Proving`: the address its HELLO claimed.
    pub claimed: Option<SocketAddr>,
    /// Unique per connection (connection ids are reused).
    pub serial: u64,
    /// When it was opened (the handshake deadline counts from here).
    pub opened: Instant,
    /// When bytes last arrived, as the port's last look saw it (the idle
    /// deadline counts from here).
    pub last_rx: Instant,
    /// Bytes arrived since the port's last look.
    pub rx_seen: bool,
    /// A grown buffer was used since the port's last look (see
    /// [`BIG_BUF_KEEP`]).
    pub big_buf_used: bool,
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
    /// Bytes that follow `tx_mem` once it is written: while a poster's
    /// payload, adopted from the wire (see `Wire::take_spill_mem`), goes
    /// first, the engine's output that was queued already.
    pub tx_after: Vec<u8>,
    /// A READ response's copied last segment, queued in `tx_after` behind
    /// the READ's segment from memory in `tx_mem` so that one write takes
    /// both: refused instead if that memory goes away first.
    pub read_tail: Option<ReadTail>,
    /// QPs whose zero-copy payload lost its registration while being sent.
    pub broken: Vec<u32>,
    /// Responder QPs whose READ was refused that way (they fail).
    pub refused_reads: Vec<u32>,
    /// Writes to the socket since the engine last counted them (into
    /// `Shared::tx_writes`).
    pub writes: u64,
    /// Bytes the packet at `rx_start` needs in the buffer.
    pub rx_need: usize,
    /// Bytes still to come of a dropped packet's payload (discarded as
    /// they arrive; the buffer is empty meanwhile).
    pub rx_skip: usize,
    pub rx_direct: Option<RxDirect>,
    /// A payload just arrived straight into memory: the next read into
    /// the buffer takes at most `RX_PEEK` bytes (see `Conn::read_some`).
    pub rx_peek: bool,
    /// The socket's `SO_RCVLOWAT` (see [`read_direct`](Self::read_direct)).
    rcvlowat: usize,
    pub resp: VecDeque<Resp>,
    /// Requester QPs with packets to send on this connection.
    pub senders: VecDeque<u32>,
    /// A READ response segment went last: a sender's packet goes next, if
    /// any (a long READ response does not hold the senders back).
    pub senders_turn: bool,
    /// Listed in the engine's active list.
    pub active: bool,
    /// While only ACKs of messages that completed a receive are pending
    /// (queued, or parked on the wire), they may wait until then (the
    /// oldest one's deadline) for a request to ride with them (the
    /// receiver's application usually answers at once): one write and one
    /// wakeup of the peer instead of two.
    pub ack_hold: Option<Instant>,
    /// Holding ACKs pays on this connection: no hold ended with its ACKs
    /// going out alone since this side last sent a request (see `acks.rs`).
    pub hold_pays: bool,
    /// The CQs its packets complete WRs of, with their handles (see
    /// `drive.rs`).
    pub cqs: smallvec::SmallVec<[(u32, std::sync::Weak<super::cq::CqShared>); 2]>,
    /// Its probes (see `probe.rs`).
    pub probe: Probe,
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
    /// The engine's connection to itself (at `local`).
    pub fn loopback(local: SocketAddr, serial: u64) -> Conn {
        let mut c = Conn::bare(None, Auth::Loopback, true, serial);
        c.peer = Some(local);
        c.got_hello = true;
        c.prove();
        c
    }

    /// A proven connection with its HELLO queued (unit tests of the
    /// connection's own code).
    #[cfg(test)]
    pub fn new(stream: Option<Arc<Wire>>, local: SocketAddr, connected: bool) -> Conn {
        let mut c = Conn::bare(stream, Auth::Proven, connected, 0);
        c.got_hello = true;
        c.prove();
        c.tx.extend_from_slice(&hello(local));
        c
    }

    /// A connection this engine dialed to the engine at `peer`: it may send
    /// at once (the HELLO first), and receives only once `peer`'s HELLO
    /// confirmed it.
    pub fn dialed(wire: Arc<Wire>, local: SocketAddr, peer: SocketAddr, serial: u64) -> Conn {
        let mut c = Conn::bare(Some(wire), Auth::Dialed, false, serial);
        c.peer = Some(peer);
        c.dialed = true;
        c.tx.reserve(2 * TX_HIGH);
        c.tx.extend_from_slice(&hello(local));
        c
    }

    /// A connection accepted from `src`: small buffers until its peer is
    /// proven; this engine's HELLO goes first.
    pub fn accepted(wire: Arc<Wire>, local: SocketAddr, src: SocketAddr, serial: u64) -> Conn {
        let mut c = Conn::bare(Some(wire), Auth::Accepted, true, serial);
        c.src = Some(src);
        c.tx.extend_from_slice(&hello(local));
        c
    }

    /// A connection this engine dialed to `peer` to ask whether connection
    /// `of`, from `src`, is `peer`'s (`asker`: this engine's listener).
    pub fn verifier(
        wire: Arc<Wire>,
        asker: SocketAddr,
        peer: SocketAddr,
        src: SocketAddr,
        of: (usize, u64),
        serial: u64,
    ) -> Conn {
        let auth = Auth::Verifier {
            of: of.0,
            serial: of.1,
        };
        let mut c = Conn::bare(Some(wire), auth, false, serial);
        c.peer = Some(peer);
        c.dialed = true;
        c.tx.extend_from_slice(&encode(Message::Verify { asker, src }));
        c
    }

    /// True once the remote engine is proven (its packets are handled).
    pub fn proven(&self) -> bool {
        matches!(self.auth, Auth::Proven | Auth::Loopback)
    }

    /// The peer is proven: the buffers grow to their working sizes.
    pub fn prove(&mut self) {
        self.auth = Auth::Proven;
        if self.rx.len() < RX_CAP {
            self.rx.resize(RX_CAP, 0);
        }
        if self.stream.is_none() {
            self.auth = Auth::Loopback;
        }
        self.tx.reserve((2 * TX_HIGH).saturating_sub(self.tx.len()));
    }

    /// Reads and discards up to `rx_skip` bytes (of a dropped packet's
    /// payload): bytes read (0 = end of stream) and whether the read was
    /// full.
    pub fn skip_some(&mut self) -> std::io::Result<(usize, bool)> {
        let Some(wire) = &self.stream else {
            return Err(std::io::ErrorKind::WouldBlock.into());
        };
        let want = self.rx_skip.min(self.rx.len());
        // SAFETY: reads into the first `want` bytes of the live receive
        // buffer (empty while a payload is skipped); the fd stays open
        // while `wire` lives.
        let r = unsafe { libc::read(wire.fd(), self.rx.as_mut_ptr().cast(), want) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = r as usize;
        self.rx_skip -= n;
        Ok((n, n == want))
    }

    /// Bytes of buffer this connection holds (receive and transmit).
    pub fn buffered(&self) -> usize {
        self.rx.capacity() + self.tx.capacity() + self.tx_after.capacity()
    }

    fn bare(stream: Option<Arc<Wire>>, auth: Auth, connected: bool, serial: u64) -> Conn {
        let now = Instant::now();
        Conn {
            stream,
            peer: None,
            auth,
            dialed: false,
            src: None,
            claimed: None,
            serial,
            opened: now,
            last_rx: now,
            rx_seen: false,
            big_buf_used: false,
            connected,
            got_hello: false,
            rx: vec![0; PRE_PROOF_BUF],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(PRE_PROOF_BUF),
            tx_pos: 0,
            tx_mem: None,
            tx_after: Vec::new(),
            read_tail: None,
            broken: Vec::new(),
            refused_reads: Vec::new(),
            writes: 0,
            rx_need: 0,
            rx_skip: 0,
            rx_direct: None,
            rx_peek: false,
            rcvlowat: 1,
            resp: VecDeque::new(),
            senders: VecDeque::new(),
            senders_turn: false,
            active: false,
            ack_hold: None,
            hold_pays: true,
            cqs: smallvec::SmallVec::new(),
            probe: Probe::default(),
        }
    }

    pub fn tx_pending(&self) -> usize {
        self.tx.len() - self.tx_pos
    }

    /// True if more packets may be appended now.
    pub fn tx_room(&self) -> bool {
        self.tx_mem.is_none() && self.tx_pending() < TX_HIGH
    }

    /// True if a buffer grew past its usual size for large packets.
    pub fn big_buffers(&self) -> bool {
        self.rx.len() > RX_CAP || self.tx.capacity() > 4 * TX_HIGH
    }

    /// Shrinks the buffers that grew for large packets back to their usual
    /// size where they hold nothing now. True if one is still large (it
    /// holds data: looked at again later).
    pub fn shrink_idle_buffers(&mut self) -> bool {
        if self.rx.len() > RX_CAP
            && self.rx_end == 0
            && self.rx_need == 0
            && self.rx_direct.is_none()
        {
            self.rx.truncate(RX_CAP);
            self.rx.shrink_to_fit();
        }
        if self.tx.is_empty() && self.tx_mem.is_none() && self.tx.capacity() > 4 * TX_HIGH {
            self.tx.shrink_to(2 * TX_HIGH);
        }
        self.big_buffers()
    }

    /// Tells posting threads whether they may write to the socket again:
    /// only once everything the engine has for it is written.
    pub fn settle(&mut self) {
        if let Some(w) = &self.stream {
            let idle = self.connected
                && self.tx_pending() == 0
                && self.tx_mem.is_none()
                && self.resp.is_empty()
                && self.senders.is_empty();
            w.release(idle);
        }
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
}
