//! Sessions and their request slots.

use std::collections::VecDeque;
use std::task::Waker;
use std::time::{Duration, Instant};

use super::budget::Charge;
use super::buf::MsgBuf;
use super::error::RpcError;
use super::header::{BulkDesc, Status};

/// Request slots per session; also its credits (packets in flight).
pub const SESSION_SLOTS: usize = 8;
// `Session::active` has a bit per slot and rotates as a `u8`.
const _: () = assert!(SESSION_SLOTS == u8::BITS as usize);

/// Copies a packet's `payload` to offset `start` of the message being
/// put together in `msg`: appended when the packets come in order (no zero
/// fill), else `msg` grown to the packet's end, never to the length the
/// message claims at once.
#[inline]
pub(crate) fn place_packet(msg: &mut Vec<u8>, start: usize, payload: &[u8]) {
    let end = start + payload.len();
    if start == msg.len() {
        msg.extend_from_slice(payload);
    } else {
        if end > msg.len() {
            msg.resize(end, 0);
        }
        msg[start..end].copy_from_slice(payload);
    }
}

/// The slot request number `req_num` uses: request `n` uses slot `n % 8`.
#[inline]
pub(crate) fn slot_of(req_num: u64) -> usize {
    (req_num % SESSION_SLOTS as u64) as usize
}

/// Client packets of one call sent beyond the first unanswered one, at most
/// (the width of [`ClientSlot::answered`]).
pub(crate) const WINDOW: usize = 64;

/// Which side of the session this endpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Client,
    Server,
}

/// A session's life.
#[derive(Debug)]
pub(crate) enum SessionState {
    /// Client: connect sent, no answer yet.
    Connecting { retries: u32, last: u64 },
    /// Open.
    Connected,
    /// Client: the connect or a call timed out.
    Failed,
}

/// The client side of a slot.
pub(crate) struct ClientSlot {
    /// The current request number (or the next, while free): the slot
    /// index plus a multiple of [`SESSION_SLOTS`].
    pub(crate) req_num: u64,
    pub(crate) state: CallState,
    /// The call future was dropped: free the slot when the call ends.
    pub(crate) abandoned: bool,
    /// The server was busy (its request memory full): nothing is sent
    /// until the next timeout.
    pub(crate) paused: bool,
    /// A large request waits for the session's RC link being set up:
    /// nothing is sent until the link is ready (it goes by READ) or given
    /// up (it streams); the link's own retries bound the wait.
    pub(crate) awaits_link: bool,
    /// The server could not READ this call's request (its end of the
    /// link was gone) and the call went again over a new link: a second
    /// failure fails the call.
    pub(crate) relinked: bool,
    /// The request went whole over this link (`engine/link_send.rs`): while the
    /// link stays ready, the server has all its packets or none, so a
    /// timeout resends only its last packet (`engine/resend.rs`).
    pub(crate) link_sent: Option<u64>,
    pub(crate) req_type: u8,
    pub(crate) req: Vec<u8>,
    pub(crate) resp: Vec<u8>,
    /// The response's length (from its first packet).
    pub(crate) resp_len: usize,
    /// Which response packets arrived (bit `j % 64` of word `j / 64`).
    pub(crate) resp_got: Vec<u64>,
    /// Response packets below this come without being asked for (the
    /// server's response window; set by the first response packet): the
    /// client counts them as asked for, with a credit each, without
    /// sending anything (a lost one is asked for at the timeout).
    pub(crate) unasked: usize,
    /// Request packets.
    pub(crate) n_req: usize,
    /// Response packets (0 until the first arrives).
    pub(crate) n_resp: usize,
    /// Client packets sent: request packets, then requests for response
    /// packets 1.. (client packet `k` is answered by the credit return of
    /// request packet `k`, or by response packet `k - n_req + 1`).
    pub(crate) num_tx: usize,
    /// Client packets below this are all answered (by a credit return or a
    /// response packet).
    pub(crate) num_rx: usize,
    /// Which of client packets `num_rx..num_rx + 64` are answered (bit
    /// `k - num_rx`): answers may arrive in any order.
    pub(crate) answered: u64,
    /// Timer tick of the last send or progress.
    pub(crate) progress: u64,
    /// Timer tick of the last packet sent for the first time (not a
    /// resend): answers measure the session's round trip from it.
    pub(crate) sent: u64,
    /// Retransmissions since the last progress.
    pub(crate) retries: u32,
    pub(crate) waker: Option<Waker>,
    /// The request's buffer while exposed to the server's READ (its
    /// [`Bulk`](super::Bulk) token): `req` is empty meanwhile. Kept until
    /// the slot's next call or the session's end, so never unexposed
    /// while the server may read it.
    pub(crate) req_exposed: Option<u64>,
    /// This call sends its request as a read request of this descriptor
    /// and length.
    pub(crate) req_desc: Option<(BulkDesc, usize)>,
    /// The READ of the response under way (its token).
    pub(crate) reading: Option<u64>,
    /// The capacity of the buffer this call offers the server to WRITE
    /// its response into (0: none; `engine/written_responses.rs`): the exposed request
    /// buffer's, or that of `offer_exposed`.
    pub(crate) offered: u32,
    /// A buffer of its own this call offers for its response (its
    /// [`Bulk`](super::Bulk) token), announced by an offer packet: for a
    /// request that does not go by READ, or whose own buffer is too small.
    pub(crate) offer_exposed: Option<u64>,
    /// Room the server granted on the session's link for this slot's
    /// next large request (`engine/written_requests.rs`, "Requests written"): where,
    /// and how many bytes; used once.
    pub(crate) grant: Option<(BulkDesc, usize)>,
    /// The WRITE of this call's request into granted room under way (its
    /// token; `req` is the WRITE's meanwhile).
    pub(crate) req_writing: Option<u64>,
    /// This call's request was written (its WRITE completed) and is kept
    /// in `req`, not exposed: exposed for READ only if a resend is due
    /// (`engine/release.rs`, `expose_written`), so the common call registers
    /// it once (as the WRITE's source), not twice.
    pub(crate) req_written: bool,
    /// A buffer this session's server could READ over all its length
    /// (the last call's request buffer, taken back from the transport):
    /// the room offered for the slot's next response, exposed again
    /// without zeroing, as what it holds discloses nothing the peer
    /// could not read already (`engine/written_responses.rs`, `room_for_response`).
    pub(crate) spare: Vec<u8>,
}

