//! One TCP connection to a remote engine: receive and transmit buffers, the
//! ordered queue of responses to send, and the requester QPs that send on it.
//!
//! This file holds the connection's state; `tx.rs` writes it out (and holds
//! the zero-copy payload type), `rx.rs` reads it in (including payloads
//! received straight into memory), `acks.rs` coalesces and holds ACKs, and
//! `resp.rs` lists the responses a responder owes.

mod acks;
mod resp;
mod rx;
mod tx;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::packet::{encode_hello, Header, Opcode, HELLO_LEN};
use super::wire::Wire;
pub(crate) use resp::{ReadJob, Resp};
pub(crate) use rx::RxDirect;
pub(crate) use tx::{TxMem, TxMemRef};

/// Stop generating packets once this many bytes wait to be written.
pub(crate) const TX_HIGH: usize = 256 * 1024;
/// Initial receive buffer size; it grows to hold a packet that is not
/// received directly into registered memory.
const RX_CAP: usize = 64 * 1024;

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
