//! An in-memory datagram network for tests: every endpoint on one thread,
//! packets copied into per-endpoint queues, with seeded loss, duplication
//! and reordering. Packet buffers are recycled, so a steady stream
//! allocates nothing.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use crate::rpc::waker::keep_waker;

pub(crate) mod bulk;

use crate::rpc::transport::{Bulk, Transport, TransportError, TxBatch};

/// What the network does to packets, as fractions from 0 to 1.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Packets lost.
    pub drop: f64,
    /// Packets delivered twice.
    pub duplicate: f64,
    /// Packets delivered ahead of up to three packets queued before them.
    pub reorder: f64,
}

/// What the network did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Packets handed to the network.
    pub sent: u64,
    /// Packets lost by fault injection.
    pub dropped: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Packets put ahead of others.
    pub reordered: u64,
    /// Packets to an endpoint that is gone or unreachable.
    pub undeliverable: u64,
}

#[derive(Default)]
pub(crate) struct Inbox {
    queue: VecDeque<Vec<u8>>,
    waker: Option<Waker>,
    open: bool,
    reachable: bool,
    /// Calls of [`Transport::send`] made by this endpoint (each a batch:
    /// on a device, one post list).
    send_calls: u64,
}

pub(crate) struct Net {
    pub(crate) inboxes: Vec<Inbox>,
    faults: Faults,
    /// Some fault is set (else a packet is delivered with no draw).
    faulty: bool,
    rng: u64,
    free: Vec<Vec<u8>>,
    max_packet: usize,
    stats: MemStats,
    /// Links, exposed buffers and READs (`bulk.rs`).
    pub(crate) bulk: bulk::BulkNet,
    /// Endpoints made from now on have a large-message path.
    with_bulk: bool,
    /// Endpoints made from now on batch call starts
    /// ([`Transport::batch_call_starts`]).
    batch_call_starts: bool,
}

impl Net {
    /// xorshift64*: a uniform number in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p` (no draw when `p` is 0: a network
    /// without faults costs no random numbers).
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.uniform() < p
    }

    /// [`deliver`](Self::deliver) on a network without faults: a copy,
    /// a push and a wake (inline: the send loop's common case).
    #[inline(always)]
    fn deliver_plain(&mut self, to: u32, bytes: &[u8]) {
        let mut buf = self.free.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(bytes);
        let inbox = &mut self.inboxes[to as usize];
        inbox.queue.push_back(buf);
        if let Some(w) = &inbox.waker {
            w.wake_by_ref();
        }
    }

    fn deliver(&mut self, to: u32, bytes: &[u8]) {
        let mut buf = self.free.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(bytes);
        let reorder = self.chance(self.faults.reorder);
        let len = self.inboxes[to as usize].queue.len();
        let pick = if reorder && len > 0 {
            self.uniform()
        } else {
            0.0
        };
        let inbox = &mut self.inboxes[to as usize];
        if reorder && len > 0 {
            let back = 1 + (pick * len.min(3) as f64) as usize;
            inbox.queue.insert(len - back.min(len), buf);
            self.stats.reordered += 1;
        } else {
            inbox.queue.push_back(buf);
        }
        // Woken by reference and kept: the receiver registers the same
        // waker again, so no clone and no drop per packet.
        if let Some(w) = &inbox.waker {
            w.wake_by_ref();
        }
    }
}

/// The network: create endpoints with [`endpoint`](MemNetwork::endpoint).
#[derive(Clone)]
pub struct MemNetwork(pub(crate) Rc<RefCell<Net>>);

impl MemNetwork {
    /// A network of packets up to `max_packet` bytes, its faults drawn from
    /// a generator seeded with `seed`.
    pub fn new(seed: u64, max_packet: usize) -> MemNetwork {
        MemNetwork(Rc::new(RefCell::new(Net {
            inboxes: Vec::new(),
            faults: Faults::default(),
            faulty: false,
            rng: seed | 1,
            free: Vec::new(),
            max_packet,
            stats: MemStats::default(),
            bulk: Default::default(),
            with_bulk: true,
            batch_call_starts: false,
        })))
    }

    /// Whether endpoints made from now on move large messages by READ
    /// ([`Transport::bulk`]; true by default).
    pub fn set_bulk(&self, on: bool) {
        self.0.borrow_mut().with_bulk = on;
    }

