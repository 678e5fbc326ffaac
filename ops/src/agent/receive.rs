//! [`Receive`]: the future of `Rdma::receive_msg`. It takes a queued
//! message if there is one; else, as the driving receiver, it takes the
//! connection's receive completions itself (`task::step`) and returns the
//! first user message straight from its receive buffer.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use super::backlog::SMALL_ITEM_CHARGE;
use super::error::AgentError;
use super::msg::RecvMsg;
use super::rdma::Shared;
use super::receiving::Begin;
use super::task::{deliver, step, Step};

/// Waits for the connection's next user message. Cancel-safe: a message
/// is only taken by the poll that returns it; dropped while driving, it
/// lets the next receiver drive. It holds the connection (no borrow), so
/// a `Stream` can keep it.
pub(crate) struct Receive {
    shared: Rc<Shared>,
    id: u64,
    /// Returned its output (and left the receivers).
    done: bool,
}

impl Receive {
    #[inline(always)]
    pub(crate) fn new(shared: &Rc<Shared>) -> Receive {
        Receive {
            shared: shared.clone(),
            id: shared.rx.receiver_id(),
            done: false,
        }
    }
}

impl Future for Receive {
    type Output = Result<RecvMsg, AgentError>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let (shared, id) = (&this.shared, this.id);
        let rx = &shared.rx;
        loop {
            match rx.begin(id, true, cx) {
                Begin::Queued(m) => {
                    rx.leave(id);
                    this.done = true;
                    shared.taken(m.charge(shared.config.posted_buf_size()));
                    super::staged_lend::handed(shared, &m);
                    return Poll::Ready(Ok(m));
                }
                Begin::Closed => {
                    rx.leave(id);
                    this.done = true;
                    return Poll::Ready(Err(shared.closed_error()));
                }
                Begin::Wait => return Poll::Pending,
                // Nothing completed since the oldest receive was polled
                // pending: the fan wakes this receiver when it does.
                Begin::Drive if rx.armed() => {
                    if rx.drive_wait(cx) {
                        return Poll::Pending;
                    }
                    continue;
                }
                Begin::Drive => {}
            }
            match step(shared) {
                Step::Pending => {
                    if rx.drive_wait(cx) {
                        return Poll::Pending;
                    }
                }
                // Straight to the caller: never queued, so never charged.
                Step::Msg(m) => {
                    rx.leave(id);
                    this.done = true;
                    settle(shared);
                    super::staged_lend::handed(shared, &m);
                    return Poll::Ready(Ok(m));
                }
                // A control message, a piece (a completed message is in the
                // inbox now), or the end: look again.
                Step::Continue | Step::Stop => {}
            }
        }
    }
}

/// Takes what else completed (queued for the next receive) until the
/// oldest receive is pending again: then the ring's check at the end of
/// the pass finds nothing left for the agent task to take. Nothing on a
/// shared receive queue (no ring of its own: the agent task reads its
/// messages). It stops once every spare slot is lent: a burst of
/// messages (a window of the peer's sends) taken whole would copy every
/// one past the spare slots out of its slot (half of a 4 KiB window did);
/// the rest stay in the ring for the next receive, which usually comes
/// in the same task poll, after the application let go of the messages
/// before (if none comes in this loop pass, the pass's check wakes the
/// agent task, which takes them as it did before).
#[inline(always)]
fn settle(shared: &Rc<Shared>) {
    if !shared.rx.owns_ring() {
        return;
    }
    loop {
        // The usual case, checked without a step.
        if shared.rx.ring_waiting() || shared.rx.lending_full() {
            break;
        }
        match step(shared) {
            Step::Pending => break,
            Step::Stop => return,
            Step::Msg(m) => deliver(shared, m),
            Step::Continue => {}
        }
    }
}

impl Drop for Receive {
    #[inline(always)]
    fn drop(&mut self) {
        if !self.done {
            self.shared.rx.leave(self.id);
        }
    }
}

/// Waits for the immediate of the peer's next WRITE_WITH_IMM, driving the
/// connection's receives like [`Receive`] when no other receiver does (the
/// completion then wakes this task, not the agent's).
pub(crate) struct ReceiveImm<'a> {
    shared: &'a Rc<Shared>,
    id: u64,
}

impl<'a> ReceiveImm<'a> {
    pub(crate) fn new(shared: &'a Rc<Shared>) -> ReceiveImm<'a> {
        ReceiveImm {
            shared,
            id: shared.rx.receiver_id(),
        }
    }
}

impl Future for ReceiveImm<'_> {
    type Output = Result<u32, AgentError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (shared, id) = (self.shared, self.id);
        let rx = &shared.rx;
        loop {
            match shared.write_imms.poll_recv(None, cx) {
                Poll::Ready(Some((_, imm))) => {
                    rx.leave(id);
                    settle(shared);
                    shared.taken(SMALL_ITEM_CHARGE);
                    return Poll::Ready(Ok(imm));
                }
                Poll::Ready(None) => {
                    rx.leave(id);
                    return Poll::Ready(Err(shared.closed_error()));
                }
                Poll::Pending => {}
            }
            match rx.begin(id, false, cx) {
                // The immediates' inbox closes with the receive side.
                Begin::Queued(_) | Begin::Closed | Begin::Wait => return Poll::Pending,
                Begin::Drive if rx.armed() => {
                    if rx.drive_wait(cx) {
                        return Poll::Pending;
                    }
                    continue;
                }
                Begin::Drive => {}
            }
            match step(shared) {
                Step::Pending => {
                    if rx.drive_wait(cx) {
                        return Poll::Pending;
                    }
                }
                Step::Msg(m) => deliver(shared, m),
                Step::Continue | Step::Stop => {}
            }
        }
    }
}

impl Drop for ReceiveImm<'_> {
    fn drop(&mut self) {
        self.shared.rx.leave(self.id);
    }
}
