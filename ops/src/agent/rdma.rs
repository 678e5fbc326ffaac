//! [`Rdma`]: a high-level connection. Messages travel as agent `Data`
//! frames over SEND/RECV, with credit-based flow control; the agent task
//! (see `task.rs`) owns the receive queue.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::poll_fn;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Poll, Waker};

use futures::channel::{mpsc, oneshot};
use futures::io::AsyncRead;
use futures::lock::Mutex;
use futures::StreamExt;
use std::time::{Duration, Instant};
use verbio_runtime::buf::{LocalBuf, MrPool};
use verbio_runtime::provider::AccessFlags;

use verbio_runtime::{sleep, spawn, timeout, Device, Handle, JoinHandle, QueuePair, TcpStream};

use std::net::SocketAddr;

use super::builder::{Config, RdmaBuilder};
use super::error::{AgentError, CloseReason};
use super::flow::{Credits, Owed};
use super::mr::{LocalMr, RemoteMr};
use super::tokens::GrantTable;
use super::wire::{HandOverKind, Message, MrToken, RefuseCode};
use crate::connect::Connection;
use crate::verbs::{RemoteBuf, Verbs};

/// How long a closing connection lets its in-flight sends finish.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// How long a dropped connection tries to tell the peer with a `Close`.
const CLOSE_LIMIT: Duration = Duration::from_secs(1);

/// A received user message: its bytes and the immediate of `send_with_imm`.
pub(crate) type Incoming = (Vec<u8>, Option<u32>);

/// A message being reassembled from `Data` pieces.
#[derive(Debug)]
pub(crate) struct Partial {
    pub(crate) total_len: u64,
    pub(crate) imm: Option<u32>,
    pub(crate) bytes: Vec<u8>,
}

/// State shared by the [`Rdma`] handle, its agent and its watcher.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) qp: QueuePair,
    pub(crate) device: Device,
    pub(crate) pool: MrPool,
    pub(crate) config: Rc<Config>,
    pub(crate) credits: Credits,
    pub(crate) owed: Owed,
    failure: RefCell<Option<CloseReason>>,
    pub(crate) inbox_tx: RefCell<Option<mpsc::UnboundedSender<Incoming>>>,
    pub(crate) imm_tx: RefCell<Option<mpsc::UnboundedSender<u32>>>,
    pub(crate) partial: RefCell<HashMap<u64, Partial>>,
    next_msg_id: Cell<u64>,
    pub(crate) grants: GrantTable,
    pub(crate) requests: RefCell<HashMap<u64, oneshot::Sender<Result<MrToken, RefuseCode>>>>,
    next_req_id: Cell<u64>,
    pub(crate) remote_mr_tx: RefCell<Option<mpsc::UnboundedSender<MrToken>>>,
    pub(crate) local_mr_tx: RefCell<Option<mpsc::UnboundedSender<Vec<u8>>>>,
    stream: RefCell<Option<TcpStream>>,
    watch_waker: RefCell<Option<Waker>>,
}

impl Shared {
    /// The reason the connection is down, if it is.
    pub(crate) fn failure(&self) -> Option<CloseReason> {
        self.failure.borrow().clone()
    }

