//! The runtime thread's side of an [`RdmaHandle`](super::RdmaHandle): the
//! connection's server task, which takes the requests from the mailbox and
//! hands them to workers (local tasks, reused: no task per request), the
//! ordered sender task (sends answered at hand-over, and streams' messages,
//! one at a time in order), and the read-ahead task that receives the
//! connection's messages into the handles' inbox.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::pin;
use std::rc::Rc;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};

use futures::future::{select, Either};
use verbio_runtime::pool::{
    inbox, mailbox, Completer, Feeder, MailReceiver, ShutdownSignal, ThreadRef,
};

use super::direct::DirectServer;
use super::rdma::{ConnShared, RdmaHandle, QUEUE_DEPTH};
use super::remote::{RemoteEntry, RemoteMrHandle};
use super::workers::{Serve, Workers};
use super::HandleError;
use crate::agent::wire::MrToken;
use crate::agent::{AgentError, CloseReason, Rdma, RemoteMr};
use std::collections::HashMap;

/// Workers per connection at most: the requests in flight at once (beyond
/// the receives and the ordered sends, served by their own tasks).
const MAX_WORKERS: usize = 64;

/// Messages the read-ahead task keeps received for the handles at most...
const READ_AHEAD_MESSAGES: usize = 64;
/// ... and bytes (past the first message, which always fits).
const READ_AHEAD_BYTES: usize = 1 << 20;

/// A received message (and its immediate), or why the receive failed.
pub(crate) type Received = Result<(Vec<u8>, Option<u32>), HandleError>;

/// What a request is answered with.
pub(crate) type Reply = Result<Done, HandleError>;

/// A successful answer.
pub(crate) enum Done {
    Unit,
    Bytes(Vec<u8>),
    /// An atomic's previous value, or a WRITE's immediate.
    Word(u64),
    Remote(RemoteMrHandle),
    Token(MrToken),
    Tagged(Box<Done>, u64),
}

/// A request from a handle.
pub(crate) enum Request {
    Send {
        data: Vec<u8>,
        imm: Option<u32>,
        done: Completer<Reply>,
    },
    /// A message sent one at a time in the order asked, and sent even if
    /// its asker is gone (the bytes were handed over): a stream's, or a
    /// send answered at hand-over (`done` is `None`: a failure is kept
    /// for the handle's next send or flush).
    SendInOrder {
        data: Vec<u8>,
        imm: Option<u32>,
        done: Option<Completer<Reply>>,
    },
    /// Answered once every message queued for sending in order before it
    /// is done.
    Flush {
        done: Completer<Reply>,
    },
    AskRemote {
        len: usize,
        done: Completer<Reply>,
    },
    Write {
        remote: Arc<RemoteEntry>,
        offset: u64,
        data: Vec<u8>,
        imm: Option<u32>,
        done: Completer<Reply>,
    },
    /// A 64-bit atomic on the word at `offset`.
    Atomic {
        remote: Arc<RemoteEntry>,
        offset: u64,
        op: AtomicOp,
        done: Completer<Reply>,
    },
    /// The immediate of the peer's next WRITE_WITH_IMM.
    ReceiveWriteImm {
        done: Completer<Reply>,
    },
    Read {
        remote: Arc<RemoteEntry>,
        offset: u64,
        len: usize,
        done: Completer<Reply>,
    },
    /// Grant this side's memory to the peer.
    SendLocal {
        data: Vec<u8>,
        tag: u64,
        done: Completer<Reply>,
    },
    /// Hand a grant of the peer's back to it.
    SendRemote {
        remote: Arc<RemoteEntry>,
        tag: u64,
        done: Completer<Reply>,
    },
    /// The next grant the peer hands over (with `tag`, or any).
    ReceiveRemote {
        tag: Option<u64>,
        done: Completer<Reply>,
    },
    /// The next of this side's grants the peer hands back.
    ReceiveLocal {
        tag: Option<u64>,
        done: Completer<Reply>,
    },
    /// The last holder of a remote MR handle is gone.
    Release {
        id: u64,
    },
}

