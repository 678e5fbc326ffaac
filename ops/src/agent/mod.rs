//! The MR-token agent (DESIGN.md section 7): the high-level [`Rdma`]
//! connection built with [`RdmaBuilder`], its agent task that owns the
//! receive queue, credit-based flow control, and the wire codec.
//!
//! When a connection starts, both sides exchange their agent settings over
//! the TCP side channel (`settings.rs`): pieces are sized for the peer's
//! receive buffers, the largest message is the smaller maximum, the control
//! reserve follows the peer's credit batches, and an unworkable pair is
//! refused on both sides. Cancelled operations keep the books straight: a
//! send dropped before it was posted gives its credit back (and the credits
//! it was to return to the peer, which ride on data pieces), a split message
//! cut mid-way is aborted at the receiver (`Abort`), and a hand-over dropped
//! before it was posted revokes its grant. Hand-overs carry a user tag.
//!
//! Adapters on the public send / receive path: [`RdmaStream`] (a
//! `futures::io` byte stream for codecs and framed protocols),
//! [`MessageStream`] / [`MessageSink`] (`futures::Stream` / `Sink` of
//! messages), and `From<AgentError> for std::io::Error`. Every connection
//! runs in a tracing span named `rdma` (peer address, local and remote QPN).

mod backlog;
mod builder;
mod cm;
mod copy_bufs;
mod direct;
mod error;
mod exposed;
mod flow;
mod inbox;
mod io_error;
mod keepalive;
mod landing;
mod memory;
mod messages;
mod mr;
mod msg;
mod packing;
mod pieces;
mod qps;
mod rdma;
mod read_bufs;
mod read_msg;
mod receive;
mod receiving;
mod send_msg;
mod settings;
mod side;
mod srq;
mod staged_lend;
mod staged_now;
mod staging;
mod staging_budget;
mod stream;
mod task;
mod tokens;
mod window_grants;
pub mod wire;

pub use builder::{
    RdmaBuilder, RdmaListener, DEFAULT_KEEPALIVE, DEFAULT_MAX_INLINE_DATA, DEFAULT_RECV_BUF_COUNT,
    DEFAULT_SRQ_ABOVE, DEFAULT_SRQ_DEPTH, DEFAULT_STAGING_RING, MAX_INLINE_DATA,
};
pub use cm::RdmaCmListener;
pub use error::{AgentError, CloseReason};
pub use memory::GrantMem;
pub use messages::{MessageSink, MessageStream};
pub use mr::{LocalMr, RemoteMr};
pub use msg::RecvMsg;
pub use rdma::Rdma;
pub use settings::MIN_RECV_BUF_SIZE;
pub use staging_budget::{StagingBudget, DEFAULT_STAGING_BUDGET};
pub use stream::{RdmaStream, DEFAULT_STREAM_CHUNK};
