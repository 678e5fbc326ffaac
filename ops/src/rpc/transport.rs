//! What the engine needs from a datagram transport, and the packet batch it
//! hands over for one doorbell.

use std::ops::Range;
use std::task::{Context, Poll};

use thiserror::Error;

use super::header::{Header, HEADER_LEN};

/// A datagram transport: unreliable, unordered, packets of at most
/// [`max_packet`](Transport::max_packet) bytes. The engine adds every
/// reliability property on top.
///
/// Implemented by the runtime's UD queue pair (`UdTransport`, with the
/// runtime's UD support) and by [`MemTransport`](super::mem::MemTransport), an
/// in-memory network with seeded loss, duplication and reordering.
pub trait Transport: 'static {
    /// A resolved destination (an address handle with QPN and Q_Key on UD).
    /// Cloned per packet sent: keep it cheap.
    type Peer: Clone + 'static;

    /// The largest packet, header included.
    fn max_packet(&self) -> usize;

    /// This endpoint's address, as the peers resolve it: carried by the
    /// connect packet.
    fn local_addr(&self) -> Vec<u8>;

    /// Resolves a peer's address (from [`local_addr`](Transport::local_addr)
    /// on its side).
    fn resolve(&mut self, addr: &[u8]) -> Result<Self::Peer, TransportError>;

    /// Sends every packet of `batch`, with one doorbell where the transport
    /// has doorbells. A packet the network loses is not an error.
    fn send(&mut self, batch: &TxBatch<Self::Peer>) -> Result<(), TransportError>;

    /// Hands up to `max` received packets to `on_packet`, returning how
    /// many; `Pending` (with `cx` registered) if none is there.
    fn poll_recv(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        on_packet: &mut dyn FnMut(&[u8]),
    ) -> Poll<Result<usize, TransportError>>;

    /// Whether [`poll_recv`](Transport::poll_recv) returning fewer than
    /// `max` packets means it found no more and registered `cx` for the
    /// next one (as it does when it returns `Pending`): the engine then
    /// does not call it again just to see `Pending`, a call saved per
    /// receive batch. `false` (the default) for a transport that registers
    /// only when it returns `Pending`.
    fn short_batch_registers(&self) -> bool {
        false
    }

    /// Whether a send of packets of `packet_len` bytes costs enough per
    /// call (a doorbell: on UD one post list, on the soft device one wake
    /// of its engine thread) that calls started while others of their
    /// session are under way should leave together in one
    /// [`send`](Transport::send), made by the endpoint's dispatcher (woken
    /// by the first of them, it runs after the task that started them),
    /// rather than each at its start. A call started alone leaves at once
    /// either way. `false` by default.
    fn batch_call_starts(&self, packet_len: usize) -> bool {
        let _ = packet_len;
        false
    }

    /// The transport's large-message path, if it has one: taken once by
    /// [`Rpc::new`](super::Rpc::new). `None` (the default): every
    /// message travels in packets.
    fn bulk(&mut self) -> Option<Box<dyn Bulk>> {
        None
    }
}

/// One finished READ: its token, the buffer it read into (the message's
/// bytes on success), and how it ended.
pub type BulkDone = (u64, Vec<u8>, Result<(), TransportError>);

/// A large-message path next to a datagram transport, the rrppcc way:
/// RC links between two endpoints (one per session, opened on demand
/// through the session's packets), buffers exposed for the peer to READ,
/// and READs of the peer's exposed buffers. Implemented on the runtime's
/// RC queue pairs ([`UdTransport`](super::ud::UdTransport)) and in memory
/// ([`MemTransport`](super::mem::MemTransport)).
pub trait Bulk {
    /// Makes this side's end of link `link` (a number the engine never
    /// reuses) and returns its address for the peer.
    fn open(&mut self, link: u64) -> Result<Vec<u8>, TransportError>;

    /// Connects this side's end of `link` to the peer's end at `remote`.
    fn connect(&mut self, link: u64, remote: &[u8]) -> Result<(), TransportError>;

    /// Closes `link`: its READs under way end (in error, reported by
    /// [`poll_done`](Bulk::poll_done)).
    fn close(&mut self, link: u64);

