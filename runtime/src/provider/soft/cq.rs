//! Completion queues: the queue the engine pushes to and the application
//! polls, arming, and overflow.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::time::Instant;

use smallvec::SmallVec;

use super::channel::{Channel, CompChannel};
use super::context::Context;
use super::events::EventQueue;
use super::lock;
use super::wire::{DirectWrite, Wire};
use crate::provider::{
    AsyncElement, AsyncEvent, AsyncEventKind, Completion, ProviderError, Result,
};

/// What [`CqShared::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Push {
    /// Queued.
    Queued,
    /// Queued, and it disarmed the CQ: its channel must be signalled.
    Fired,
    /// Not queued: the CQ is full and in error from now on (the engine
    /// moves its QPs to ERR).
    Overflowed,
    /// Not queued: the CQ had overflowed before.
    Lost,
}

pub(crate) struct CqState {
    queue: VecDeque<Completion>,
    /// `Some(solicited_only)` while armed.
    armed: Option<bool>,
    overflow: bool,
    /// Polls that found the queue empty since the CQ was last armed: from
    /// the second on, the application busy-polls, and its polls receive
    /// themselves (see `drive.rs`).
    idle_polls: u32,
}

/// CQ state shared by the handle and the engine.
pub(crate) struct CqShared {
    pub handle: u32,
    pub capacity: u32,
    state: Mutex<CqState>,
    /// Events acknowledged (outside `state`: the application acks while
    /// the engine pushes).
    acked: AtomicU64,
    channel: Option<Arc<Channel>>,
    async_events: Arc<EventQueue<AsyncEvent>>,
    /// Mirror of `state.armed.is_some()`, read by the engine without the
    /// CQ's lock.
    armed_flag: AtomicBool,
    /// The sockets whose packets complete this CQ's WRs (kept by the
    /// engine): arming the CQ hands them back to the engine.
    pub feeds: Mutex<SmallVec<[Arc<Wire>; 2]>>,
}

impl CqShared {
    pub fn new(
        handle: u32,
        capacity: u32,
        channel: Option<Arc<Channel>>,
        async_events: Arc<EventQueue<AsyncEvent>>,
    ) -> CqShared {
        CqShared {
            handle,
            capacity,
            state: Mutex::new(CqState {
                // Grown as completions queue up (bounded by `capacity`):
                // a CQ sized for every QP's claim holds few entries at
                // once (issue 31).
                queue: VecDeque::new(),
                armed: None,
                overflow: false,
                idle_polls: 0,
            }),
            acked: AtomicU64::new(0),
            channel,
            async_events,
            armed_flag: AtomicBool::new(false),
            feeds: Mutex::new(SmallVec::new()),
        }
    }

    /// Pushes a completion (engine side). `solicited` marks a receive
    /// completion of a solicited message; error completions count as
    /// solicited. True if this disarmed the CQ: the caller must then
    /// [`signal`](Self::signal) its channel (the engine does so once per
    /// loop turn, after all of that turn's completions are in).
    #[must_use]
    pub fn push(&self, wc: Completion, solicited: bool) -> Push {
        let mut st = lock(&self.state);
        if st.overflow {
            return Push::Lost;
        }
        if st.queue.len() >= self.capacity as usize {
            st.overflow = true;
            drop(st);
            tracing::warn!(cq = self.handle, "soft CQ overflow");
            self.async_events.push(AsyncEvent {
                kind: AsyncEventKind::CqErr,
                element: AsyncElement::Cq(self.handle),
            });
            return Push::Overflowed;
        }
        st.queue.push_back(wc);
        let fire = match st.armed {
            Some(only_solicited) => !only_solicited || solicited || !wc.status.is_success(),
            None => false,
        };
        if fire {
            st.armed = None;
            self.armed_flag.store(false, Ordering::SeqCst);
            Push::Fired
        } else {
            Push::Queued
        }
    }

    /// Queues this CQ's event on its channel (after a `push` that fired).
    /// `quiet`: the channel whose `get_event` receives now, and takes the
    /// event itself (no signal needed for it).
    pub fn signal(&self, quiet: Option<&Channel>) {
        if let Some(ch) = &self.channel {
            if quiet.is_some_and(|q| std::ptr::eq(q, &**ch)) {
                ch.events.enqueue_quiet(self.handle);
                return;
            }
            ch.events.push(self.handle);
        }
    }

