//! The software device's CM listener: a task accepts TCP connections and
//! reads each one's connect request concurrently, so no peer waits for
//! another; the valid requests queue (up to the backlog) until
//! [`Listener::request`] takes them.
//!
//! What a peer can make it hold before its request is validated:
//!
//! - **time**: `CmOptions::request_timeout` to send its request (and, once
//!   the application accepts, to confirm with ready-to-use); then the
//!   connection is closed;
//! - **memory**: one reading task of a fixed size (the largest frame's
//!   buffer, 520 bytes, on its stack; nothing allocated before the frame
//!   decodes);
//! - **connections**: at most `CmOptions::max_pending` being read, and
//!   `max_pending_per_source` from one IP address. A full listener stops
//!   accepting (new connections wait in the kernel's backlog); a source
//!   over its cap is rejected at once (reason 3, no resources).
//!
//! A malformed or unacceptable request is answered with the InfiniBand
//! CM's reject reason ([`crate::cm::reject`]) and logged; it never reaches
//! `request`, which fails only if the listening socket itself fails.
//! `accept` errors for lack of resources (`EMFILE`, ...) are ridden out
//! with a backoff ([`AcceptBackoff`]).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};

use super::wire::{Frame, Hello};
use super::{
    connect_qp, drain_ready, make_qp, read_frame_raw, send_reject, spawn_reject, ReadError, Request,
};
use crate::cm::reject::{REJECT_INVALID_ADDRESS, REJECT_NO_RESOURCES, REJECT_UNSUPPORTED};
use crate::cm::{backend, CmError, CmOptions};
use crate::device::Device;
use crate::provider::{Endpoint, ProviderKind};
use crate::reactor::{
    timeout, AcceptBackoff, Handle, JoinHandle, PendingLimits, PendingSlot, TcpListener, TcpStream,
};

/// Name of the listener in logs.
const WHAT: &str = "soft CM listener";
/// Connections accepted or requests read per wake of the listener task
/// before it lets other tasks run.
const WORK_PER_WAKE: usize = 256;

/// A validated request waiting for [`Listener::request`].
struct Queued {
    stream: TcpStream,
    peer: SocketAddr,
    hello: Hello,
}

/// What the listener task and `request` share.
struct Shared {
    queue: RefCell<VecDeque<Queued>>,
    backlog: usize,
    waiters: RefCell<Vec<Waker>>,
    /// The listening socket's own failure, once it failed.
    failed: RefCell<Option<std::io::Error>>,
    /// The listening socket; taken (closed) when the `Listener` drops, so
    /// that the port refuses connections at once, not when the task ends.
    tcp: RefCell<Option<TcpListener>>,
}