    /// Lets peers READ `buf[..buf.len()]` until [`unexpose`](Bulk::unexpose):
    /// returns a token and the buffer's address and remote key. On
    /// failure the buffer comes back.
    fn expose(&mut self, buf: Vec<u8>) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)>;

    /// Stops peers reading the buffer of `token` (no READ touches it
    /// afterwards) and gives it back.
    fn unexpose(&mut self, token: u64) -> Option<Vec<u8>>;

    /// Appends the `n` bytes at offset `off` of the buffer exposed as
    /// `token` to `dst`, leaving it exposed (a peer writing meanwhile may
    /// leave a mix of old and new bytes); false, `dst` unchanged, if
    /// there is no such buffer or the span is outside it.
    fn copy_out(&mut self, token: u64, off: usize, n: usize, dst: &mut Vec<u8>) -> bool;

    /// Starts a READ over `link` of `len` bytes at `addr` under `rkey`
    /// into `into` (capacity at least `len`), reported with `token` by
    /// [`poll_done`](Bulk::poll_done). On failure to start, the buffer
    /// comes back.
    fn read(
        &mut self,
        link: u64,
        addr: u64,
        rkey: u32,
        len: usize,
        into: Vec<u8>,
        token: u64,
    ) -> Result<(), (Vec<u8>, TransportError)>;

    /// The READs and WRITEs that finished since the last call; registers
    /// `cx` for the next one (whether or not some were here: the engine
    /// does not ask again before it sleeps).
    fn poll_done(&mut self, cx: &mut Context<'_>, out: &mut Vec<BulkDone>);

    /// Like [`expose`](Bulk::expose), but the peer at the other end of
    /// `link` may also WRITE with immediate into the region, which spans
    /// `cap` bytes (at least `buf.len()`; the bytes past `buf.len()` are
    /// zeroed first). [`unexpose`](Bulk::unexpose) gives the buffer back
    /// with all `cap` bytes. The link is made ready to take the
    /// immediates ([`poll_written`](Bulk::poll_written)).
    fn expose_writable(
        &mut self,
        link: u64,
        buf: Vec<u8>,
        cap: usize,
    ) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)>;

    /// Starts an RDMA WRITE with immediate `imm` of all of `buf` over
    /// `link` to `addr` under `rkey`, reported with `token` by
    /// [`poll_done`](Bulk::poll_done) (which gives `buf` back). On failure
    /// to start, the buffer comes back.
    fn write_imm(
        &mut self,
        link: u64,
        buf: Vec<u8>,
        addr: u64,
        rkey: u32,
        imm: u32,
        token: u64,
    ) -> Result<(), (Vec<u8>, TransportError)>;

    /// The WRITEs with immediate the peers finished into this side's
    /// writable regions since the last call, as (link, immediate);
    /// registers `cx` for the next one (whether or not some were here).
    fn poll_written(&mut self, cx: &mut Context<'_>, out: &mut Vec<(u64, u32)>);

    /// The largest packet (header included) [`send_packet`](Bulk::send_packet)
    /// carries over a link: what the peer's receive buffers hold (the same
    /// constant on both sides). 0 (the default): no packets over links.
    fn max_link_packet(&self) -> usize {
        0
    }

    /// Bytes of receive buffers this side keeps posted for packets over
    /// its links (one pool for all of them, made with the first link):
    /// charged to the endpoint's request memory.
    fn link_recv_memory(&self) -> usize {
        0
    }

    /// Sends one packet, `head` then `payload` (at most
    /// [`max_link_packet`](Bulk::max_link_packet) bytes together), over
    /// `link` by RC SEND: reliable and in order while the link lasts. A
    /// send that fails later breaks the link
    /// ([`poll_received`](Bulk::poll_received) reports it).
    fn send_packet(
        &mut self,
        link: u64,
        head: &[u8; HEADER_LEN],
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let _ = (link, head, payload);
        Err(TransportError::no_such_link())
    }

    /// The packets the peers sent over this side's links since the last
    /// call, as (link, packet), and the links whose sends failed since
    /// (broken: the engine closes them); registers `cx` for the next
    /// (whether or not some were here).
    fn poll_received(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut Vec<(u64, LinkPacket)>,
        broken: &mut Vec<u64>,
    ) {
        let _ = (cx, out, broken);
    }
}