/// Where a client slot's call is.
#[derive(Debug)]
pub(crate) enum CallState {
    Free,
    Active,
    Done(Result<(), RpcError>),
}

impl ClientSlot {
    fn new(index: usize) -> ClientSlot {
        ClientSlot {
            req_num: index as u64,
            state: CallState::Free,
            abandoned: false,
            paused: false,
            awaits_link: false,
            relinked: false,
            link_sent: None,
            req_type: 0,
            req: Vec::new(),
            resp: Vec::new(),
            resp_len: 0,
            resp_got: Vec::new(),
            unasked: 0,
            n_req: 0,
            n_resp: 0,
            num_tx: 0,
            num_rx: 0,
            answered: 0,
            progress: 0,
            sent: 0,
            retries: 0,
            waker: None,
            req_exposed: None,
            req_desc: None,
            reading: None,
            offered: 0,
            offer_exposed: None,
            grant: None,
            req_writing: None,
            req_written: false,
            spare: Vec::new(),
        }
    }

    /// Bytes of this call that may be moving by READ or WRITE: its
    /// request the server reads, the room offered for its response, the
    /// response it reads.
    pub(crate) fn transfer_bytes(&self) -> usize {
        let request = match self.req_desc {
            Some((_, len)) => len,
            None if self.req_written => self.req.len(),
            None => 0,
        };
        let response = if self.reading.is_some() {
            self.resp_len
        } else {
            0
        };
        request + self.offered as usize + response
    }

    /// Client packets this call sends in all (as far as known).
    pub(crate) fn total_tx(&self) -> usize {
        self.n_req + self.n_resp.saturating_sub(1)
    }

    /// Whether the slot holds a buffer its server may reach (its request
    /// or response room exposed) or its written request kept for a
    /// resend: taken back when the call is over (`Core::take_back_request`).
    pub(crate) fn holds_request(&self) -> bool {
        self.req_exposed.is_some() || self.offer_exposed.is_some() || self.req_written
    }

    /// Packets sent and not answered: the credits the slot holds.
    pub(crate) fn in_flight(&self) -> usize {
        self.num_tx - self.num_rx - self.answered.count_ones() as usize
    }

