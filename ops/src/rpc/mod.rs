//! An RPC engine over datagrams, in the style of eRPC and rrppcc: one
//! endpoint per runtime thread, sessions with 8 request slots each, calls
//! as futures, handlers as tasks, reliability by retransmission.
//!
//! * [`header`]: the 32-byte packet header.
//! * [`Transport`]: what the engine needs from a datagram transport; the
//!   in-memory, lossy [`mem::MemTransport`] implements it for tests.
//! * [`ud::UdTransport`]: the transport on a UD queue pair of the runtime.
//! * [`Rpc`]: the endpoint: [`connect`](Rpc::connect), [`call`](Rpc::call),
//!   [`register`](Rpc::register), [`serve_until`](Rpc::serve_until).
//! * [`RpcAddr`]: an endpoint's address and its text form (`rpc:` + hex),
//!   to hand it to another process.
//!
//! # Protocol
//!
//! A session is opened by a connect packet carrying the client's transport
//! address; the server answers with a connect-ack naming its session
//! number and its response window. Each session has [`SESSION_SLOTS`]
//! slots; request number `n` uses slot `n % 8`, so each slot runs one call
//! at a time. The session's credits ([`RpcConfig::session_credits`], 32 by
//! default) bound the client packets unanswered at once, over all slots.
//!
//! A message up to the packet payload travels in one packet; a larger one
//! in packets of that size, streamed: the client sends request packets
//! while it has credits, and every client packet is answered by a server
//! packet. Request packet `i` is answered by a credit return (one credit
//! return acknowledges a run of up to 64 packets received in one receive
//! batch; the last packet is answered by response packet 0). When the
//! handler finished, the server sends the first
//! [`RpcConfig::response_window`] response packets unasked (the client
//! counts them as asked for, a credit each); the client asks for the rest
//! with requests for response, one packet per run of up to 64. So a call
//! whose response fits the window takes one round trip, and a larger one
//! a round trip per window of credits, not per packet. Packets and
//! answers are taken in any order (the transport may reorder), so
//! reordering costs no retransmission.
//!
//! A message of at least [`RpcConfig::read_threshold`] bytes (32 KiB by
//! default) goes the rrppcc way instead, when the transport has a
//! large-message path ([`Transport::bulk`]; the UD transport's is RC
//! queue pairs of the same device): one packet carries the address,
//! remote key and length of the sender's registered copy, and the
//! receiver copies it with one RDMA READ over an RC link of the session,
//! opened on the session's first large message (`engine/read_path.rs` has the
//! protocol, the ownership of the buffers and what a failed READ does).
//! A call expecting a large response (its session had one) offers room
//! for it (a read request its own buffer, other calls one announced by an
//! offer packet): a large response that fits is written into it by RDMA
//! WRITE with immediate rather than read (`engine/written_responses.rs`), two one-way
//! trips fewer a call.
//! A message larger than one packet and below the threshold goes over
//! that link too, once the session has one ready (its first such message
//! asks for it): as one packet by RC SEND that carries all of the
//! message's packets (`engine/link_send.rs`), into one pool of receive buffers
//! the endpoint keeps for all its links (on UD a shared receive queue,
//! charged to [`RpcConfig::request_memory`]); the receiver takes it as
//! those packets, so credits, duplicates and retransmission (by datagram)
//! stay as they are.
//! Smaller messages stay on the datagram transport: one UD queue pair
//! serves every peer, and the same retransmission covers every packet.
//! `docs/benchmarks.md` has the rates by size, `docs/rpc.md` why the
//! threshold is where it is.
//!
//! A slot that has had no answer for [`RpcConfig::rto`] sends its
//! unanswered packets again (its first resend waits longer when the
//! session measured a longer round trip: up to 4 `rto`, `rtt.rs`, so a
//! server slowed by a window of calls is not resent to); after
//! [`RpcConfig::max_retries`] in a row its
//! call fails with [`RpcError::Timeout`] and the session with it (a call
//! whose request or response moves by READ or WRITE gets a resend more
//! per `rto` of those bytes at 64 MiB/s; while the transfer runs the
//! server answers its resends, "in progress", `engine/resend.rs`). The
//! server keeps, per slot, the request number and the response, so a
//! request that arrives again is answered from there and its handler runs
//! at most once. A server closes a session that has heard nothing from
//! its client for [`RpcConfig::session_idle_timeout`] (60 s by default)
//! and tells the client (`engine/idle.rs`); clients keep the sessions they hold
//! open with a ping per interval the server announced in its connect-ack
//! ([`RpcConfig::session_keepalive`]), so what expires is the session of
//! a client that vanished.
//!
//! # Limits
//!
//! What a peer can make a server hold is bounded before it proved
//! anything (`docs/rpc.md` has the table and the attacks tested):
//! requests by [`RpcConfig::max_msg_len`] each and by
//! [`RpcConfig::request_memory`] together, charged as their packets
//! arrive (`budget.rs`), never from the length a packet claims (a read request's
//! whole length is charged before the server READs anything); sessions
//! by [`RpcConfig::max_server_sessions`] and
//! [`RpcConfig::max_sessions_per_peer`] (`engine/admission.rs`), and in time by
//! [`RpcConfig::session_idle_timeout`]; pooled buffers by
//! [`POOL_MAX_BYTES`] (those up to 1 MiB) and [`RpcConfig::request_memory`]
//! (larger ones). [`Rpc::memory`] reports the gauges. A bad packet is
//! dropped and counted, never failing the session or the endpoint.
//!
//! # Layout
//!
//! Lowest first; a file uses only those listed before it
//! (`scripts/check-layers.py` checks it):
//!
//! * the wire and the state: `waker.rs`, `header.rs` (the packet header),
//!   `transport.rs` (what the engine needs of a transport), `error.rs`,
//!   `addr.rs`, `budget.rs` (the request memory), `buf.rs` (the buffer
//!   pool), `rtt.rs`, `session.rs` (sessions and their slots), `config.rs`,
//!   `id_map.rs`, `table.rs` (sessions by number), `request.rs` (a request
//!   as its handler gets it), `runner.rs` (a handler task's future slot);
//! * the transports: `mem/` (in memory, lossy, and its large-message
//!   path), `ud_bulk.rs` and `ud.rs` (UD queue pairs, with RC links
//!   beside them);
//! * `engine/`: the engine, `Core`, sans I/O: its state in `mod.rs`, its
//!   methods one file per job (that file lists them in order);
//! * `dispatcher.rs`: the engine with its transport, and the dispatcher
//!   and timer tasks that drive it;
//! * `call.rs`: a call as a future;
//! * `endpoint.rs`: [`Rpc`], what users hold.
mod addr;
mod budget;
mod buf;
mod call;
mod config;
mod dispatcher;
mod endpoint;
pub(crate) mod engine;
mod error;
pub mod header;
mod id_map;
pub mod mem;
mod request;
mod rtt;
mod runner;
pub(crate) mod session;
mod table;
mod transport;
pub mod ud;
mod ud_bulk;
mod waker;

