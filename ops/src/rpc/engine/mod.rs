//! The engine: everything of an endpoint but its transport and its tasks,
//! as `Core`, driven by the dispatcher and timer tasks (`dispatcher.rs`).
//! No I/O here: received packets come in, packets to send go out in
//! `Core::tx`.
//!
//! `Core`'s methods are spread over one file per job, lowest first; a
//! file uses only files listed before it (`scripts/check-layers.py`):
//!
//! * `packets.rs`: the packets built from a session's and slot's state
//!   (client packets, credit returns, responses, pings, disconnects), for
//!   every job that sends them.
//! * `call_end.rs`: a client call ends (its credits given back, its
//!   caller woken) and its slot is freed.
//! * `write_format.rs`: the immediate and the trailers of a WRITE with
//!   immediate, and the room sizes both sides agree on.
//! * `release.rs`: what a link, a session or a slot gives back that the
//!   peer could reach (links, exposed buffers, granted room).
//! * `paths.rs`: which way a message goes: datagrams, one SEND over the
//!   session's link, or READ and WRITE.
//! * `receive.rs`: a received packet handed to its job.
//! * `sessions.rs`: sessions opened, connected, closed.
//! * `idle.rs`: idle server sessions closed, client sessions kept alive.
//! * `admission.rs`: the server's connects admitted or refused.
//! * `links.rs`: a session's RC link set up.
//! * `link_send.rs`: mid-size messages as one SEND over the link.
//! * `client_calls.rs`: calls started, their request packets sent under
//!   the session's credits, their results taken.
//! * `client_answers.rs`: credit returns and responses taken.
//! * `server_requests.rs`: request packets taken, reassembled, duplicates
//!   answered, credit returns sent.
//! * `handlers.rs`: requests handed to handlers, their responses sent.
//! * `read_path.rs`: large messages by RDMA READ.
//! * `bulk_completions.rs`: the large-message path's completions taken.
//! * `written_responses.rs`: large responses by RDMA WRITE with immediate.
//! * `written_requests.rs`: large requests by WRITE into granted room.
//! * `resend.rs`: retransmission, and sessions failed whose peer stopped
//!   answering.

pub(crate) mod admission;
pub(crate) mod bulk_completions;
pub(crate) mod call_end;
pub(crate) mod client_answers;
pub(crate) mod client_calls;
pub(crate) mod handlers;
pub(crate) mod idle;
pub(crate) mod link_send;
pub(crate) mod links;
pub(crate) mod packets;
pub(crate) mod paths;
pub(crate) mod read_path;
pub(crate) mod receive;
pub(crate) mod release;
pub(crate) mod resend;
pub(crate) mod server_requests;
pub(crate) mod sessions;
pub(crate) mod write_format;
pub(crate) mod written_requests;
pub(crate) mod written_responses;

use std::collections::{HashMap, VecDeque};
use std::rc::{Rc, Weak};
use std::task::Waker;

use verbio_runtime::Sleep;

use crate::rpc::budget::{Budget, Charge};
use crate::rpc::buf::{BufPool, MsgBuf};
use crate::rpc::config::RpcConfig;
use crate::rpc::header::Header;
use crate::rpc::id_map::IdMap;
use crate::rpc::request::Request;
use crate::rpc::runner::{JobId, Runner};
use crate::rpc::session::ConnectKey;
use crate::rpc::table::SessionTable;
use crate::rpc::transport::{Bulk, BulkDone, LinkPacket, TxBatch};

