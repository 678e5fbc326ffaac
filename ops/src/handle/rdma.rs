//! [`RdmaHandle`]: the asking side of a connection served on a runtime
//! thread.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use verbio_runtime::pool::{
    Inbox, InboxEnd, MailSender, Placement, Pool, SlotCache, ThreadContext, ThreadRef, Waiting,
};

use super::direct::DirectServer;
use super::remote::RemoteMrHandle;
use super::serve::{start, AtomicOp, Done, Received, Reply, Request};
use super::HandleError;
use crate::agent::wire::MrToken;
use crate::agent::{AgentError, CloseReason, Rdma, RdmaBuilder};

/// Requests queued per connection before callers wait for room.
pub(super) const QUEUE_DEPTH: usize = 256;

/// Idle completion slots kept per connection.
const CACHED_SLOTS: usize = 64;

/// What every clone of a handle shares.
pub(crate) struct ConnShared {
    pub(super) thread: ThreadRef,
    pub(super) tx: MailSender<Request>,
    pub(super) slots: SlotCache<Reply>,
    pub(super) max_send_len: usize,
    /// The connection's messages, received ahead by the runtime thread.
    pub(super) arrived: Inbox<Received>,
    /// The largest message a `send` answers at hand-over (one that goes
    /// INLINE in one piece: done on the runtime thread when posted).
    handover_max: usize,
    /// Sends answered at hand-over and not yet done on the runtime thread
    /// (may dip below zero for a moment: counted after the hand-over).
    handed_over: AtomicIsize,
    /// The first failure of a send answered at hand-over, for the next
    /// send or flush.
    send_failed: AtomicBool,
    send_failure: Mutex<Option<HandleError>>,
    /// The connection's server, for calls made on the asking thread when
    /// the runtime is hosted on tokio (`None` on a runtime thread).
    pub(super) direct: Option<DirectServer>,
}

impl ConnShared {
    pub(super) fn new(
        thread: ThreadRef,
        tx: MailSender<Request>,
        arrived: Inbox<Received>,
        max_send_len: usize,
        handover_max: usize,
        direct: Option<DirectServer>,
    ) -> Self {
        ConnShared {
            slots: SlotCache::new(CACHED_SLOTS).reply_spin(thread.reply_spin()),
            thread,
            tx,
            max_send_len,
            arrived,
            handover_max,
            handed_over: AtomicIsize::new(0),
            send_failed: AtomicBool::new(false),
            send_failure: Mutex::new(None),
            direct,
        }
    }

    /// A send answered at hand-over is done on the runtime thread.
    pub(super) fn handed_over_done(&self, r: Result<(), HandleError>) {
        if let Err(e) = r {
            let mut f = self.send_failure.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some(e);
                self.send_failed.store(true, Ordering::Release);
            }
        }
        self.handed_over.fetch_sub(1, Ordering::AcqRel);
    }

    /// The kept failure of a send answered at hand-over, if any (taken:
    /// reported once).
    fn take_send_failure(&self) -> Result<(), HandleError> {
        if !self.send_failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut f = self.send_failure.lock().unwrap_or_else(|p| p.into_inner());
        self.send_failed.store(false, Ordering::Release);
        match f.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// An [`Rdma`] connection living on a pool's runtime thread, usable from
/// any thread: `Send + Sync + Clone`, and every future it returns is
/// `Send`. See the [module docs](super) for what crosses threads and what
/// happens to a future dropped mid-flight.
///
/// The connection stays open while a clone of the handle (or of a
/// [`RemoteMrHandle`] of it) lives; the last one gone closes it, as
/// dropping an [`Rdma`] does.
#[derive(Clone)]
pub struct RdmaHandle {
    pub(super) conn: Arc<ConnShared>,
}

impl std::fmt::Debug for RdmaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaHandle")
            .field("thread", &self.conn.thread.index())
            .finish_non_exhaustive()
    }
}

/// A builder for the runtime thread of `cx`, with the thread's device set
/// if the pool has one.
pub(super) fn thread_builder(cx: &ThreadContext) -> RdmaBuilder {
    let b = RdmaBuilder::new();
    match cx.device() {
        Some(d) => b.device(d.clone()),
        None => b,
    }
}