    /// Whether response packet `j` arrived.
    pub(crate) fn has_response_packet(&self, j: usize) -> bool {
        self.resp_got
            .get(j / 64)
            .is_some_and(|w| w & (1 << (j % 64)) != 0)
    }

    /// Records that response packet `j` (below `n_resp`) arrived.
    pub(crate) fn mark_response_packet(&mut self, j: usize) {
        if let Some(w) = self.resp_got.get_mut(j / 64) {
            *w |= 1 << (j % 64);
        }
    }

    /// Whether client packet `k` (sent, not below `num_rx`) is answered.
    pub(crate) fn is_answered(&self, k: usize) -> bool {
        k < self.num_rx || self.answered & (1 << (k - self.num_rx)) != 0
    }

    /// Records the answer to client packet `k`; false if `k` was not sent
    /// or is answered already.
    pub(crate) fn answer(&mut self, k: usize) -> bool {
        if k >= self.num_tx || self.is_answered(k) {
            return false;
        }
        self.answered |= 1 << (k - self.num_rx);
        while self.answered & 1 != 0 {
            self.answered >>= 1;
            self.num_rx += 1;
        }
        true
    }
}

/// Where a server slot's request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ServeState {
    /// No request yet.
    Idle,
    /// Request packets arriving.
    Receiving,
    /// The handler runs.
    Handling,
    /// The response (or the error status) is cached for retransmission.
    Responded,
}

/// The server side of a slot.
pub(crate) struct ServerSlot {
    pub(crate) req_num: u64,
    pub(crate) state: ServeState,
    pub(crate) req_type: u8,
    pub(crate) msg_len: usize,
    /// The request's bytes so far: grown as packets arrive, up to the end
    /// of the furthest packet received.
    pub(crate) req: Vec<u8>,
    /// What `req` and `got` are charged to the endpoint's request budget.
    pub(crate) charge: Charge,
    /// Idle sweeps since the last packet of the request being received.
    pub(crate) stalled_sweeps: u32,
    pub(crate) n_req: usize,
    /// Request packets received.
    pub(crate) rx: usize,
    /// Which request packets are received (bit `i % 64` of word `i / 64`).
    pub(crate) got: Vec<u64>,
    pub(crate) resp: Option<MsgBuf>,
    pub(crate) n_resp: usize,
    /// How the request was answered.
    pub(crate) status: Status,
    /// The READ of a read request under way (its token).
    pub(crate) reading: Option<u64>,
    /// The response, exposed to the client's READ: its
    /// [`Bulk`](super::Bulk) token, descriptor and length (`resp` is
    /// `None` meanwhile). Kept like `resp`: until the slot's next request
    /// or the session's end.
    pub(crate) resp_exposed: Option<(u64, BulkDesc, usize)>,
    /// The buffer the client offered with read request `.0` for its
    /// response: where, and how many bytes it holds (`engine/written_responses.rs`).
    pub(crate) offer: Option<(u64, BulkDesc, usize)>,
    /// The WRITE of the response into the client's offered buffer under
    /// way (its token; the response's buffer is the WRITE's meanwhile).
    pub(crate) writing: Option<u64>,
    /// Room exposed for the client to WRITE this slot's next large
    /// request into (`engine/written_requests.rs`, "Requests written"): its
    /// [`Bulk`](super::Bulk) token, descriptor and capacity, and what it
    /// is charged to the request budget.
    pub(crate) granted: Option<(u64, BulkDesc, usize)>,
    pub(crate) grant_charge: Charge,
}

impl ServerSlot {
    /// Whether request `req_num` is this slot's and was answered
    /// [`Status::ReadFailed`]: no handler ran, so the client may send it
    /// again (over a new link, or in packets) and it is taken as new.
    pub(crate) fn read_failed(&self, req_num: u64) -> bool {
        req_num == self.req_num
            && self.state == ServeState::Responded
            && self.status == Status::ReadFailed
    }

    /// Whether request `req_num` is one the slot has not taken: the slot
    /// is idle, the request is later than the slot's, or its READ failed.
    #[inline]
    pub(crate) fn takes_new(&self, req_num: u64) -> bool {
        self.state == ServeState::Idle || req_num > self.req_num || self.read_failed(req_num)
    }