/// Counters of an endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcStats {
    /// Packets handed to the transport.
    pub packets_sent: u64,
    /// Packets received.
    pub packets_received: u64,
    /// Packets sent again after a timeout.
    pub retransmissions: u64,
    /// Request packets that arrived again (answered from the slot's state,
    /// the handler not run again).
    pub duplicate_requests: u64,
    /// Packets for an old request, an unknown session, or out of order.
    pub stale_packets: u64,
    /// Packets refused: a bad header, or a shape that does not fit the session.
    pub malformed_packets: u64,
    /// Handlers started.
    pub handler_runs: u64,
    /// Requests for which no handler was registered.
    pub unhandled_requests: u64,
    /// Handlers that panicked.
    pub handler_panics: u64,
    /// Calls that failed because the peer stopped answering.
    pub timeouts: u64,
    /// Server sessions closed after [`RpcConfig::session_idle_timeout`]
    /// without a packet from their client.
    pub sessions_expired: u64,
    /// Connects refused: [`RpcConfig::max_server_sessions`]
    /// or [`RpcConfig::max_sessions_per_peer`]
    /// reached.
    pub connects_refused: u64,
    /// Request packets dropped because [`RpcConfig::request_memory`]
    /// was spent (their clients send them again).
    pub budget_drops: u64,
    /// Requests whose packets stopped arriving for an idle timeout,
    /// dropped half received.
    pub partial_requests_dropped: u64,
    /// Client: times a server answered "busy" (its request memory full);
    /// the call paused and sent its request again after a timeout.
    pub busy_pauses: u64,
    /// Client: keepalive pings sent (see
    /// [`RpcConfig::session_keepalive`]).
    pub pings_sent: u64,
    /// Messages received by RDMA READ (requests at a server, responses at
    /// a client; see [`RpcConfig::read_threshold`]).
    pub bulk_reads: u64,
    /// READs that failed (a bad descriptor, or a link that broke): the
    /// request or call failed and the session's link was closed.
    pub bulk_read_failures: u64,
    /// Responses moved by RDMA WRITE with immediate into the buffer the
    /// client offered (written at a server, received at a client).
    pub bulk_writes: u64,
    /// WRITEs that failed: of a response at a server (the client's end of
    /// the link broke or its buffer is gone: the link was closed and the
    /// response kept to go in packets if the client asks again), of a
    /// request at a client (the link was closed and the call goes again
    /// by READ over a new one).
    pub bulk_write_failures: u64,
    /// Large requests moved by RDMA WRITE with immediate into room the
    /// server granted (written at a client, received at a server; see
    /// [`RpcConfig::read_threshold`]).
    pub bulk_request_writes: u64,
    /// Client: large requests the server could not READ because its end
    /// of the link was gone (answered
    /// [`Status::ReadFailed`](crate::rpc::header::Status::ReadFailed),
    /// no handler ran), sent again over a new link instead of failing.
    pub bulk_relinks: u64,
    /// Packets sent over a session's RC link by SEND (a message larger
    /// than a datagram and below the READ threshold, in one packet;
    /// `link_send.rs`).
    pub link_packets_sent: u64,
    /// Packets received over links (taken, or dropped as malformed or
    /// stale).
    pub link_packets_received: u64,
}

/// What an endpoint holds now: the memory peers can make it hold, against
/// its limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcMemory {
    /// Bytes of requests held (being received, or given to a handler that
    /// still has them), charged to [`RpcConfig::request_memory`].
    pub request_bytes: usize,
    /// The most `request_bytes` has been.
    pub request_bytes_peak: usize,
    /// The limit of `request_bytes` (the configured one, raised to fit one
    /// largest request).
    pub request_budget: usize,
    /// Bytes of buffers kept for reuse by the message pool (at most
    /// [`POOL_MAX_BYTES`](crate::rpc::POOL_MAX_BYTES) of buffers up to 1 MiB
    /// plus [`RpcConfig::request_memory`]
    /// of larger ones).
    pub pooled_bytes: usize,
    /// Bytes of the receive buffers kept posted for packets over RC links
    /// (`link_send.rs`: one pool for all the links, made with the first),
    /// charged to [`RpcConfig::request_memory`]
    /// besides `request_bytes`.
    pub link_recv_bytes: usize,
    /// Bytes of the room a server granted clients for their next large
    /// requests (`written_requests.rs`, "Requests written"): held per slot
    /// until written into or the link closes, and bounded apart from
    /// `request_bytes` by half of
    /// [`RpcConfig::request_memory`].
    pub granted_bytes: usize,
    /// Server sessions open.
    pub server_sessions: usize,
    /// Sessions open, client and server.
    pub sessions: usize,
}

/// Whose READ a token is (`read_path.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadTarget {
    pub(crate) sid: u32,
    pub(crate) slot: usize,
    pub(crate) req_num: u64,
    /// The link it runs over: its failure closes that link only, not a
    /// newer one the session opened meanwhile.
    pub(crate) link: u64,
}

/// A handler task waiting for work: its waker and its future slot (weak:
/// the task owns the slot, and with it the handler, which may hold this
/// endpoint; a strong one would keep the endpoint alive past its runtime).
pub(crate) type IdleRunner = (Waker, Weak<dyn Runner>);

/// A handler task to start a request in: its waker and its future slot.
pub(crate) type StartRunner = (Waker, Rc<dyn Runner>);

/// A request to start in an idle handler task's slot (`runner.rs`), by
/// the dispatcher once it holds no borrow of the engine. The request
/// stays in its session's slot until then ([`Core::take_request`]): what
/// is queued is where it is, not its bytes, buffer and charge.
pub(crate) struct Start {
    pub(crate) id: JobId,
    pub(crate) req_type: u8,
    pub(crate) runner: StartRunner,
}

