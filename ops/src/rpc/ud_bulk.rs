//! The large-message path of [`UdTransport`](super::ud::UdTransport): RC
//! queue pairs of the same device (one per session that asks), buffers
//! granted to peers for REMOTE_READ (and REMOTE_WRITE where the peer may
//! write a response into them), READs into buffers registered for the
//! READ's time, WRITEs with immediate from buffers registered for the
//! WRITE's time, and one shared receive queue for all the links, whose
//! buffers take the peers' packets sent by RC SEND (messages larger than
//! a datagram and below the READ threshold) and the immediates of their
//! WRITEs: rings of [`LINK_RECV_DEPTH`] buffers of [`LINK_PACKET`] bytes,
//! the first made with the first link and one more for every
//! [`LINKS_PER_RING`] links after, up to [`LINK_RECV_MAX`] buffers
//! whatever the number of links or peers.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tracing::debug;
use verbio_runtime::buf::{IoBuf, LocalBuf, MrPool, RegisteredMem, RemoteAccessRegion, Slice};
use verbio_runtime::provider::{AccessFlags, Endpoint, Pd, QpCaps};
use verbio_runtime::{Device, QueuePair, RecvRing, RecvRingConfig, SharedRecvQueue, Submit};

use super::header::HEADER_LEN;
use super::id_map::IdMap;
use super::session::SESSION_SLOTS;
use super::transport::{Bulk, BulkDone, LinkPacket, TransportError};
use crate::connect::handshake::{self, Hello};
use crate::connect::{DeviceQps, QpConfig, QpFactory};
use crate::verbs::write_with_imm::WriteWithImmVerb;
use crate::verbs::{ReadVerb, RemoteBuf, SendVerb};

/// READs a link has under way at most (its send queue).
const LINK_SEND_DEPTH: u32 = 64;
/// Receives of one ring on the links' shared receive queue, which takes
/// the packets and immediates of all links together. A peer sending more
/// at once than are posted waits (RNR) for a repost; the buffers are
/// reposted as the dispatcher takes each packet.
pub(crate) const LINK_RECV_DEPTH: u32 = 64;
/// Links one ring of receives is kept for: a link carries at most a
/// session's calls under way ([`SESSION_SLOTS`]), one SEND or immediate
/// each, so 8 links fill a ring. More links on one ring find it empty
/// under a window and wait out the RNR timer (on rxe a kernel tick).
pub(crate) const LINKS_PER_RING: usize = LINK_RECV_DEPTH as usize / SESSION_SLOTS;
/// The shared receive queue's capacity: at most this many receives
/// posted, 4 rings (8 MiB), whatever the number of links.
pub(crate) const LINK_RECV_MAX: u32 = 4 * LINK_RECV_DEPTH;
/// Bytes of each of those receives: the largest packet a link carries (a
/// header and 32 KiB, the default READ threshold: larger messages go by
/// READ or WRITE). A larger SEND fails at the receiver and breaks its link.
pub(crate) const LINK_PACKET: usize = HEADER_LEN + (32 << 10);
/// The RNR timer the links ask their peers for (encoded: 0.01 ms), for the
/// rare SEND that finds the shared receive queue empty.
const LINK_MIN_RNR_TIMER: u8 = 1;
/// Registered buffers of finished link SENDs kept for the next ones (a
/// pool allocation and release saved per SEND), at least: a link's send
/// queue, so a window's burst of completions is kept whole (the pool
/// would keep their blocks anyway). With more links, up to the SENDs they
/// may have under way together ([`spare_sends`]).
const SPARE_SENDS: usize = LINK_SEND_DEPTH as usize;
/// The most finished SENDs' buffers kept, whatever the number of links:
/// as many as the receives the links' shared queue holds at most (4 rings,
/// [`LINK_RECV_MAX`]).
const SPARE_SENDS_MAX: usize = LINK_RECV_MAX as usize;

/// Finished SENDs' buffers kept with `links` links open: the SENDs they
/// may have under way together (a link carries at most its session's
/// calls, [`SESSION_SLOTS`], one SEND each), so that a window's burst of
/// completions over all of them is kept whole and the next window takes
/// no buffer from the pool; between [`SPARE_SENDS`] and
/// [`SPARE_SENDS_MAX`]. (Kept to a link's send queue whatever the links,
/// a window of 128 calls over 16 links took about 40 % of its SENDs'
/// buffers from the pool.)
pub(crate) fn spare_sends(links: usize) -> usize {
    links
        .saturating_mul(SESSION_SLOTS)
        .clamp(SPARE_SENDS, SPARE_SENDS_MAX)
}

