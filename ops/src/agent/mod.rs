//! The MR-token agent (DESIGN.md section 7): the high-level [`Rdma`]
//! connection built with [`RdmaBuilder`], its agent task that owns the
//! receive queue, credit-based flow control, and the wire codec.

mod builder;
mod error;
mod flow;
mod inbox;
mod memory;
mod mr;
mod msg;
mod qps;
mod rdma;
mod settings;
mod task;
mod tokens;
pub mod wire;

pub use builder::{RdmaBuilder, RdmaListener};
pub use error::{AgentError, CloseReason};
pub use mr::{LocalMr, RemoteMr};
pub use msg::RecvMsg;
pub use rdma::Rdma;
pub use settings::MIN_RECV_BUF_SIZE;