/// A handler run inside the dispatcher
/// ([`Rpc::register_inline`](crate::rpc::Rpc::register_inline)).
pub(crate) type InlineHandler = Rc<dyn Fn(Request) -> MsgBuf>;

/// The queue of one request type's handler tasks (or its inline handler).
#[derive(Default)]
pub(crate) struct HandlerQueue {
    /// Requests no handler task was idle for (each in its session's
    /// slot): the next task to finish takes them.
    pub(crate) jobs: VecDeque<JobId>,
    pub(crate) idle: Vec<IdleRunner>,
    /// Run by the dispatcher as each request completes, no task.
    pub(crate) inline: Option<InlineHandler>,
}

/// A connect packet waiting for the transport to resolve its address.
pub(crate) struct ConnectRequest {
    pub(crate) header: Header,
    pub(crate) addr: Vec<u8>,
}

/// Request packets received in this receive batch, to acknowledge: the
/// contiguous run `first..=last` of request `req_num` in a slot.
pub(crate) struct PendingAck {
    pub(crate) sid: u32,
    pub(crate) slot: usize,
    pub(crate) req_num: u64,
    pub(crate) first: u16,
    pub(crate) last: u16,
}

/// Everything but the transport.
pub(crate) struct Core<P> {
    pub(crate) config: RpcConfig,
    /// By session number (`table.rs`).
    pub(crate) sessions: SessionTable<P>,
    /// Server sessions by their connect's key.
    pub(crate) connects: HashMap<ConnectKey, u32>,
    /// This endpoint's incarnation number, random: a server tells a client
    /// that restarted with the same address and session number from the
    /// old one by it.
    pub(crate) nonce: u64,
    /// Connects this endpoint has made (each connect's id is the nonce
    /// plus this count).
    pub(crate) connects_made: u64,
    pub(crate) connect_requests: Vec<ConnectRequest>,
    pub(crate) tx: TxBatch<P>,
    /// Client sessions to pump at the end of this receive batch (`client_calls.rs`).
    pub(crate) pumps: Vec<u32>,
    /// Credit returns owed for this receive batch (`server_requests.rs`).
    pub(crate) acks: Vec<PendingAck>,
    pub(crate) pool: BufPool,
    pub(crate) handlers: Vec<Option<HandlerQueue>>,
    /// Requests to start in idle handler tasks' slots at the end of this
    /// receive batch (`Engine::start_handlers`).
    pub(crate) starts: VecDeque<Start>,
    /// Requests given to handler tasks (queued or being handled) and not
    /// answered yet: the last one answered sends the responses at once
    /// (`Engine::flush_after_handler`).
    pub(crate) jobs_open: usize,
    pub(crate) stats: RpcStats,
    /// Retransmission timer ticks so far (the engine's clock: the hot path
    /// reads no time).
    pub(crate) now: u64,
    /// The transport's largest packet.
    pub(crate) max_packet: usize,
    pub(crate) local_addr: Vec<u8>,
    pub(crate) timer: Option<Sleep>,
    /// Some call or connect may need a retransmission.
    pub(crate) timer_wanted: bool,
    /// The idle sweep's timer (`idle.rs`), while server sessions are open
    /// and [`RpcConfig::session_idle_timeout`] is set.
    pub(crate) idle_timer: Option<Sleep>,
    /// The keepalive timer (`idle.rs`), while client sessions ping.
    pub(crate) keepalive_timer: Option<Sleep>,
    /// Its period: the shortest ping interval of the client sessions that
    /// ping (`None`: none do).
    pub(crate) keepalive_period: Option<std::time::Duration>,
    /// Server sessions open (the idle sweep runs while there are any).
    pub(crate) server_sessions: usize,
    /// Server sessions open per client address.
    pub(crate) peer_sessions: HashMap<Vec<u8>, usize>,
    /// Sessions open, client and server.
    pub(crate) open_sessions: usize,
    /// The request memory budget (`budget.rs`).
    pub(crate) budget: Budget,
    /// Room granted for written requests (`written_requests.rs`): half of the
    /// request memory, apart from it, so what peers are granted never
    /// takes room from the requests themselves.
    pub(crate) grants: Budget,
    pub(crate) dispatcher: Option<Waker>,
    /// The timer task (`endpoint.rs`): the retransmission timer, the idle
    /// sweep and the keepalive run there, off the dispatcher's path.
    pub(crate) ticker: Option<Waker>,
    /// The transport's large-message path (`read_path.rs`), if it has one.
    pub(crate) bulk: Option<Box<dyn Bulk>>,
    /// READs under way, by token.
    pub(crate) reads: IdMap<u64, ReadTarget>,
    /// The next READ's token.
    pub(crate) next_token: u64,
    /// The next link number.
    pub(crate) next_link: u64,
    /// Client sessions to ask for a link at the end of this receive batch.
    pub(crate) links_wanted: Vec<u32>,
    /// READs finished, taken from the transport (reused).
    pub(crate) bulk_done: Vec<BulkDone>,
    /// Server: WRITEs of responses under way, by token (`written_responses.rs`).
    pub(crate) writes: IdMap<u64, ReadTarget>,
    /// Client: WRITEs with immediate received, taken from the transport
    /// (reused).
    pub(crate) bulk_written: Vec<(u64, u32)>,
    /// Client: requests exposed to their servers (each may take its
    /// response by WRITE with immediate), over all sessions.
    pub(crate) requests_exposed: usize,
    /// A link was opened: the dispatcher polls the links' receives
    /// (`link_send.rs`).
    pub(crate) links_opened: bool,
    /// The links' receive buffers, charged to the request memory when
    /// the first link opens.
    pub(crate) link_recv_charge: Charge,
    pub(crate) link_recv_bytes: usize,
    /// Packets taken from the links, and links broken (reused).
    pub(crate) link_rx: Vec<(u64, LinkPacket)>,
    pub(crate) links_broken: Vec<u64>,
    /// Work counted for tests that bound it.
    #[cfg(test)]
    pub(crate) work: WorkCounts,
}