impl RdmaHandle {
    /// Connects to an [`RdmaListener`](crate::agent::RdmaListener) (or a
    /// [`ListenerHandle`](super::ListenerHandle)) at `addr` from the pool
    /// thread `placement` names, with the default settings and the
    /// thread's device (if the pool has one).
    pub async fn connect(
        pool: &Pool,
        placement: Placement,
        addr: SocketAddr,
    ) -> Result<RdmaHandle, HandleError> {
        Self::connect_with(pool, placement, addr, |b| b).await
    }

    /// [`connect`](Self::connect) with settings: `configure` gets the
    /// builder (with the thread's device set, if the pool has one) on the
    /// runtime thread.
    pub async fn connect_with<F>(
        pool: &Pool,
        placement: Placement,
        addr: SocketAddr,
        configure: F,
    ) -> Result<RdmaHandle, HandleError>
    where
        F: FnOnce(RdmaBuilder) -> RdmaBuilder + Send + 'static,
    {
        let h = pool.spawn(placement, move |cx| {
            let b = configure(thread_builder(cx));
            let (thread, shutdown) = (cx.thread().clone(), cx.shutdown_signal());
            async move {
                let rdma = b.connect(addr).await?;
                Ok::<_, HandleError>(start(thread, shutdown, rdma))
            }
        });
        h.await?
    }

    /// Serves an existing connection from its runtime thread (call it on a
    /// pool thread, e.g. in [`Pool::spawn`]'s closure, with that thread's
    /// [`ThreadContext`](verbio_runtime::pool::ThreadContext)).
    pub fn serve(cx: &verbio_runtime::pool::ThreadContext, rdma: Rdma) -> RdmaHandle {
        start(cx.thread().clone(), cx.shutdown_signal(), rdma)
    }

    /// The runtime thread the connection lives on.
    pub fn thread(&self) -> &ThreadRef {
        &self.conn.thread
    }

    /// The largest message [`send`](Self::send) takes.
    pub fn max_send_len(&self) -> usize {
        self.conn.max_send_len
    }

    /// Sends `data` as one message ([`Rdma::send`]).
    ///
    /// A small message (one the connection sends INLINE, e.g. up to about
    /// 100 bytes with the default
    /// [`max_inline_data`](crate::agent::RdmaBuilder::max_inline_data)) is
    /// answered at hand-over: `Ok` once the runtime thread owns it, without
    /// waiting for that thread (it is sent there, in the order handed over,
    /// even if every handle is dropped meanwhile). Should it fail there,
    /// the failure is returned by the handle's next `send`,
    /// `send_with_imm` or [`flush`](Self::flush) (whose own message is then
    /// not sent); `flush` waits until every message handed over is done. A
    /// larger message is answered once the connection's send is done, and
    /// goes after the small ones handed over before it.
    ///
    /// On a runtime hosted on tokio
    /// ([`PoolBuilder::host_on_tokio`](verbio_runtime::pool::PoolBuilder::host_on_tokio)),
    /// from that tokio runtime's tasks, a small message is sent by the
    /// asking task itself when it can be posted at once (a credit at hand,
    /// nothing handed over still to go before it, the runtime not held by
    /// another thread at the moment): no request, no runtime task, and its
    /// failure is this call's.
    pub async fn send(&self, data: Vec<u8>) -> Result<(), HandleError> {
        self.send_imm(data, None).await
    }

    /// Sends `data` as one message with a 32-bit immediate
    /// ([`Rdma::send_with_imm`]), received by
    /// [`receive_with_imm`](Self::receive_with_imm). Answered as
    /// [`send`](Self::send) is.
    pub async fn send_with_imm(&self, data: Vec<u8>, imm: u32) -> Result<(), HandleError> {
        self.send_imm(data, Some(imm)).await
    }