pub use addr::{ParseRpcAddrError, RpcAddr, MAX_RPC_ADDR_LEN};
pub use buf::{MsgBuf, POOL_MAX_BYTES};
pub use config::{
    RpcConfig, DEFAULT_READ_THRESHOLD, DEFAULT_REQUEST_MEMORY, DEFAULT_RESPONSE_WINDOW,
    DEFAULT_SESSION_CREDITS, DEFAULT_SESSION_IDLE_TIMEOUT,
};
pub use endpoint::Rpc;
pub use engine::{RpcMemory, RpcStats};
pub use error::{RpcError, SessionId};
pub use request::Request;
pub use session::SESSION_SLOTS;
pub use transport::{Bulk, BulkDone, LinkPacket, Transport, TransportError, TxBatch};

#[cfg(test)]
mod addr_tests;
#[cfg(test)]
mod buf_tests;
#[cfg(test)]
mod bulk_tests;
#[cfg(test)]
mod bulk_write_tests;
#[cfg(test)]
mod credit_tests;
#[cfg(test)]
mod flush_tests;
#[cfg(test)]
mod header_tests;
#[cfg(test)]
mod link_send_tests;
#[cfg(test)]
mod linked_window_tests;
#[cfg(test)]
mod rtt_tests;
#[cfg(test)]
mod runner_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod ud_bulk_tests;
#[cfg(test)]
mod written_request_tests;
