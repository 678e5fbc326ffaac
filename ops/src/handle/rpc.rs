//! [`RpcHandle`]: an [`Rpc`] endpoint on a pool thread, calling from any
//! thread.

use std::future::Future;
use std::pin::pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;

use verbio_runtime::pool::{
    mailbox, Completer, MailReceiver, MailSender, Placement, Pool, ShutdownSignal, SlotCache,
    ThreadContext, ThreadRef,
};

use super::workers::{Serve, Workers};
use super::HandleError;
use crate::rpc::{Rpc, RpcAddr, RpcError, SessionId, Transport};

/// Requests queued per endpoint before callers wait for room.
const QUEUE_DEPTH: usize = 256;

/// Calls under way at once per endpoint (the engine itself queues calls
/// beyond a session's slots).
const MAX_WORKERS: usize = 64;

enum RpcRequest {
    Connect {
        remote: Vec<u8>,
        done: Completer<Result<SessionId, RpcError>>,
    },
    Call {
        session: SessionId,
        req_type: u8,
        req: Vec<u8>,
        done: Completer<Result<Vec<u8>, RpcError>>,
    },
    Disconnect {
        session: SessionId,
    },
}

struct RpcShared {
    thread: ThreadRef,
    tx: MailSender<RpcRequest>,
    calls: SlotCache<Result<Vec<u8>, RpcError>>,
    local_addr: RpcAddr,
}

/// An [`Rpc`] endpoint living on a pool thread, usable from any thread:
/// `Send + Sync + Clone`, its futures `Send`. The endpoint's handlers (its
/// server side) are registered where it is made, on its thread; the
/// handle calls and connects (its client side). The endpoint stays up
/// while a clone of the handle lives (or until the pool shuts down).
#[derive(Clone)]
pub struct RpcHandle {
    inner: Arc<RpcShared>,
}

impl std::fmt::Debug for RpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcHandle")
            .field("thread", &self.inner.thread.index())
            .field("local_addr", &self.inner.local_addr)
            .finish()
    }
}

impl RpcHandle {
    /// Makes an endpoint on the pool thread `placement` names: `make`
    /// runs there (with the thread's device, say for a `UdTransport`) and
    /// may register handlers before returning it. Its error comes back as
    /// the source of [`HandleError::Setup`], typed (downcast it).
    pub async fn start<F, T, E>(
        pool: &Pool,
        placement: Placement,
        make: F,
    ) -> Result<RpcHandle, HandleError>
    where
        F: FnOnce(&ThreadContext) -> Result<Rpc<T>, E> + Send + 'static,
        T: Transport + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let h = pool.spawn(placement, move |cx| {
            let r = make(cx)
                .map(|rpc| start(cx, rpc))
                .map_err(|e| HandleError::Setup {
                    what: "making the RPC endpoint",
                    source: e.into(),
                });
            std::future::ready(r)
        });
        h.await?
    }

    /// The endpoint's address, for the peers' `connect`.
    pub fn local_addr(&self) -> &RpcAddr {
        &self.inner.local_addr
    }

    /// The runtime thread the endpoint lives on.
    pub fn thread(&self) -> &ThreadRef {
        &self.inner.thread
    }

    /// Opens a session to the endpoint at `remote` ([`Rpc::connect`]).
    pub async fn connect(&self, remote: &[u8]) -> Result<SessionId, HandleError> {
        let (done, answer) = verbio_runtime::pool::slot();
        let remote = remote.to_vec();
        self.queue(RpcRequest::Connect { remote, done }).await?;
        match answer.await {
            Ok(r) => r.map_err(|source| HandleError::Rpc {
                what: "connect",
                source,
            }),
            Err(_lost) => Err(self.inner.thread.lost_error().into()),
        }
    }

    /// Calls `req_type` with `req` on `session` ([`Rpc::call`]); the
    /// response comes back as a vector.
    pub async fn call(
        &self,
        session: SessionId,
        req_type: u8,
        req: Vec<u8>,
    ) -> Result<Vec<u8>, HandleError> {
        let inner = &self.inner;
        let (done, mut answer) = inner.calls.pair();
        self.queue(RpcRequest::Call {
            session,
            req_type,
            req,
            done,
        })
        .await?;
        let r = (&mut answer).await;
        inner.calls.give_back(answer);
        match r {
            Ok(r) => r.map_err(|source| HandleError::Rpc {
                what: "call",
                source,
            }),
            Err(_lost) => Err(inner.thread.lost_error().into()),
        }
    }

    /// Closes `session` ([`Rpc::disconnect`]); queued, not awaited.
    pub fn disconnect(&self, session: SessionId) {
        // A closed endpoint has no session to close.
        let _ = self.inner.tx.try_send(RpcRequest::Disconnect { session });
    }

    async fn queue(&self, req: RpcRequest) -> Result<(), HandleError> {
        if self.inner.tx.send(req).await.is_ok() {
            return Ok(());
        }
        Err(match self.inner.thread.check() {
            Err(e) => e.into(),
            Ok(()) => HandleError::EndpointClosed,
        })
    }
}

struct RpcServer<T: Transport> {
    rpc: Rpc<T>,
    workers: Rc<Workers<RpcRequest>>,
}

impl<T: Transport + 'static> Serve<RpcRequest> for RpcServer<T> {
    async fn serve(self: &Rc<Self>, req: RpcRequest) {
        match req {
            RpcRequest::Connect { remote, done } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.rpc.connect(&remote).await;
                done.complete(r);
            }
            RpcRequest::Call {
                session,
                req_type,
                req,
                done,
            } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.rpc.call(session, req_type, &req).await;
                done.complete(r.map(|m| m.to_vec()));
            }
            RpcRequest::Disconnect { .. } => unreachable!("served by the endpoint's task"),
        }
    }
}

fn start<T: Transport + 'static>(cx: &ThreadContext, rpc: Rpc<T>) -> RpcHandle {
    let (tx, rx) = mailbox(QUEUE_DEPTH);
    let inner = Arc::new(RpcShared {
        thread: cx.thread().clone(),
        tx,
        calls: SlotCache::new(64).reply_spin(cx.thread().reply_spin()),
        local_addr: rpc.local_addr(),
    });
    let server = Rc::new(RpcServer {
        rpc,
        workers: Rc::new(Workers::new(MAX_WORKERS)),
    });
    verbio_runtime::spawn(serve(server, rx, cx.shutdown_signal()));
    RpcHandle { inner }
}

/// The endpoint's task: routes requests to the workers until every handle
/// is gone or the pool shuts down (queued requests are still served).
async fn serve<T: Transport + 'static>(
    server: Rc<RpcServer<T>>,
    rx: MailReceiver<RpcRequest>,
    shutdown: ShutdownSignal,
) {
    let mut shutdown = pin!(shutdown);
    let mut stopping = false;
    std::future::poll_fn(|cx| {
        if !stopping && shutdown.as_mut().poll(cx).is_ready() {
            stopping = true;
            rx.close();
        }
        loop {
            match rx.poll_recv(cx) {
                Poll::Ready(Some(RpcRequest::Disconnect { session })) => {
                    server.rpc.disconnect(session)
                }
                Poll::Ready(Some(req)) => server.workers.push(req),
                Poll::Ready(None) => return Poll::Ready(()),
                Poll::Pending => {
                    server.workers.kick(&server);
                    return Poll::Pending;
                }
            }
        }
    })
    .await;
    server.workers.kick(&server);
    server.workers.close();
}