impl Shared {
    fn wake(&self) {
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// Queues a valid request, or rejects it if the backlog is full.
    fn offer(&self, q: Queued) {
        let mut queue = self.queue.borrow_mut();
        if queue.len() >= self.backlog {
            drop(queue);
            tracing::warn!(peer = %q.peer, backlog = self.backlog, "{WHAT}: backlog full; rejecting the request (reason {REJECT_NO_RESOURCES})");
            spawn_reject(q.stream, REJECT_NO_RESOURCES, Vec::new());
            return;
        }
        queue.push_back(q);
        drop(queue);
        self.wake();
    }

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Result<Queued, CmError>> {
        if let Some(q) = self.queue.borrow_mut().pop_front() {
            return Poll::Ready(Ok(q));
        }
        if let Some(e) = self.failed.borrow().as_ref() {
            return Poll::Ready(Err(CmError::Io {
                step: "accepting CM connections",
                source: std::io::Error::new(e.kind(), e.to_string()),
            }));
        }
        let mut w = self.waiters.borrow_mut();
        if !w.iter().any(|x| x.will_wake(cx.waker())) {
            w.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// A TCP listener for connect requests.
pub(crate) struct Listener {
    local: Option<SocketAddr>,
    shared: Rc<Shared>,
    request_timeout: Duration,
    task: Option<JoinHandle<()>>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        drop(self.shared.tcp.borrow_mut().take());
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Listener {
    /// Listens on `addr` and starts the task that accepts and reads
    /// requests (on this thread's runtime).
    pub(crate) fn bind(addr: SocketAddr, opts: &CmOptions) -> Result<Listener, CmError> {
        let tcp = TcpListener::bind(addr).map_err(CmError::io("listening"))?;
        let local = tcp.local_addr().ok();
        let handle = Handle::try_current().ok_or_else(|| {
            CmError::io("listening")(std::io::Error::other("no verbio runtime on this thread"))
        })?;
        let shared = Rc::new(Shared {
            queue: RefCell::new(VecDeque::new()),
            backlog: usize::try_from(opts.backlog).unwrap_or(0).max(1),
            waiters: RefCell::new(Vec::new()),
            failed: RefCell::new(None),
            tcp: RefCell::new(Some(tcp)),
        });
        let limits = PendingLimits::new(WHAT, opts.max_pending, opts.max_pending_per_source);
        let task = handle.spawn(serve(shared.clone(), limits, opts.request_timeout));
        Ok(Listener {
            local,
            shared,
            request_timeout: opts.request_timeout,
            task: Some(task),
        })
    }
}

impl backend::Listening for Listener {
    type Answer = Request;

    fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    /// The next acceptable connect request, its QP in RTS. Requests that
    /// cannot be taken (the peer left or sent more than its request, no QP
    /// could be made, or the QP refuses the peer's endpoint) are rejected
    /// and logged, and the next one is taken: this fails only if the
    /// listening socket itself failed.
    async fn request(
        &self,
        device: &Device,
        opts: &CmOptions,
    ) -> Result<backend::Request<Request>, CmError> {
        loop {
            let Queued {
                mut stream,
                peer,
                hello,
            } = poll_fn(|cx| self.shared.poll_next(cx)).await?;
            match still_waiting(&mut stream) {
                Waiting::Yes => {}
                Waiting::Gone => {
                    tracing::debug!(%peer, "{WHAT}: the requester left before its request was taken");
                    continue;
                }
                Waiting::SentMore => {
                    tracing::debug!(%peer, "{WHAT}: bytes after the connect request (sent twice?); rejecting (reason {REJECT_UNSUPPORTED})");
                    spawn_reject(stream, REJECT_UNSUPPORTED, Vec::new());
                    continue;
                }
            }
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY on the CM stream");
            }
            let (qp, pd, local) = match make_qp(device, opts) {
                // (An engine on the unspecified address is announced at
                // the IP the requester reached this host at.)
                Ok((qp, pd, local)) => (
                    qp,
                    pd,
                    stream
                        .local_addr()
                        .map_or(local, |l| local.announced_over(l)),
                ),
                Err(e) => {
                    tracing::warn!(%peer, error = %crate::report::ErrorChain(&e), "{WHAT}: no queue pair for a request; rejecting it (reason {REJECT_NO_RESOURCES})");
                    spawn_reject(stream, REJECT_NO_RESOURCES, Vec::new());
                    continue;
                }
            };
            let responder_resources = opts.responder_resources.min(hello.initiator_depth);
            let initiator_depth = opts.initiator_depth.min(hello.responder_resources);
            if let Err(e) = connect_qp(
                &qp,
                &local,
                &hello.endpoint,
                responder_resources,
                initiator_depth,
                opts.min_rnr_timer,
            ) {
                tracing::debug!(%peer, error = %crate::report::ErrorChain(&e), "{WHAT}: the queue pair refuses the requester's endpoint; rejecting (reason {REJECT_UNSUPPORTED})");
                spawn_reject(stream, REJECT_UNSUPPORTED, Vec::new());
                continue;
            }
            let request = Request {
                stream,
                peer,
                local,
                responder_resources,
                initiator_depth,
                rtu_wait: self.request_timeout,
            };
            return Ok((request, qp, pd, hello.private_data, Some(peer)));
        }
    }
}

/// Whether a queued requester still waits for our answer.
enum Waiting {
    Yes,
    /// It closed or reset the connection.
    Gone,
    /// It sent bytes after its request (nothing may come before our answer).
    SentMore,
}

fn still_waiting(s: &mut TcpStream) -> Waiting {
    let mut cx = Context::from_waker(Waker::noop());
    let mut one = [0u8; 1];
    match futures::io::AsyncRead::poll_read(Pin::new(s), &mut cx, &mut one) {
        Poll::Pending => Waiting::Yes,
        Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => Waiting::Gone,
        Poll::Ready(Ok(_)) => Waiting::SentMore,
    }
}

/// Why a request is refused before it is queued: the reject reason and
/// what was wrong.
pub(super) fn check_request(ep: &Endpoint) -> Result<(), (u16, String)> {
    if ep.provider != ProviderKind::Soft {
        return Err((REJECT_UNSUPPORTED, format!("{:?} endpoint", ep.provider)));
    }
    if ep.qpn > 0x00ff_ffff {
        return Err((
            REJECT_UNSUPPORTED,
            format!("QPN {:#x}: QP numbers have 24 bits", ep.qpn),
        ));
    }
    if ep.psn > 0x00ff_ffff {
        return Err((
            REJECT_UNSUPPORTED,
            format!("PSN {:#x}: PSNs have 24 bits", ep.psn),
        ));
    }
    match ep.addr.to_socket() {
        None => Err((
            REJECT_INVALID_ADDRESS,
            "no engine address (address family 0)".into(),
        )),
        Some(a) if a.port() == 0 || a.ip().is_unspecified() || a.ip().is_multicast() => Err((
            REJECT_INVALID_ADDRESS,
            format!("engine address {a} cannot be connected to"),
        )),
        Some(_) => Ok(()),
    }
}

/// Reads one connection's request (within `deadline`), checks it and
/// queues it, or rejects it. Holds the connection's pending slot until
/// done.
async fn read_request(
    mut stream: TcpStream,
    peer: SocketAddr,
    slot: PendingSlot,
    shared: Rc<Shared>,
    deadline: Duration,
) {
    let got = timeout(deadline, read_frame_raw(&mut stream)).await;
    let refusal = match got {
        Err(_) => {
            tracing::debug!(%peer, ?deadline, "{WHAT}: no connect request in time; closing");
            return;
        }
        Ok(Err(ReadError::Io(e))) => {
            tracing::debug!(%peer, error = %e, "{WHAT}: the connection ended before its request");
            return;
        }
        Ok(Err(ReadError::Decode(e))) => match e.reject {
            Some(reason) => (reason, e.what),
            None => {
                tracing::debug!(%peer, error = %e, "{WHAT}: not a CM peer; closing");
                drain_ready(&mut stream);
                return;
            }
        },
        Ok(Ok(Frame::Req(hello))) => match check_request(&hello.endpoint) {
            Ok(()) => {
                drop(slot);
                shared.offer(Queued {
                    stream,
                    peer,
                    hello,
                });
                return;
            }
            Err(r) => r,
        },
        Ok(Ok(Frame::Rej { .. })) => {
            tracing::debug!(%peer, "{WHAT}: a reject instead of a request; closing");
            return;
        }
        Ok(Ok(other)) => (
            REJECT_UNSUPPORTED,
            format!("expected a connect request, got {other:?}"),
        ),
    };
    let (reason, what) = refusal;
    tracing::debug!(%peer, reason, what, "{WHAT}: bad connect request; rejecting");
    send_reject(stream, reason, Vec::new()).await;
    drop(slot);
}

/// Refuses a connection over its source's cap at once: a reject without
/// waiting (the send buffer of a fresh connection takes it), then close.
fn refuse_now(mut stream: TcpStream) {
    let frame = super::wire::encode(&Frame::Rej {
        reason: REJECT_NO_RESOURCES,
        private_data: Vec::new(),
    });
    drain_ready(&mut stream);
    let mut cx = Context::from_waker(Waker::noop());
    let _ = futures::io::AsyncWrite::poll_write(Pin::new(&mut stream), &mut cx, &frame);
    let _ = futures::io::AsyncWrite::poll_close(Pin::new(&mut stream), &mut cx);
}

type Reading = Pin<Box<dyn Future<Output = ()>>>;

/// The listener task: accepts while under the caps, reads every accepted
/// connection's request concurrently, and ends only if the listening
/// socket fails (recorded for `request`).
async fn serve(shared: Rc<Shared>, limits: PendingLimits, deadline: Duration) {
    let mut backoff = AcceptBackoff::new(WHAT);
    let mut reading: FuturesUnordered<Reading> = FuturesUnordered::new();
    let mut full_noted = false;
    poll_fn(|cx| {
        // Connections accepted and reads finished in this wake.
        let mut budget = WORK_PER_WAKE;
        loop {
            let mut progress = false;
            // Finished reads free their slots before new connections are taken.
            while budget > 0 {
                match reading.poll_next_unpin(cx) {
                    Poll::Ready(Some(())) => {
                        progress = true;
                        budget -= 1;
                    }
                    _ => break,
                }
            }
            while budget > 0 {
                if !limits.has_room() {
                    if !full_noted {
                        limits.note_full();
                        full_noted = true;
                    }
                    break;
                }
                full_noted = false;
                let accepted = match shared.tcp.borrow().as_ref() {
                    Some(tcp) => backoff.poll_accept(tcp, cx),
                    // The listener is gone; the task is being aborted.
                    None => return Poll::Ready(()),
                };
                match accepted {
                    Poll::Ready(Ok((stream, peer))) => {
                        progress = true;
                        budget -= 1;
                        match limits.admit(peer) {
                            Ok(slot) => reading.push(Box::pin(read_request(
                                stream,
                                peer,
                                slot,
                                shared.clone(),
                                deadline,
                            ))),
                            Err(_) => refuse_now(stream),
                        }
                    }
                    Poll::Ready(Err(e)) => {
                        tracing::error!(error = %e, "{WHAT}: the listening socket failed");
                        *shared.failed.borrow_mut() = Some(e);
                        shared.wake();
                        return Poll::Ready(());
                    }
                    Poll::Pending => break,
                }
            }
            if budget == 0 {
                // More may be ready: go on after the other tasks.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if !progress {
                return Poll::Pending;
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests;