    /// Marks the connection down (first reason wins): pending and later
    /// calls fail with `reason`, the TCP side channel closes (the peer sees
    /// it), and the QP is closed so posted receives flush. Runs on the runtime.
    pub(crate) fn fail(&self, reason: CloseReason) {
        if self.failure.borrow().is_some() {
            return;
        }
        tracing::debug!(qp = self.qp.qp_num(), %reason, "agent connection down");
        *self.failure.borrow_mut() = Some(reason.clone());
        self.credits.close(reason);
        self.inbox_tx.borrow_mut().take();
        self.imm_tx.borrow_mut().take();
        self.partial.borrow_mut().clear();
        self.requests.borrow_mut().clear();
        self.remote_mr_tx.borrow_mut().take();
        self.local_mr_tx.borrow_mut().take();
        self.grants.clear();
        let Some(handle) = Handle::try_current() else {
            // Runtime teardown: the QP goes with the last handle.
            self.drop_stream();
            return;
        };
        let qp = self.qp.clone();
        let stream = self.stream.borrow_mut().take();
        let waker = self.watch_waker.borrow_mut().take();
        handle.spawn(async move {
            // Sends already on the wire (a last `Error` notice included)
            // finish by the transport's rules (ACK or retry limit); then the
            // side channel closes and the flush ends the posted receives.
            let deadline = Instant::now() + DRAIN_LIMIT;
            while qp.outstanding_sends() > 0 && Instant::now() < deadline {
                sleep(Duration::from_millis(1)).await;
            }
            drop(stream);
            if let Some(w) = waker {
                w.wake();
            }
            if let Err(e) = qp.close().await {
                tracing::debug!(error = %e, "closing the agent QP");
            }
        });
    }

    fn drop_stream(&self) {
        self.stream.borrow_mut().take();
        if let Some(w) = self.watch_waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn closed_error(&self) -> AgentError {
        AgentError::Closed(self.failure().unwrap_or(CloseReason::Local))
    }

    /// Encodes `msg` into a pool buffer and SENDs it, spending a credit
    /// first unless `credited` is false (control messages in the reserve).
    pub(crate) async fn send_message(
        &self,
        msg: &Message<'_>,
        credited: bool,
    ) -> Result<(), AgentError> {
        if credited {
            self.credits.acquire().await?;
        } else if let Some(r) = self.failure() {
            return Err(r.into());
        }
        self.send_unchecked(msg).await
    }

    /// Sends `msg` without credit or state checks (the last notice of a
    /// failing connection).
    pub(crate) async fn send_unchecked(&self, msg: &Message<'_>) -> Result<(), AgentError> {
        let len = msg.encoded_len();
        let mut buf = self.pool.alloc(len).map_err(|source| AgentError::Buf {
            stage: "allocating a send buffer",
            source,
        })?;
        buf.resize(len, 0).map_err(|source| AgentError::Buf {
            stage: "sizing a send buffer",
            source,
        })?;
        // The buffer holds exactly `encoded_len` bytes: encoding cannot fail
        // for a message this side built; report it as a violation if it does.
        msg.encode(&mut buf[..])
            .map_err(|e| AgentError::Closed(CloseReason::Malformed(e)))?;
        self.send_buf(buf).await
    }

    async fn send_buf(&self, buf: LocalBuf) -> Result<(), AgentError> {
        let (res, _buf) = self.qp.send(buf).await;
        match res {
            Ok(_) => Ok(()),
            Err(e) => {
                if let Some(r) = self.failure() {
                    return Err(r.into());
                }
                self.fail(CloseReason::Transport(e.to_string()));
                Err(e.into())
            }
        }
    }

    /// Maps a verb's outcome: a failed completion leaves the QP in ERR, so
    /// the connection goes down; the caller gets the verb's own error.
    pub(crate) fn verb_result<T>(&self, r: Result<T, crate::Error>) -> Result<T, AgentError> {
        r.map_err(|e| {
            if let Some(reason) = self.failure() {
                if e.is_flush() {
                    return AgentError::Closed(reason);
                }
            } else {
                self.fail(CloseReason::Transport(e.to_string()));
            }
            AgentError::Verb(e)
        })
    }

    fn next_msg_id(&self) -> u64 {
        let id = self.next_msg_id.get();
        self.next_msg_id.set(id + 1);
        id
    }
}

/// A connection to one peer (names follow async-rdma). Create it with
/// [`RdmaBuilder`](super::RdmaBuilder). Single-threaded: share it between
/// tasks of its runtime with `Rc`; every method takes `&self`.
///
/// Dropping it closes the connection: the peer's pending calls fail with
/// [`CloseReason::Disconnected`].
#[derive(Debug)]
pub struct Rdma {
    shared: Rc<Shared>,
    inbox: Mutex<mpsc::UnboundedReceiver<Incoming>>,
    remote_mr_inbox: Mutex<mpsc::UnboundedReceiver<MrToken>>,
    local_mr_inbox: Mutex<mpsc::UnboundedReceiver<Vec<u8>>>,
    imm_inbox: Mutex<mpsc::UnboundedReceiver<u32>>,
    agent: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
    /// How to reach the peer's listener again (connecting side only).
    redial: Option<(Box<RdmaBuilder>, SocketAddr)>,
}

impl Rdma {
    /// Starts the agent and the disconnect watcher on a connected QP.
    pub(crate) fn start(
        conn: Connection<QueuePair>,
        device: Device,
        config: Rc<Config>,
    ) -> Result<Rdma, AgentError> {
        let (inbox_tx, inbox) = mpsc::unbounded();
        let (imm_tx, imm_inbox) = mpsc::unbounded();
        let (remote_mr_tx, remote_mr_inbox) = mpsc::unbounded();
        let (local_mr_tx, local_mr_inbox) = mpsc::unbounded();
        let pool = MrPool::new(device.pd());
        let shared = Rc::new(Shared {
            qp: conn.qp,
            device,
            pool,
            credits: Credits::new(0), // the peer's first `Credit` tells
            owed: Owed::new(config.credit_batch),
            config,
            failure: RefCell::new(None),
            inbox_tx: RefCell::new(Some(inbox_tx)),
            imm_tx: RefCell::new(Some(imm_tx)),
            partial: RefCell::new(HashMap::new()),
            next_msg_id: Cell::new(0),
            grants: GrantTable::default(),
            requests: RefCell::new(HashMap::new()),
            next_req_id: Cell::new(0),
            remote_mr_tx: RefCell::new(Some(remote_mr_tx)),
            local_mr_tx: RefCell::new(Some(local_mr_tx)),
            stream: RefCell::new(Some(conn.stream)),
            watch_waker: RefCell::new(None),
        });
        let receives = super::task::post_receives(&shared)?;
        let agent = spawn(super::task::run(shared.clone(), receives));
        let watcher = spawn(watch(Rc::downgrade(&shared)));
        Ok(Rdma {
            shared,
            inbox: Mutex::new(inbox),
            remote_mr_inbox: Mutex::new(remote_mr_inbox),
            local_mr_inbox: Mutex::new(local_mr_inbox),
            imm_inbox: Mutex::new(imm_inbox),
            agent: Some(agent),
            watcher: Some(watcher),
            redial: None,
        })
    }