    /// Breaks every link end of endpoint `id` (as a QP in error: what goes
    /// over them fails; tests).
    pub fn break_links(&self, id: u32) {
        self.0.borrow_mut().bulk.break_links(id);
    }

    /// Packets sent over links so far (tests).
    pub fn link_packets(&self) -> u64 {
        self.0.borrow().bulk.link_packets
    }

    /// Whether endpoints made from now on send calls started while others
    /// of their session are under way together, by the dispatcher
    /// ([`Transport::batch_call_starts`], as on UD; false by default:
    /// each leaves at its start).
    pub fn set_batch_call_starts(&self, on: bool) {
        self.0.borrow_mut().batch_call_starts = on;
    }

    /// Holds READs from now on (they wait, under way, until this is
    /// called with false, which carries them out).
    pub fn hold_reads(&self, hold: bool) {
        self.hold(false, hold);
    }

    /// READs held (see [`hold_reads`](MemNetwork::hold_reads)).
    pub fn held_reads(&self) -> usize {
        self.0.borrow().bulk.held(false)
    }

    /// Holds WRITEs with immediate from now on, as
    /// [`hold_reads`](MemNetwork::hold_reads) holds READs.
    pub fn hold_writes(&self, hold: bool) {
        self.hold(true, hold);
    }

    /// Holds READs (`writes`: WRITEs with immediate) from now on, or
    /// carries out those held and holds no more.
    fn hold(&self, writes: bool, hold: bool) {
        let mut net = self.0.borrow_mut();
        if writes {
            net.bulk.hold_writes = hold;
        } else {
            net.bulk.hold = hold;
        }
        if !hold {
            net.bulk.release(writes);
        }
    }

    /// WRITEs held (see [`hold_writes`](MemNetwork::hold_writes)).
    pub fn held_writes(&self) -> usize {
        self.0.borrow().bulk.held(true)
    }

    /// Bytes zeroed so far to expose buffers for WRITE (the room past
    /// what a buffer held: a pass over memory per byte, as a device's
    /// registration makes).
    pub fn zeroed_bytes(&self) -> u64 {
        self.0.borrow().bulk.zeroed
    }

    /// Bytes endpoints copied out of their own exposed buffers so far
    /// (a written request's trailer, checked before its room is handed
    /// over).
    pub fn copied_out_bytes(&self) -> u64 {
        self.0.borrow().bulk.copied_out
    }

    /// Memory registrations endpoint `id` would have made so far on a
    /// device: each buffer it exposed (for READ, or READ and WRITE), each
    /// READ's destination and each WRITE's source (tests count them per
    /// call).
    pub fn registrations(&self, id: u32) -> u64 {
        self.0.borrow().bulk.registrations_of(id)
    }

    /// READs carried out so far.
    pub fn reads(&self) -> u64 {
        self.0.borrow().bulk.reads
    }

    /// Buffers endpoint `id` exposes to READ now.
    pub fn exposed_by(&self, id: u32) -> usize {
        self.0.borrow().bulk.exposed_by(id)
    }

    /// Withdraws every buffer endpoint `id` exposes, as a device that lost
    /// its registrations would: READs and WRITEs of them fail from now on
    /// (tests break a link by it).
    pub fn withdraw_exposed(&self, id: u32) {
        let mut net = self.0.borrow_mut();
        net.bulk.withdraw(id);
    }

    /// Sets what happens to packets from now on.
    pub fn set_faults(&self, faults: Faults) {
        let mut net = self.0.borrow_mut();
        net.faults = faults;
        net.faulty = faults != Faults::default();
    }

    /// A new endpoint on the network.
    pub fn endpoint(&self) -> MemTransport {
        let mut net = self.0.borrow_mut();
        let id = net.inboxes.len() as u32;
        net.inboxes.push(Inbox {
            open: true,
            reachable: true,
            ..Inbox::default()
        });
        MemTransport {
            net: self.clone(),
            id,
            max_packet: net.max_packet,
            bulk: net.with_bulk,
            batch_call_starts: net.batch_call_starts,
        }
    }

    /// Cuts endpoint `id` off (packets to it are lost) or reconnects it.
    pub fn set_reachable(&self, id: u32, reachable: bool) {
        if let Some(inbox) = self.0.borrow_mut().inboxes.get_mut(id as usize) {
            inbox.reachable = reachable;
        }
    }