    async fn send_imm(&self, data: Vec<u8>, imm: Option<u32>) -> Result<(), HandleError> {
        let conn = &self.conn;
        conn.take_send_failure()?;
        if data.len() <= conn.handover_max {
            if let Some(r) = self.send_direct(&data, imm) {
                return r.map_err(HandleError::from);
            }
            let req = Request::SendInOrder {
                data,
                imm,
                done: None,
            };
            if conn.tx.send(req).await.is_err() {
                return Err(self.refused_error());
            }
            // A thread marked ended polls no task again: a message queued
            // as it died (before its mailbox's receiver is dropped) is
            // never sent, so say so now rather than answer `Ok`.
            conn.thread.check()?;
            conn.handed_over.fetch_add(1, Ordering::AcqRel);
            return Ok(());
        }
        // After the messages handed over and not yet sent, in order; else
        // served with the other requests (concurrently with them).
        let ordered = conn.handed_over.load(Ordering::Acquire) > 0;
        self.call(|done| match ordered {
            true => Request::SendInOrder {
                data,
                imm,
                done: Some(done),
            },
            false => Request::Send { data, imm, done },
        })
        .await
        .map(drop)
    }

    /// A small send made on the asking thread (see [`super::direct`]):
    /// `None` unless nothing handed over is still to be sent before it and
    /// the connection posts it at once.
    #[inline]
    fn send_direct(&self, data: &[u8], imm: Option<u32>) -> Option<Result<(), AgentError>> {
        let conn = &self.conn;
        let direct = conn.direct.as_ref()?;
        if conn.handed_over.load(Ordering::Acquire) != 0 {
            return None;
        }
        direct
            .run(&conn.thread, |server| server.try_send_now(data, imm))
            .flatten()
    }

    /// Waits until every message [`send`](Self::send) answered at
    /// hand-over is done on the runtime thread; returns the failure of
    /// one of them, if one failed and was not reported yet.
    pub async fn flush(&self) -> Result<(), HandleError> {
        let conn = &self.conn;
        if conn.handed_over.load(Ordering::Acquire) > 0 {
            self.call(|done| Request::Flush { done }).await?;
        }
        conn.take_send_failure()
    }

    /// The next message ([`Rdma::receive`]).
    ///
    /// The runtime thread receives the connection's messages ahead into a
    /// queue the handles share (at most 64 messages and, past one, 1 MiB):
    /// a `receive` that finds a message there takes it without waiting for
    /// that thread; one that finds none waits to be woken by the next
    /// arrival. Each message goes to one `receive`, in arrival order;
    /// receives waiting at once are woken in the order they began waiting.
    /// Cancel-safe: dropped, it leaves the messages to the next receive.
    pub async fn receive(&self) -> Result<Vec<u8>, HandleError> {
        Ok(self.receive_with_imm().await?.0)
    }

    /// The next message and its immediate, `None` if it was sent without
    /// one ([`Rdma::receive_with_imm`]). Taken from the same queue as
    /// [`receive`](Self::receive)'s.
    pub async fn receive_with_imm(&self) -> Result<(Vec<u8>, Option<u32>), HandleError> {
        Receive {
            handle: self,
            waiting: Waiting::default(),
        }
        .await
    }

    /// Asks the peer for `len` bytes of its memory
    /// ([`Rdma::request_remote_mr`]).
    pub async fn request_remote_mr(&self, len: usize) -> Result<RemoteMrHandle, HandleError> {
        match self.call(|done| Request::AskRemote { len, done }).await? {
            Done::Remote(r) => Ok(r),
            _ => unreachable!("a memory request is answered with a region"),
        }
    }

    /// RDMA WRITE of `data` at `offset` in `remote` (copied into registered
    /// memory on the runtime thread).
    pub async fn write(
        &self,
        remote: &RemoteMrHandle,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), HandleError> {
        self.write_imm("write", remote, offset, data, None).await
    }

    /// RDMA WRITE with immediate of `data` at `offset` in `remote`
    /// ([`Rdma::write_with_imm`]): the peer's
    /// [`receive_write_imm`](Self::receive_write_imm) (or
    /// [`Rdma::receive_write_imm`]) gets `imm` once the bytes are there.
    pub async fn write_with_imm(
        &self,
        remote: &RemoteMrHandle,
        offset: u64,
        data: Vec<u8>,
        imm: u32,
    ) -> Result<(), HandleError> {
        self.write_imm("write_with_imm", remote, offset, data, Some(imm))
            .await
    }

    async fn write_imm(
        &self,
        what: &'static str,
        remote: &RemoteMrHandle,
        offset: u64,
        data: Vec<u8>,
        imm: Option<u32>,
    ) -> Result<(), HandleError> {
        self.check_remote(what, remote, offset, data.len() as u64)?;
        let remote = remote.entry.clone();
        self.call(|done| Request::Write {
            remote,
            offset,
            data,
            imm,
            done,
        })
        .await
        .map(drop)
    }