    pub(crate) fn set_redial(&mut self, builder: RdmaBuilder, addr: SocketAddr) {
        self.redial = Some((Box::new(builder), addr));
    }

    /// A second connection to the same peer (same settings and device);
    /// only the side that connected knows the peer's listener.
    pub async fn new_connection(&self) -> Result<Rdma, AgentError> {
        match &self.redial {
            Some((builder, addr)) => builder.connect(*addr).await,
            None => Err(AgentError::Config {
                setting: "new_connection",
                reason: "only the connecting side knows the peer's listener",
            }),
        }
    }

    /// The reason the connection is down, `None` while it works.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.shared.failure()
    }

    /// The device the connection runs on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The connection's queue pair (for verbs beyond this API).
    pub fn qp(&self) -> &QueuePair {
        &self.shared.qp
    }

    /// Send credits left (messages this side may send before waiting).
    pub fn send_credits(&self) -> u32 {
        self.shared.credits.available()
    }

    /// Sends `data` as one message (split into pieces if it is larger than
    /// the peer's receive buffers). Waits for credits when the peer's
    /// buffers are full.
    pub async fn send(&self, data: &[u8]) -> Result<(), AgentError> {
        self.send_inner(data, None).await
    }

    /// Sends `data` with a 32-bit immediate, received by [`Rdma::receive_with_imm`].
    pub async fn send_with_imm(&self, data: &[u8], imm: u32) -> Result<(), AgentError> {
        self.send_inner(data, Some(imm)).await
    }

