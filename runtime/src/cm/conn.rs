//! The life of an established connection, whatever the provider: its
//! phase, why it ended, the tasks waiting for that, and the watcher task
//! that ends the queue pair's pending ops when the peer disconnects.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use crate::qp::QueuePair;
use crate::reactor::{spawn, JoinHandle};

/// Who ended a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisconnectReason {
    /// This side called [`CmConnection::disconnect`](super::CmConnection::disconnect).
    Local,
    /// The peer disconnected (or its connection manager went away).
    Peer,
    /// The device was removed.
    DeviceRemoved,
    /// The connection manager's event stream failed (logged).
    EventsFailed,
}

impl std::fmt::Display for DisconnectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DisconnectReason::Local => "disconnected by this side",
            DisconnectReason::Peer => "disconnected by the peer",
            DisconnectReason::DeviceRemoved => "the device was removed",
            DisconnectReason::EventsFailed => "the connection manager's events failed",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Connected,
    Disconnecting,
    Down(DisconnectReason),
}

/// Shared by a connection's handle and its watcher task.
pub(crate) struct ConnState {
    phase: Cell<Phase>,
    waiters: RefCell<Vec<Waker>>,
}

impl ConnState {
    pub(crate) fn new() -> Rc<ConnState> {
        Rc::new(ConnState {
            phase: Cell::new(Phase::Connected),
            waiters: RefCell::new(Vec::new()),
        })
    }

    /// Why the connection is down, if it is.
    pub(crate) fn reason(&self) -> Option<DisconnectReason> {
        match self.phase.get() {
            Phase::Down(r) => Some(r),
            _ => None,
        }
    }

    /// Marks a local disconnect under way; false if it was not connected.
    pub(crate) fn start_disconnect(&self) -> bool {
        if self.phase.get() == Phase::Connected {
            self.phase.set(Phase::Disconnecting);
            true
        } else {
            false
        }
    }

    /// The connection is down: `peer_side` is the reason unless this side
    /// started the disconnect. The QP moves to ERR, so its pending ops
    /// complete (flushed) and later submissions fail.
    pub(crate) fn finish(&self, peer_side: DisconnectReason, qp: &QueuePair) {
        let reason = match self.phase.get() {
            Phase::Down(_) => return,
            Phase::Disconnecting => DisconnectReason::Local,
            Phase::Connected => peer_side,
        };
        tracing::debug!(qp = qp.qp_num(), %reason, "RDMA CM connection down");
        self.phase.set(Phase::Down(reason));
        // `close` moves the QP to ERR at once; its future (waiting for the
        // flushes) is not needed here.
        drop(qp.close());
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// `Ready` with the reason once the connection is down, else keeps
    /// `cx`'s waker.
    pub(crate) fn poll_down(&self, cx: &mut Context<'_>) -> Poll<DisconnectReason> {
        match self.phase.get() {
            Phase::Down(r) => Poll::Ready(r),
            _ => {
                let mut w = self.waiters.borrow_mut();
                if !w.iter().any(|x| x.will_wake(cx.waker())) {
                    w.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// Resolves with the reason once the connection is down.
    pub(crate) fn down(self: &Rc<Self>) -> impl Future<Output = DisconnectReason> + 'static {
        let me = self.clone();
        std::future::poll_fn(move |cx| me.poll_down(cx))
    }
}

/// Spawns the task that waits for `event` (the provider's "connection
/// down" signal) and then ends the connection.
pub(crate) fn watch<F>(state: &Rc<ConnState>, qp: &QueuePair, event: F) -> JoinHandle<()>
where
    F: Future<Output = DisconnectReason> + 'static,
{
    let state = state.clone();
    let qp = qp.clone();
    spawn(async move {
        let reason = event.await;
        state.finish(reason, &qp);
    })
}
