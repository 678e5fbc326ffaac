//! The RPC transport on a UD queue pair of the runtime: one QP serves every
//! peer; small packets go out INLINE in post lists (one doorbell per batch
//! of up to 64), larger ones from registered buffers (submitted in the
//! same poll phase, so posted in one list too); a [`RecvRing`] receives.
//! Packets the send queue has no room for wait in a queue of their own
//! (copied into registered buffers, posted in order as the queue drains:
//! [`UdStats::queued`]) rather than being lost: the engine's credits may
//! put more packets under way than the send queue holds, and a packet
//! lost there costs a retransmission timeout.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use smallvec::SmallVec;
use tracing::{debug, trace};
use verbio_runtime::buf::{LocalBuf, MrPool};
use verbio_runtime::provider::{QpCaps, UdAttr};
use verbio_runtime::qp::{Datagram, UdEndpoint, UdPeer, MAX_INLINE_BURST};
use verbio_runtime::{Device, QueuePair, RecvRing, RecvRingConfig, Submit};

use super::transport::{Transport, TransportError, TxBatch};
use crate::connect::handshake::{self, Hello, HELLO_LEN};
use crate::verbs::{SendToVerb, Verbs};

/// Packets waiting for send-queue room at most; past it a packet is
/// lost (counted in [`UdStats::post_dropped`]). Far above what the
/// engine puts under way (its credits), so a bound on memory only.
const MAX_WAITING: usize = 1 << 14;

/// [`UdConfig::max_inline`]'s default: a 256-byte message and its
/// 32-byte header go INLINE (at 256, they went from a registered
/// buffer: about 460 more instructions per packet on the soft device,
/// and a send completion per packet).
pub const DEFAULT_MAX_INLINE: u32 = 512;
/// The `max_inline` a QP is created with when the device refuses
/// [`DEFAULT_MAX_INLINE`] (the runtime's default QP caps' one).
pub const FALLBACK_MAX_INLINE: u32 = 256;

/// Bytes of an encoded [`UdEndpoint`]: a handshake hello, then the Q_Key.
pub const UD_ADDR_LEN: usize = HELLO_LEN + 4;

/// Encodes a UD endpoint as an RPC address: the handshake's hello frame
/// (validated, versioned) followed by the Q_Key (`u32` LE).
pub fn encode_ud_addr(ep: &UdEndpoint) -> Result<Vec<u8>, TransportError> {
    let hello =
        handshake::encode(&Hello::new(ep.endpoint)).map_err(|e| TransportError::Failed {
            op: "encoding the UD endpoint",
            source: Box::new(e),
        })?;
    let mut v = Vec::with_capacity(UD_ADDR_LEN);
    v.extend_from_slice(&hello);
    v.extend_from_slice(&ep.qkey.to_le_bytes());
    Ok(v)
}

/// Decodes what [`encode_ud_addr`] wrote.
pub fn decode_ud_addr(addr: &[u8]) -> Result<UdEndpoint, TransportError> {
    let Some((hello, qkey)) = addr.split_last_chunk::<4>() else {
        return Err(TransportError::bad_address(
            addr.len(),
            "shorter than a Q_Key",
        ));
    };
    let hello = handshake::decode(hello).map_err(|_| {
        TransportError::bad_address(addr.len(), "not a handshake hello followed by a Q_Key")
    })?;
    Ok(UdEndpoint {
        endpoint: hello.endpoint,
        qkey: u32::from_le_bytes(*qkey),
    })
}

/// Settings of a [`UdTransport`].
#[derive(Clone, Debug)]
pub struct UdConfig {
    /// Largest packet (header included); capped by the port's MTU.
    pub mtu: usize,
    /// Receive buffers.
    pub recv_depth: u32,
    /// Receive buffers reposted per doorbell. The default, 1, reposts each
    /// buffer as its packet is released, in the same turn: a larger batch
    /// leaves a released buffer pending, and the ring wakes its consumer
    /// (the dispatcher) to repost it, a second, empty run of the
    /// dispatcher per packet when packets come one at a time.
    pub repost_batch: u32,
    /// Send-queue depth.
    pub send_depth: u32,
    /// One inline send signaled per this many.
    pub signal_interval: u32,
    /// Largest INLINE packet asked of the device; larger packets are sent
    /// from registered buffers (a copy, and a signaled send whose
    /// completion returns the buffer). The default,
    /// [`DEFAULT_MAX_INLINE`], takes a 256-byte message and its header;
    /// a device that refuses it gets a QP of [`FALLBACK_MAX_INLINE`].
    pub max_inline: u32,
    /// The GID index the endpoint announces (`None`: the device's default,
    /// e.g. the RoCE v2 IPv4 GID).
    pub gid_index: Option<u8>,
    /// Port, P_Key index, Q_Key.
    pub attr: UdAttr,
}