/// A packet that came over a link ([`Bulk::poll_received`]): a receive
/// buffer of the link's pool, reposted when this is dropped, or bytes of
/// its own.
pub enum LinkPacket {
    /// A buffer of a receive ring (its bytes are the packet).
    Ring(verbio_runtime::RingMsg),
    /// Bytes of its own.
    Owned(Vec<u8>),
}

impl LinkPacket {
    /// The packet's bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            LinkPacket::Ring(m) => m.as_slice(),
            LinkPacket::Owned(v) => v,
        }
    }
}

impl std::fmt::Debug for LinkPacket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkPacket")
            .field("len", &self.as_slice().len())
            .finish()
    }
}

/// A transport failure.
#[derive(Debug, Error)]
pub enum TransportError {
    /// A peer address that does not resolve.
    #[error("peer address of {len} bytes does not resolve: {reason}")]
    BadAddress {
        /// The address length.
        len: usize,
        /// Why.
        reason: &'static str,
    },
    /// A packet larger than the transport's largest.
    #[error("packet of {len} bytes exceeds the transport's {max}")]
    TooLarge {
        /// The packet length.
        len: usize,
        /// [`Transport::max_packet`].
        max: usize,
    },
    /// The transport's device or queue pair failed.
    #[error("{op} failed")]
    Failed {
        /// What was being done.
        op: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl TransportError {
    /// A bulk operation named a link this side does not have.
    pub(crate) fn no_such_link() -> Self {
        TransportError::bad_address(0, "no such link")
    }

    /// A [`TransportError::BadAddress`] of `len` bytes: `reason`.
    pub(crate) fn bad_address(len: usize, reason: &'static str) -> Self {
        TransportError::BadAddress { len, reason }
    }
}

/// Packets queued for one [`Transport::send`]: their bytes in one reused
/// buffer, each with its destination. Clearing keeps the capacity, so a
/// steady stream of batches allocates nothing.
#[derive(Debug)]
pub struct TxBatch<P> {
    bytes: Vec<u8>,
    packets: Vec<(P, Range<usize>)>,
}

/// Packets a batch has room for before it grows.
const BATCH_PACKETS: usize = 256;
/// Bytes a batch has room for before it grows.
const BATCH_BYTES: usize = BATCH_PACKETS * 64;

impl<P> Default for TxBatch<P> {
    fn default() -> Self {
        TxBatch {
            bytes: Vec::with_capacity(BATCH_BYTES),
            packets: Vec::with_capacity(BATCH_PACKETS),
        }
    }
}

impl<P: Clone> TxBatch<P> {
    /// Queues a packet of `header` and `payload` to `peer`.
    #[inline]
    pub fn push(&mut self, peer: &P, header: &Header, payload: &[u8]) {
        let start = self.bytes.len();
        let mut head = [0u8; HEADER_LEN];
        header.encode_into(&mut head);
        self.bytes.extend_from_slice(&head);
        self.bytes.extend_from_slice(payload);
        self.packets.push((peer.clone(), start..self.bytes.len()));
    }

    /// Queues a packet of raw bytes to `peer` (tools and tests that speak
    /// for a peer, malformed packets included).
    pub fn push_bytes(&mut self, peer: &P, packet: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(packet);
        self.packets.push((peer.clone(), start..self.bytes.len()));
    }

    /// Packets queued.
    pub fn len(&self) -> usize {
        self.packets.len()
    }

    /// True if no packet is queued.
    pub fn is_empty(&self) -> bool {
        self.packets.is_empty()
    }

    /// The packets, in the order queued.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&P, &[u8])> {
        self.packets
            .iter()
            .map(|(p, r)| (p, &self.bytes[r.clone()]))
    }

    /// Forgets every packet, keeping the capacity.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.packets.clear();
    }
}
