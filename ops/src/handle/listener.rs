//! [`ListenerHandle`]: an [`RdmaListener`] on a pool thread, accepting
//! from any thread.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use futures::future::{select, Either};
use verbio_runtime::pool::{
    mailbox, Completer, MailReceiver, MailSender, Placement, Pool, ShutdownSignal, SlotCache,
    ThreadRef,
};

use super::rdma::thread_builder;
use super::serve::start;
use super::{HandleError, RdmaHandle};
use crate::agent::{AgentError, CloseReason, RdmaBuilder, RdmaListener};

type Accepted = Result<RdmaHandle, AgentError>;

/// Accepts queued per listener before callers wait for room.
const ACCEPT_QUEUE: usize = 64;

struct ListenerShared {
    thread: ThreadRef,
    tx: MailSender<Completer<Accepted>>,
    slots: SlotCache<Accepted>,
    local_addr: SocketAddr,
}

/// An [`RdmaListener`] living on a pool thread: `Send + Sync + Clone`.
/// The connections it accepts live on the same thread. The listener
/// closes when its last clone is dropped (or the pool shuts down).
#[derive(Clone)]
pub struct ListenerHandle {
    inner: Arc<ListenerShared>,
}

impl std::fmt::Debug for ListenerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerHandle")
            .field("thread", &self.inner.thread.index())
            .field("local_addr", &self.inner.local_addr)
            .finish()
    }
}

impl ListenerHandle {
    /// Listens on `addr` (port 0: an ephemeral port) on the pool thread
    /// `placement` names, with the default settings and the thread's
    /// device (if the pool has one).
    pub async fn bind(
        pool: &Pool,
        placement: Placement,
        addr: SocketAddr,
    ) -> Result<ListenerHandle, HandleError> {
        Self::bind_with(pool, placement, addr, |b| b).await
    }

    /// [`bind`](Self::bind) with settings: `configure` gets the builder
    /// (with the thread's device set, if the pool has one) on the runtime
    /// thread.
    pub async fn bind_with<F>(
        pool: &Pool,
        placement: Placement,
        addr: SocketAddr,
        configure: F,
    ) -> Result<ListenerHandle, HandleError>
    where
        F: FnOnce(RdmaBuilder) -> RdmaBuilder + Send + 'static,
    {
        let h = pool.spawn(placement, move |cx| {
            let r = configure(thread_builder(cx))
                .listen(addr)
                .and_then(|listener| {
                    let local_addr = listener.local_addr()?;
                    let (tx, rx) = mailbox(ACCEPT_QUEUE);
                    let inner = Arc::new(ListenerShared {
                        thread: cx.thread().clone(),
                        tx,
                        slots: SlotCache::new(8),
                        local_addr,
                    });
                    let thread = cx.thread().clone();
                    verbio_runtime::spawn(serve(listener, rx, thread, cx.shutdown_signal()));
                    Ok(ListenerHandle { inner })
                });
            std::future::ready(r)
        });
        Ok(h.await??)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The runtime thread the listener (and its connections) live on.
    pub fn thread(&self) -> &ThreadRef {
        &self.inner.thread
    }

    /// The next connection ([`RdmaListener::accept`]: a client that fails
    /// its handshake fails this call only). Cancel-safe: dropped while
    /// waiting, it leaves the next connection to the next `accept`.
    pub async fn accept(&self) -> Result<RdmaHandle, HandleError> {
        let inner = &self.inner;
        let (done, mut answer) = inner.slots.pair();
        if inner.tx.send(done).await.is_err() {
            return Err(match inner.thread.check() {
                Err(e) => e.into(),
                Ok(()) => AgentError::Closed(CloseReason::Local).into(),
            });
        }
        let r = (&mut answer).await;
        inner.slots.give_back(answer);
        match r {
            Ok(accepted) => Ok(accepted?),
            Err(_lost) => Err(inner.thread.lost_error().into()),
        }
    }
}

/// The listener's task: serves accepts one at a time until every handle
/// is gone or the pool shuts down.
async fn serve(
    listener: RdmaListener,
    rx: MailReceiver<Completer<Accepted>>,
    thread: ThreadRef,
    shutdown: ShutdownSignal,
) {
    let mut shutdown = pin!(shutdown);
    loop {
        let next = std::future::poll_fn(|cx| {
            if shutdown.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            rx.poll_recv(cx)
        })
        .await;
        let Some(done) = next else { break };
        if done.is_abandoned() {
            continue;
        }
        let accepted = {
            let accept = pin!(listener.accept());
            let abandoned = pin!(done.abandoned());
            let stop = select(abandoned, shutdown.as_mut());
            match select(accept, stop).await {
                Either::Left((r, _)) => Some(r),
                Either::Right(_) => None,
            }
        };
        match accepted {
            Some(Ok(rdma)) => {
                let h = start(thread.clone(), shutdown.as_ref().get_ref().clone(), rdma);
                done.complete(Ok(h));
            }
            Some(Err(e)) => done.complete(Err(e)),
            None => {}
        }
    }
    // Accepts still queued are answered (the mailbox drops with us).
    rx.close();
    while let Poll::Ready(Some(done)) = rx.poll_recv(&mut std::task::Context::from_waker(
        futures::task::noop_waker_ref(),
    )) {
        done.complete(Err(AgentError::Closed(CloseReason::Local)));
    }
}
