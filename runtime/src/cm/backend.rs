//! The connection manager's backend contract: what a provider's connection
//! manager supplies, one trait per object, so that `cm/mod.rs` (the public
//! API, the disconnect and its bounds) names no provider.
//!
//! A backend resolves and connects ([`CmBackend::resolve`],
//! [`Connect::connect`]), listens and answers requests
//! ([`CmBackend::bind`], [`Listen::request`], [`Answer`]), and reports an
//! established connection's end ([`Conn::down`]). The queue pair is always
//! the runtime's own, made on the given device by the backend and moved to
//! RTS by it. The futures are boxed: connection set-up is the slow path, and
//! a boxed future keeps the public futures small.
//!
//! [`for_device`] is the one place that chooses a backend by provider.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

use super::conn::DisconnectReason;
use super::{CmError, CmOptions};
use crate::device::Device;
use crate::provider::Pd;
use crate::qp::QueuePair;

/// A backend's future: not `Send` (the runtime is thread-per-core).
pub(crate) type CmFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, CmError>> + 'a>>;

/// A provider's connection manager.
pub(crate) trait CmBackend {
    /// Resolves `addr` to a route on `device` and makes the connection's QP
    /// there (in INIT: receives may be posted).
    fn resolve<'a>(
        &self,
        device: &'a Device,
        addr: SocketAddr,
        opts: &'a CmOptions,
    ) -> CmFuture<'a, Resolved>;

    /// Listens on `addr`.
    fn bind(
        &self,
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<Box<dyn Listen>, CmError>;
}

/// A resolved connector, its QP and that QP's protection domain.
pub(crate) struct Resolved {
    /// Sends the request.
    pub(crate) connector: Box<dyn Connect>,
    /// The connection's QP.
    pub(crate) qp: QueuePair,
    /// Its protection domain.
    pub(crate) pd: Pd,
}

/// The active side after resolution.
pub(crate) trait Connect {
    /// Sends the connect request with `private_data`; resolves once `qp` is
    /// in RTS and the connection is established, with the peer's private
    /// data.
    fn connect<'a>(
        self: Box<Self>,
        qp: &'a QueuePair,
        private_data: &'a [u8],
    ) -> CmFuture<'a, (Box<dyn Conn>, Vec<u8>)>;
}

/// A connect request as a listener hands it over: its QP is in RTS.
pub(crate) struct Incoming {
    /// Answers it.
    pub(crate) answer: Box<dyn Answer>,
    /// The connection's QP.
    pub(crate) qp: QueuePair,
    /// Its protection domain.
    pub(crate) pd: Pd,
    /// The requester's private data.
    pub(crate) private_data: Vec<u8>,
    /// The requester's address.
    pub(crate) peer: Option<SocketAddr>,
}

/// A listening endpoint.
pub(crate) trait Listen {
    /// The address it listens on.
    fn local_addr(&self) -> Option<SocketAddr>;

    /// The next request that can be taken (the others are rejected and
    /// skipped); fails only when the listener itself does.
    fn request<'a>(&'a self, device: &'a Device, opts: &'a CmOptions) -> CmFuture<'a, Incoming>;
}

/// A connect request not yet answered.
pub(crate) trait Answer {
    /// Accepts with `private_data`; resolves once established.
    fn accept<'a>(
        self: Box<Self>,
        qp: &'a QueuePair,
        private_data: &'a [u8],
    ) -> CmFuture<'a, Box<dyn Conn>>;

    /// Refuses it with `private_data`.
    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<(), CmError>;
}

/// An established connection, as its backend sees it.
pub(crate) trait Conn {
    /// The local address.
    fn local_addr(&self) -> Option<SocketAddr>;

    /// The peer's address.
    fn peer_addr(&self) -> Option<SocketAddr>;

    /// Tells the peer this side disconnects (does not wait).
    fn disconnect(&self) -> Result<(), CmError>;

    /// Resolves when the backend reports the connection down (answering
    /// the peer's disconnect at once), with who ended it.
    fn down(&self) -> Pin<Box<dyn Future<Output = DisconnectReason>>>;

    /// What `disconnect` waits for, for its timeout error.
    fn down_event(&self) -> &'static str;
}

/// The backend of `device`'s provider: RDMA CM (librdmacm) on a libibverbs
/// device, the TCP equivalent on the software device.
pub(crate) fn for_device(device: &Device) -> &'static dyn CmBackend {
    #[cfg(feature = "ibverbs")]
    if device.context().as_ibverbs().is_some() {
        return &super::ibverbs::Backend;
    }
    let _ = device;
    &super::soft::Backend
}