    /// Sends a registered buffer's bytes; the buffer is given back.
    pub async fn send_buf(&self, buf: LocalBuf) -> (Result<(), AgentError>, LocalBuf) {
        let r = self.send_inner(&buf, None).await;
        (r, buf)
    }

    async fn send_inner(&self, data: &[u8], imm: Option<u32>) -> Result<(), AgentError> {
        let s = &self.shared;
        let max = s.config.max_message_len;
        if data.len() > max {
            return Err(AgentError::MessageTooLarge {
                len: data.len(),
                max,
            });
        }
        let msg_id = s.next_msg_id();
        let piece = s.config.piece_len();
        let mut offset = 0usize;
        loop {
            let end = data.len().min(offset + piece);
            let msg = Message::Data {
                msg_id,
                total_len: data.len() as u64,
                offset: offset as u64,
                imm,
                payload: &data[offset..end],
            };
            s.send_message(&msg, true).await?;
            offset = end;
            if offset >= data.len() {
                return Ok(());
            }
        }
    }

    /// The next message (in arrival order of its last piece).
    pub async fn receive(&self) -> Result<Vec<u8>, AgentError> {
        Ok(self.receive_with_imm().await?.0)
    }

    /// The next message with its immediate (`None` if sent without one).
    pub async fn receive_with_imm(&self) -> Result<(Vec<u8>, Option<u32>), AgentError> {
        let mut rx = self.inbox.lock().await;
        match rx.next().await {
            Some(m) => Ok(m),
            None => Err(self.shared.closed_error()),
        }
    }

    /// The next message copied into a registered buffer.
    pub async fn receive_buf(&self) -> Result<LocalBuf, AgentError> {
        let data = self.receive().await?;
        self.shared
            .pool
            .alloc_from(&data)
            .map_err(|source| AgentError::Buf {
                stage: "allocating the receive buffer",
                source,
            })
    }

    /// The immediate of the peer's next `write_with_imm`.
    pub async fn receive_write_imm(&self) -> Result<u32, AgentError> {
        let mut rx = self.imm_inbox.lock().await;
        match rx.next().await {
            Some(imm) => Ok(imm),
            None => Err(self.shared.closed_error()),
        }
    }

    /// Registered memory of `len` zeroed bytes for local use.
    pub fn alloc_local_mr(&self, len: usize) -> Result<LocalMr, AgentError> {
        let buf = self
            .shared
            .pool
            .alloc_zeroed(len)
            .map_err(|source| AgentError::Buf {
                stage: "allocating a local memory region",
                source,
            })?;
        Ok(LocalMr { buf })
    }

    /// Asks the peer for `len` bytes it grants with read, write and atomic
    /// access (capped by the peer's maximum); fails after the request timeout.
    pub async fn request_remote_mr(&self, len: usize) -> Result<RemoteMr, AgentError> {
        self.request_remote_mr_with(
            len,
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
        )
        .await
    }

    /// [`Rdma::request_remote_mr`] with the access to ask for.
    pub async fn request_remote_mr_with(
        &self,
        len: usize,
        access: AccessFlags,
    ) -> Result<RemoteMr, AgentError> {
        let s = &self.shared;
        let req_id = s.next_req_id.get() + 1;
        s.next_req_id.set(req_id);
        let (tx, rx) = oneshot::channel();
        s.requests.borrow_mut().insert(req_id, tx);
        let msg = Message::AllocRequest {
            req_id,
            len: len as u64,
            align: 8,
            access: access.bits(),
            lifetime_ms: 0,
        };
        let limit = s.config.request_timeout;
        let asked = async {
            s.send_message(&msg, true).await?;
            rx.await.map_err(|_| s.closed_error())
        };
        let answer = match timeout(limit, asked).await {
            Ok(a) => a,
            Err(_) => Err(AgentError::Timeout {
                what: "memory request",
                after: limit,
            }),
        };
        s.requests.borrow_mut().remove(&req_id);
        match answer? {
            Ok(token) => Ok(RemoteMr::new(token, Rc::downgrade(s))),
            Err(code) => Err(AgentError::Refused {
                what: "memory request",
                code,
            }),
        }
    }

