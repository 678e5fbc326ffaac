//! verbio: an io_uring-style async runtime for RDMA verbs.
//!
//! This facade re-exports [`verbio_runtime`] (reactor, `Op` futures, buffers,
//! providers) and [`verbio_ops`] (verbs as ops, connections, the agent).
#![deny(missing_docs)]

pub use verbio_ops as ops;
pub use verbio_ops::agent::{
    AgentError, CloseReason, LocalMr, MessageSink, MessageStream, Rdma, RdmaBuilder, RdmaListener,
    RdmaStream, RecvMsg, RemoteMr,
};
pub use verbio_ops::connect::{connect, DeviceQps, Listener, QpConfig};
pub use verbio_ops::rpc;
pub use verbio_ops::verbs::{Batch, Received, RemoteBuf, Verbs};
pub use verbio_runtime as runtime;
pub use verbio_runtime::provider;

/// The README's examples, compiled as doctests so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
