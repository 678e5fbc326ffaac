//! `Send + Sync + Clone` handles to connections living on the runtime
//! threads of a [`Pool`](verbio_runtime::pool::Pool): use an [`Rdma`]
//! from any thread, e.g. from tasks of tokio's multi-thread runtime.
//!
//! An [`RdmaHandle`] names a connection that stays on one runtime thread,
//! served there by a task of its own; each call is a request in the
//! connection's [mailbox](verbio_runtime::pool::mailbox()) (woken once per
//! burst, and not at all while the thread is awake) answered through a
//! recycled [completion slot](verbio_runtime::pool::SlotCache), with two
//! shortcuts for messages, so that an echo crosses between threads once
//! each way: a small `send` is answered at hand-over (its failure comes
//! back on the next send or [`RdmaHandle::flush`]), and the runtime thread
//! receives the connection's messages ahead into an
//! [inbox](verbio_runtime::pool::inbox()) that `receive` takes from
//! without asking. The futures are `Send`; the data they carry (a
//! message, a WRITE's bytes) is owned by the request, on the runtime
//! thread, until its operation completes: dropping a future mid-flight
//! never frees memory the device may still read or write. A request
//! dropped before its operation started is not started (a send answered at
//! hand-over is sent); a `receive` dropped takes no message.
//!
//! On a pool hosted on tokio
//! ([`PoolBuilder::host_on_tokio`](verbio_runtime::pool::PoolBuilder::host_on_tokio)),
//! a small `send` from that tokio runtime's tasks skips the mailbox: the
//! asking task holds the runtime for the call and posts the message itself
//! ([`ThreadRef::run_hosted`](verbio_runtime::pool::ThreadRef::run_hosted)),
//! when it can be posted at once; otherwise it goes as above.
//!
//! Immediates ([`RdmaHandle::send_with_imm`],
//! [`RdmaHandle::write_with_imm`]) and remote atomics
//! ([`RdmaHandle::compare_and_swap`], [`RdmaHandle::fetch_and_add`]) go the
//! same way.
//!
//! [`HandleStream`] is a `Send` byte stream over a handle (`futures::io`
//! and, with the `tokio` feature, `tokio::io` traits), compatible with
//! [`RdmaStream`](crate::agent::RdmaStream) on the other end.
//!
//! [`RpcHandle`] calls through an RPC endpoint made on a pool thread.
//!
//! Memory: [`RdmaHandle::request_remote_mr`] asks the peer for a grant;
//! [`RdmaHandle::send_local_mr`] grants the peer a copy of bytes (it gets a
//! [`RemoteMrHandle`] with [`RdmaHandle::receive_remote_mr`]), which it
//! hands back with [`RdmaHandle::send_remote_mr`] and this side takes back,
//! with the peer's writes, with [`RdmaHandle::receive_local_mr`].
//!
//! [`ListenerHandle`] accepts connections (they live on the listener's
//! thread: bind one listener per thread, e.g. on separate ports, to spread
//! them). [`RemoteMrHandle`] is a peer's memory region this side may READ
//! and WRITE; it is released when its last clone is dropped.
//!
//! One-sided data goes through a copy into (or out of) registered memory
//! on the runtime thread (`Vec<u8>` in, `Vec<u8>` out), the price of
//! buffers that cross threads.
//!
//! [`Rdma`]: crate::agent::Rdma

mod direct;
mod listener;
mod rdma;
mod remote;
mod rpc;
mod serve;
mod stream;
mod workers;

pub use listener::ListenerHandle;
pub use rdma::RdmaHandle;
pub use remote::RemoteMrHandle;
pub use rpc::RpcHandle;
pub use stream::HandleStream;

use verbio_runtime::pool::PoolError;

use crate::agent::AgentError;
use crate::rpc::RpcError;

/// Why a handle's call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandleError {
    /// The connection's own call failed.
    #[error("the connection's call failed")]
    Agent(#[from] AgentError),
    /// The runtime thread the object lives on is gone, or the task
    /// serving it failed.
    #[error("the pool thread serving the call")]
    Pool(#[from] PoolError),
    /// The remote MR was handed back to its owner (through a clone of its
    /// handle): it can no longer be read, written or handed back.
    #[error("the remote MR was handed back to its owner")]
    GrantGone,
    /// The remote MR was granted to another connection.
    #[error("{what}: the remote MR belongs to another connection")]
    ForeignRemote {
        /// The call.
        what: &'static str,
    },
    /// An RPC call or connect failed: the engine's error, typed (match on
    /// it, or walk the chain with [`ErrorChain`](crate::ErrorChain)).
    #[error("RPC {what} failed")]
    Rpc {
        /// The call (`connect` or `call`).
        what: &'static str,
        /// The engine's error.
        #[source]
        source: RpcError,
    },
    /// The RPC endpoint's task is gone (every request it had was answered).
    #[error("the RPC endpoint is closed")]
    EndpointClosed,
    /// Making the object on its runtime thread failed.
    #[error("{what} failed")]
    Setup {
        /// What was being made.
        what: &'static str,
        /// The error the making closure returned.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The range is outside the remote MR.
    #[error("{what}: {len} bytes at offset {offset} do not fit the remote MR's {have} bytes")]
    OutOfBounds {
        /// The call.
        what: &'static str,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        have: u64,
    },
}