/// A registered buffer an RDMA READ or WRITE owns while it runs.
type OpMem = RegisteredMem<Vec<u8>>;

/// A READ or WRITE with immediate under way, polled by the dispatcher in
/// [`Bulk::poll_done`] (no task per operation: its completion wakes the
/// dispatcher itself, and nothing is allocated for it).
enum BulkOp {
    Read(Submit<ReadVerb<OpMem>>),
    Write(Submit<WriteWithImmVerb<OpMem>>),
}

impl BulkOp {
    /// The operation's result and buffer once it finished.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<(Result<(), TransportError>, Vec<u8>)> {
        let (result, mem, what) = match self {
            BulkOp::Read(op) => match Pin::new(op).poll(cx) {
                Poll::Ready((r, mem)) => (r.map(drop), mem, "reading by RDMA READ"),
                Poll::Pending => return Poll::Pending,
            },
            BulkOp::Write(op) => match Pin::new(op).poll(cx) {
                Poll::Ready((r, mem)) => (r.map(drop), mem, "writing by RDMA WRITE with immediate"),
                Poll::Pending => return Poll::Pending,
            },
        };
        let result = result.map_err(|e| {
            debug!(error = %e, what, "rpc/ud: bulk operation failed");
            failed(what, e)
        });
        Poll::Ready((result, mem.into_inner()))
    }
}

/// A SEND over a link under way: its registered copy of the packet is
/// the SEND's until its completion.
type LinkSend = Submit<SendVerb<LocalBuf>>;

/// One RC link: its queue pair, local endpoint, and SENDs under way.
struct Link {
    qp: QueuePair,
    ep: Endpoint,
    /// SENDs under way, oldest first: an RC send queue completes in order,
    /// so only the oldest is polled (the others wait behind it). Dropped
    /// with the link: the runtime keeps each buffer until the device is
    /// done with it.
    sends: VecDeque<LinkSend>,
}

/// The [`Bulk`] of a UD transport's device.
pub(crate) struct UdBulk {
    qps: DeviceQps,
    pd: Pd,
    /// The links by number (numbers this side allocates: a cheap hash).
    links: IdMap<u64, Link>,
    /// The links by their queue pairs' numbers (a receive on the shared
    /// queue names its QP).
    qp_links: IdMap<u32, u64>,
    /// The links' shared receive queue and its rings: the first made with
    /// the first link, one more for every [`LINKS_PER_RING`] links open
    /// (kept when links close: their memory is charged while it lasts).
    srq: Option<(SharedRecvQueue, Vec<RecvRing>)>,
    /// Registered buffers the packets sent over links are copied into.
    send_pool: MrPool,
    /// Buffers of finished SENDs, emptied, taken before the pool's.
    spare: Vec<LocalBuf>,
    /// What the ring gave that the other poll takes.
    written: Vec<(u64, u32)>,
    received: Vec<(u64, LinkPacket)>,
    regions: IdMap<u64, RemoteAccessRegion<Slice<Vec<u8>>>>,
    next_region: u64,
    /// READs and WRITEs under way, by token.
    ops: Vec<(u64, BulkOp)>,
    /// The links with SENDs under way (each link's oldest is polled with
    /// the received packets; one that failed broke its link).
    sending: Vec<u64>,
}