    /// The immediate of the peer's next WRITE_WITH_IMM
    /// ([`Rdma::receive_write_imm`]). Cancel-safe: dropped while waiting,
    /// it leaves the immediate for the next call.
    pub async fn receive_write_imm(&self) -> Result<u32, HandleError> {
        match self.call(|done| Request::ReceiveWriteImm { done }).await? {
            Done::Word(imm) => Ok(imm as u32),
            _ => unreachable!("a WRITE's immediate is answered with a word"),
        }
    }

    /// 64-bit compare-and-swap on the 8 bytes at `offset` in `remote`
    /// ([`Rdma::compare_and_swap`]): if the word equals `compare` it
    /// becomes `swap`. Returns the word's previous value. The word must be
    /// 8-byte aligned in the peer's memory (a misaligned one fails the
    /// call, not the connection).
    pub async fn compare_and_swap(
        &self,
        remote: &RemoteMrHandle,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, HandleError> {
        self.atomic(
            "compare_and_swap",
            remote,
            offset,
            AtomicOp::CompareAndSwap { compare, swap },
        )
        .await
    }

    /// 64-bit fetch-and-add (wrapping) on the 8 bytes at `offset` in
    /// `remote` ([`Rdma::fetch_and_add`]); returns the word's previous
    /// value. Aligned as for [`compare_and_swap`](Self::compare_and_swap).
    pub async fn fetch_and_add(
        &self,
        remote: &RemoteMrHandle,
        offset: u64,
        add: u64,
    ) -> Result<u64, HandleError> {
        self.atomic(
            "fetch_and_add",
            remote,
            offset,
            AtomicOp::FetchAndAdd { add },
        )
        .await
    }

    async fn atomic(
        &self,
        what: &'static str,
        remote: &RemoteMrHandle,
        offset: u64,
        op: AtomicOp,
    ) -> Result<u64, HandleError> {
        self.check_remote(what, remote, offset, 8)?;
        let remote = remote.entry.clone();
        match self
            .call(|done| Request::Atomic {
                remote,
                offset,
                op,
                done,
            })
            .await?
        {
            Done::Word(w) => Ok(w),
            _ => unreachable!("an atomic is answered with a word"),
        }
    }

    /// RDMA READ of `len` bytes at `offset` in `remote`.
    pub async fn read(
        &self,
        remote: &RemoteMrHandle,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, HandleError> {
        self.check_remote("read", remote, offset, len as u64)?;
        let remote = remote.entry.clone();
        match self
            .call(|done| Request::Read {
                remote,
                offset,
                len,
                done,
            })
            .await?
        {
            Done::Bytes(b) => Ok(b),
            _ => unreachable!("a read is answered with bytes"),
        }
    }

    /// Grants the peer access to a copy of `data` in a registration of its
    /// own ([`Rdma::send_local_mr_with_tag`]); the peer gets it with
    /// [`receive_remote_mr`](Self::receive_remote_mr). Returns the token.
    pub async fn send_local_mr(&self, data: Vec<u8>, tag: u64) -> Result<MrToken, HandleError> {
        match self
            .call(|done| Request::SendLocal { data, tag, done })
            .await?
        {
            Done::Token(t) => Ok(t),
            _ => unreachable!("a grant is answered with its token"),
        }
    }

    /// The next grant the peer handed over (with `tag`, or any tag if
    /// `None`), and its tag ([`Rdma::receive_remote_mr_tagged`]).
    /// Cancel-safe: dropped while waiting, it leaves the grant for the next
    /// call.
    pub async fn receive_remote_mr(
        &self,
        tag: Option<u64>,
    ) -> Result<(RemoteMrHandle, u64), HandleError> {
        match self
            .call(|done| Request::ReceiveRemote { tag, done })
            .await?
        {
            Done::Tagged(d, t) => match *d {
                Done::Remote(r) => Ok((r, t)),
                _ => unreachable!("a grant is answered with a region"),
            },
            _ => unreachable!("a grant is answered with its tag"),
        }
    }

    /// Hands the peer's grant `remote` back to it, with `tag`
    /// ([`Rdma::send_remote_mr_with_tag`]); the owner revokes it and gets
    /// its memory back. Other clones of `remote` stop working.
    pub async fn send_remote_mr(
        &self,
        remote: RemoteMrHandle,
        tag: u64,
    ) -> Result<(), HandleError> {
        if !Arc::ptr_eq(&remote.entry.conn, &self.conn) {
            return Err(HandleError::ForeignRemote {
                what: "send_remote_mr",
            });
        }
        let remote = remote.entry;
        self.call(|done| Request::SendRemote { remote, tag, done })
            .await
            .map(drop)
    }

    /// The next of this side's grants the peer handed back (with `tag`, or
    /// any if `None`), as the memory's bytes, and its tag
    /// ([`Rdma::receive_local_mr_tagged`]). Cancel-safe like
    /// [`receive_remote_mr`](Self::receive_remote_mr).
    pub async fn receive_local_mr(&self, tag: Option<u64>) -> Result<(Vec<u8>, u64), HandleError> {
        match self
            .call(|done| Request::ReceiveLocal { tag, done })
            .await?
        {
            Done::Tagged(d, t) => match *d {
                Done::Bytes(b) => Ok((b, t)),
                _ => unreachable!("a hand-back is answered with bytes"),
            },
            _ => unreachable!("a hand-back is answered with its tag"),
        }
    }

    fn check_remote(
        &self,
        what: &'static str,
        remote: &RemoteMrHandle,
        offset: u64,
        len: u64,
    ) -> Result<(), HandleError> {
        if !Arc::ptr_eq(&remote.entry.conn, &self.conn) {
            return Err(HandleError::ForeignRemote { what });
        }
        let have = remote.entry.len;
        if offset.checked_add(len).is_none_or(|end| end > have) {
            return Err(HandleError::OutOfBounds {
                what,
                offset,
                len,
                have,
            });
        }
        Ok(())
    }

    /// Queues the request `make` builds around a completion slot and
    /// waits for its answer.
    async fn call(
        &self,
        make: impl FnOnce(verbio_runtime::pool::Completer<Reply>) -> Request,
    ) -> Result<Done, HandleError> {
        let conn = &self.conn;
        let (done, mut answer) = conn.slots.pair();
        if conn.tx.send(make(done)).await.is_err() {
            // The request (and its completer) is dropped here.
            return Err(self.refused_error());
        }
        let r = (&mut answer).await;
        conn.slots.give_back(answer);
        self.answered(r)
    }

    /// A message (or why there is none) of the connection's read-ahead
    /// queue, or `Pending` with `waiting` in the line of its takers (see
    /// [`Inbox::poll_take`]).
    pub(super) fn poll_arrived(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
    ) -> Poll<Received> {
        self.conn.arrived.poll_take(cx, waiting).map(|r| match r {
            Ok(received) => received,
            Err(InboxEnd::Closed) => Err(AgentError::Closed(CloseReason::Local).into()),
            Err(InboxEnd::Lost) => Err(self.conn.thread.lost_error().into()),
        })
    }

    /// Why the mailbox refused a request: the connection's server stopped
    /// taking requests (its thread is gone, or going, or the connection
    /// closed).
    pub(super) fn refused_error(&self) -> HandleError {
        match self.conn.thread.check() {
            Err(e) => e.into(),
            Ok(()) => AgentError::Closed(CloseReason::Local).into(),
        }
    }

    /// The reply in a completion slot's answer (its completer dropped
    /// unanswered: the thread was lost).
    pub(super) fn answered(
        &self,
        r: Result<Reply, verbio_runtime::pool::Lost>,
    ) -> Result<Done, HandleError> {
        match r {
            Ok(reply) => reply,
            Err(_lost) => Err(self.conn.thread.lost_error().into()),
        }
    }
}

/// The future of [`RdmaHandle::receive_with_imm`]: takes from the
/// connection's read-ahead queue; dropped while waiting, it gives up its
/// place in line (passing on a wake it got for a message it leaves).
struct Receive<'a> {
    handle: &'a RdmaHandle,
    waiting: Waiting,
}

impl Future for Receive<'_> {
    type Output = Received;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.handle.poll_arrived(cx, &mut this.waiting)
    }
}

impl Drop for Receive<'_> {
    fn drop(&mut self) {
        self.handle.conn.arrived.cancel(&mut self.waiting);
    }
}