    /// Takes request `req_num` of type `req_type`, `msg_len` bytes in
    /// `n_req` packets, only to refuse it: nothing of it is kept but the
    /// slot's answer ([`Core::refuse`](super::engine::Core::refuse) sends it).
    pub(crate) fn take_refused(
        &mut self,
        req_num: u64,
        req_type: u8,
        msg_len: usize,
        n_req: usize,
    ) {
        self.drop_partial();
        self.req_num = req_num;
        self.req_type = req_type;
        self.msg_len = msg_len;
        self.n_req = n_req;
    }

    /// Gives the slot a request buffer for its next request: the last
    /// response's (kept for its resends until now), without a trip through
    /// `pool`, unless the slot still has one or the response's is too big
    /// to keep.
    #[inline]
    pub(crate) fn reuse_response_buffer(&mut self, pool: &super::buf::BufPool) {
        let old_resp = self.resp.take();
        if self.req.capacity() != 0 {
            return;
        }
        self.req = match old_resp {
            Some(resp) if resp.capacity() <= super::buf::KEEP_MAX_CAPACITY => resp.into_vec(),
            other => {
                drop(other);
                pool.take()
            }
        };
    }

    /// Starts receiving request `req_num` (of type `req_type`, `msg_len`
    /// bytes in `n_req` packets) in this slot: none of its packets is in
    /// yet, or only the first if `first_in`. The caller sets what else the
    /// request changes (its buffer, charge, READ or WRITE under way).
    #[inline]
    pub(crate) fn begin_request(
        &mut self,
        req_num: u64,
        req_type: u8,
        msg_len: usize,
        n_req: usize,
        first_in: bool,
    ) {
        self.status = Status::Ok;
        self.req_num = req_num;
        self.state = ServeState::Receiving;
        self.req_type = req_type;
        self.msg_len = msg_len;
        self.n_req = n_req;
        self.rx = usize::from(first_in);
        self.stalled_sweeps = 0;
        self.got.clear();
        let words = n_req.div_ceil(64);
        if words <= 1 {
            self.got.push(u64::from(first_in));
        } else {
            self.got.resize(words, 0);
            self.got[0] = u64::from(first_in);
        }
    }

    /// Forgets the request being received (its memory given back): the
    /// slot is idle until its client sends the request again.
    pub(crate) fn drop_partial(&mut self) {
        self.state = ServeState::Idle;
        self.req = Vec::new();
        self.got = Vec::new();
        self.charge.release();
    }

    fn new() -> ServerSlot {
        ServerSlot {
            req_num: 0,
            state: ServeState::Idle,
            req_type: 0,
            msg_len: 0,
            req: Vec::new(),
            charge: Charge::default(),
            stalled_sweeps: 0,
            n_req: 0,
            rx: 0,
            got: Vec::new(),
            resp: None,
            n_resp: 0,
            status: Status::Ok,
            reading: None,
            resp_exposed: None,
            offer: None,
            writing: None,
            granted: None,
            grant_charge: Charge::default(),
        }
    }
}

/// Where a session's RC link for large messages is (`engine/links.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkStep {
    /// Client: bulk connect sent, no answer yet.
    Opening,
    /// Client: connected to the server's end; the confirmation sent.
    Confirming,
    /// Server: connected to the client's end; not confirmed yet.
    Offered,
    /// Both ends connected: large messages go by READ.
    Ready,
}

/// A session's RC link for large messages.
pub(crate) struct Link {
    /// This side's link number at its transport.
    pub(crate) local: u64,
    /// The client's link number (what the bulk packets carry).
    pub(crate) id: u64,
    /// This side's end's address (sent again with each retransmission).
    pub(crate) addr: Vec<u8>,
    pub(crate) step: LinkStep,
    /// Client: retransmissions of the current step, and the tick of the
    /// last.
    pub(crate) retries: u32,
    pub(crate) last: u64,
}

