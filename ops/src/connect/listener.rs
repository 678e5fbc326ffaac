//! [`Listener`] and [`connect`]: the handshake over the reactor's TCP.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::LocalBoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use tracing::Instrument;
use verbio_runtime::provider::Endpoint;
use verbio_runtime::reactor::{AcceptBackoff, PendingLimits, PendingRefusal};
use verbio_runtime::{sleep_until, TcpListener, TcpStream};

use super::error::HandshakeError;
use super::exchange::{accept_exchange, connect_exchange, Deadline};
use super::reach::{advertised, check_engine_reachable};
use super::setup::QpFactory;

/// Default limit for one handshake (TCP connect included on the client).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap on the handshakes a [`Listener`] runs at once.
pub const DEFAULT_MAX_PENDING: usize = 128;
/// Default cap on the handshakes a [`Listener`] runs at once with one IP
/// address.
pub const DEFAULT_MAX_PENDING_PER_SOURCE: usize = 32;
/// Name of the listener in logs.
const WHAT: &str = "handshake listener";
/// A failed client is logged as a warning at most this often.
const FAILED_CLIENT_WARN_INTERVAL: Duration = Duration::from_secs(1);

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
        futures::future::Either::Left((r, _)) => {
            r.map_err(HandshakeError::io("connecting over TCP"))?
        }
        futures::future::Either::Right(_) => {
            return Err(HandshakeError::Timeout {
                stage: "connecting over TCP",
                after: timeout,
            })
        }
    };
    let _ = stream.set_nodelay(true);
    let local_tcp = stream
        .local_addr()
        .map_err(HandshakeError::io("reading the local TCP address"))?;
    let local = advertised(local, local_tcp);
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

type AttemptResult<Q> = Result<Connection<Q>, (SocketAddr, HandshakeError)>;
type Attempt<Q> = LocalBoxFuture<'static, AttemptResult<Q>>;