impl Default for UdConfig {
    fn default() -> Self {
        UdConfig {
            mtu: 4096,
            recv_depth: 1024,
            repost_batch: 1,
            send_depth: 256,
            signal_interval: 64,
            max_inline: DEFAULT_MAX_INLINE,
            gid_index: None,
            attr: UdAttr::default(),
        }
    }
}

/// Counters of a [`UdTransport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdStats {
    /// Packets posted INLINE.
    pub inline_sent: u64,
    /// Packets posted from registered buffers.
    pub buffered_sent: u64,
    /// Packets that found the send queue full and waited for room (in
    /// order, from registered buffers).
    pub queued: u64,
    /// Packets not posted (refused, no send buffer, or more than
    /// `MAX_WAITING` waiting): lost.
    pub post_dropped: u64,
    /// Receive completions in error (skipped).
    pub recv_errors: u64,
}

/// An RPC [`Transport`] on a UD queue pair.
pub struct UdTransport {
    device: Device,
    qp: QueuePair,
    ring: RecvRing,
    pool: MrPool,
    local: UdEndpoint,
    local_addr: Vec<u8>,
    max_packet: usize,
    max_inline: usize,
    /// Largest inline post list: [`MAX_INLINE_BURST`], at most the send
    /// queue's depth.
    max_burst: usize,
    /// Sends waiting for send-queue room, oldest first: posted as it
    /// frees ([`UdTransport::post_waiting`]).
    waiting: VecDeque<Submit<SendToVerb<LocalBuf>>>,
    /// Sends posted from registered buffers, oldest first (a send queue
    /// completes in order), kept until their completion
    /// ([`UdTransport::reap_sent`]) so that their buffers come back for
    /// the next sends: a send's future dropped while the device still
    /// reads its buffer has the runtime box the buffer until then (an
    /// allocation per packet). At most the send queue's depth: past it
    /// the oldest is dropped to the runtime as before.
    sent: VecDeque<Submit<SendToVerb<LocalBuf>>>,
    /// Buffers of finished sends, emptied, taken before the pool's (at
    /// most the send queue's depth).
    spare: Vec<LocalBuf>,
    /// The send queue's depth.
    send_depth: usize,
    stats: UdStats,
}

impl std::fmt::Debug for UdTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdTransport")
            .field("qpn", &self.local.endpoint.qpn)
            .field("max_packet", &self.max_packet)
            .field("stats", &self.stats)
            .finish()
    }
}

fn failed(
    op: &'static str,
) -> impl FnOnce(verbio_runtime::provider::ProviderError) -> TransportError {
    move |e| TransportError::Failed {
        op,
        source: Box::new(e),
    }
}

impl UdTransport {
    /// A UD queue pair on `device` (in RTS) with its receive ring posted.
    pub fn new(device: &Device, config: &UdConfig) -> Result<UdTransport, TransportError> {
        let caps = QpCaps {
            max_send_wr: config.send_depth,
            max_recv_wr: config.recv_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: config.max_inline,
        };
        let qp = match device.create_ud_qp(caps, &config.attr) {
            Err(error) if config.max_inline == DEFAULT_MAX_INLINE => {
                // A device with a smaller inline limit (the default is
                // not the application's choice): the smaller one.
                debug!(%error, "rpc/ud: the default max_inline refused; asking {FALLBACK_MAX_INLINE}");
                let caps = QpCaps {
                    max_inline_data: FALLBACK_MAX_INLINE,
                    ..caps
                };
                device.create_ud_qp(caps, &config.attr)
            }
            r => r,
        }
        .map_err(failed("creating the UD queue pair"))?;
        qp.set_inline_signal_interval(config.signal_interval);
        let gid_index = match config.gid_index {
            Some(i) => i,
            None => device
                .context()
                .default_gid_index(config.attr.port)
                .map_err(failed("choosing the GID index"))?,
        };
        let local = qp
            .ud_endpoint(gid_index)
            .map_err(failed("reading the UD endpoint"))?;
        let max_packet = config.mtu.min(local.endpoint.mtu.bytes() as usize);
        let ring_config =
            RecvRingConfig::new(config.recv_depth, max_packet).repost_batch(config.repost_batch);
        let ring =
            RecvRing::new(&qp, device.pd(), ring_config).map_err(|e| TransportError::Failed {
                op: "posting the receive ring",
                source: Box::new(e),
            })?;
        let local_addr = encode_ud_addr(&local)?;
        let max_inline = qp.caps().max_inline_data as usize;
        Ok(UdTransport {
            device: device.clone(),
            pool: MrPool::new(device.pd()),
            qp,
            ring,
            local,
            local_addr,
            max_packet,
            max_inline,
            max_burst: MAX_INLINE_BURST.min(config.send_depth.max(1) as usize),
            waiting: VecDeque::new(),
            // At their bounds (the send queue's depth) from the start: not
            // grown on the hot path when a loaded host lets more sends
            // finish late than the warm-up did.
            sent: VecDeque::with_capacity(config.send_depth.max(1) as usize),
            spare: Vec::with_capacity(config.send_depth.max(1) as usize),
            send_depth: config.send_depth.max(1) as usize,
            stats: UdStats::default(),
        })
    }

