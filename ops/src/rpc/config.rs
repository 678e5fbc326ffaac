//! The engine's settings.

use std::time::Duration;

use super::header::{HEADER_LEN, MAX_MSG_LEN, MIN_PACKET};
use super::session::WINDOW;

/// Settings of an [`Rpc`](super::Rpc) endpoint.
#[derive(Clone, Debug)]
pub struct RpcConfig {
    /// Retransmission timeout: a request slot that made no progress for this
    /// long (up to a third more: the timer ticks three times per timeout)
    /// resends its unanswered packets. The first resend of a slot waits
    /// the session's measured round trip plus four times its deviation
    /// instead when that is longer, up to 4 times this.
    pub rto: Duration,
    /// Retransmissions without progress before the call (and its session)
    /// fails with [`RpcError::Timeout`](super::RpcError::Timeout); connects
    /// fail after as many. A dead peer is detected within about
    /// `rto * (max_retries + 1)` (`rto * (max_retries + 4)` after a long
    /// round trip was measured). A connect's resends back off, each
    /// waiting twice as long as the one before (up to `64 * rto`): an
    /// unanswered connect fails after about `rto * (2^(max_retries+1) - 1)`,
    /// 1.26 s with the defaults. A call whose request or response moves
    /// by RDMA READ or WRITE gets besides
    /// one resend per `rto`'s worth of those bytes at 64 MiB/s (a peer
    /// that vanished mid-transfer is detected that much later: 16 MiB
    /// with the defaults, 13 resends more, 250 ms).
    pub max_retries: u32,
    /// Largest request or response, in bytes (at most 16 MiB).
    pub max_msg_len: usize,
    /// Client: packets a session may have unanswered (its credits), over
    /// all its calls: a message larger than a packet streams this many
    /// packets before waiting for their answers. From 1 to 64.
    ///
    /// Default: [`DEFAULT_SESSION_CREDITS`] (docs/benchmarks.md has the
    /// measurement that chose it).
    pub session_credits: usize,
    /// Server: response packets sent as soon as the handler finished,
    /// before the client asks for them (it asks for the rest, a run per
    /// packet, under its credits): a response of up to this many packets
    /// takes no round trip beyond the request's. From 1 to 64.
    ///
    /// Default: [`DEFAULT_RESPONSE_WINDOW`].
    pub response_window: usize,
    /// Tasks per registered request type that run its handler (requests
    /// beyond that wait in a queue).
    pub handler_tasks: usize,
    /// Packets taken from the transport per receive call.
    pub recv_batch: usize,
    /// Server: a session that has heard nothing from its client for this
    /// long (up to a quarter more), with no handler of it running, is
    /// closed, its memory freed, and the client told (best effort: one
    /// disconnect packet; its next call fails with
    /// [`RpcError::SessionClosed`](super::RpcError::SessionClosed), or with
    /// a timeout if that packet was lost: reconnect). Clients keep the
    /// sessions they hold open by pinging them
    /// ([`session_keepalive`](Self::session_keepalive)): the server
    /// announces the interval, a sixth of this, at connect; so what
    /// expires is the session of a client that vanished (or turned its
    /// pings off), and a quiet client's next call succeeds. The same sweep drops
    /// a request whose packets stopped arriving for as long (its client
    /// sends it again if it is still there). This reclaims what clients
    /// that vanished, or never meant to finish, left behind.
    ///
    /// Default: 60 s. `None` keeps sessions until their client disconnects,
    /// so peers can hold server memory forever: only for trusted peers.
    pub session_idle_timeout: Option<Duration>,
    /// Client: keeps the sessions this endpoint holds open at servers that
    /// close idle sessions: each such session is pinged (one empty packet,
    /// not answered) at the interval its server announced when it accepted
    /// the connect (a sixth of its
    /// [`session_idle_timeout`](Self::session_idle_timeout), at most 65 s),
    /// busy or not, until it is disconnected or the endpoint dropped. So a
    /// call after any quiet time finds its session open; the server still
    /// closes the session of a client that stops pinging (it vanished).
    ///
    /// Default: true. `false`: no pings; a session quiet for its server's
    /// idle timeout is closed and its next call fails with
    /// [`RpcError::SessionClosed`](super::RpcError::SessionClosed).
    pub session_keepalive: bool,
    /// Server: bytes of requests held at once, over all sessions: from a
    /// request's first packet until its handler drops the
    /// [`Request`](super::Request) (reassembly buffers and their packet
    /// bitmaps). A request is reserved whole at its first packet, and its
    /// buffer allocated as its packets arrive, never to the length a packet
    /// claims at once; a multi-packet request that does not fit is not
    /// admitted (its client is told to wait and sends it again after
    /// [`rto`](Self::rto)), so a peer claiming large messages cannot make
    /// the server allocate more than this. Single-packet requests are not
    /// refused (their bytes are the packet's) but are counted.
    ///
    /// Default: 64 MiB; raised to at least `max_msg_len` plus its bitmap
    /// so one largest request always fits.
    pub request_memory: usize,
    /// Server: sessions open at once from all clients; a connect beyond it
    /// is refused (not answered, logged, counted in
    /// [`RpcStats::connects_refused`](super::RpcStats::connects_refused)).
    /// Each server session costs about 3.5 KiB (its 3 KiB record, map
    /// entries, an address handle on UD) plus its cached responses.
    ///
    /// Default: 1024.
    pub max_server_sessions: usize,
    /// Server: sessions open at once from one client address (one client
    /// endpoint usually opens one per server); a connect beyond it is
    /// refused like one beyond [`max_server_sessions`](Self::max_server_sessions).
    ///
    /// Default: 32.
    pub max_sessions_per_peer: usize,
    /// Messages of at least this many bytes go by RDMA READ over an RC
    /// link of the session, when the transport has one
    /// ([`Transport::bulk`](super::Transport::bulk)): the client sends a
    /// read request carrying its buffer's address and key, the server
    /// READs it (and a large response the other way). A session opens its
    /// link on its first message this large (which still streams in
    /// packets); a server whose peer never answers, or that sets this to
    /// `usize::MAX`, keeps every message in packets.
    ///
    /// Default: [`DEFAULT_READ_THRESHOLD`] (docs/rpc.md says why).
    pub read_threshold: usize,
}

