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

/// What a backend's connector does, written as plain async code; the one
/// impl of [`Connect`] below boxes it for every backend.
pub(crate) trait Connecting: 'static {
    /// The backend's established connection.
    type Conn: Conn + 'static;

    /// As [`Connect::connect`].
    async fn connect(
        self,
        qp: &QueuePair,
        private_data: &[u8],
    ) -> Result<(Self::Conn, Vec<u8>), CmError>;
}

impl<T: Connecting> Connect for T {
    fn connect<'a>(
        self: Box<Self>,
        qp: &'a QueuePair,
        private_data: &'a [u8],
    ) -> CmFuture<'a, (Box<dyn Conn>, Vec<u8>)> {
        Box::pin(async move {
            let (conn, peer) = Connecting::connect(*self, qp, private_data).await?;
            Ok((Box::new(conn) as Box<dyn Conn>, peer))
        })
    }
}

/// A request as a backend's listener takes it: the answer, the connection's
/// QP (in RTS) and its protection domain, the requester's private data and
/// address.
pub(crate) type Request<A> = (A, QueuePair, Pd, Vec<u8>, Option<SocketAddr>);

/// What a backend's listener does, written as plain async code; the one
/// impl of [`Listen`] below boxes it for every backend.
pub(crate) trait Listening: 'static {
    /// The backend's unanswered request.
    type Answer: Answer + 'static;

    /// As [`Listen::local_addr`].
    fn local_addr(&self) -> Option<SocketAddr>;

    /// As [`Listen::request`].
    async fn request(
        &self,
        device: &Device,
        opts: &CmOptions,
    ) -> Result<Request<Self::Answer>, CmError>;
}

impl<T: Listening> Listen for T {
    fn local_addr(&self) -> Option<SocketAddr> {
        Listening::local_addr(self)
    }

    fn request<'a>(&'a self, device: &'a Device, opts: &'a CmOptions) -> CmFuture<'a, Incoming> {
        Box::pin(async move {
            let (req, qp, pd, private_data, peer) = Listening::request(self, device, opts).await?;
            Ok(Incoming {
                answer: Box::new(req),
                qp,
                pd,
                private_data,
                peer,
            })
        })
    }
}

/// What a backend's unanswered request does, written as plain async code;
/// the one impl of [`Answer`] below boxes it for every backend.
pub(crate) trait Answering: 'static {
    /// The backend's established connection.
    type Conn: Conn + 'static;

    /// As [`Answer::accept`].
    async fn accept(self, qp: &QueuePair, private_data: &[u8]) -> Result<Self::Conn, CmError>;

    /// As [`Answer::reject`].
    fn reject(self, private_data: &[u8]) -> Result<(), CmError>;
}

impl<T: Answering> Answer for T {
    fn accept<'a>(
        self: Box<Self>,
        qp: &'a QueuePair,
        private_data: &'a [u8],
    ) -> CmFuture<'a, Box<dyn Conn>> {
        Box::pin(async move {
            let conn = Answering::accept(*self, qp, private_data).await?;
            Ok(Box::new(conn) as Box<dyn Conn>)
        })
    }

    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<(), CmError> {
        Answering::reject(*self, private_data)
    }
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
