//! verbio: an io_uring-style async runtime for RDMA verbs.
//!
//! Every verb is a future that owns its buffers until the device is done
//! with them and is tracked by its work request id; a single-threaded
//! reactor sleeps on the completion channel and wakes exactly the tasks
//! whose completions arrived. verbio runs on RDMA hardware through
//! libibverbs (feature `ibverbs`) and, on any Linux machine, on a built-in
//! software RDMA device ([`provider::soft`]) that keeps the verbs
//! semantics, so every example here runs without RDMA hardware.
//!
//! # Three layers
//!
//! | layer | module | what you get |
//! |---|---|---|
//! | runtime | [`runtime`] | [`Runtime`](runtime::Runtime) (one per thread), [`spawn`](runtime::spawn), timers, async TCP, a [`Pool`](runtime::Pool) of runtime threads; [`Device`](runtime::Device) (a context, its PD and CQ); [`QueuePair`](runtime::QueuePair) and [`RecvRing`](runtime::RecvRing); registered buffers ([`MrPool`](runtime::buf::MrPool)); the connection manager ([`runtime::cm`]); driving verbio from tokio or smol ([`runtime::compat`]) |
//! | verbs and connections | [`ops`] | the verbs as owned-buffer futures ([`Verbs`]: `send`, `recv`, `write`, `read`, atomics, [`Batch`]); RC connection setup over a TCP handshake ([`connect()`], [`Listener`]) |
//! | connections and RPC | [`Rdma`], [`rpc`] | [`Rdma`]: a connection modelled on async-rdma (messages of any size, memory granted with MR tokens), built by [`RdmaBuilder`]; [`rpc::Rpc`]: an eRPC-style RPC engine over UD datagrams |
//!
//! [`provider`] opens devices: [`provider::open_device`] picks the device
//! named by `VERBIO_DEVICE`, else a hardware one, else a software device.
//!
//! # Where to start
//!
//! * Messages and remote memory between two processes: [`RdmaBuilder`] and
//!   [`Rdma`] (the example below).
//! * Request/response between many peers: [`rpc::Rpc`].
//! * The verbs themselves, your own protocol: [`runtime::Device`],
//!   [`ops::connect`] and [`Verbs`] on a [`runtime::QueuePair`].
//! * From tokio or from many threads: verbio's objects live on one
//!   runtime thread (`!Send`); drive a runtime from a tokio thread with
//!   [`runtime::compat`], or keep connections on the threads of a
//!   [`runtime::Pool`] and use them from anywhere through the `Send`
//!   handles ([`RdmaHandle`]; `docs/tokio.md` compares the three ways).
//! * Coming from async-rdma: `docs/coming-from-async-rdma.md` in the
//!   repository maps every call; `docs/ARCHITECTURE.md` shows how the
//!   pieces fit.
//! * Errors: verbio's errors keep their cause in `source()`; print them
//!   with [`ErrorChain`] (`top: cause: root cause`), as every example does.
//!
//! ```
//! use verbio::runtime::{spawn, Runtime};
//! use verbio::RdmaBuilder;
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let rt = Runtime::new()?; // one per thread; it drives every task
//!     rt.block_on(async {
//!         // A listener on a software device; `RdmaBuilder::device`
//!         // picks another.
//!         let listener = RdmaBuilder::new().listen("127.0.0.1:0".parse()?)?;
//!         let addr = listener.local_addr()?;
//!         let server = spawn(async move {
//!             let rdma = listener.accept().await?;
//!             let msg = rdma.receive().await?;
//!             rdma.send(&msg).await?; // echo
//!             rdma.receive().await // keeps the connection until the client is done
//!         });
//!         let rdma = RdmaBuilder::new().connect(addr).await?;
//!         rdma.send(b"hello").await?;
//!         assert_eq!(rdma.receive().await?, b"hello");
//!         rdma.send(b"done").await?;
//!         server.await?;
//!         Ok::<_, Box<dyn std::error::Error>>(())
//!     })?;
//!     Ok(())
//! }
//! ```
//!
//! # Feature flags
//!
//! | feature | what it adds |
//! |---|---|
//! | `ibverbs` | the hardware provider (libibverbs via `rdma-mummy-sys`, loaded at run time) |
//! | `tokio` | `runtime::compat::tokio`: drive verbio from a tokio `LocalSet` |
//! | `async-io` | `runtime::compat::async_io`: drive verbio from smol or async-std |
//! | `test-util` | `runtime::testing`: a fake provider for unit tests of code built on verbio |
//!
//! None is on by default.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod runtime {
    //! The runtime layer (crate `verbio-runtime`): the reactor and its
    //! executor ([`Runtime`], [`spawn`], [`sleep`], [`timeout`], async
    //! TCP), the op futures tracked by work request id ([`op`]), devices
    //! ([`Device`]), queue pairs ([`QueuePair`], [`RecvRing`],
    //! [`SharedRecvQueue`]), registered buffers ([`buf`]), the providers
    //! ([`provider`]: the software device and libibverbs), the connection
    //! manager ([`cm`]), the adapters that drive a runtime from tokio
    //! or smol ([`compat`]) and a [`Pool`] of runtime threads reached from
    //! any thread ([`pool`](mod@pool)).
    #[doc(inline)]
    pub use verbio_runtime::*;
}

pub mod ops {
    //! Verbs and connections (crate `verbio-ops`): the verbs as
    //! owned-buffer futures ([`verbs`]), RC connection setup over a TCP
    //! handshake ([`connect`](mod@connect)), the MR-token agent [`Rdma`]
    //! ([`agent`]), `Send` handles to it from any thread ([`handle`]) and
    //! the RPC engine over datagrams ([`rpc`]).
    #[doc(inline)]
    pub use verbio_ops::*;
}

pub use verbio_ops::agent::{
    AgentError, CloseReason, LocalMr, MessageSink, MessageStream, Rdma, RdmaBuilder,
    RdmaCmListener, RdmaListener, RdmaStream, RecvMsg, RemoteMr, StagingBudget,
};
pub use verbio_ops::connect::{connect, DeviceQps, Listener, QpConfig};
pub use verbio_ops::handle::{
    HandleError, HandleStream, ListenerHandle, RdmaHandle, RemoteMrHandle, RpcHandle,
};
pub use verbio_ops::rpc;
pub use verbio_ops::verbs::{Batch, Received, RemoteBuf, Verbs};
pub use verbio_runtime::provider;
pub use verbio_runtime::ErrorChain;

/// The README's examples, compiled as doctests so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