impl RpcConfig {
    /// Brings every setting into its range (as [`Rpc::new`](super::Rpc::new)
    /// does): `max_msg_len` at most 16 MiB, `request_memory` room for one
    /// largest request, the windows from 1 to 64.
    pub(crate) fn normalize(&mut self) {
        self.max_msg_len = self.max_msg_len.min(MAX_MSG_LEN as usize);
        let bitmap = (self.max_msg_len / (MIN_PACKET as usize - HEADER_LEN)).div_ceil(64) * 8;
        self.request_memory = self.request_memory.max(self.max_msg_len + bitmap);
        self.recv_batch = self.recv_batch.max(1);
        self.session_credits = self.session_credits.clamp(1, WINDOW);
        self.response_window = self.response_window.clamp(1, WINDOW);
        // An empty message has nothing to read.
        self.read_threshold = self.read_threshold.max(1);
    }
}

/// Default of [`RpcConfig::read_threshold`]: 32 KiB (docs/rpc.md says why).
pub const DEFAULT_READ_THRESHOLD: usize = 32 << 10;
/// Default of [`RpcConfig::session_idle_timeout`].
pub const DEFAULT_SESSION_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default of [`RpcConfig::session_credits`].
pub const DEFAULT_SESSION_CREDITS: usize = 32;
/// Default of [`RpcConfig::response_window`].
pub const DEFAULT_RESPONSE_WINDOW: usize = 32;
/// Default of [`RpcConfig::request_memory`].
pub const DEFAULT_REQUEST_MEMORY: usize = 64 << 20;

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig {
            rto: Duration::from_millis(20),
            max_retries: 5,
            max_msg_len: 1 << 20,
            session_credits: DEFAULT_SESSION_CREDITS,
            response_window: DEFAULT_RESPONSE_WINDOW,
            handler_tasks: 16,
            recv_batch: 16,
            session_idle_timeout: Some(DEFAULT_SESSION_IDLE_TIMEOUT),
            session_keepalive: true,
            request_memory: DEFAULT_REQUEST_MEMORY,
            max_server_sessions: 1024,
            max_sessions_per_peer: 32,
            read_threshold: DEFAULT_READ_THRESHOLD,
        }
    }
}