/// What the ordered sender task sends (or answers) in turn.
enum Ordered {
    Send {
        data: Vec<u8>,
        imm: Option<u32>,
        done: Option<Completer<Reply>>,
    },
    Flush(Completer<Reply>),
}

/// A remote atomic's operation.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AtomicOp {
    CompareAndSwap { compare: u64, swap: u64 },
    FetchAndAdd { add: u64 },
}

/// Starts serving `rdma` on this (a pool) thread; returns its handle.
pub(super) fn start(thread: ThreadRef, shutdown: ShutdownSignal, rdma: Rdma) -> RdmaHandle {
    let (tx, rx) = mailbox(QUEUE_DEPTH);
    let (feeder, arrived) = inbox(READ_AHEAD_MESSAGES, READ_AHEAD_BYTES);
    let (max_send_len, handover_max) = (rdma.max_send_len(), rdma.inline_send_max());
    let mut made = None;
    let conn = Arc::new_cyclic(|weak| {
        let server = Rc::new(Server {
            rdma,
            conn: weak.clone(),
            remotes: RefCell::new(HashMap::new()),
            next_remote: Cell::new(0),
            workers: Rc::new(Workers::new(MAX_WORKERS)),
            ordered: RefCell::new(VecDeque::new()),
            sender: RefCell::new(None),
            closing: RefCell::new(Vec::new()),
            closed: Cell::new(false),
        });
        let direct = thread
            .is_hosted()
            .then(|| DirectServer::new(Rc::as_ptr(&server)));
        made = Some(server);
        ConnShared::new(thread, tx, arrived, max_send_len, handover_max, direct)
    });
    let server = made.expect("made by the closure above");
    verbio_runtime::spawn(server.clone().read_ahead_loop(feeder));
    verbio_runtime::spawn(server.clone().ordered_send_loop());
    verbio_runtime::spawn(serve(server, rx, shutdown));
    RdmaHandle { conn }
}

pub(super) struct Server {
    rdma: Rdma,
    /// The handles' shared part (weak: the handles own it; when the last
    /// goes, the mailbox ends and so does the server).
    conn: Weak<ConnShared>,
    /// The peer's grants held for `RemoteMrHandle`s.
    remotes: RefCell<HashMap<u64, RemoteMr>>,
    next_remote: Cell<u64>,
    /// Every request but receives and releases.
    workers: Rc<Workers<Request>>,
    /// Messages to send in order (and flushes), and the task sending them.
    ordered: RefCell<VecDeque<Ordered>>,
    sender: RefCell<Option<Waker>>,
    /// Tasks to wake when the server closes.
    closing: RefCell<Vec<Waker>>,
    closed: Cell<bool>,
}

