//! [`TaggedInbox`]: the queue of memory regions handed over by the peer,
//! each with the user tag it travelled with. A receiver takes the oldest
//! entry, or the oldest entry with a given tag (entries with other tags stay
//! queued for their own receivers). Single-threaded; cancel-safe (an entry
//! is only removed by the poll that returns it).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::task::{Context, Poll, Waker};

/// A queue of tagged items closed when the agent stops.
#[derive(Debug)]
pub(crate) struct TaggedInbox<T> {
    state: RefCell<State<T>>,
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<(u64, T)>,
    waiters: Vec<Waker>,
    closed: bool,
}

impl<T> TaggedInbox<T> {
    pub(crate) fn new() -> TaggedInbox<T> {
        TaggedInbox {
            state: RefCell::new(State {
                items: VecDeque::new(),
                waiters: Vec::new(),
                closed: false,
            }),
        }
    }

    /// Queues `item` with `tag` and wakes the receivers; false (the item
    /// is dropped) if the inbox is closed.
    pub(crate) fn push(&self, tag: u64, item: T) -> bool {
        let waiters = {
            let mut s = self.state.borrow_mut();
            if s.closed {
                return false;
            }
            s.items.push_back((tag, item));
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
        true
    }

    /// No more items will come: receivers get `None` once nothing queued
    /// matches them.
    pub(crate) fn close(&self) {
        let waiters = {
            let mut s = self.state.borrow_mut();
            s.closed = true;
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }

    /// The oldest item (with tag `want`, if given) and its tag; `None` once
    /// the inbox is closed and holds no such item.
    pub(crate) async fn recv(&self, want: Option<u64>) -> Option<(u64, T)> {
        poll_fn(|cx| self.poll_recv(want, cx)).await
    }

    /// [`TaggedInbox::recv`] as a poll: registers `cx` when nothing matches.
    pub(crate) fn poll_recv(&self, want: Option<u64>, cx: &Context<'_>) -> Poll<Option<(u64, T)>> {
        let mut s = self.state.borrow_mut();
        let at = s
            .items
            .iter()
            .position(|(tag, _)| want.is_none_or(|w| w == *tag));
        if let Some(i) = at {
            return Poll::Ready(s.items.remove(i));
        }
        if s.closed {
            return Poll::Ready(None);
        }
        // Polled again without a push (a spurious wake, a `select!`
        // loop): one entry per receiver, not one per poll.
        if !s.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            s.waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Items queued.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.state.borrow().items.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use std::future::Future;

    #[test]
    fn a_receiver_polled_again_waits_once() {
        let inbox: TaggedInbox<&str> = TaggedInbox::new();
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let mut rx = std::pin::pin!(inbox.recv(None));
        for _ in 0..10 {
            assert!(rx.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(inbox.state.borrow().waiters.len(), 1);
        inbox.push(0, "x");
        assert_eq!(rx.poll(&mut cx), Poll::Ready(Some((0, "x"))));
    }

    #[test]
    fn by_tag_or_in_order_and_closed() {
        let inbox = TaggedInbox::new();
        inbox.push(1, "a");
        inbox.push(2, "b");
        inbox.push(1, "c");
        assert_eq!(block_on(inbox.recv(Some(2))), Some((2, "b")));
        assert_eq!(block_on(inbox.recv(None)), Some((1, "a")));
        // Cancelled before it got anything: takes nothing.
        drop(inbox.recv(Some(9)));
        assert_eq!(inbox.len(), 1);
        inbox.close();
        assert_eq!(block_on(inbox.recv(Some(9))), None);
        assert_eq!(
            block_on(inbox.recv(Some(1))),
            Some((1, "c")),
            "queued before the close"
        );
        assert_eq!(block_on(inbox.recv(None)), None);
        inbox.push(3, "late");
        assert_eq!(inbox.len(), 0, "closed inboxes take nothing");
    }
}
