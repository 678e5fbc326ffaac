//! An RPC engine over datagrams, in the style of eRPC and rrppcc: one
//! endpoint per runtime thread, sessions with 8 request slots each, calls
//! as futures, handlers as tasks, reliability by retransmission.
//!
//! * [`header`]: the 32-byte packet header.
//! * [`Transport`]: what the engine needs from a datagram transport; the
//!   in-memory, lossy [`mem::MemTransport`] implements it for tests.
//! * [`ud::UdTransport`]: the transport on a UD queue pair of the runtime.
//! * [`Rpc`]: the endpoint: [`connect`](Rpc::connect), [`call`](Rpc::call),
//!   [`register`](Rpc::register).
//!
//! # Protocol
//!
//! A session is opened by a connect packet carrying the client's transport
//! address; the server answers with a connect-ack naming its session number.
//! Each session has [`SESSION_SLOTS`] slots; request number `n` uses slot
//! `n % 8`, so each slot runs one call at a time, and the 8 slots are also
//! the session's credits: at most 8 packets of the client are unanswered.
//!
//! A message up to the packet payload travels in one packet; a larger one
//! in packets of that size. Each client packet is answered by one server
//! packet: request packet `i` by a credit return (the last by response
//! packet 0), and the client asks for response packets `1..` one by one
//! (request for response), each taking a credit. Packets and answers are
//! taken in any order (the transport may reorder), so reordering costs no
//! retransmission. Everything stays on the
//! datagram transport (rrppcc moves large messages by RDMA READ over RC
//! instead): one UD queue pair serves every peer with no RC connection or
//! memory registration exchange per peer, and the same retransmission
//! covers every packet. The price is bandwidth: 8 packets in flight per
//! session bound a large message's rate (see `examples/rpc_echo.rs`).
//!
//! A slot that has had no answer for [`RpcConfig::rto`] sends its
//! unanswered packets again; after [`RpcConfig::max_retries`] in a row its
//! call fails with [`RpcError::Timeout`] and the session with it. The
//! server keeps, per slot, the request number and the response, so a
//! request that arrives again is answered from there and its handler runs
//! at most once. A server closes a session that has heard nothing from
//! its client for [`RpcConfig::session_idle_timeout`] (60 s by default)
//! and tells the client (`idle.rs`).
//!
//! # Limits
//!
//! What a peer can make a server hold is bounded before it proved
//! anything (`docs/rpc.md` has the table and the attacks tested):
//! requests by [`RpcConfig::max_msg_len`] each and by
//! [`RpcConfig::request_memory`] together, charged as their packets
//! arrive (`budget.rs`), never from the length a packet claims; sessions
//! by [`RpcConfig::max_server_sessions`] and
//! [`RpcConfig::max_sessions_per_peer`] (`admission.rs`), and in time by
//! [`RpcConfig::session_idle_timeout`]; pooled buffers by
//! [`POOL_MAX_BYTES`]. [`Rpc::memory`] reports the gauges. A bad packet is
//! dropped and counted, never failing the session or the endpoint.
mod admission;
mod budget;
mod buf;
mod client;
mod config;
mod core;
mod endpoint;
mod error;
pub mod header;
mod idle;
pub mod mem;
mod server;
mod session;
mod table;
mod timer;
mod transport;
pub mod ud;

pub use buf::{MsgBuf, POOL_MAX_BYTES};
pub use config::{RpcConfig, DEFAULT_REQUEST_MEMORY, DEFAULT_SESSION_IDLE_TIMEOUT};
pub use core::{RpcMemory, RpcStats};
pub use endpoint::{Request, Rpc};
pub use error::{RpcError, SessionId};
pub use session::SESSION_SLOTS;
pub use transport::{Transport, TransportError, TxBatch};

#[cfg(test)]
mod header_tests;
#[cfg(test)]
mod tests;