    /// Completions waiting (tests: looks without receiving).
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        lock(&self.state).queue.len()
    }

    /// True while armed.
    pub fn armed(&self) -> bool {
        self.armed_flag.load(Ordering::SeqCst)
    }

    /// Takes completions; also says whether the caller should receive
    /// itself (nothing there, not armed, and polled empty before).
    fn poll(&self, out: &mut [Completion]) -> Result<(usize, bool)> {
        let mut st = lock(&self.state);
        if st.overflow {
            return Err(ProviderError::CqOverflow {
                cq: self.handle,
                capacity: self.capacity,
            });
        }
        let n = out.len().min(st.queue.len());
        for (slot, wc) in out.iter_mut().zip(st.queue.drain(..n)) {
            *slot = wc;
        }
        let mut drive = false;
        if n == 0 && !out.is_empty() && st.armed.is_none() {
            st.idle_polls = st.idle_polls.saturating_add(1);
            drive = st.idle_polls >= 2;
        }
        Ok((n, drive))
    }

    /// Arms the CQ. Its sockets join its channel's set (the application
    /// is going to sleep on the channel, and its `get_event` receives what
    /// wakes it), the lease on them is renewed to `lease_until`, and the
    /// engine stops watching their input (`muted` is told of each socket
    /// muted now: the engine must learn of it); a
    /// socket that cannot join (the engine is writing to it, or with
    /// app-driven receive off, `None`) is handed back to the engine at once
    /// (after the arming, which keeps the engine from taking it away again).
    /// True if it renewed a lease.
    fn req_notify(
        &self,
        solicited_only: bool,
        registry: &mio::Registry,
        lease_until: impl FnOnce() -> Option<u64>,
        mut muted: impl FnMut(&Wire, u64),
    ) -> bool {
        {
            let mut st = lock(&self.state);
            st.armed = Some(solicited_only);
            st.idle_polls = 0;
            self.armed_flag.store(true, Ordering::SeqCst);
        }
        let feeds = lock(&self.feeds);
        if feeds.is_empty() {
            return false;
        }
        let lease_until = lease_until();
        let mut renewed = false;
        for w in feeds.iter() {
            match (&self.channel, lease_until) {
                // (A connection the engine is writing to stays the
                // engine's: see `CompChannel::receive`.)
                (Some(ch), Some(until)) if !w.engine_busy() && ch.join(w) => {
                    w.renew_lease(until);
                    renewed = true;
                    // The engine need not wake for what arrives now: the
                    // application does (usually the socket is muted already;
                    // after a hand-back it is not). (The lease was just
                    // renewed: it lasts beyond `until - 1`.)
                    if w.mute(registry, until.saturating_sub(1), || false) {
                        muted(w, until);
                    }
                }
                (Some(ch), _) => ch.hand_back(w, registry),
                (None, _) => w.revoke(registry),
            }
        }
        renewed
    }

    /// True if an application sleeping on this CQ's channel wakes when
    /// `wire` receives (it is in the channel's set).
    pub fn app_wakes(&self, wire: &Wire) -> bool {
        self.channel.as_ref().is_some_and(|ch| ch.holds(wire))
    }
}

/// A completion queue of the soft device.
#[derive(Clone)]
pub struct Cq {
    pub(crate) shared: Arc<CqShared>,
    pub(crate) _channel: Option<CompChannel>,
    pub(crate) _ctx: Context,
}

impl Cq {
    /// Handle unique within the context.
    pub fn handle(&self) -> u32 {
        self.shared.handle
    }
    /// Capacity.
    pub fn capacity(&self) -> u32 {
        self.shared.capacity
    }
    /// Arms the CQ for one event.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let sh = self._ctx.shared();
        let until = (!sh.lease.is_zero()).then(|| sh.nanos_at(Instant::now() + sh.lease));
        let muted = |w: &Wire, until| sh.app_muted(w.cid(), until);
        let renewed = self
            .shared
            .req_notify(solicited_only, &sh.registry, || until, muted);
        if let (true, Some(until)) = (renewed, until) {
            // (An engine asleep for these leases only sleeps on.)
            sh.lease_renewed(until);
        }
        // ACKs an earlier receive of this application held for its next
        // request leave now: it goes to sleep, and its peer may wait for
        // them (a lease later, the engine would send them). They wait on
        // the connection they arrived on or on the one to their sender's
        // engine that the QP's requests use (where a request takes them
        // along).
        // Requests posts corked go out too (with the ACKs held on their
        // connections).
        sh.flush_corked();
        // (Only the connections that hold ACKs are taken out of the locks.)
        let holding = |w: &&Arc<Wire>| !w.held_gone_hint();
        let mut held: SmallVec<[Arc<Wire>; 2]> = lock(&self.shared.feeds)
            .iter()
            .filter(holding)
            .cloned()
            .collect();
        held.extend(lock(&sh.wires).values().filter(holding).cloned());
        for w in &held {
            match w.flush_held() {
                None => continue,
                Some(DirectWrite::Spilled) => sh.ring(),
                Some(DirectWrite::Sent) => {}
            }
            sh.arm_flushes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
    /// Takes up to `out.len()` completions. An application that polls an
    /// empty CQ again without arming it busy-polls: then the poll reads
    /// the CQ's connections itself and runs the engine's receive work
    /// (`drive.rs`), sparing the engine thread's wakeup.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        // A burst of posts ends here: what it corked goes out.
        self._ctx.shared().flush_corked();
        let (n, drive) = self.shared.poll(out)?;
        if !drive || self._ctx.shared().lease.is_zero() {
            return Ok(n);
        }
        self._ctx.drive(&self.shared);
        Ok(self.shared.poll(out)?.0)
    }
    /// Acknowledges `n` events.
    pub fn ack_events(&self, n: u32) {
        self.shared.acked.fetch_add(u64::from(n), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_cq_polled_empty_again_without_arming_receives_itself() {
        let events = Arc::new(EventQueue::new().expect("eventfd"));
        let cq = CqShared::new(1, 4, None, events);
        let registry = mio::Poll::new()
            .expect("epoll")
            .registry()
            .try_clone()
            .expect("registry");
        let mut out = [Completion::EMPTY; 2];
        // A sleeping application: drains, arms, polls once more, sleeps.
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
        cq.req_notify(false, &registry, || None, |_, _| {});
        assert!(cq.armed());
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false), "armed");
        let wc = Completion {
            wr_id: 7,
            ..Completion::EMPTY
        };
        assert_eq!(cq.push(wc, false), Push::Fired);
        assert!(!cq.armed());
        assert_eq!(cq.poll(&mut out).expect("poll"), (1, false));
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
        // A busy-polling one: from the second empty poll on, until it arms.
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, true));
        assert_eq!(cq.push(wc, false), Push::Queued);
        assert_eq!(cq.poll(&mut out).expect("poll"), (1, false));
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, true));
        assert_eq!(cq.poll(&mut []).expect("poll"), (0, false), "no room asked");
        cq.req_notify(true, &registry, || None, |_, _| {});
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
    }
}
