//! [`Rpc`]: the endpoint, its dispatcher task and its handler tasks.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::rc::Rc;
use std::task::Poll;

use tracing::info;

use super::addr::RpcAddr;
use super::buf::MsgBuf;
use super::call::{Call, CallReq};
use super::config::RpcConfig;
use super::dispatcher::Engine;
use super::engine::handlers::Work;
use super::engine::{Core, HandlerQueue, RpcMemory, RpcStats};
use super::error::{RpcError, SessionId};
use super::header::{HEADER_LEN, MAX_PACKET, MIN_PACKET};
use super::request::Request;
use super::runner::{HandlerRunner, Runner};
use super::session::{Role, Session, SessionState};
use super::transport::Transport;

/// An RPC endpoint on one runtime thread: sessions to servers (as a
/// client), sessions from clients (as a server), and the handlers.
///
/// Create it inside a verbio runtime: it spawns its dispatcher task (and
/// handler tasks at [`register`](Rpc::register)); they end when it is
/// dropped.
///
/// # Example
///
/// A server thread serving an echo until it is told to stop, and a client
/// that gets the server's address in its text form (as another process
/// would: on its command line, say), both on UD queue pairs of software
/// devices.
///
/// ```
/// # mod verbio { pub use verbio_ops::*; pub mod ops { pub use verbio_ops::*; } pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use std::error::Error;
/// use std::sync::mpsc;
///
/// use futures::channel::oneshot;
/// use verbio::provider::{Context, SoftConfig};
/// use verbio::rpc::ud::{UdConfig, UdTransport};
/// use verbio::rpc::{Request, Rpc, RpcAddr, RpcConfig};
/// use verbio::runtime::{Device, Runtime};
///
/// // verbio's errors are `Send + Sync`: they cross threads with `?`.
/// type BoxError = Box<dyn Error + Send + Sync>;
///
/// const ECHO: u8 = 1;
///
/// /// An endpoint on a UD queue pair of a new software device.
/// fn endpoint() -> Result<Rpc<UdTransport>, BoxError> {
///     let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
///     let transport = UdTransport::new(&dev, &UdConfig::default())?;
///     Ok(Rpc::new(transport, RpcConfig::default()))
/// }
///
/// /// Serves ECHO, hands out its address as text, stops when told.
/// fn server(addr: mpsc::Sender<String>, stop: oneshot::Receiver<()>) -> Result<(), BoxError> {
///     Runtime::new()?.block_on(async {
///         let rpc = endpoint()?;
///         rpc.register(ECHO, |req: Request| {
///             let mut resp = req.response();
///             resp.extend_from_slice(req.data());
///             async move { resp }
///         })?;
///         addr.send(rpc.local_addr().to_string())?; // "rpc:56524249…"
///         let _ = rpc.serve_until(stop).await;
///         Ok(())
///     })
/// }
///
/// # fn main() -> Result<(), BoxError> {
/// let (addr_tx, addr_rx) = mpsc::channel();
/// let (stop, stopped) = oneshot::channel();
/// // The server's error, typed, comes back through `join`.
/// let thread = std::thread::spawn(move || server(addr_tx, stopped));
///
/// let addr: RpcAddr = addr_rx.recv()?.parse()?;
/// Runtime::new()?.block_on(async {
///     let rpc = endpoint()?;
///     let session = rpc.connect(&addr).await?;
///     let resp = rpc.call(session, ECHO, b"ping").await?;
///     assert_eq!(&resp[..], b"ping");
///     Ok::<_, BoxError>(())
/// })?;
/// let _ = stop.send(());
/// thread.join().expect("the server thread")?;
/// # Ok(())
/// # }
/// ```
pub struct Rpc<T: Transport> {
    engine: Rc<RefCell<Engine<T>>>,
}

impl<T: Transport> std::fmt::Debug for Rpc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rpc").field("stats", &self.stats()).finish()
    }
}

impl<T: Transport> Rpc<T> {
    /// An endpoint over `transport`.
    ///
    /// # Panics
    ///
    /// Without a verbio runtime on this thread, or if the transport's
    /// packet size is outside 64..=65567 bytes.
    pub fn new(transport: T, mut config: RpcConfig) -> Rpc<T> {
        let max_packet = transport.max_packet();
        assert!(
            (MIN_PACKET as usize..=MAX_PACKET as usize).contains(&max_packet),
            "rpc: the transport's packet size {max_packet} is outside {MIN_PACKET}..={MAX_PACKET}"
        );
        config.normalize();
        let local_addr = transport.local_addr();
        let mut transport = transport;
        let mut core = Core::new(config, max_packet, local_addr);
        core.bulk = transport.bulk();
        let engine = Rc::new(RefCell::new(Engine { transport, core }));
        let weak = Rc::downgrade(&engine);
        verbio_runtime::spawn(poll_fn(move |cx| match weak.upgrade() {
            Some(e) => Engine::poll_dispatch(&e, cx),
            None => Poll::Ready(()),
        }));
        let weak = Rc::downgrade(&engine);
        verbio_runtime::spawn(poll_fn(move |cx| match weak.upgrade() {
            Some(e) => e.borrow_mut().poll_timers(cx),
            None => Poll::Ready(()),
        }));
        Rpc { engine }
    }

