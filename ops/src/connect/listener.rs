//! [`Listener`] and [`connect`]: the handshake over the reactor's TCP.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::future::LocalBoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use tracing::Instrument;
use verbio_runtime::provider::Endpoint;
use verbio_runtime::{sleep_until, TcpListener, TcpStream};

use super::error::HandshakeError;
use super::exchange::{accept_exchange, connect_exchange, Deadline};
use super::reach::check_engine_reachable;
use super::setup::QpFactory;

/// Default limit for one handshake (TCP connect included on the client).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connected queue pair.
#[derive(Debug)]
pub struct Connection<Q> {
    /// The QP, in RTS, connected to the peer.
    pub qp: Q,
    /// Our endpoint as sent.
    pub local: Endpoint,
    /// The peer's endpoint.
    pub remote: Endpoint,
    /// The peer's TCP address.
    pub peer_addr: SocketAddr,
    /// The TCP connection the handshake ran on, left open (its closing can
    /// serve as a liveness signal); drop it if not needed.
    pub stream: TcpStream,
}

/// Connects to a [`Listener`] at `addr`: creates a QP with `qps`, exchanges
/// endpoints and brings the QP to RTS, within `timeout` (TCP connect
/// included). Must run on a verbio runtime.
pub async fn connect<F: QpFactory>(
    addr: SocketAddr,
    qps: &F,
    timeout: Duration,
) -> Result<Connection<F::Qp>, HandshakeError> {
    let span = setup_span("connect", addr);
    connect_in(addr, qps, timeout, &span)
        .instrument(span.clone())
        .await
}

/// The span of one connection's setup: the peer's address, and both QP
/// numbers once known.
fn setup_span(role: &'static str, peer: SocketAddr) -> tracing::Span {
    tracing::info_span!(
        "conn_setup",
        role,
        %peer,
        local_qpn = tracing::field::Empty,
        remote_qpn = tracing::field::Empty,
    )
}

async fn connect_in<F: QpFactory>(
    addr: SocketAddr,
    qps: &F,
    timeout: Duration,
    span: &tracing::Span,
) -> Result<Connection<F::Qp>, HandshakeError> {
    let deadline = Instant::now() + timeout;
    let (qp, local) = qps.create()?;
    span.record("local_qpn", local.qpn);
    let connecting = pin!(TcpStream::connect(addr));
    let mut stream = match futures::future::select(connecting, pin!(sleep_until(deadline))).await {
        futures::future::Either::Left((r, _)) => r.map_err(|source| HandshakeError::Io {
            stage: "connecting over TCP",
            source,
        })?,
        futures::future::Either::Right(_) => {
            return Err(HandshakeError::Timeout {
                stage: "connecting over TCP",
                after: timeout,
            })
        }
    };
    let _ = stream.set_nodelay(true);
    let local_tcp = stream.local_addr().map_err(|source| HandshakeError::Io {
        stage: "reading the local TCP address",
        source,
    })?;
    let remote = connect_exchange(
        &mut stream,
        &local,
        |remote| {
            check_engine_reachable(remote, addr, local_tcp)?;
            qps.connect(&qp, &local, remote)
        },
        Deadline {
            timer: sleep_until(deadline),
            after: timeout,
        },
    )
    .await?;
    span.record("remote_qpn", remote.qpn);
    tracing::debug!("connected");
    Ok(Connection {
        qp,
        local,
        remote,
        peer_addr: addr,
        stream,
    })
}

type Attempt<Q> = LocalBoxFuture<'static, Result<Connection<Q>, (SocketAddr, HandshakeError)>>;

/// Accepts connections and runs their handshakes concurrently, so a slow or
/// malicious client never holds up the others; each handshake is bounded by
/// the listener's timeout. Must be used on a verbio runtime.
pub struct Listener<F: QpFactory> {
    tcp: TcpListener,
    qps: Rc<F>,
    timeout: Duration,
    in_flight: RefCell<FuturesUnordered<Attempt<F::Qp>>>,
}

impl<F: QpFactory> std::fmt::Debug for Listener<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("tcp", &self.tcp)
            .field("timeout", &self.timeout)
            .field("in_flight", &self.in_flight.borrow().len())
            .finish()
    }
}

impl<F: QpFactory> Listener<F> {
    /// Listens on `addr` (port 0 = ephemeral); QPs for accepted connections
    /// come from `qps`; each handshake must finish within `timeout`.
    pub fn bind(
        addr: SocketAddr,
        qps: F,
        timeout: Duration,
    ) -> Result<Listener<F>, HandshakeError> {
        let tcp = TcpListener::bind(addr).map_err(|source| HandshakeError::Io {
            stage: "binding the listener",
            source,
        })?;
        Ok(Listener::with_tcp(tcp, qps, timeout))
    }

