//! verbio-runtime: the reactor, `Op` futures tracked by wr_id, registered
//! buffers, and the RDMA providers (the software device and libibverbs).
#![deny(missing_docs)]
#![warn(unsafe_op_in_unsafe_fn)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(target_os = "linux"))]
compile_error!("verbio supports Linux only: it needs epoll, eventfd and (for hardware) libibverbs");

mod accept_error;
pub mod buf;
pub mod cm;
pub mod compat;
pub mod provider;

pub mod device;
pub mod op;
pub mod pool;
pub mod qp;
pub mod reactor;
mod report;
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
mod wake;

pub use device::Device;
pub use op::{Completable, Op, SubmitError};
pub use pool::{Placement, Pool, PoolBuilder, PoolError, PoolJoinHandle};
pub use qp::{Bind, Invalidate, WindowVerb};
pub use qp::{
    Datagram, DatagramSource, GatherChainVerb, GatherVerb, QueuePair, RecvRing, RecvRingConfig,
    RecvRingError, RingMsg, ScatterVerb, SendChain, SendInline, SendInlineBurst, SharedRecvQueue,
    Submit, UdEndpoint, UdPeer,
};
pub use reactor::{
    schedule_pass_hook, sleep, sleep_until, spawn, timeout, yield_now, Builder, Elapsed,
    FallibleJoinHandle, Handle, JoinError, JoinHandle, JoinResult, PassHook, PassHookId, Runtime,
    RuntimeError, RuntimeStats, Sleep, TcpListener, TcpStream, Timeout, Turn, LISTEN_BACKLOG,
};
pub use report::ErrorChain;