    /// Calls of [`Transport::send`] endpoint `id` made so far, each with
    /// a batch of packets (on a device, one post list): tests count the
    /// transport calls an endpoint's packets left in.
    pub fn send_calls(&self, id: u32) -> u64 {
        self.0
            .borrow()
            .inboxes
            .get(id as usize)
            .map_or(0, |inbox| inbox.send_calls)
    }

    /// What the network did so far.
    pub fn stats(&self) -> MemStats {
        self.0.borrow().stats
    }
}

/// One endpoint of a [`MemNetwork`]: its address is its 4-byte id.
pub struct MemTransport {
    net: MemNetwork,
    id: u32,
    max_packet: usize,
    bulk: bool,
    batch_call_starts: bool,
}

impl MemTransport {
    /// This endpoint's id on the network.
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        let mut net = self.net.0.borrow_mut();
        let inbox = &mut net.inboxes[self.id as usize];
        inbox.open = false;
        inbox.queue.clear();
        inbox.waker = None;
    }
}

impl Transport for MemTransport {
    type Peer = u32;

    fn max_packet(&self) -> usize {
        self.max_packet
    }

    fn local_addr(&self) -> Vec<u8> {
        self.id.to_le_bytes().to_vec()
    }

    fn resolve(&mut self, addr: &[u8]) -> Result<u32, TransportError> {
        let bad = |reason| TransportError::bad_address(addr.len(), reason);
        let id = u32::from_le_bytes(addr.try_into().map_err(|_| bad("not 4 bytes"))?);
        if (id as usize) < self.net.0.borrow().inboxes.len() {
            Ok(id)
        } else {
            Err(bad("no such endpoint"))
        }
    }

    fn send(&mut self, batch: &TxBatch<u32>) -> Result<(), TransportError> {
        let mut net = self.net.0.borrow_mut();
        net.inboxes[self.id as usize].send_calls += 1;
        for (&to, bytes) in batch.iter() {
            if bytes.len() > self.max_packet {
                return Err(TransportError::TooLarge {
                    len: bytes.len(),
                    max: self.max_packet,
                });
            }
            net.stats.sent += 1;
            let Some(inbox) = net.inboxes.get(to as usize) else {
                net.stats.undeliverable += 1;
                continue;
            };
            if !inbox.open || !inbox.reachable {
                net.stats.undeliverable += 1;
                continue;
            }
            if !net.faulty {
                net.deliver_plain(to, bytes);
                continue;
            }
            let faults = net.faults;
            if net.chance(faults.drop) {
                net.stats.dropped += 1;
                continue;
            }
            net.deliver(to, bytes);
            if net.chance(faults.duplicate) {
                net.stats.duplicated += 1;
                net.deliver(to, bytes);
            }
        }
        Ok(())
    }

    fn poll_recv(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        on_packet: &mut dyn FnMut(&[u8]),
    ) -> Poll<Result<usize, TransportError>> {
        let mut n = 0;
        // The last packet's buffer, recycled with the next borrow.
        let mut spent: Option<Vec<u8>> = None;
        loop {
            // The network is not borrowed while `on_packet` runs.
            let mut net = self.net.0.borrow_mut();
            if let Some(buf) = spent.take() {
                net.free.push(buf);
            }
            if n == max {
                break;
            }
            let inbox = &mut net.inboxes[self.id as usize];
            let Some(buf) = inbox.queue.pop_front() else {
                // Drained: woken by the next packet (`short_batch_registers`).
                keep_waker(&mut inbox.waker, cx);
                break;
            };
            drop(net);
            on_packet(&buf);
            spent = Some(buf);
            n += 1;
        }
        if n > 0 {
            Poll::Ready(Ok(n))
        } else {
            Poll::Pending
        }
    }

    fn short_batch_registers(&self) -> bool {
        true
    }

    fn batch_call_starts(&self, _packet_len: usize) -> bool {
        self.batch_call_starts
    }

    fn bulk(&mut self) -> Option<Box<dyn Bulk>> {
        if !std::mem::take(&mut self.bulk) {
            return None;
        }
        Some(Box::new(bulk::MemBulk {
            net: self.net.clone(),
            id: self.id,
        }))
    }
}