/// The server task: routes requests until the mailbox ends (every handle
/// gone) or the pool shuts down (then the requests already queued are
/// still served), then closes.
async fn serve(server: Rc<Server>, rx: MailReceiver<Request>, shutdown: ShutdownSignal) {
    let mut shutdown = pin!(shutdown);
    let mut stopping = false;
    std::future::poll_fn(|cx| {
        if !stopping && shutdown.as_mut().poll(cx).is_ready() {
            stopping = true;
            rx.close();
        }
        loop {
            match rx.poll_recv(cx) {
                Poll::Ready(Some(req)) => server.route(req),
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
    server.close();
}

impl Drop for Server {
    fn drop(&mut self) {
        // No direct call reaches it any more (dropped on its runtime,
        // which the dropping thread holds).
        if let Some(conn) = self.conn.upgrade() {
            if let Some(d) = &conn.direct {
                d.gone();
            }
        }
    }
}

impl Server {
    /// A small send made at once for a handle holding the runtime
    /// ([`super::direct`]): `None` if messages wait to be sent in order
    /// before it, the server closed, or the connection cannot post it now.
    pub(super) fn try_send_now(
        &self,
        data: &[u8],
        imm: Option<u32>,
    ) -> Option<Result<(), AgentError>> {
        if self.closed.get() || !self.ordered.borrow().is_empty() {
            return None;
        }
        self.rdma.try_send_now(data, imm)
    }

    fn route(self: &Rc<Self>, req: Request) {
        match req {
            Request::Release { id } => {
                // Its `Drop` tells the owner to revoke it.
                drop(self.remotes.borrow_mut().remove(&id));
            }
            Request::SendInOrder { data, imm, done } => {
                self.send_in_order(Ordered::Send { data, imm, done });
            }
            Request::Flush { done } => self.send_in_order(Ordered::Flush(done)),
            other => self.workers.push(other),
        }
    }

    fn send_in_order(&self, o: Ordered) {
        self.ordered.borrow_mut().push_back(o);
        if let Some(w) = self.sender.borrow_mut().take() {
            w.wake();
        }
    }

    /// No more requests: workers and the ordered sender finish what is
    /// queued and end; the read-ahead task stops and closes the inbox.
    fn close(&self) {
        self.closed.set(true);
        self.workers.close();
        if let Some(w) = self.sender.borrow_mut().take() {
            w.wake();
        }
        for w in std::mem::take(&mut *self.closing.borrow_mut()) {
            w.wake();
        }
    }

    fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed.get() {
            return Poll::Ready(());
        }
        let mut c = self.closing.borrow_mut();
        if !c.iter().any(|w| w.will_wake(cx.waker())) {
            c.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl Serve<Request> for Server {
    /// Serves one request; its data stays in this frame until the
    /// operation is done.
    async fn serve(self: &Rc<Self>, req: Request) {
        match req {
            Request::Send { data, imm, done } => {
                if done.is_abandoned() {
                    return;
                }
                let r = match imm {
                    None => self.rdma.send(&data).await,
                    Some(imm) => self.rdma.send_with_imm(&data, imm).await,
                };
                done.complete(r.map_err(HandleError::from).map(|()| Done::Unit));
            }
            Request::AskRemote { len, done } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.rdma.request_remote_mr(len).await;
                done.complete(
                    r.map_err(HandleError::from)
                        .and_then(|mr| self.keep_remote(mr)),
                );
            }
            Request::Write {
                remote,
                offset,
                data,
                imm,
                done,
            } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.write(&remote, offset, &data, imm).await;
                done.complete(r.map(|()| Done::Unit));
            }
            Request::Atomic {
                remote,
                offset,
                op,
                done,
            } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.atomic(&remote, offset, op).await;
                done.complete(r.map(Done::Word));
            }
            Request::ReceiveWriteImm { done } => {
                let r = self
                    .until_abandoned_or_closed(&done, self.rdma.receive_write_imm())
                    .await;
                if let Some(r) = r {
                    done.complete(
                        r.map_err(HandleError::from)
                            .map(|imm| Done::Word(imm.into())),
                    );
                }
            }
            Request::Read {
                remote,
                offset,
                len,
                done,
            } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.read(&remote, offset, len).await;
                done.complete(r.map(Done::Bytes));
            }
            Request::SendLocal { data, tag, done } => {
                if done.is_abandoned() {
                    return;
                }
                let r = self.rdma.send_local_mr_with_tag(data, tag).await;
                done.complete(r.map_err(HandleError::from).map(Done::Token));
            }
            Request::SendRemote { remote, tag, done } => {
                if done.is_abandoned() {
                    return;
                }
                let taken = self.remotes.borrow_mut().remove(&remote.id);
                let r = match taken {
                    Some(mr) => self.rdma.send_remote_mr_with_tag(mr, tag).await,
                    // Handed back already (by another clone).
                    None => {
                        done.complete(Err(HandleError::GrantGone));
                        return;
                    }
                };
                done.complete(r.map_err(HandleError::from).map(|()| Done::Unit));
            }
            Request::ReceiveRemote { tag, done } => {
                let r = self
                    .until_abandoned_or_closed(&done, async {
                        match tag {
                            Some(t) => self
                                .rdma
                                .receive_remote_mr_with_tag(t)
                                .await
                                .map(|mr| (mr, t)),
                            None => self.rdma.receive_remote_mr_tagged().await,
                        }
                    })
                    .await;
                if let Some(r) = r {
                    let r = r.map_err(HandleError::from).and_then(|(mr, t)| {
                        self.keep_remote(mr).map(|d| Done::Tagged(Box::new(d), t))
                    });
                    done.complete(r);
                }
            }
            Request::ReceiveLocal { tag, done } => {
                let r = self
                    .until_abandoned_or_closed(&done, async {
                        match tag {
                            Some(t) => self.rdma.receive_local_mr_with_tag(t).await.map(|v| (v, t)),
                            None => self.rdma.receive_local_mr_tagged().await,
                        }
                    })
                    .await;
                if let Some(r) = r {
                    done.complete(
                        r.map_err(HandleError::from)
                            .map(|(v, t)| Done::Tagged(Box::new(Done::Bytes(v)), t)),
                    );
                }
            }
            Request::SendInOrder { .. } | Request::Flush { .. } | Request::Release { .. } => {
                unreachable!("routed by the server task")
            }
        }
    }
}

impl Server {
    /// Runs `wait` (a cancel-safe wait of the connection) until it ends,
    /// its asker leaves (`None`: the item stays for the next asker) or the
    /// server closes (answered with the local close, `None`).
    async fn until_abandoned_or_closed<T>(
        &self,
        done: &Completer<Reply>,
        wait: impl Future<Output = Result<T, AgentError>>,
    ) -> Option<Result<T, AgentError>> {
        // An asker gone before the wait began (its request was still
        // queued) takes nothing: the item stays for the next asker.
        if done.is_abandoned() {
            return None;
        }
        let stop = pin!(async {
            let closed = std::future::poll_fn(|cx| self.poll_closed(cx));
            select(pin!(done.abandoned()), pin!(closed)).await;
        });
        // `stop` is polled first: when the asker left and the item came in
        // the same turn, the item is left, not taken for nobody.
        match select(stop, pin!(wait)).await {
            Either::Right((r, _)) => Some(r),
            Either::Left(_) if self.closed.get() => {
                Some(Err(AgentError::Closed(CloseReason::Local)))
            }
            Either::Left(_) => None,
        }
    }

    /// Keeps `mr` in the table and makes its handle (which releases it
    /// when dropped, even if nobody takes the answer).
    fn keep_remote(&self, mr: RemoteMr) -> Reply {
        let Some(conn) = self.conn.upgrade() else {
            // Every handle is gone: nobody can use it.
            return Err(AgentError::Closed(CloseReason::Local).into());
        };
        let len = mr.len() as u64;
        let id = self.next_remote.get();
        self.next_remote.set(id + 1);
        self.remotes.borrow_mut().insert(id, mr);
        Ok(Done::Remote(RemoteMrHandle {
            entry: Arc::new(RemoteEntry { conn, id, len }),
        }))
    }

    /// The view of the table's grant `entry` at `offset`, `len` bytes
    /// (checked against the handle's length by the asking side).
    fn view(&self, entry: &RemoteEntry, offset: u64, len: usize) -> Option<RemoteMr> {
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(len)?;
        self.remotes.borrow().get(&entry.id)?.get(start..end)
    }

    async fn write(
        &self,
        entry: &RemoteEntry,
        offset: u64,
        data: &[u8],
        imm: Option<u32>,
    ) -> Result<(), HandleError> {
        let view = self
            .view(entry, offset, data.len())
            .ok_or(HandleError::GrantGone)?;
        let mut local = self.rdma.alloc_local_mr(data.len())?;
        local.copy_from_slice(data);
        let (r, _local) = match imm {
            None => self.rdma.write(local, &view).await,
            Some(imm) => self.rdma.write_with_imm(local, &view, imm).await,
        };
        Ok(r?)
    }

    /// The atomic `op` on the 8 bytes at `offset` of the grant `entry`;
    /// the word's previous value.
    async fn atomic(
        &self,
        entry: &RemoteEntry,
        offset: u64,
        op: AtomicOp,
    ) -> Result<u64, HandleError> {
        let word = self.view(entry, offset, 8).ok_or(HandleError::GrantGone)?;
        let r = match op {
            AtomicOp::CompareAndSwap { compare, swap } => {
                self.rdma.compare_and_swap(&word, compare, swap).await
            }
            AtomicOp::FetchAndAdd { add } => self.rdma.fetch_and_add(&word, add).await,
        };
        Ok(r?)
    }

    async fn read(
        &self,
        entry: &RemoteEntry,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, HandleError> {
        let view = self
            .view(entry, offset, len)
            .ok_or(HandleError::GrantGone)?;
        let local = self.rdma.alloc_local_mr(len)?;
        let (r, local) = self.rdma.read(local, &view).await;
        Ok(r.map(|()| local.to_vec())?)
    }

    /// The ordered sender task: sends the messages queued in order one at
    /// a time, each to its end (the next is already here when one
    /// completes: no thread crossing between them; a small message goes
    /// INLINE, done when posted). A message whose asker is gone is still
    /// sent, so the bytes handed over have no gap. A failed send answered
    /// at hand-over is kept for the handle's next send or flush. Once the
    /// server closes, what is queued is still sent, as the workers serve
    /// theirs.
    async fn ordered_send_loop(self: Rc<Self>) {
        loop {
            let next = std::future::poll_fn(|cx| {
                if let Some(m) = self.ordered.borrow_mut().pop_front() {
                    return Poll::Ready(Some(m));
                }
                if self.closed.get() {
                    return Poll::Ready(None);
                }
                *self.sender.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            match next {
                None => break,
                Some(Ordered::Flush(done)) => done.complete(Ok(Done::Unit)),
                Some(Ordered::Send { data, imm, done }) => {
                    let r = match imm {
                        None => self.rdma.send(&data).await,
                        Some(imm) => self.rdma.send_with_imm(&data, imm).await,
                    };
                    match done {
                        Some(done) => {
                            done.complete(r.map_err(HandleError::from).map(|()| Done::Unit))
                        }
                        None => self.handed_over_done(r),
                    }
                }
            }
        }
    }

    /// A send answered at hand-over is done: one fewer in flight, and its
    /// failure kept for the handle's next send or flush.
    fn handed_over_done(&self, r: Result<(), AgentError>) {
        match self.conn.upgrade() {
            Some(conn) => conn.handed_over_done(r.map_err(HandleError::from)),
            None => {
                if let Err(e) = r {
                    tracing::debug!(
                        error = %crate::error::ErrorChain(&e),
                        "a send answered at hand-over failed after every handle was gone"
                    );
                }
            }
        }
    }

    /// The read-ahead task: receives the connection's messages (and its
    /// errors) into the handles' inbox while it has room, so that a
    /// handle's `receive` finds them there without asking this thread.
    /// When the server closes it stops (a receive in progress is dropped:
    /// the connection's receive is cancel-safe) and closes the inbox
    /// (takers then get the local close); dropped with its runtime (the
    /// thread died), the inbox ends as lost.
    async fn read_ahead_loop(self: Rc<Self>, feeder: Feeder<Received>) {
        loop {
            let room = std::future::poll_fn(|cx| {
                if self.closed.get() || feeder.is_orphaned() {
                    return Poll::Ready(false);
                }
                if feeder.poll_room(cx).is_ready() {
                    return Poll::Ready(true);
                }
                // Woken by a take that makes room, or by the close.
                let _ = self.poll_closed(cx);
                Poll::Pending
            })
            .await;
            if !room {
                break;
            }
            let received = {
                let receive = pin!(self.rdma.receive_with_imm());
                let closed = pin!(std::future::poll_fn(|cx| self.poll_closed(cx)));
                // The close first: a message that came in the same turn
                // stays with the connection.
                match select(closed, receive).await {
                    Either::Right((r, _)) => Some(r),
                    Either::Left(_) => None,
                }
            };
            let Some(r) = received else { break };
            let bytes = r.as_ref().map_or(0, |(m, _)| m.len());
            feeder.push(r.map_err(HandleError::from), bytes);
        }
        feeder.close();
    }
}