impl UdBulk {
    /// Grants the peer `access` to exactly the first `len` bytes of `buf`
    /// (`what`: the error's operation), under a new token: the token, the
    /// address and the remote key; `buf` back on failure.
    fn grant(
        &mut self,
        buf: Vec<u8>,
        len: usize,
        access: AccessFlags,
        what: &'static str,
    ) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        let buf = match buf.slice(..len) {
            Ok(slice) => slice,
            Err(rejected) => {
                let error = failed("exposing a buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        match RemoteAccessRegion::grant(&self.pd, buf, access) {
            Ok(region) => {
                let token = self.next_region;
                self.next_region += 1;
                let (addr, rkey) = (region.addr(), region.rkey());
                self.regions.insert(token, region);
                Ok((token, addr, rkey))
            }
            Err(rejected) => Err((rejected.buf.into_inner(), failed(what, rejected.error))),
        }
    }

    /// RC links on `device`.
    pub(crate) fn new(device: &Device) -> UdBulk {
        let config = QpConfig {
            min_rnr_timer: LINK_MIN_RNR_TIMER,
            caps: QpCaps {
                max_send_wr: LINK_SEND_DEPTH,
                max_recv_wr: LINK_RECV_DEPTH,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..QpConfig::default()
        };
        UdBulk {
            qps: DeviceQps::new(device.clone(), config),
            pd: device.pd().clone(),
            links: IdMap::default(),
            qp_links: IdMap::default(),
            srq: None,
            send_pool: MrPool::new(device.pd()),
            spare: Vec::new(),
            written: Vec::new(),
            received: Vec::new(),
            regions: IdMap::default(),
            next_region: 1,
            ops: Vec::new(),
            sending: Vec::new(),
        }
    }
}

#[cfg(test)]
impl UdBulk {
    /// Finished SENDs' buffers kept for the next ones.
    pub(crate) fn spare_len(&self) -> usize {
        self.spare.len()
    }

    /// Links with SENDs under way.
    pub(crate) fn links_sending(&self) -> usize {
        self.sending.len()
    }

    /// The pool the SENDs' buffers come from.
    pub(crate) fn send_pool_stats(&self) -> verbio_runtime::buf::PoolStats {
        self.send_pool.stats()
    }
}

fn failed(op: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> TransportError {
    TransportError::Failed {
        op,
        source: Box::new(e),
    }
}

impl UdBulk {
    /// The links' shared receive queue, made (and its first ring's
    /// buffers posted) on the first call.
    fn srq(&mut self) -> Result<SharedRecvQueue, TransportError> {
        if let Some((srq, _)) = &self.srq {
            return Ok(srq.clone());
        }
        let device = self.qps.device();
        let srq = device
            .create_srq(LINK_RECV_MAX)
            .map_err(|e| failed("creating the links' shared receive queue", e))?;
        let ring = new_ring(&srq, &self.pd)?;
        self.srq = Some((srq.clone(), vec![ring]));
        Ok(srq)
    }

    /// Posts one more ring when the links open outnumber what the rings
    /// are kept for, up to [`LINK_RECV_MAX`] receives. A ring that cannot
    /// be made leaves the links as they are (a SEND that finds the queue
    /// empty waits for a repost).
    fn grow_rings(&mut self) {
        let Some((srq, rings)) = &mut self.srq else {
            return;
        };
        let want = self.links.len().div_ceil(LINKS_PER_RING);
        if want <= rings.len() || (rings.len() as u32 + 1) * LINK_RECV_DEPTH > LINK_RECV_MAX {
            return;
        }
        match new_ring(srq, &self.pd) {
            Ok(ring) => {
                rings.push(ring);
                debug!(
                    links = self.links.len(),
                    rings = rings.len(),
                    "rpc/ud: one more ring of link receives"
                );
            }
            Err(error) => debug!(%error, "rpc/ud: no more link receives; links share those posted"),
        }
    }

    /// Takes what the shared receive queue received: immediates into
    /// `self.written`, packets into `self.received`; registers `cx`.
    fn drain_ring(&mut self, cx: &mut Context<'_>) {
        let Some((_, rings)) = &self.srq else {
            return;
        };
        for ring in rings {
            while let Poll::Ready(Some(next)) = ring.poll_next(cx) {
                let msg = match next {
                    Ok(msg) => msg,
                    Err(error) => {
                        debug!(%error, "rpc/ud: a link's receive completed in error");
                        continue;
                    }
                };
                let Some(&link) = self.qp_links.get(&msg.qp_num()) else {
                    // A link closed since: dropped (reposted).
                    continue;
                };
                match (msg.by_write(), msg.imm()) {
                    (true, Some(imm)) => self.written.push((link, imm)),
                    (false, None) => self.received.push((link, LinkPacket::Ring(msg))),
                    _ => debug!(
                        link,
                        "rpc/ud: a SEND with immediate or a WRITE without one on a link; ignored"
                    ),
                }
            }
        }
    }
}

/// A ring of [`LINK_RECV_DEPTH`] receives posted on `srq`.
fn new_ring(srq: &SharedRecvQueue, pd: &Pd) -> Result<RecvRing, TransportError> {
    let config = RecvRingConfig::new(LINK_RECV_DEPTH, LINK_PACKET);
    RecvRing::on_srq(srq, pd, config).map_err(|e| failed("posting the links' receives", e))
}

impl Bulk for UdBulk {
    fn open(&mut self, link: u64) -> Result<Vec<u8>, TransportError> {
        let srq = self.srq()?;
        let (qp, ep) = self
            .qps
            .create_on_srq(&srq)
            .map_err(|e| failed("creating an RC queue pair", e))?;
        let hello = handshake::encode(&Hello::new(ep))
            .map_err(|e| failed("encoding the RC endpoint", e))?;
        self.qp_links.insert(qp.qp_num(), link);
        let sends = VecDeque::new();
        self.links.insert(link, Link { qp, ep, sends });
        self.grow_rings();
        Ok(hello.to_vec())
    }

    fn connect(&mut self, link: u64, remote: &[u8]) -> Result<(), TransportError> {
        let Some(Link { qp, ep: local, .. }) = self.links.get(&link) else {
            return Err(TransportError::bad_address(remote.len(), "no such link"));
        };
        let hello = handshake::decode(remote)
            .map_err(|_| TransportError::bad_address(remote.len(), "not a handshake hello"))?;
        self.qps
            .connect(qp, local, &hello.endpoint)
            .map_err(|e| failed("connecting the RC queue pair", e))
    }

    fn close(&mut self, link: u64) {
        // Dropping the queue pair destroys it; READs and WRITEs under way
        // end flushed (`poll_done` reports them), SENDs under way are
        // dropped with it (their buffers kept until the device is done
        // with them). The receives
        // are the shared queue's: they stay posted for the other links.
        if let Some(l) = self.links.remove(&link) {
            self.qp_links.remove(&l.qp.qp_num());
        }
    }

    fn expose(&mut self, buf: Vec<u8>) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        // Exactly the message: the peer reaches nothing past it (and the
        // pool buffer's spare capacity is neither registered nor zeroed).
        let len = buf.len();
        let access = AccessFlags::REMOTE_READ;
        self.grant(buf, len, access, "granting a buffer for READ")
    }

    fn copy_out(&mut self, token: u64, off: usize, n: usize, dst: &mut Vec<u8>) -> bool {
        self.regions
            .get(&token)
            .is_some_and(|region| region.append_to(off, n, dst).is_ok())
    }

    fn unexpose(&mut self, token: u64) -> Option<Vec<u8>> {
        // Deregistered first: no READ reaches it afterwards.
        self.regions
            .remove(&token)
            .map(|region| region.revoke().into_inner())
    }

    fn read(
        &mut self,
        link: u64,
        addr: u64,
        rkey: u32,
        len: usize,
        into: Vec<u8>,
        token: u64,
    ) -> Result<(), (Vec<u8>, TransportError)> {
        let Some(Link { qp, .. }) = self.links.get(&link) else {
            let e = TransportError::no_such_link();
            return Err((into, e));
        };
        let mem = match RegisteredMem::register(&self.pd, into, AccessFlags::LOCAL_WRITE) {
            Ok(mem) => mem,
            Err(rejected) => {
                let error = failed("registering the READ's buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        let op = crate::verbs::read::read(qp, mem, RemoteBuf::new(addr, len as u64, rkey));
        self.ops.push((token, BulkOp::Read(op)));
        Ok(())
    }

    fn expose_writable(
        &mut self,
        link: u64,
        mut buf: Vec<u8>,
        cap: usize,
    ) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        // The immediates land in the links' shared receive queue.
        if !self.links.contains_key(&link) {
            let e = TransportError::no_such_link();
            return Err((buf, e));
        }
        let cap = cap.max(buf.len());
        buf.reserve_exact(cap - buf.len());
        // Exactly `cap` bytes: the peer reaches nothing past them.
        let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        self.grant(buf, cap, access, "granting a buffer for READ and WRITE")
    }

    fn write_imm(
        &mut self,
        link: u64,
        buf: Vec<u8>,
        addr: u64,
        rkey: u32,
        imm: u32,
        token: u64,
    ) -> Result<(), (Vec<u8>, TransportError)> {
        let Some(Link { qp, .. }) = self.links.get(&link) else {
            let e = TransportError::no_such_link();
            return Err((buf, e));
        };
        let len = buf.len() as u64;
        let mem = match RegisteredMem::register(&self.pd, buf, AccessFlags::from_bits_truncate(0)) {
            Ok(mem) => mem,
            Err(rejected) => {
                let error = failed("registering the WRITE's buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        let op = crate::verbs::write_with_imm::write_with_imm(
            qp,
            mem,
            RemoteBuf::new(addr, len, rkey),
            imm,
        );
        self.ops.push((token, BulkOp::Write(op)));
        Ok(())
    }

    fn poll_written(&mut self, cx: &mut Context<'_>, out: &mut Vec<(u64, u32)>) {
        self.drain_ring(cx);
        out.append(&mut self.written);
    }

    fn max_link_packet(&self) -> usize {
        LINK_PACKET
    }

    fn link_recv_memory(&self) -> usize {
        let rings = self.srq.as_ref().map_or(0, |(_, rings)| rings.len());
        rings * LINK_RECV_DEPTH as usize * LINK_PACKET
    }

    fn send_packet(
        &mut self,
        link: u64,
        head: &[u8; HEADER_LEN],
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let Some(l) = self.links.get_mut(&link) else {
            return Err(TransportError::no_such_link());
        };
        let len = HEADER_LEN + payload.len();
        if len > LINK_PACKET {
            return Err(TransportError::TooLarge {
                len,
                max: LINK_PACKET,
            });
        }
        let mut buf = match self.spare.pop() {
            Some(buf) if buf.capacity() >= len => buf,
            _ => self
                .send_pool
                .alloc(len)
                .map_err(|e| failed("taking a registered buffer for a link's SEND", e))?,
        };
        buf.extend_from_slice(head)
            .and_then(|()| buf.extend_from_slice(payload))
            .map_err(|e| failed("copying a packet for a link's SEND", e))?;
        // The buffer is the SEND's until its completion (the runtime keeps
        // it, also if the future is dropped); a SEND that failed broke the
        // link (`poll_received`).
        if l.sends.is_empty() {
            self.sending.push(link);
        }
        l.sends.push_back(crate::verbs::send::send(&l.qp, buf));
        Ok(())
    }

    fn poll_received(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut Vec<(u64, LinkPacket)>,
        broken: &mut Vec<u64>,
    ) {
        self.drain_ring(cx);
        out.append(&mut self.received);
        let keep = spare_sends(self.links.len());
        let mut k = 0;
        while k < self.sending.len() {
            let link = self.sending[k];
            let Some(l) = self.links.get_mut(&link) else {
                // Closed since: its SENDs went with it.
                self.sending.swap_remove(k);
                continue;
            };
            let mut failed = false;
            // The oldest only: the others complete after it (and are
            // polled then: its completion wakes the dispatcher).
            while let Some(op) = l.sends.front_mut() {
                let Poll::Ready((result, mut buf)) = Pin::new(op).poll(cx) else {
                    break;
                };
                if self.spare.len() < keep {
                    buf.clear();
                    self.spare.push(buf);
                }
                if let Err(error) = result {
                    debug!(%error, link, "rpc/ud: a SEND over a link failed");
                    failed = true;
                }
                l.sends.pop_front();
            }
            if failed {
                broken.push(link);
            }
            if l.sends.is_empty() {
                self.sending.swap_remove(k);
            } else {
                k += 1;
            }
        }
    }

    fn poll_done(&mut self, cx: &mut Context<'_>, out: &mut Vec<BulkDone>) {
        // Each operation under way registers `cx` (whether or not some
        // finished: the dispatcher does not ask again before it sleeps).
        let mut k = 0;
        while k < self.ops.len() {
            let (token, op) = &mut self.ops[k];
            match op.poll(cx) {
                Poll::Pending => k += 1,
                Poll::Ready((result, buf)) => {
                    out.push((*token, buf, result));
                    self.ops.swap_remove(k);
                }
            }
        }
    }
}