/// One session: a peer, its session number there, and the slots.
pub(crate) struct Session<P> {
    pub(crate) role: Role,
    pub(crate) state: SessionState,
    pub(crate) peer: P,
    /// The peer's number for this session (unknown while connecting).
    pub(crate) remote: u32,
    /// Payload bytes per packet.
    pub(crate) max_payload: usize,
    /// Client: the round trip to the peer, which sets how long a slot
    /// waits before its first resend (`rtt.rs`).
    pub(crate) rtt: super::rtt::RttEstimator,
    /// Packets this side may still send (client).
    pub(crate) credits: usize,
    /// Client: response packets the server sends before being asked (from
    /// its connect-ack; at least 1, the first).
    pub(crate) response_window: usize,
    pub(crate) client: [ClientSlot; SESSION_SLOTS],
    pub(crate) server: [ServerSlot; SESSION_SLOTS],
    /// Calls waiting for a free slot.
    pub(crate) slot_waiters: VecDeque<Waker>,
    /// The connect call.
    pub(crate) connect_waker: Option<Waker>,
    /// The slot the next pump starts at (round robin).
    pub(crate) pump_from: usize,
    /// Client: bit `i` is set while slot `i`'s call is
    /// [`CallState::Active`] (so a pump visits only those).
    pub(crate) active: u8,
    /// Client: a call of it waited for credits at the last pump (only
    /// then do credits that come back need a pump; `engine/client_calls.rs`).
    pub(crate) starved: bool,
    /// Server: the key of the connect that made it.
    pub(crate) connect_key: Option<ConnectKey>,
    /// Client: what its connect packets carry as their request number,
    /// unique among this endpoint's connects (the server tells connects
    /// apart by it even when a session number is reused).
    pub(crate) connect_id: u64,
    /// Server: idle sweeps since the last packet from the client (see
    /// `engine/idle.rs`).
    pub(crate) idle_sweeps: u32,
    /// Client: the keepalive interval its server announced (zero: no
    /// pings), and when the next ping is due (`engine/idle.rs`).
    pub(crate) ping_every: Duration,
    pub(crate) next_ping: Option<Instant>,
    /// The RC link for large messages, once asked for.
    pub(crate) link: Option<Link>,
    /// Client: the server did not answer a bulk connect (or a READ
    /// failed): no link is asked for again on this session.
    pub(crate) link_refused: bool,
    /// Client: the length of the last response that came by READ or
    /// WRITE: a large request offers at least this much room for its
    /// response (`engine/written_responses.rs`).
    pub(crate) resp_hint: usize,
}

impl<P> Session<P> {
    pub(crate) fn new(role: Role, state: SessionState, peer: P, max_payload: usize) -> Self {
        Session {
            role,
            state,
            peer,
            remote: 0,
            max_payload,
            credits: SESSION_SLOTS,
            response_window: 1,
            client: std::array::from_fn(ClientSlot::new),
            server: std::array::from_fn(|_| ServerSlot::new()),
            slot_waiters: VecDeque::new(),
            connect_waker: None,
            pump_from: 0,
            active: 0,
            starved: false,
            connect_key: None,
            connect_id: 0,
            idle_sweeps: 0,
            ping_every: Duration::ZERO,
            next_ping: None,
            link: None,
            rtt: super::rtt::RttEstimator::default(),
            link_refused: false,
            resp_hint: 0,
        }
    }

    /// Client: whether the session's link is being set up (asked for,
    /// neither ready nor given up).
    pub(crate) fn link_pending(&self) -> bool {
        self.link
            .as_ref()
            .is_some_and(|l| matches!(l.step, LinkStep::Opening | LinkStep::Confirming))
    }

    /// Whether large messages go by READ on this session now.
    pub(crate) fn link_ready(&self) -> Option<u64> {
        match &self.link {
            Some(l) if l.step == LinkStep::Ready => Some(l.local),
            _ => None,
        }
    }

    /// Client: the link to READ a response over: its end is connected
    /// (the server, which sends read responses only once it heard that,
    /// may have answered the confirmation with an ack that was lost: the
    /// read response confirms the link too).
    pub(crate) fn link_to_read(&mut self) -> Option<u64> {
        match &mut self.link {
            Some(l) if matches!(l.step, LinkStep::Confirming | LinkStep::Ready) => {
                l.step = LinkStep::Ready;
                Some(l.local)
            }
            _ => None,
        }
    }

    /// Wakes every call, waiter and the connect call (the session ended).
    pub(crate) fn wake_all(&mut self) {
        for w in self.slot_waiters.drain(..) {
            w.wake();
        }
        for slot in &mut self.client {
            if let Some(w) = slot.waker.take() {
                w.wake();
            }
        }
        if let Some(w) = self.connect_waker.take() {
            w.wake();
        }
    }
}

/// What identifies a client's session at the server: its address, its
/// session number and its incarnation number.
pub(crate) type ConnectKey = (Vec<u8>, u32, u64);