    /// Serves connections arriving on a listening socket made elsewhere,
    /// for example one of several bound to one port with `SO_REUSEPORT`:
    /// a thread-per-core server gives each core's runtime its own socket
    /// and the kernel spreads the clients over them
    /// (`examples/thread_per_core.rs`).
    pub fn from_std(
        listener: std::net::TcpListener,
        qps: F,
        timeout: Duration,
    ) -> Result<Listener<F>, HandshakeError> {
        let tcp = TcpListener::from_std(listener).map_err(|source| HandshakeError::Io {
            stage: "registering the listening socket",
            source,
        })?;
        Ok(Listener::with_tcp(tcp, qps, timeout))
    }

    fn with_tcp(tcp: TcpListener, qps: F, timeout: Duration) -> Listener<F> {
        Listener {
            tcp,
            qps: Rc::new(qps),
            timeout,
            in_flight: RefCell::new(FuturesUnordered::new()),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, HandshakeError> {
        self.tcp.local_addr().map_err(|source| HandshakeError::Io {
            stage: "querying the listener address",
            source,
        })
    }

    /// The next successful connection. Clients whose handshake fails (bad
    /// frames, other provider, timeout) are told why when possible, logged
    /// and skipped. Fails only if the listening socket itself fails.
    pub async fn accept(&self) -> Result<Connection<F::Qp>, HandshakeError> {
        loop {
            match self.next_handshake().await {
                Ok(c) => return Ok(c),
                Err(Failure::Listener(e)) => return Err(e),
                Err(Failure::Client(peer, e)) => {
                    tracing::warn!(%peer, error = %crate::error::ErrorChain(&e), "handshake failed; still listening");
                }
            }
        }
    }

    /// The next finished handshake, failed or not: `Err((peer, error))` for
    /// a client whose handshake failed (the listener keeps working), or the
    /// listener's own error with `peer == None`.
    pub async fn accept_attempt(
        &self,
    ) -> Result<Connection<F::Qp>, (Option<SocketAddr>, HandshakeError)> {
        self.next_handshake().await.map_err(|f| match f {
            Failure::Listener(e) => (None, e),
            Failure::Client(peer, e) => (Some(peer), e),
        })
    }

    /// Handshakes that are running.
    pub fn in_flight(&self) -> usize {
        self.in_flight.borrow().len()
    }

    fn next_handshake(&self) -> impl Future<Output = Result<Connection<F::Qp>, Failure>> + '_ {
        poll_fn(move |cx| {
            // Start a handshake for every connection waiting in the backlog.
            loop {
                let accepting = pin!(self.tcp.accept());
                match accepting.poll(cx) {
                    Poll::Ready(Ok((stream, peer))) => {
                        let span = setup_span("accept", peer);
                        let attempt =
                            handshake(stream, peer, self.qps.clone(), self.timeout, span.clone())
                                .instrument(span);
                        self.in_flight.borrow_mut().push(Box::pin(async move {
                            attempt.await.map_err(|e| (peer, e))
                        }));
                    }
                    Poll::Ready(Err(e)) if is_transient(&e) => {
                        tracing::debug!(error = %crate::error::ErrorChain(&e), "transient accept error");
                    }
                    Poll::Ready(Err(source)) => {
                        return Poll::Ready(Err(Failure::Listener(HandshakeError::Io {
                            stage: "accepting a connection",
                            source,
                        })))
                    }
                    Poll::Pending => break,
                }
            }
            let mut in_flight = self.in_flight.borrow_mut();
            match in_flight.poll_next_unpin(cx) {
                Poll::Ready(Some(r)) => {
                    Poll::Ready(r.map_err(|(peer, e)| Failure::Client(peer, e)))
                }
                Poll::Ready(None) | Poll::Pending => Poll::Pending,
            }
        })
    }
}

/// Why `next_handshake` returned without a connection.
enum Failure {
    Listener(HandshakeError),
    Client(SocketAddr, HandshakeError),
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted)
}

/// Server side of one connection.
async fn handshake<F: QpFactory>(
    mut stream: TcpStream,
    peer: SocketAddr,
    qps: Rc<F>,
    timeout: Duration,
    span: tracing::Span,
) -> Result<Connection<F::Qp>, HandshakeError> {
    let _ = stream.set_nodelay(true);
    let local_tcp = stream.local_addr().map_err(|source| HandshakeError::Io {
        stage: "reading the local TCP address",
        source,
    })?;
    let deadline = Deadline {
        timer: sleep_until(Instant::now() + timeout),
        after: timeout,
    };
    let (remote, (qp, local)) = accept_exchange(
        &mut stream,
        qps.provider(),
        |remote| {
            span.record("remote_qpn", remote.qpn);
            check_engine_reachable(remote, peer, local_tcp)?;
            let (qp, local) = qps.create()?;
            span.record("local_qpn", local.qpn);
            qps.connect(&qp, &local, remote)?;
            Ok((local, (qp, local)))
        },
        deadline,
    )
    .await?;
    tracing::debug!("accepted");
    Ok(Connection {
        qp,
        local,
        remote,
        peer_addr: peer,
        stream,
    })
}

#[cfg(test)]
mod tests;
