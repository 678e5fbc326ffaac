//! [`RdmaIncoming`]: a tonic (or hyper) server's incoming connections,
//! accepted by a verbio listener on a pool thread.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::Stream;
use verbio::ops::agent::DEFAULT_STREAM_CHUNK;
use verbio::runtime::{Placement, Pool};
use verbio::{AgentError, CloseReason, HandleError, ListenerHandle, RdmaBuilder, RdmaHandle};

use crate::{AcceptError, RdmaConnection};

/// The connections a verbio listener accepts, as a `Stream` of
/// [`RdmaConnection`]s: what tonic's `Server::serve_with_incoming` (and
/// `serve_with_incoming_shutdown`) take.
///
/// A client that fails its handshake yields [`AcceptError::Client`] and
/// the stream goes on (tonic logs it and keeps accepting); when the
/// listener is gone (its pool thread ended, the pool shut down) the
/// stream yields [`AcceptError::Listener`] once, then ends. Handshakes run
/// side by side on the listener's thread: a client that stalls holds up no
/// other. The connections live on the listener's pool thread. A client
/// must send its first bytes (HTTP/2's preface) within the handshake
/// timeout ([`handshake_timeout`](Self::handshake_timeout), 10 s unless
/// set), else its connection fails.
///
/// ```no_run
/// # async fn f(pool: &verbio::runtime::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// use verbio::runtime::Placement;
/// let incoming =
///     verbio_tonic::RdmaIncoming::bind(pool, Placement::RoundRobin, "0.0.0.0:50051".parse()?)
///         .await?;
/// // tonic::transport::Server::builder().add_service(...).serve_with_incoming(incoming).await?;
/// # let _ = incoming; Ok(()) }
/// ```
pub struct RdmaIncoming {
    listener: ListenerHandle,
    chunk: usize,
    handshake_timeout: Option<Duration>,
    accepting: Option<BoxFuture<'static, Result<RdmaHandle, HandleError>>>,
    ended: bool,
}

impl std::fmt::Debug for RdmaIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaIncoming")
            .field("listener", &self.listener)
            .field("chunk", &self.chunk)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl RdmaIncoming {
    /// Listens on `addr` (port 0: an ephemeral port) on the pool thread
    /// `placement` names, with the default connection settings.
    pub async fn bind(
        pool: &Pool,
        placement: Placement,
        addr: SocketAddr,
    ) -> Result<RdmaIncoming, HandleError> {
        Self::bind_with(pool, placement, addr, |b| b).await
    }

    /// [`bind`](Self::bind) with connection settings (see
    /// [`ListenerHandle::bind_with`]).
    pub async fn bind_with<F>(
        pool: &Pool,
        placement: Placement,
        addr: SocketAddr,
        configure: F,
    ) -> Result<RdmaIncoming, HandleError>
    where
        F: FnOnce(RdmaBuilder) -> RdmaBuilder + Send + 'static,
    {
        let listener = ListenerHandle::bind_with(pool, placement, addr, configure).await?;
        Ok(Self::new(listener))
    }

    /// The connections `listener` accepts, with byte streams sending
    /// messages of up to [`DEFAULT_STREAM_CHUNK`] bytes.
    pub fn new(listener: ListenerHandle) -> RdmaIncoming {
        RdmaIncoming {
            listener,
            chunk: DEFAULT_STREAM_CHUNK,
            handshake_timeout: Some(DEFAULT_HANDSHAKE_TIMEOUT),
            accepting: None,
            ended: false,
        }
    }

    /// Largest message of each connection's byte stream (see
    /// [`HandleStream::with_chunk`](verbio::HandleStream::with_chunk)).
    pub fn chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk;
        self
    }

    /// How long a connection may take to send its first bytes (see
    /// [`RdmaConnection::with_handshake_timeout`]); `None`: unbounded.
    pub fn handshake_timeout(mut self, limit: Option<Duration>) -> Self {
        self.handshake_timeout = limit;
        self
    }

    /// The address it listens on (clients dial it).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// The listener.
    pub fn listener(&self) -> &ListenerHandle {
        &self.listener
    }
}

/// How long a connection may take to send its first bytes, unless set.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// True when `e` means no connection will come from the listener again.
fn listener_gone(e: &HandleError) -> bool {
    matches!(
        e,
        HandleError::Pool(_) | HandleError::Agent(AgentError::Closed(CloseReason::Local))
    )
}

impl Stream for RdmaIncoming {
    type Item = Result<RdmaConnection, AcceptError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        let listener = this.listener.clone();
        let fut = this
            .accepting
            .get_or_insert_with(|| Box::pin(async move { listener.accept().await }));
        let r = ready!(fut.as_mut().poll(cx));
        this.accepting = None;
        let addr = this.listener.local_addr();
        Poll::Ready(Some(match r {
            Ok(handle) => {
                tracing::debug!(listener = %addr, thread = handle.thread().index(), "verbio-tonic: accepted");
                let conn = RdmaConnection::new(handle, this.chunk, addr);
                Ok(match this.handshake_timeout {
                    Some(limit) => conn.with_handshake_timeout(limit),
                    None => conn,
                })
            }
            Err(source) if listener_gone(&source) => {
                this.ended = true;
                tracing::warn!(listener = %addr, error = %source, "verbio-tonic: listener gone");
                Err(AcceptError::Listener {
                    listener: addr,
                    source,
                })
            }
            Err(source) => {
                tracing::debug!(listener = %addr, error = %source, "verbio-tonic: a client failed its handshake");
                Err(AcceptError::Client {
                    listener: addr,
                    source,
                })
            }
        }))
    }
}
