//! Device async events (port state, QP and CQ errors): the context's
//! async-event fd registered with mio, events logged and kept for
//! `Device::next_async_event`.

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

use mio::unix::SourceFd;
use mio::{Interest, Token};

use super::{Driver, ASYNC_BASE, ASYNC_QUEUE};
use crate::provider::{AsyncElement, AsyncEvent, AsyncEventKind};

/// Called on an SRQ-limit event of its SRQ; false once its owner is gone
/// (then it is forgotten).
pub(crate) type SrqLimitHook = Box<dyn Fn() -> bool>;

pub(super) struct AsyncEntry {
    ctx: crate::provider::Context,
    queue: VecDeque<AsyncEvent>,
    waker: Option<Waker>,
    /// SRQ-limit listeners, by SRQ handle (`qp::srq_ring`).
    srq_hooks: Vec<(u32, SrqLimitHook)>,
}

impl Driver {
    // ---- async events ----------------------------------------------------

    /// Watches a context's async-event fd. `None` if it cannot be registered
    /// (e.g. another `Device` on the same context already watches it).
    pub(crate) fn register_async(&self, ctx: crate::provider::Context) -> Option<usize> {
        let mut asyncs = self.asyncs.borrow_mut();
        let entry = asyncs.vacant_entry();
        let key = entry.key();
        let fd = ctx.async_fd();
        match self.registry.register(
            &mut SourceFd(&fd),
            Token(ASYNC_BASE + key),
            Interest::READABLE,
        ) {
            Ok(()) => {
                entry.insert(AsyncEntry {
                    ctx,
                    queue: VecDeque::new(),
                    waker: None,
                    srq_hooks: Vec::new(),
                });
                Some(key)
            }
            Err(e) => {
                tracing::debug!(error = %crate::report::ErrorChain(&e), "async-event fd not watched");
                None
            }
        }
    }

    pub(crate) fn deregister_async(&self, key: usize) {
        let Some(entry) = self.asyncs.borrow_mut().try_remove(key) else {
            return;
        };
        let fd = entry.ctx.async_fd();
        if let Err(e) = self.registry.deregister(&mut SourceFd(&fd)) {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "deregistering an async-event fd");
        }
    }

    /// Calls `hook` on every SRQ-limit event of the SRQ `handle` of the
    /// context watched as `key` (the event is still queued for
    /// `Device::next_async_event`).
    pub(crate) fn watch_srq_limit(&self, key: usize, handle: u32, hook: SrqLimitHook) {
        if let Some(e) = self.asyncs.borrow_mut().get_mut(key) {
            e.srq_hooks.push((handle, hook));
        }
    }

    /// Takes every pending async event of `key`, logs it and queues it.
    pub(super) fn async_ready(&self, key: usize) {
        let mut limits: Vec<u32> = Vec::new();
        let waker = {
            let mut asyncs = self.asyncs.borrow_mut();
            let Some(e) = asyncs.get_mut(key) else { return };
            loop {
                match e.ctx.get_async_event() {
                    Ok(Some(ev)) => {
                        match ev.kind {
                            AsyncEventKind::CommEst
                            | AsyncEventKind::PortActive
                            | AsyncEventKind::SqDrained
                            | AsyncEventKind::LidChange
                            | AsyncEventKind::GidChange
                            | AsyncEventKind::SrqLimitReached => {
                                tracing::debug!(?ev, "async event")
                            }
                            _ => tracing::warn!(?ev, "async event"),
                        }
                        if let (AsyncEventKind::SrqLimitReached, AsyncElement::Srq(h)) =
                            (ev.kind, ev.element)
                        {
                            limits.push(h);
                        }
                        if e.queue.len() >= ASYNC_QUEUE {
                            e.queue.pop_front();
                        }
                        e.queue.push_back(ev);
                    }
                    Ok(None) => break,
                    Err(err) => {
                        tracing::warn!(error = %crate::report::ErrorChain(&err), "get_async_event failed");
                        break;
                    }
                }
            }
            e.waker.take()
        };
        if !limits.is_empty() {
            self.run_srq_hooks(key, &limits);
        }
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Runs the hooks of the SRQs in `handles` (outside the registry's
    /// borrow: a hook posts receives), dropping those whose owner is gone.
    fn run_srq_hooks(&self, key: usize, handles: &[u32]) {
        let hooks = match self.asyncs.borrow_mut().get_mut(key) {
            Some(e) => std::mem::take(&mut e.srq_hooks),
            None => return,
        };
        let kept: Vec<(u32, SrqLimitHook)> = hooks
            .into_iter()
            .filter(|(h, hook)| !handles.contains(h) || hook())
            .collect();
        if let Some(e) = self.asyncs.borrow_mut().get_mut(key) {
            let added = std::mem::replace(&mut e.srq_hooks, kept);
            e.srq_hooks.extend(added);
        }
    }

    /// The next async event of `key` (`Ready(None)` if it is not watched).
    pub(crate) fn poll_async_event(
        &self,
        key: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Option<AsyncEvent>> {
        let mut asyncs = self.asyncs.borrow_mut();
        let Some(e) = asyncs.get_mut(key) else {
            return Poll::Ready(None);
        };
        if let Some(ev) = e.queue.pop_front() {
            return Poll::Ready(Some(ev));
        }
        match &e.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => e.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}
