//! [`RdmaConnector`]: tonic's and hyper's client connector (a
//! `tower::Service<Uri>`) over verbio connections.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::rt::TokioIo;
use verbio::ops::agent::DEFAULT_STREAM_CHUNK;
use verbio::runtime::{Placement, Pool};
use verbio::{RdmaBuilder, RdmaHandle};

use crate::{ConnectError, RdmaConnection};

type Configure = Arc<dyn Fn(RdmaBuilder) -> RdmaBuilder + Send + Sync>;

/// Connects to a verbio listener (a [`RdmaIncoming`](crate::RdmaIncoming)
/// or any [`RdmaListener`](verbio::RdmaListener)) named by a `Uri`'s host
/// and port, e.g. `http://10.0.0.2:50051` (a host name is resolved, and
/// each of its addresses tried in turn). The connection lives on a thread
/// of the [`Pool`]; the response is a [`TokioIo`]-wrapped
/// [`RdmaConnection`], what tonic's `Endpoint::connect_with_connector` and
/// hyper's client want. Cheap to clone (the settings are shared).
///
/// ```no_run
/// # async fn f(pool: std::sync::Arc<verbio::runtime::Pool>) -> Result<(), Box<dyn std::error::Error>> {
/// use tonic::transport::Endpoint;
/// let channel = Endpoint::from_static("http://127.0.0.1:50051")
///     .connect_with_connector(verbio_tonic::RdmaConnector::new(pool))
///     .await?;
/// # let _ = channel; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RdmaConnector {
    pool: Arc<Pool>,
    placement: Placement,
    chunk: usize,
    configure: Option<Configure>,
}

impl std::fmt::Debug for RdmaConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaConnector")
            .field("pool", &self.pool)
            .field("placement", &self.placement)
            .field("chunk", &self.chunk)
            .field("configured", &self.configure.is_some())
            .finish()
    }
}

impl RdmaConnector {
    /// Connections placed round-robin on `pool`'s threads, with the
    /// default connection settings and messages of up to
    /// [`DEFAULT_STREAM_CHUNK`] bytes.
    pub fn new(pool: Arc<Pool>) -> RdmaConnector {
        RdmaConnector {
            pool,
            placement: Placement::RoundRobin,
            chunk: DEFAULT_STREAM_CHUNK,
            configure: None,
        }
    }

    /// Which pool thread gets each connection.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Largest message of the byte stream (see
    /// [`HandleStream::with_chunk`](verbio::HandleStream::with_chunk)).
    pub fn chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk;
        self
    }

    /// Connection settings: `configure` gets each connection's builder on
    /// its runtime thread (see [`RdmaHandle::connect_with`]).
    pub fn configure<F>(mut self, configure: F) -> Self
    where
        F: Fn(RdmaBuilder) -> RdmaBuilder + Send + Sync + 'static,
    {
        self.configure = Some(Arc::new(configure));
        self
    }

    /// Connects to `addr`.
    pub async fn connect_addr(&self, addr: SocketAddr) -> Result<RdmaConnection, ConnectError> {
        let configure = self.configure.clone();
        let handle =
            RdmaHandle::connect_with(&self.pool, self.placement, addr, move |b| match configure {
                Some(c) => c(b),
                None => b,
            })
            .await
            .map_err(|source| ConnectError::Connect { addr, source })?;
        tracing::debug!(%addr, thread = handle.thread().index(), "verbio-tonic: connected");
        Ok(RdmaConnection::new(handle, self.chunk, addr))
    }

    /// Connects to the address `uri` names.
    pub async fn connect_uri(&self, uri: Uri) -> Result<RdmaConnection, ConnectError> {
        let mut last = None;
        for addr in resolve(&uri).await? {
            match self.connect_addr(addr).await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::debug!(%uri, %addr, error = %e, "verbio-tonic: connect failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(ConnectError::NoAddress { uri }))
    }
}

/// The socket addresses `uri`'s host and port name.
async fn resolve(uri: &Uri) -> Result<Vec<SocketAddr>, ConnectError> {
    let host = uri
        .host()
        .ok_or_else(|| ConnectError::NoHost { uri: uri.clone() })?;
    let port = uri
        .port_u16()
        .ok_or_else(|| ConnectError::NoPort { uri: uri.clone() })?;
    // An IPv6 literal keeps its brackets in `Uri::host`.
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((bare, port))
        .await
        .map_err(|source| ConnectError::Resolve {
            uri: uri.clone(),
            source,
        })?
        .collect();
    if addrs.is_empty() {
        return Err(ConnectError::NoAddress { uri: uri.clone() });
    }
    Ok(addrs)
}

impl tower_service::Service<Uri> for RdmaConnector {
    type Response = TokioIo<RdmaConnection>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.connect_uri(uri).await.map(TokioIo::new) })
    }
}
