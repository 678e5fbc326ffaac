//! verbio-ops: every verb as an owned-buffer `Op` future, connection setup over
//! TCP, and the MR-token agent.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod agent;
pub mod connect;
pub mod error;
#[cfg(feature = "fuzzing")]
#[cfg_attr(docsrs, doc(cfg(feature = "fuzzing")))]
pub mod fuzz_checks;
pub mod handle;
pub mod rpc;
pub mod verbs;

pub use agent::{
    AgentError, CloseReason, LocalMr, MessageSink, MessageStream, Rdma, RdmaBuilder,
    RdmaCmListener, RdmaListener, RdmaStream, RemoteMr, StagingBudget,
};
pub use error::{Error, ErrorChain, Result};
pub use verbs::{Batch, Received, RemoteBuf, Verbs};