    /// The queue pair's endpoint.
    pub fn endpoint(&self) -> &UdEndpoint {
        &self.local
    }

    /// The queue pair.
    pub fn queue_pair(&self) -> &QueuePair {
        &self.qp
    }

    /// Counters.
    pub fn stats(&self) -> UdStats {
        self.stats
    }

    /// Posts `burst` as one post list if the send queue has room now;
    /// else its packets wait for room from registered buffers.
    fn post_burst(&mut self, burst: &[Datagram<'_>]) {
        if let [one] = burst {
            self.post_one(one);
            return;
        }
        let n = burst.len() as u64;
        // The try form: no future, no waker, no ticket queued and
        // withdrawn when there is no room (what holds the room is asked
        // to give it back, as when a future would wait).
        match self.qp.try_post_send_inline_burst(burst) {
            Some(Ok(())) => self.stats.inline_sent += n,
            Some(Err(error)) => {
                self.stats.post_dropped += n;
                debug!(%error, packets = n, "rpc/ud: inline burst refused; packets lost");
            }
            None => {
                trace!(
                    packets = n,
                    "rpc/ud: send queue full; packets wait for room"
                );
                for d in burst {
                    self.post_buffered(d.peer, d.data);
                }
            }
        }
    }

    /// Posts one datagram INLINE if the send queue has room now (else it
    /// waits for room from a registered buffer). Not as a burst of one:
    /// a burst's last datagram is always signaled, so each call's packet
    /// took a send completion that the queue's signal interval
    /// (`UdConfig::signal_interval`) spares it.
    fn post_one(&mut self, d: &Datagram<'_>) {
        match self.qp.try_post_send_inline_to(d.peer, d.data, d.imm) {
            Some(Ok(())) => self.stats.inline_sent += 1,
            Some(Err(error)) => {
                self.stats.post_dropped += 1;
                debug!(%error, "rpc/ud: inline send refused; packet lost");
            }
            None => {
                trace!("rpc/ud: send queue full; the packet waits for room");
                self.post_buffered(d.peer, d.data);
            }
        }
    }

    /// Sends `bytes` from a registered buffer. The send is submitted now
    /// (posted with the poll phase's other sends, one post list) and its
    /// future dropped: the runtime keeps the buffer until the completion.
    /// Without send-queue room now (or with sends waiting already, which
    /// go first) it waits in `waiting`.
    fn post_buffered(&mut self, peer: &UdPeer, bytes: &[u8]) {
        if self.waiting.len() >= MAX_WAITING {
            self.stats.post_dropped += 1;
            debug!(
                waiting = self.waiting.len(),
                "rpc/ud: too many packets wait for send-queue room; packet lost"
            );
            return;
        }
        if self.spare.is_empty() && !self.sent.is_empty() {
            // Finished sends give their buffers back first: a loaded host
            // that runs the dispatcher late (the only other reaper) must
            // not make this send allocate and register a new buffer.
            self.reap_sent();
        }
        let buf = match self.spare.pop() {
            Some(mut buf) if buf.capacity() >= bytes.len() => {
                buf.extend_from_slice(bytes).map(|()| buf)
            }
            _ => self.pool.alloc_from(bytes),
        };
        let buf = match buf {
            Ok(buf) => buf,
            Err(error) => {
                self.stats.post_dropped += 1;
                debug!(%error, "rpc/ud: no send buffer; packet lost");
                return;
            }
        };
        self.stats.buffered_sent += 1;
        let send = self.qp.send_to(peer, buf);
        if send.is_queued() {
            self.stats.queued += 1;
            self.waiting.push_back(send);
        } else {
            self.keep_sent(send);
        }
    }

    /// Keeps `send`, posted (or refused), until its completion; the
    /// oldest kept goes to the runtime past the send queue's depth.
    fn keep_sent(&mut self, send: Submit<SendToVerb<LocalBuf>>) {
        if self.sent.len() >= self.send_depth {
            // (Dropped, the runtime keeps its buffer until its completion.)
            self.sent.pop_front();
        }
        self.sent.push_back(send);
    }

    /// Takes the finished sends' buffers back, oldest first, for the next
    /// sends. Taken without a waker ([`Submit::try_take`]): nothing waits
    /// on a send's completion but its buffer (the send queue's room has
    /// its own).
    fn reap_sent(&mut self) {
        while let Some(send) = self.sent.front_mut() {
            let Some((result, buf)) = send.try_take() else {
                break;
            };
            self.sent.pop_front();
            if let Err(error) = result {
                debug!(%error, "rpc/ud: a send from a registered buffer failed; packet lost");
            }
            self.keep_spare(buf);
        }
    }

    /// Keeps a finished send's buffer for the next sends.
    fn keep_spare(&mut self, mut buf: LocalBuf) {
        if self.spare.len() < self.send_depth {
            buf.clear();
            self.spare.push(buf);
        }
    }

    /// Posts the sends that waited for send-queue room, oldest first, as
    /// far as it has room; `cx` is woken when more room comes (the first
    /// one still waiting holds the queue's line).
    fn post_waiting(&mut self, cx: &mut Context<'_>) {
        while let Some(send) = self.waiting.front_mut() {
            // Ready: refused (closed queue pair) or done; else posted,
            // or still waiting for room.
            match Pin::new(&mut *send).poll(cx) {
                Poll::Ready((_, buf)) => {
                    self.waiting.pop_front();
                    self.keep_spare(buf);
                }
                Poll::Pending if send.is_queued() => return,
                Poll::Pending => {
                    // Posted: kept until its completion.
                    if let Some(send) = self.waiting.pop_front() {
                        self.keep_sent(send);
                    }
                }
            }
        }
    }

    /// [`post_waiting`](Self::post_waiting) from a `send`, which has no
    /// task context: the waiting sends go, oldest first, as far as there
    /// is room now ([`Submit::try_post`]); the one still waiting keeps its
    /// place and the dispatcher's waker from its last receive poll, so
    /// that room coming back still wakes the dispatcher.
    fn post_waiting_now(&mut self) {
        while let Some(send) = self.waiting.front_mut() {
            if !send.try_post() {
                return;
            }
            let Some(mut send) = self.waiting.pop_front() else {
                return;
            };
            if send.wr_id().is_some() {
                // Posted: kept until its completion.
                self.keep_sent(send);
            } else if let Some((_, buf)) = send.try_take() {
                // Refused (closed queue pair): its buffer is kept.
                self.keep_spare(buf);
            }
        }
    }

    /// Sends waiting for send-queue room.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

impl Transport for UdTransport {
    type Peer = UdPeer;

    fn max_packet(&self) -> usize {
        self.max_packet
    }

    fn local_addr(&self) -> Vec<u8> {
        self.local_addr.clone()
    }

    fn resolve(&mut self, addr: &[u8]) -> Result<UdPeer, TransportError> {
        let ep = decode_ud_addr(addr)?;
        self.qp
            .ud_peer(&ep)
            .map_err(failed("creating an address handle"))
    }

    fn send(&mut self, batch: &TxBatch<UdPeer>) -> Result<(), TransportError> {
        if !self.waiting.is_empty() {
            self.post_waiting_now();
        }
        let mut burst: SmallVec<[Datagram<'_>; MAX_INLINE_BURST]> = SmallVec::new();
        // A batch with a packet too large for INLINE goes out whole from
        // registered buffers: one post list (one doorbell, one wake of a
        // software device's engine), in order, so a message's packets
        // arrive together instead of in two waves (the last, small one
        // first), each costing the receiver a wake-up.
        // Sends waiting for room go first: the batch waits behind them.
        let inline_max =
            if !self.waiting.is_empty() || batch.iter().any(|(_, b)| b.len() > self.max_inline) {
                0
            } else {
                self.max_inline
            };
        for (peer, bytes) in batch.iter() {
            if bytes.len() > self.max_packet {
                return Err(TransportError::TooLarge {
                    len: bytes.len(),
                    max: self.max_packet,
                });
            }
            if bytes.len() <= inline_max {
                burst.push(Datagram {
                    peer,
                    data: bytes,
                    imm: None,
                });
                if burst.len() == self.max_burst {
                    self.post_burst(&burst);
                    burst.clear();
                }
            } else {
                self.post_buffered(peer, bytes);
            }
        }
        if !burst.is_empty() {
            self.post_burst(&burst);
        }
        Ok(())
    }

    fn poll_recv(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        on_packet: &mut dyn FnMut(&[u8]),
    ) -> Poll<Result<usize, TransportError>> {
        if !self.sent.is_empty() {
            self.reap_sent();
        }
        if !self.waiting.is_empty() {
            // Room that came back since: the waiting sends go (and `cx`
            // hears of more room).
            self.post_waiting(cx);
        }
        let mut n = 0;
        let mut waiting = false;
        for _ in 0..max {
            match self.ring.poll_next(cx) {
                Poll::Ready(Some(Ok(msg))) => {
                    on_packet(msg.as_slice());
                    n += 1;
                }
                Poll::Ready(Some(Err(error))) => {
                    self.stats.recv_errors += 1;
                    debug!(%error, "rpc/ud: receive completion in error; skipped");
                }
                Poll::Ready(None) if n == 0 => {
                    return Poll::Ready(Err(TransportError::Failed {
                        op: "receiving",
                        source: "the receive ring is closed".into(),
                    }))
                }
                Poll::Ready(None) => break,
                Poll::Pending => {
                    waiting = true;
                    break;
                }
            }
        }
        if n > 0 {
            if !waiting && n < max {
                // Errors took turns (or the ring closed): `cx` is not
                // registered; look again at the next turn
                // (`short_batch_registers`).
                cx.waker().wake_by_ref();
            }
            return Poll::Ready(Ok(n));
        }
        if !waiting {
            // Only errors were taken: look again at the next turn.
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }

    fn short_batch_registers(&self) -> bool {
        true
    }

    /// INLINE packets: posted at each send (larger ones wait for the end
    /// of the runtime's poll phase, posted in lists already).
    fn batch_call_starts(&self, packet_len: usize) -> bool {
        packet_len <= self.max_inline
    }

    fn bulk(&mut self) -> Option<Box<dyn super::transport::Bulk>> {
        Some(Box::new(super::ud_bulk::UdBulk::new(&self.device)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use verbio_runtime::provider::{
        Context as DevContext, Endpoint, Gid, Mtu, ProviderKind, SoftConfig,
    };
    use verbio_runtime::{timeout, Runtime};

    use super::*;
    use crate::rpc::header::{Header, PacketKind};

    /// Receives from `rx` until `want` packets came (each checked against
    /// its index), bounded by a generous deadline (a count, not a timing).
    async fn receive_all(rx: &mut UdTransport, want: usize, len: usize) -> Vec<u64> {
        let mut got = Vec::new();
        let all = std::future::poll_fn(|cx| {
            while got.len() < want {
                let mut on = |p: &[u8]| {
                    assert_eq!(p.len(), len);
                    let (h, _) = Header::decode(p).expect("a header");
                    got.push(h.req_num);
                };
                if rx.poll_recv(cx, 64, &mut on).is_pending() {
                    return Poll::Pending;
                }
            }
            Poll::Ready(())
        });
        let _ = timeout(Duration::from_secs(20), all).await;
        got
    }

    /// More packets in one batch than the send queue holds, large
    /// (from registered buffers) and small (INLINE): none is lost; the
    /// ones without room wait for it and go in order. (Before, every
    /// packet past the send queue's depth was dropped, unposted: a
    /// retransmission timeout each.)
    #[test]
    fn packets_past_the_send_queue_wait_for_room() {
        let rt = Runtime::new().unwrap();
        let dev = Device::open(DevContext::open_soft(SoftConfig::default()).unwrap()).unwrap();
        let small_sq = UdConfig {
            send_depth: 8,
            ..UdConfig::default()
        };
        let mut tx = UdTransport::new(&dev, &small_sq).unwrap();
        let mut rx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        let peer = tx.resolve(&rx.local_addr()).unwrap();
        for (len, n) in [(1500usize, 100u64), (48, 200)] {
            let mut batch = TxBatch::default();
            let payload = vec![7u8; len - crate::rpc::header::HEADER_LEN];
            for i in 0..n {
                let h = Header {
                    req_num: i,
                    payload_len: payload.len() as u16,
                    msg_len: payload.len() as u32,
                    pkt_count: 1,
                    ..Header::new(PacketKind::Request)
                };
                batch.push(&peer, &h, &payload);
            }
            tx.send(&batch).unwrap();
            let sent_before = tx.stats();
            let got = rt.block_on(async {
                // The sender's waiting packets go as its queue drains
                // (its engine's turn: `poll_recv`).
                let drain = std::future::poll_fn(|cx| {
                    let _ = tx.poll_recv(cx, 64, &mut |_| {});
                    if tx.waiting() == 0 {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                });
                let (_, got) = futures::join!(
                    timeout(Duration::from_secs(20), drain),
                    receive_all(&mut rx, n as usize, len)
                );
                got
            });
            let stats = tx.stats();
            assert_eq!(stats.post_dropped, 0, "{stats:?}");
            assert!(
                sent_before.queued > 0,
                "the queue was never full: {sent_before:?}"
            );
            assert_eq!(got, (0..n).collect::<Vec<_>>(), "{stats:?}");
        }
    }

    /// One packet at a time, as a call and its response go: its send
    /// takes no completion of its own (one in the signal interval is
    /// signaled), only its receive does. Before, each packet went as a
    /// burst of one, whose last datagram is always signaled: two
    /// completions per packet.
    #[test]
    fn a_packet_at_a_time_costs_one_completion() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::task::{Wake, Waker};

        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let rt = Runtime::new().unwrap();
        let dev = Device::open(DevContext::open_soft(SoftConfig::default()).unwrap()).unwrap();
        let mut tx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        let mut rx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        let peer = tx.resolve(&rx.local_addr()).unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let wakes = || count.0.load(Ordering::SeqCst);
        const PACKETS: u64 = 20;
        let completions = rt.stats().completions;
        rt.block_on(async {
            let mut cx = Context::from_waker(&waker);
            assert!(rx.poll_recv(&mut cx, 64, &mut |_| {}).is_pending());
            for i in 0..PACKETS {
                send_one_and_await_wake(&mut tx, &peer, i, &wakes).await;
                let mut got = Vec::new();
                let polled = rx.poll_recv(&mut cx, 64, &mut |p| {
                    got.push(Header::decode(p).expect("a header").0.req_num)
                });
                assert!(matches!(polled, Poll::Ready(Ok(1))), "packet {i}");
                assert_eq!(got, [i]);
                assert!(rx.poll_recv(&mut cx, 64, &mut |_| {}).is_pending());
            }
        });
        // Its receive's completion; the sends' go unsignaled (20 of 64).
        assert_eq!(rt.stats().completions - completions, PACKETS);
    }

    /// Sends request packet `i` (8 bytes) from `tx` to `peer` and waits,
    /// at most 10 s, until the runtime's turns deliver it and its arrival
    /// wakes the receiver (`wakes` grows).
    async fn send_one_and_await_wake(
        tx: &mut UdTransport,
        peer: &<UdTransport as Transport>::Peer,
        i: u64,
        wakes: &impl Fn() -> usize,
    ) {
        let before = wakes();
        let mut batch = TxBatch::default();
        let h = Header {
            req_num: i,
            payload_len: 8,
            msg_len: 8,
            pkt_count: 1,
            ..Header::new(PacketKind::Request)
        };
        batch.push(peer, &h, &i.to_le_bytes());
        tx.send(&batch).unwrap();
        let arrived = std::future::poll_fn(|cx| {
            if wakes() > before {
                Poll::Ready(())
            } else {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        });
        timeout(Duration::from_secs(10), arrived)
            .await
            .unwrap_or_else(|_| panic!("packet {i} never woke the receiver"));
    }

    /// One packet at a time, as a call and its response go: receiving
    /// (and releasing) a packet does not wake the receiver again. With
    /// reposts in batches of 16 each packet's release left its buffer
    /// pending and woke the receiver to repost it: a second, empty run of
    /// the dispatcher per packet. Counted: wakes made inside `poll_recv`.
    #[test]
    fn receiving_a_packet_does_not_wake_the_receiver_again() {
        use std::cell::Cell;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::task::{Wake, Waker};

        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let rt = Runtime::new().unwrap();
        let dev = Device::open(DevContext::open_soft(SoftConfig::default()).unwrap()).unwrap();
        let mut tx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        let mut rx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        let peer = tx.resolve(&rx.local_addr()).unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let wakes = || count.0.load(Ordering::SeqCst);
        // Wakes made while `rx` was being polled: each one a run of its
        // consumer that finds nothing to do.
        let self_wakes = Cell::new(0);
        const PACKETS: u64 = 20;
        rt.block_on(async {
            let mut cx = Context::from_waker(&waker);
            let mut poll = |rx: &mut UdTransport, got: &mut Vec<u64>| {
                let before = wakes();
                let polled = rx.poll_recv(&mut cx, 64, &mut |p| {
                    got.push(Header::decode(p).expect("a header").0.req_num)
                });
                self_wakes.set(self_wakes.get() + wakes() - before);
                polled
            };
            assert!(poll(&mut rx, &mut Vec::new()).is_pending());
            for i in 0..PACKETS {
                send_one_and_await_wake(&mut tx, &peer, i, &wakes).await;
                let mut got = Vec::new();
                assert!(
                    matches!(poll(&mut rx, &mut got), Poll::Ready(Ok(1))),
                    "packet {i}"
                );
                assert_eq!(got, [i]);
                assert!(poll(&mut rx, &mut got).is_pending());
            }
        });
        assert_eq!(self_wakes.get(), 0, "in {PACKETS} packets");
        // Every buffer is posted again.
        assert_eq!(rx.ring.posted(), UdConfig::default().recv_depth);
    }

    /// With the default config a 256-byte message's packet (and its
    /// header) goes INLINE, not from a registered buffer (the limit was
    /// 256 bytes of packet).
    #[test]
    fn a_256_byte_message_goes_inline() {
        let rt = Runtime::new().unwrap();
        let dev = Device::open(DevContext::open_soft(SoftConfig::default()).unwrap()).unwrap();
        let mut tx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        let mut rx = UdTransport::new(&dev, &UdConfig::default()).unwrap();
        assert!(tx.queue_pair().caps().max_inline_data >= DEFAULT_MAX_INLINE);
        let peer = tx.resolve(&rx.local_addr()).unwrap();
        let payload = [5u8; 256];
        let mut batch = TxBatch::default();
        let h = Header {
            payload_len: 256,
            msg_len: 256,
            pkt_count: 1,
            ..Header::new(PacketKind::Request)
        };
        batch.push(&peer, &h, &payload);
        tx.send(&batch).unwrap();
        let stats = tx.stats();
        assert_eq!(
            (stats.inline_sent, stats.buffered_sent),
            (1, 0),
            "{stats:?}"
        );
        let got = rt.block_on(receive_all(
            &mut rx,
            1,
            crate::rpc::header::HEADER_LEN + 256,
        ));
        assert_eq!(got, [0]);
    }

    fn endpoint() -> UdEndpoint {
        UdEndpoint {
            endpoint: Endpoint {
                provider: ProviderKind::Soft,
                qpn: 0x12,
                psn: 0,
                lid: 0,
                gid: Gid::default(),
                mtu: Mtu::Mtu4096,
                addr: "127.0.0.1:4791"
                    .parse::<std::net::SocketAddr>()
                    .unwrap()
                    .into(),
            },
            qkey: 0x1111_1111,
        }
    }

    #[test]
    fn addresses_round_trip() {
        let ep = endpoint();
        let addr = encode_ud_addr(&ep).unwrap();
        assert_eq!(addr.len(), UD_ADDR_LEN);
        assert_eq!(decode_ud_addr(&addr).unwrap(), ep);
    }

    #[test]
    fn malformed_addresses_are_refused() {
        let addr = encode_ud_addr(&endpoint()).unwrap();
        for bad in [&addr[..3], &addr[..addr.len() - 1], &addr[1..]] {
            let e = decode_ud_addr(bad).unwrap_err();
            assert!(matches!(e, TransportError::BadAddress { .. }), "{e}");
        }
        let mut bad = addr.clone();
        bad[0] ^= 0xff;
        assert!(decode_ud_addr(&bad).is_err());
    }
}
