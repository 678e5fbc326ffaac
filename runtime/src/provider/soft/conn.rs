//! One TCP connection to a remote engine: receive and transmit buffers, the
//! ordered queue of responses to send, and the requester QPs that send on it.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use super::packet::{encode_hello, Header, Opcode, HEADER_LEN, HELLO_LEN, MAX_PAYLOAD};

/// Stop generating packets once this many bytes wait to be written.
pub(crate) const TX_HIGH: usize = 256 * 1024;
/// Receive buffer size (several maximal packets).
const RX_CAP: usize = 512 * 1024;

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

pub(crate) struct Conn {
    pub stream: mio::net::TcpStream,
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
    pub resp: VecDeque<Resp>,
    /// Requester QPs with packets to send on this connection.
    pub senders: VecDeque<u32>,
    /// Listed in the engine's active list.
    pub active: bool,
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
    pub fn new(stream: mio::net::TcpStream, local: SocketAddr, connected: bool) -> Conn {
        let mut c = Conn {
            stream,
            peer: None,
            connected,
            got_hello: false,
            rx: vec![0; RX_CAP],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(TX_HIGH + HEADER_LEN + MAX_PAYLOAD as usize),
            tx_pos: 0,
            resp: VecDeque::new(),
            senders: VecDeque::new(),
            active: false,
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

    /// Queues a response, coalescing consecutive ACKs of one QP.
    pub fn push_resp(&mut self, r: Resp) {
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

    /// Writes as much of the transmit buffer as the socket takes.
    pub fn flush(&mut self) -> Flush {
        if !self.connected {
            return Flush::Blocked;
        }
        while self.tx_pos < self.tx.len() {
            match self.stream.write(&self.tx[self.tx_pos..]) {
                Ok(0) => return Flush::Closed,
                Ok(n) => self.tx_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.compact_tx();
                    return Flush::Blocked;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(error = %e, "soft engine: write failed");
                    return Flush::Closed;
                }
            }
        }
        self.tx.clear();
        self.tx_pos = 0;
        Flush::Done
    }

    fn compact_tx(&mut self) {
        if self.tx_pos > TX_HIGH / 2 {
            self.tx.drain(..self.tx_pos);
            self.tx_pos = 0;
        }
    }

    /// Reads once into the receive buffer. `Ok(0)` means end of stream.
    pub fn read_some(&mut self) -> io::Result<usize> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx.len() - self.rx_end < HEADER_LEN + MAX_PAYLOAD as usize {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        let end = self.rx_end;
        let n = self.stream.read(&mut self.rx[end..])?;
        self.rx_end += n;
        Ok(n)
    }
}