    /// This endpoint's address, for the peers' [`connect`](Rpc::connect).
    ///
    /// To give it to another process, hand over its text form
    /// (`addr.to_string()`, `rpc:` + hex: on a command line, in a file, on
    /// a line of a TCP stream) and parse it there
    /// (`text.parse::<RpcAddr>()`, or [`RpcAddr::read_from`] a stream).
    pub fn local_addr(&self) -> RpcAddr {
        RpcAddr::from(self.engine.borrow().core.local_addr.clone())
    }

    /// Largest payload per packet: messages up to it travel in one packet.
    pub fn max_payload(&self) -> usize {
        self.engine.borrow().core.max_packet - HEADER_LEN
    }

    /// Runs `f` on the transport (for its counters, say).
    pub fn with_transport<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.engine.borrow().transport)
    }

    /// Counters.
    pub fn stats(&self) -> RpcStats {
        self.engine.borrow().core.stats
    }

    /// What the endpoint holds now (gauges, unlike the counters of
    /// [`stats`](Rpc::stats)).
    pub fn memory(&self) -> RpcMemory {
        self.engine.borrow().core.memory()
    }

    /// Serves requests of `req_type` with `handler`, run in
    /// [`handler_tasks`](RpcConfig::handler_tasks) tasks on the runtime;
    /// each request's response is sent when its handler's future completes.
    ///
    /// The dispatcher starts each request's future in an idle task's slot
    /// and polls it once (with that task's waker, holding no borrow of the
    /// endpoint): a future ready at once is answered there and then, with
    /// no task run; one that waits is polled on by its task. Requests
    /// beyond the tasks wait for one to finish.
    ///
    /// Fails with [`RpcError::HandlerExists`] (and changes nothing) if
    /// `req_type` has a handler already.
    pub fn register<H, F>(&self, req_type: u8, handler: H) -> Result<(), RpcError>
    where
        H: Fn(Request) -> F + 'static,
        F: Future<Output = MsgBuf> + 'static,
    {
        let tasks = {
            let mut e = self.engine.borrow_mut();
            let entry = &mut e.core.handlers[usize::from(req_type)];
            if entry.is_some() {
                return Err(RpcError::HandlerExists { req_type });
            }
            *entry = Some(HandlerQueue::default());
            e.core.config.handler_tasks.max(1)
        };
        let handler = Rc::new(handler);
        for _ in 0..tasks {
            let weak = Rc::downgrade(&self.engine);
            let runner: Rc<dyn Runner> = Rc::new(HandlerRunner::new(handler.clone()));
            verbio_runtime::spawn(async move {
                // Idle here until the dispatcher starts a request in this
                // task's slot; most finish then, answered by the
                // dispatcher, and this task never runs for them.
                while let Some(work) = poll_fn(|cx| match weak.upgrade() {
                    Some(e) => e.borrow_mut().core.poll_work(req_type, &runner, cx),
                    None => Poll::Ready(None),
                })
                .await
                {
                    let (id, outcome) = match work {
                        Work::Resume(id) => (id, poll_fn(|cx| runner.resume(cx)).await),
                        Work::Start(id, request) => {
                            let mut request = Some(request);
                            let outcome = poll_fn(|cx| match request.take() {
                                Some(request) => runner.start(request, cx),
                                None => runner.resume(cx),
                            })
                            .await;
                            (id, outcome)
                        }
                    };
                    let Some(e) = weak.upgrade() else {
                        return;
                    };
                    let mut e = e.borrow_mut();
                    match outcome {
                        Ok(resp) => e.core.respond(id.session, id.slot, id.req_num, resp),
                        Err(()) => e.core.handler_panicked(id.session, id.slot, id.req_num),
                    }
                    e.flush_after_handler();
                }
            });
        }
        Ok(())
    }

    /// Serves requests of `req_type` with `handler`, a plain function run
    /// by the endpoint's dispatcher as each request is complete (the way
    /// eRPC runs its handlers): no task and no hand-over per request, so a
    /// small call costs less CPU than with [`register`](Rpc::register).
    /// For handlers that answer at once: one that must wait (for I/O,
    /// another call) belongs in `register`, and while it runs no other
    /// packet of this endpoint is taken. It must not use this endpoint
    /// (that would panic, failing the call with
    /// [`Status::HandlerPanicked`](super::header::Status::HandlerPanicked)).
    ///
    /// Fails with [`RpcError::HandlerExists`] (and changes nothing) if
    /// `req_type` has a handler already.
    pub fn register_inline<H>(&self, req_type: u8, handler: H) -> Result<(), RpcError>
    where
        H: Fn(Request) -> MsgBuf + 'static,
    {
        let mut e = self.engine.borrow_mut();
        let entry = &mut e.core.handlers[usize::from(req_type)];
        if entry.is_some() {
            return Err(RpcError::HandlerExists { req_type });
        }
        *entry = Some(HandlerQueue {
            inline: Some(Rc::new(handler)),
            ..HandlerQueue::default()
        });
        Ok(())
    }

    /// Serves the [`register`](Rpc::register)ed handlers until `stop`
    /// completes, and returns its output.
    ///
    /// The endpoint serves from its creation for as long as it lives and
    /// its runtime runs; this is the call a server's `block_on` ends with:
    /// `stop` is what ends the serving, e.g. the receiving end of a
    /// `futures::channel::oneshot` whose sender another thread (a signal
    /// handler, say) fires, or [`std::future::pending`] to serve for
    /// ever. It logs the address served and, at the end, the counters.
    /// Dropping the endpoint afterwards closes its sessions.
    pub async fn serve_until<F: Future>(&self, stop: F) -> F::Output {
        info!(addr = %self.local_addr(), "rpc: serving");
        let out = stop.await;
        let stats = self.stats();
        info!(
            handler_runs = stats.handler_runs,
            handler_panics = stats.handler_panics,
            sessions_expired = stats.sessions_expired,
            "rpc: stopped serving"
        );
        out
    }

    /// Slots of the session table, open or free (tests).
    #[cfg(test)]
    pub(crate) fn session_slots(&self) -> usize {
        self.engine.borrow().core.sessions.capacity()
    }

    /// Whether `session`'s RC link is ready (tests).
    #[cfg(test)]
    pub(crate) fn link_ready(&self, session: SessionId) -> bool {
        let e = self.engine.borrow();
        e.core
            .sessions
            .get(session.0)
            .is_some_and(|s| s.link_ready().is_some())
    }

    /// Work the engine counted (tests).
    #[cfg(test)]
    pub(crate) fn work_counts(&self) -> super::engine::WorkCounts {
        self.engine.borrow().core.work
    }

    /// Server sessions open (tests).
    #[cfg(test)]
    pub(crate) fn server_sessions(&self) -> usize {
        self.engine.borrow().core.server_sessions
    }

    /// Opens a session to the endpoint at `remote` (its
    /// [`local_addr`](Rpc::local_addr)).
    pub async fn connect(&self, remote: &[u8]) -> Result<SessionId, RpcError> {
        let sid = {
            let mut e = self.engine.borrow_mut();
            let peer = e.transport.resolve(remote)?;
            let now = e.core.now;
            let max_payload = e.core.max_packet - HEADER_LEN;
            let state = SessionState::Connecting {
                retries: 0,
                last: now,
            };
            let mut session = Session::new(Role::Client, state, peer, max_payload);
            session.credits = e.core.config.session_credits;
            session.connect_id = e.core.nonce.wrapping_add(e.core.connects_made);
            e.core.connects_made += 1;
            let Some(sid) = e.core.add_session(session) else {
                return Err(RpcError::TooManySessions {
                    max: super::table::MAX_SESSIONS,
                });
            };
            e.core.send_connect(sid);
            e.core.want_timer();
            e.flush();
            sid
        };
        let session = SessionId(sid);
        poll_fn(|cx| {
            let mut e = self.engine.borrow_mut();
            let retries = e.core.config.max_retries;
            let Some(s) = e.core.sessions.get_mut(sid) else {
                return Poll::Ready(Err(RpcError::SessionClosed { session }));
            };
            match s.state {
                SessionState::Connected => Poll::Ready(Ok(session)),
                SessionState::Failed => {
                    e.core.close_session(sid);
                    Poll::Ready(Err(RpcError::ConnectTimeout { session, retries }))
                }
                SessionState::Connecting { .. } => {
                    s.connect_waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Calls `req_type` with `req` on `session` and returns the response.
    ///
    /// At most 8 calls per session are under way; more wait for a slot.
    /// Lost packets are sent again after [`RpcConfig::rto`]; a peer that
    /// stopped answering fails the call with [`RpcError::Timeout`] after
    /// [`RpcConfig::max_retries`] retransmissions. Dropping the future
    /// abandons the call (its slot frees when the call ends).
    pub fn call<'a>(
        &'a self,
        session: SessionId,
        req_type: u8,
        req: &'a [u8],
    ) -> impl Future<Output = Result<MsgBuf, RpcError>> + 'a {
        Call::new(&self.engine, session.0, req_type, CallReq::Copy(req))
    }

    /// Calls as [`call`](Self::call) with a request in a buffer of its
    /// own, which the call keeps instead of copying the request out of it
    /// (it goes back to the endpoint's pool when the session's slot serves
    /// a later call). A response, or a buffer from
    /// [`Request::into_data`], can be sent on so without a copy. The
    /// buffer is consumed whatever the outcome.
    pub fn call_owned(
        &self,
        session: SessionId,
        req_type: u8,
        req: MsgBuf,
    ) -> impl Future<Output = Result<MsgBuf, RpcError>> + '_ {
        let req = CallReq::Owned(Some(req.into_vec()));
        Call::new(&self.engine, session.0, req_type, req)
    }

    /// Closes `session` (telling the peer); its calls fail with
    /// [`RpcError::SessionClosed`].
    pub fn disconnect(&self, session: SessionId) {
        let mut e = self.engine.borrow_mut();
        e.core.disconnect(session.0);
        e.flush();
    }
}