/// Work of the engine counted for tests (`linked_window_tests.rs`): how
/// often it takes its general paths where a fast one may do.
#[cfg(test)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WorkCounts {
    /// Client: pumps over a session's slots (`Core::pump`).
    pub(crate) pumps: u64,
    /// Server: request packets taken one by one by the general path
    /// (`Core::on_request` past `small_request`).
    pub(crate) request_packets: u64,
    /// Server: request packets queued for a credit return (`queue_ack`).
    pub(crate) acks_queued: u64,
    /// Runs of the dispatcher task (`Engine::poll_dispatch`).
    pub(crate) dispatches: u64,
}

impl<P: Clone> Core<P> {
    pub(crate) fn new(config: RpcConfig, max_packet: usize, local_addr: Vec<u8>) -> Self {
        Core {
            budget: Budget::new(config.request_memory),
            grants: Budget::new(config.request_memory / 2),
            pool: BufPool::new(config.request_memory),
            peer_sessions: HashMap::new(),
            open_sessions: 0,
            config,
            sessions: SessionTable::default(),
            connects: HashMap::new(),
            nonce: {
                use std::hash::{BuildHasher, Hasher};
                // Seeded from the OS's randomness per process.
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
            connects_made: 0,
            connect_requests: Vec::new(),
            tx: TxBatch::default(),
            acks: Vec::new(),
            pumps: Vec::new(),
            handlers: (0..256).map(|_| None).collect(),
            starts: VecDeque::new(),
            jobs_open: 0,
            stats: RpcStats::default(),
            now: 0,
            max_packet,
            local_addr,
            timer: None,
            timer_wanted: false,
            idle_timer: None,
            keepalive_timer: None,
            keepalive_period: None,
            server_sessions: 0,
            dispatcher: None,
            ticker: None,
            bulk: None,
            reads: IdMap::default(),
            next_token: 1,
            next_link: 1,
            bulk_done: Vec::new(),
            links_wanted: Vec::new(),
            writes: IdMap::default(),
            bulk_written: Vec::new(),
            requests_exposed: 0,
            links_opened: false,
            link_recv_charge: Charge::default(),
            link_recv_bytes: 0,
            link_rx: Vec::new(),
            links_broken: Vec::new(),
            #[cfg(test)]
            work: WorkCounts::default(),
        }
    }

    /// Makes sure the timer task runs the retransmission timer.
    pub(crate) fn want_timer(&mut self) {
        if !self.timer_wanted {
            self.timer_wanted = true;
            self.wake_ticker();
        }
    }

    /// Wakes the timer task (a timer is to be armed).
    pub(crate) fn wake_ticker(&self) {
        if let Some(w) = &self.ticker {
            w.wake_by_ref();
        }
    }

    /// What the endpoint holds now.
    pub(crate) fn memory(&self) -> RpcMemory {
        RpcMemory {
            request_bytes: self.budget.used() - self.link_recv_bytes,
            request_bytes_peak: self.budget.peak() - self.link_recv_bytes,
            link_recv_bytes: self.link_recv_bytes,
            request_budget: self.budget.limit(),
            granted_bytes: self.grants.used(),
            pooled_bytes: self.pool.bytes(),
            server_sessions: self.server_sessions,
            sessions: self.open_sessions,
        }
    }
}
