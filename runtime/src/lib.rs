//! verbio-runtime: the reactor, `Op` futures tracked by wr_id, registered
//! buffers, and the RDMA providers (the software device and libibverbs).
#![deny(missing_docs)]
#![warn(unsafe_op_in_unsafe_fn)]

pub mod buf;
pub mod provider;