/// Accepts connections and runs their handshakes concurrently, so a slow or
/// malicious client never holds up the others. Must be used on a verbio
/// runtime.
///
/// What a client can make it hold before its hello is validated:
///
/// - **time**: the listener's `timeout` for the whole handshake; then the
///   connection is closed;
/// - **memory**: one handshake future of fixed size (the frame buffer,
///   header plus [`MAX_BODY_LEN`](super::handshake::MAX_BODY_LEN), is part
///   of it; under 4 KiB, checked by a test); nothing is allocated from
///   what the client sends before its length is checked;
/// - **connections**: at most [`DEFAULT_MAX_PENDING`] (128) handshakes at
///   once, of which [`DEFAULT_MAX_PENDING_PER_SOURCE`] (32) from one IP
///   address ([`with_pending_caps`](Self::with_pending_caps)). A full
///   listener stops accepting (new connections wait in the kernel's
///   backlog, [`LISTEN_BACKLOG`](verbio_runtime::LISTEN_BACKLOG) of them
///   for a listener this crate binds) until a handshake ends. A
///   connection from a source at its cap waits up to [`PARK_GRACE`]
///   (100 ms; at most 32 such at once) for one of the source's
///   handshakes to end, then gets a reject. Both are logged (`warn`, at
///   most every 10 s). A handshake ends on the client when it has sent
///   its last frame, before the listener has read it, so a client that
///   waited for its handshakes before dialing more is not refused
///   because the listener's thread ran late: the listener ends the
///   handshakes whose last frame is here before it counts new
///   connections, and the grace covers a frame whose arrival it has not
///   seen yet. A client that keeps as many handshakes going as its cap
///   allows is still refused now and then: dial fewer at once
///   (`tests/handshake_crowd.rs` dials half the cap).
///
/// Handshakes progress while [`accept`](Self::accept) (or
/// [`accept_attempt`](Self::accept_attempt)) is being awaited. `accept(2)`
/// errors for lack of resources (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`)
/// pause accepting (10 ms doubling to 1 s) and are logged once per burst;
/// only an error of the listening socket itself is returned.
pub struct Listener<F: QpFactory> {
    tcp: TcpListener,
    qps: Rc<F>,
    timeout: Duration,
    in_flight: RefCell<FuturesUnordered<Attempt<F::Qp>>>,
    /// Handshakes that ended and were not returned yet (see
    /// `drain_finished`).
    finished: RefCell<VecDeque<AttemptResult<F::Qp>>>,
    /// Connections from sources at their cap, waiting out [`PARK_GRACE`].
    parked: RefCell<VecDeque<Parked>>,
    /// Wakes the listener when the first parked connection's grace ends.
    park_timer: RefCell<Option<Pin<Box<verbio_runtime::Sleep>>>>,
    limits: PendingLimits,
    /// Whether the current stretch of being full was logged.
    full_noted: Cell<bool>,
    /// When a failed client was last logged as a warning, and how many
    /// failed since.
    last_failure_warning: Cell<Option<Instant>>,
    failed_clients: Cell<u64>,
    backoff: RefCell<AcceptBackoff>,
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
        let tcp = TcpListener::bind(addr).map_err(HandshakeError::io("binding the listener"))?;
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
        let tcp = TcpListener::from_std(listener)
            .map_err(HandshakeError::io("registering the listening socket"))?;
        Ok(Listener::with_tcp(tcp, qps, timeout))
    }

    fn with_tcp(tcp: TcpListener, qps: F, timeout: Duration) -> Listener<F> {
        Listener {
            tcp,
            qps: Rc::new(qps),
            timeout,
            in_flight: RefCell::new(FuturesUnordered::new()),
            finished: RefCell::new(VecDeque::new()),
            parked: RefCell::new(VecDeque::new()),
            park_timer: RefCell::new(None),
            limits: PendingLimits::new(WHAT, DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_SOURCE),
            full_noted: Cell::new(false),
            last_failure_warning: Cell::new(None),
            failed_clients: Cell::new(0),
            backoff: RefCell::new(AcceptBackoff::new(WHAT)),
        }
    }

    /// Caps the handshakes running at once: `max_pending` in all,
    /// `max_per_source` from one IP address (each at least 1; defaults
    /// [`DEFAULT_MAX_PENDING`], [`DEFAULT_MAX_PENDING_PER_SOURCE`]).
    pub fn with_pending_caps(mut self, max_pending: usize, max_per_source: usize) -> Listener<F> {
        self.limits = PendingLimits::new(WHAT, max_pending, max_per_source);
        self
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, HandshakeError> {
        self.tcp
            .local_addr()
            .map_err(HandshakeError::io("querying the listener address"))
    }

    /// The next successful connection. Clients whose handshake fails (bad
    /// frames, other provider, timeout) are told why when possible, logged
    /// and skipped. Fails only if the listening socket itself fails.
    pub async fn accept(&self) -> Result<Connection<F::Qp>, HandshakeError> {
        loop {
            match self.next_handshake().await {
                Ok(c) => return Ok(c),
                Err(Failure::Listener(e)) => return Err(e),
                Err(Failure::Client(peer, e)) => self.log_failed_client(peer, &e),
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

    /// Logs a failed client: a warning at most once per
    /// [`FAILED_CLIENT_WARN_INTERVAL`] (with how many failed since the
    /// last), so that a flood of bad clients cannot flood the log; every
    /// one at `debug`.
    fn log_failed_client(&self, peer: SocketAddr, e: &HandshakeError) {
        let now = Instant::now();
        let failed = self.failed_clients.get() + 1;
        let due = self
            .last_failure_warning
            .get()
            .is_none_or(|t| now.duration_since(t) >= FAILED_CLIENT_WARN_INTERVAL);
        if due {
            tracing::warn!(%peer, error = %crate::error::ErrorChain(e), failed_clients = failed, "handshake failed; still listening (warned at most every {FAILED_CLIENT_WARN_INTERVAL:?}, each at debug)");
            self.last_failure_warning.set(Some(now));
            self.failed_clients.set(0);
        } else {
            tracing::debug!(%peer, error = %crate::error::ErrorChain(e), "handshake failed; still listening");
            self.failed_clients.set(failed);
        }
    }

    /// Handshakes that are running.
    pub fn in_flight(&self) -> usize {
        self.in_flight.borrow().len()
    }

    fn next_handshake(&self) -> impl Future<Output = Result<Connection<F::Qp>, Failure>> + '_ {
        poll_fn(move |cx| {
            // First let every handshake that can finish finish, so that the
            // slots of clients whose last frame is already here are free
            // before their next connections are counted (a client that
            // waited for its handshakes before dialing more is never refused
            // because this thread ran late).
            self.drain_finished(cx);
            let mut accepted = self.retry_parked(cx);
            // Start a handshake for every connection waiting in the backlog,
            // while under the caps.
            let mut backoff = self.backoff.borrow_mut();
            let mut taken = 0;
            while taken < ACCEPTS_PER_POLL {
                if !self.limits.has_room() {
                    if !self.full_noted.replace(true) {
                        self.limits.note_full();
                    }
                    break;
                }
                self.full_noted.set(false);
                match backoff.poll_accept(&self.tcp, cx) {
                    Poll::Ready(Ok((stream, peer))) => {
                        taken += 1;
                        if self.limits.would_admit(peer) {
                            accepted += usize::from(self.start(stream, peer));
                        } else {
                            self.park_or_refuse(stream, peer, cx);
                        }
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
            if taken == ACCEPTS_PER_POLL {
                // More may wait: come back after the other tasks.
                cx.waker().wake_by_ref();
            }
            if accepted > 0 {
                // The new handshakes' first poll sends the server's hello.
                self.drain_finished(cx);
            }
            match self.finished.borrow_mut().pop_front() {
                Some(r) => Poll::Ready(r.map_err(|(peer, e)| Failure::Client(peer, e))),
                None => Poll::Pending,
            }
        })
    }

    /// Starts the handshake of a connection under the caps, or refuses it
    /// (logged) when its source or the listener has no room; returns
    /// whether it started.
    fn start(&self, stream: TcpStream, peer: SocketAddr) -> bool {
        let slot = match self.limits.admit(peer) {
            Ok(slot) => slot,
            Err(refusal) => {
                refuse_now(stream, &refusal);
                return false;
            }
        };
        let span = setup_span("accept", peer);
        let attempt =
            handshake(stream, peer, self.qps.clone(), self.timeout, span.clone()).instrument(span);
        self.in_flight.borrow_mut().push(Box::pin(async move {
            let r = attempt.await.map_err(|e| (peer, e));
            drop(slot);
            r
        }));
        true
    }

    /// A connection from a source at its cap waits up to [`PARK_GRACE`]
    /// for one of that source's handshakes to end (its last frame may be
    /// here already, its readiness not yet seen by this thread), at most
    /// [`MAX_PARKED`] at once; else, or then, it is refused.
    fn park_or_refuse(&self, stream: TcpStream, peer: SocketAddr, cx: &mut Context<'_>) {
        if self.parked.borrow().len() >= MAX_PARKED {
            self.start(stream, peer);
            return;
        }
        self.parked.borrow_mut().push_back(Parked {
            stream,
            peer,
            until: Instant::now() + PARK_GRACE,
        });
        self.arm_park_timer(cx);
    }

    /// Starts the parked connections whose source has room again and
    /// refuses those whose grace ended; returns how many started.
    fn retry_parked(&self, cx: &mut Context<'_>) -> usize {
        if self.parked.borrow().is_empty() {
            return 0;
        }
        let now = Instant::now();
        let mut started = 0;
        let waiting = std::mem::take(&mut *self.parked.borrow_mut());
        for p in waiting {
            if now >= p.until || self.limits.would_admit(p.peer) {
                started += usize::from(self.start(p.stream, p.peer));
            } else {
                self.parked.borrow_mut().push_back(p);
            }
        }
        self.arm_park_timer(cx);
        started
    }

    /// Wakes the listener when the oldest parked connection's grace ends.
    fn arm_park_timer(&self, cx: &mut Context<'_>) {
        let Some(until) = self.parked.borrow().front().map(|p| p.until) else {
            return;
        };
        let mut timer = self.park_timer.borrow_mut();
        if timer.as_ref().is_none_or(|t| t.deadline() != until) {
            *timer = Some(Box::pin(verbio_runtime::sleep_until(until)));
        }
        if let Some(t) = timer.as_mut() {
            if t.as_mut().poll(cx).is_ready() {
                // Due already: the next poll refuses it.
                cx.waker().wake_by_ref();
            }
        }
    }

    /// Polls the running handshakes until none is ready, keeping the ones
    /// that ended (in the order they ended) for `next_handshake` to return.
    /// At most the pending cap of them are kept: each was a pending
    /// handshake a moment ago.
    fn drain_finished(&self, cx: &mut Context<'_>) {
        let mut in_flight = self.in_flight.borrow_mut();
        let mut finished = self.finished.borrow_mut();
        while let Poll::Ready(Some(r)) = in_flight.poll_next_unpin(cx) {
            finished.push_back(r);
        }
    }
}

/// Connections accepted in one poll before the listener lets other tasks run.
const ACCEPTS_PER_POLL: usize = 256;

/// How long a connection from a source at its cap waits for one of the
/// source's handshakes to end before it is refused.
pub const PARK_GRACE: Duration = Duration::from_millis(100);

/// Connections waiting out [`PARK_GRACE`] at once (more are refused at
/// once).
const MAX_PARKED: usize = 32;

/// A connection from a source at its cap, accepted from the kernel and
/// waiting for its source to have room (see `park_or_refuse`).
struct Parked {
    stream: TcpStream,
    peer: SocketAddr,
    until: Instant,
}

/// Refuses a connection over its source's cap at once: a reject frame
/// without waiting (a fresh connection's send buffer takes it), then close.
fn refuse_now(mut stream: TcpStream, refusal: &PendingRefusal) {
    use futures::io::{AsyncRead, AsyncWrite};
    let frame = super::handshake::encode_reject(&refusal.to_string());
    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
    // Unread bytes at close would turn the FIN into a reset.
    let mut scratch = [0u8; 1024];
    for _ in 0..4 {
        match Pin::new(&mut stream).poll_read(&mut cx, &mut scratch) {
            Poll::Ready(Ok(n)) if n > 0 => continue,
            _ => break,
        }
    }
    let _ = Pin::new(&mut stream).poll_write(&mut cx, &frame);
    let _ = Pin::new(&mut stream).poll_close(&mut cx);
}

/// Why `next_handshake` returned without a connection.
enum Failure {
    Listener(HandshakeError),
    Client(SocketAddr, HandshakeError),
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
    let local_tcp = stream
        .local_addr()
        .map_err(HandshakeError::io("reading the local TCP address"))?;
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
            let local = advertised(local, local_tcp);
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
mod attacks;
#[cfg(test)]
mod tests;