    fn check_fits(what: &'static str, need: u64, have: u64) -> Result<(), AgentError> {
        if need > have {
            return Err(AgentError::OutOfBounds { what, need, have });
        }
        Ok(())
    }

    /// RDMA WRITE of all of `local` to the start of `remote`.
    pub async fn write(
        &self,
        local: LocalMr,
        remote: &RemoteMr,
    ) -> (Result<(), AgentError>, LocalMr) {
        if let Err(e) = Self::check_fits("write", local.len() as u64, remote.len()) {
            return (Err(e), local);
        }
        let target = RemoteBuf::new(
            remote.remote_buf().addr(),
            local.len() as u64,
            remote.remote_buf().rkey(),
        );
        let (r, buf) = self.shared.qp.write(local.buf, target).await;
        (self.shared.verb_result(r), LocalMr { buf })
    }

    /// RDMA WRITE with immediate: the peer's [`Rdma::receive_write_imm`]
    /// gets `imm` (spends a credit: it consumes a receive buffer there).
    pub async fn write_with_imm(
        &self,
        local: LocalMr,
        remote: &RemoteMr,
        imm: u32,
    ) -> (Result<(), AgentError>, LocalMr) {
        if let Err(e) = Self::check_fits("write_with_imm", local.len() as u64, remote.len()) {
            return (Err(e), local);
        }
        if let Err(e) = self.shared.credits.acquire().await {
            return (Err(e.into()), local);
        }
        let target = RemoteBuf::new(
            remote.remote_buf().addr(),
            local.len() as u64,
            remote.remote_buf().rkey(),
        );
        let (r, buf) = self.shared.qp.write_with_imm(local.buf, target, imm).await;
        (self.shared.verb_result(r), LocalMr { buf })
    }

    /// RDMA READ of all of `remote` into the start of `local`.
    pub async fn read(
        &self,
        local: LocalMr,
        remote: &RemoteMr,
    ) -> (Result<(), AgentError>, LocalMr) {
        if let Err(e) = Self::check_fits("read", remote.len(), local.len() as u64) {
            return (Err(e), local);
        }
        let (r, buf) = self.shared.qp.read(local.buf, remote.remote_buf()).await;
        (self.shared.verb_result(r), LocalMr { buf })
    }

    fn word_buf(&self) -> Result<LocalBuf, AgentError> {
        self.shared.pool.alloc(8).map_err(|source| AgentError::Buf {
            stage: "allocating an atomic result buffer",
            source,
        })
    }

    /// 64-bit compare-and-swap on `remote` (an 8-byte, 8-aligned view);
    /// returns the previous value.
    pub async fn compare_and_swap(
        &self,
        remote: &RemoteMr,
        compare: u64,
        swap: u64,
    ) -> Result<u64, AgentError> {
        let buf = self.word_buf()?;
        let (r, _) = self
            .shared
            .qp
            .compare_and_swap(buf, remote.remote_buf(), compare, swap)
            .await;
        self.shared.verb_result(r)
    }

    /// 64-bit fetch-and-add on `remote` (an 8-byte, 8-aligned view);
    /// returns the previous value.
    pub async fn fetch_and_add(&self, remote: &RemoteMr, add: u64) -> Result<u64, AgentError> {
        let buf = self.word_buf()?;
        let (r, _) = self
            .shared
            .qp
            .fetch_and_add(buf, remote.remote_buf(), add)
            .await;
        self.shared.verb_result(r)
    }

    /// Gives up a grant: the owner revokes it (dropping the last view of a
    /// [`RemoteMr`] does the same in the background).
    pub async fn release(&self, remote: RemoteMr) -> Result<(), AgentError> {
        remote.held.done.set(true);
        let token_id = remote.held.token.token_id;
        self.shared
            .send_message(&Message::Release { token_id }, true)
            .await
    }

