//! The pieces of one split message in flight: `Rdma::send` posts them back
//! to back, under the credit window, instead of waiting for each one's
//! completion before posting the next (which made every piece cost a
//! round trip, and on a device that delays ACKs, the ACK delay too).
//! Their completions are collected as they arrive (each gives its pool
//! buffer back) and the last one is awaited before `send` returns.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::{Context, Poll};

use super::error::AgentError;
use super::rdma::{PostedSend, Shared};

/// The posted, not yet completed SENDs of one message's pieces, oldest
/// first.
pub(crate) struct PiecesInFlight<'s> {
    shared: &'s Shared,
    sends: VecDeque<PostedSend>,
}

impl<'s> PiecesInFlight<'s> {
    /// None in flight yet.
    pub(crate) fn new(shared: &'s Shared) -> Self {
        PiecesInFlight {
            shared,
            sends: VecDeque::new(),
        }
    }

    /// A piece's SEND was posted: kept until it completes. Takes the
    /// completions that arrived meanwhile without waiting (so a long
    /// message holds the buffers of its unacknowledged pieces only); a
    /// failed one is the message's error (the connection is down then).
    pub(crate) async fn push(&mut self, sent: PostedSend) -> Result<(), AgentError> {
        self.sends.push_back(sent);
        poll_fn(|cx| Poll::Ready(self.reap(cx))).await
    }

    /// Waits for every piece's completion.
    pub(crate) async fn finish(mut self) -> Result<(), AgentError> {
        while let Some(sent) = self.sends.pop_front() {
            self.shared.completed(sent).await?;
        }
        Ok(())
    }

    /// Takes the completed SENDs at the front.
    fn reap(&mut self, cx: &mut Context<'_>) -> Result<(), AgentError> {
        while let Some(front) = self.sends.front_mut() {
            let Poll::Ready((res, _buf)) = Pin::new(front).poll(cx) else {
                return Ok(());
            };
            self.sends.pop_front();
            if let Err(e) = res {
                return Err(self.shared.verb_error(e));
            }
        }
        Ok(())
    }
}