    /// Hands a grant back to its owner, who revokes it and gets the memory
    /// with [`Rdma::receive_local_mr`].
    pub async fn send_remote_mr(&self, remote: RemoteMr) -> Result<(), AgentError> {
        remote.held.done.set(true);
        let msg = Message::HandOver {
            kind: HandOverKind::Remote,
            tag: 0,
            token: remote.held.token,
        };
        self.shared.send_message(&msg, true).await
    }

    /// The next grant the peer handed over ([`Rdma::send_local_mr`] there).
    pub async fn receive_remote_mr(&self) -> Result<RemoteMr, AgentError> {
        let mut rx = self.remote_mr_inbox.lock().await;
        match rx.next().await {
            Some(token) => Ok(RemoteMr::new(token, Rc::downgrade(&self.shared))),
            None => Err(self.shared.closed_error()),
        }
    }

    /// Grants the peer access to `mem` (its own registration, this side's
    /// maximum access, the token lifetime); the peer gets it with
    /// [`Rdma::receive_remote_mr`]. Returns the token.
    pub async fn send_local_mr(&self, mem: Vec<u8>) -> Result<MrToken, AgentError> {
        let s = &self.shared;
        let (token, deadline) = s
            .grants
            .grant(
                s.device.pd(),
                mem,
                s.config.max_access,
                s.config.token_lifetime,
            )
            .map_err(|code| AgentError::Refused {
                what: "granting memory",
                code,
            })?;
        super::task::expire_at(s, token.token_id, deadline);
        let msg = Message::HandOver {
            kind: HandOverKind::Local,
            tag: 0,
            token,
        };
        s.send_message(&msg, true).await?;
        Ok(token)
    }

    /// The next grant of this side's memory the peer handed back: revoked
    /// first, so the bytes are plain memory again.
    pub async fn receive_local_mr(&self) -> Result<Vec<u8>, AgentError> {
        let mut rx = self.local_mr_inbox.lock().await;
        match rx.next().await {
            Some(mem) => Ok(mem),
            None => Err(self.shared.closed_error()),
        }
    }

    /// Grants of this side's memory the peer may still access.
    pub fn live_grants(&self) -> usize {
        self.shared.grants.len()
    }

    /// Closes the connection: tells the peer, then stops the agent.
    pub async fn close(self) -> Result<(), AgentError> {
        let r = self.shared.send_message(&Message::Close, false).await;
        self.shared.fail(CloseReason::Local);
        r
    }
}

impl Drop for Rdma {
    fn drop(&mut self) {
        // No await here: on a runtime, a task sends `Close` (ordered after
        // every message sent before) and then closes; otherwise the TCP
        // side channel is dropped (the peer's watcher sees EOF). The agent
        // is cancelled; its posted receives park until the QP's flush.
        match Handle::try_current() {
            Some(h) if self.shared.failure().is_none() => {
                let shared = self.shared.clone();
                h.spawn(async move {
                    let _ = timeout(CLOSE_LIMIT, shared.send_message(&Message::Close, false)).await;
                    shared.fail(CloseReason::Local);
                });
            }
            _ => self.shared.drop_stream(),
        }
        if let Some(a) = self.agent.take() {
            a.abort();
        }
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}

/// Waits for EOF (or an error) on the connection's TCP stream, the sign that
/// the peer is gone, and marks the connection down.
async fn watch(shared: std::rc::Weak<Shared>) {
    let mut scratch = [0u8; 64];
    let gone = poll_fn(|cx| {
        let Some(s) = shared.upgrade() else {
            return Poll::Ready(false);
        };
        let mut stream = s.stream.borrow_mut();
        let Some(st) = stream.as_mut() else {
            return Poll::Ready(false); // closed by this side
        };
        *s.watch_waker.borrow_mut() = Some(cx.waker().clone());
        loop {
            match Pin::new(&mut *st).poll_read(cx, &mut scratch) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(true),
                Poll::Ready(Ok(_)) => continue, // the peer sends nothing; ignore
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await;
    if gone {
        if let Some(s) = shared.upgrade() {
            s.fail(CloseReason::Disconnected);
        }
    }
}
