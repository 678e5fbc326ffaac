//! The CQs the reactor polls and sleeps on: registration, arming, taking
//! channel events, and draining completions into the op table (or to
//! [`complete_reserved`](Driver::complete_reserved) for reserved wr_ids).

use mio::unix::SourceFd;
use mio::{Interest, Token};

use super::{Driver, CHANNEL_BASE};
use crate::op::wr_id;
use crate::provider::{CompChannel, Completion, Cq};
use crate::reactor::RuntimeError;

pub(super) struct CqEntry {
    cq: Cq,
    channel: CompChannel,
    /// `req_notify` was called and no event has been taken since.
    armed: bool,
    /// Events taken from the channel and not yet acknowledged.
    unacked: u32,
    /// The CQ overflowed; it is no longer polled.
    broken: bool,
    /// Its channel is an edge-triggered source
    /// ([`ProviderCaps::edge_triggered_channel`](crate::provider::ProviderCaps)).
    edge_safe: bool,
}

impl Driver {
    // ---- CQs -------------------------------------------------------------

    /// Registers a CQ and its completion channel (one CQ per channel).
    pub(crate) fn register_cq(&self, cq: Cq, channel: CompChannel) -> Result<usize, RuntimeError> {
        let mut cqs = self.cqs.borrow_mut();
        let entry = cqs.vacant_entry();
        let key = entry.key();
        let fd = channel.fd();
        let edge_safe = channel.provider_caps().edge_triggered_channel;
        self.registry
            .register(
                &mut SourceFd(&fd),
                Token(CHANNEL_BASE + key),
                Interest::READABLE,
            )
            .map_err(|source| RuntimeError::Io {
                context: "registering a completion channel with mio",
                source,
            })?;
        entry.insert(CqEntry {
            cq,
            channel,
            armed: false,
            unacked: 0,
            broken: false,
            edge_safe,
        });
        if !edge_safe {
            self.level_channels.set(self.level_channels.get() + 1);
        }
        self.cq_bound.set(self.cq_bound.get().max(key + 1));
        Ok(key)
    }

    /// Forgets a CQ: acknowledges its remaining events, deregisters its channel.
    pub(crate) fn deregister_cq(&self, key: usize) {
        let Some(entry) = self.cqs.borrow_mut().try_remove(key) else {
            return;
        };
        if !entry.edge_safe {
            self.level_channels.set(self.level_channels.get() - 1);
        }
        // Take what is pending so the acknowledgement count is complete.
        let mut unacked = entry.unacked;
        while let Ok(Some(_)) = entry.channel.get_event() {
            unacked += 1;
        }
        if unacked > 0 {
            entry.cq.ack_events(unacked);
        }
        let fd = entry.channel.fd();
        if let Err(e) = self.registry.deregister(&mut SourceFd(&fd)) {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "deregistering a completion channel");
        }
    }

    /// Every channel registered is an edge-triggered source (see
    /// [`ProviderCaps::edge_triggered_channel`](crate::provider::ProviderCaps)):
    /// an outer poller's readiness then tells of every event behind the
    /// epoll fd, and a turn it reported none for may skip `epoll_wait`.
    #[cfg(feature = "tokio")]
    pub(crate) fn channels_edge_safe(&self) -> bool {
        self.level_channels.get() == 0
    }

    /// Arms every CQ not armed yet. Returns false if a call failed.
    pub(crate) fn arm_cqs(&self) {
        for (_, e) in self.cqs.borrow_mut().iter_mut() {
            if !e.armed && !e.broken {
                match e.cq.req_notify(false) {
                    Ok(()) => e.armed = true,
                    Err(err) => {
                        tracing::warn!(cq = e.cq.handle(), error = %crate::report::ErrorChain(&err), "req_notify failed")
                    }
                }
            }
        }
    }

    /// Marks CQ `key` unarmed: something outside the reactor armed it or
    /// took its channel's events, so the next sleep arms it again.
    pub(crate) fn forget_arming(&self, key: usize) {
        if let Some(e) = self.cqs.borrow_mut().get_mut(key) {
            e.armed = false;
        }
    }

    /// Takes the pending events of channel `key` and acknowledges them in
    /// batches.
    ///
    /// The channel serves one CQ, and an armed CQ raises one event, after
    /// which it stays disarmed until the next `req_notify`, which the
    /// reactor calls only once that event is taken. So an event taken for
    /// an armed CQ is the channel's only one: stop there, sparing the
    /// `get_event` that would find the channel empty (a failed `read` on a
    /// verbs channel, per wake). Readiness without an event the reactor was
    /// waiting for (a stale wake-up, a stray event) takes events until the
    /// channel is empty (edge-triggered: none may be left behind).
    pub(super) fn channel_ready(&self, key: usize) {
        let mut cqs = self.cqs.borrow_mut();
        let Some(e) = cqs.get_mut(key) else { return };
        loop {
            match e.channel.get_event() {
                Ok(Some(handle)) => {
                    if handle != e.cq.handle() {
                        tracing::warn!(handle, "event for an unknown CQ on a channel");
                        continue;
                    }
                    let expected = std::mem::replace(&mut e.armed, false);
                    e.unacked += 1;
                    if e.unacked >= self.ack_batch {
                        e.cq.ack_events(e.unacked);
                        e.unacked = 0;
                    }
                    if expected {
                        break;
                    }
                }
                Ok(None) => break,
                Err(err) => {
                    tracing::warn!(error = %crate::report::ErrorChain(&err), "get_event failed");
                    break;
                }
            }
        }
    }

    /// Polls every CQ until empty, completing ops. Returns the number of
    /// completions handled.
    ///
    /// The busy-poll spin calls this once per spin, so the empty case is
    /// kept short: one borrow of the batch, then per CQ one borrow of the
    /// table and one provider poll. Completion handling may run user code
    /// (wakers, the reserved handler): no borrow of the CQ table is held
    /// then; the batch stays borrowed, so a nested call polls no CQ (its
    /// caller's loop takes what is left).
    ///
    /// Inlined into its callers (the spin loop above all): the empty case
    /// then costs no call frame; handling completions is out of line.
    #[inline(always)]
    pub(crate) fn drain_cqs(&self) -> usize {
        let mut total = 0;
        let Ok(mut batch) = self.batch.try_borrow_mut() else {
            return total;
        };
        let bound = self.cq_bound.get();
        let mut key = 0;
        while key < bound {
            let polled = self.poll_cq(key, &mut batch);
            if polled == 1 && batch.len() > 1 && batch[0].wr_id & wr_id::RESERVED != 0 {
                // One reserved completion (a receive ring's message, the
                // common poll of a request-reply loop): the op table is
                // not involved. (Less than a full batch: the CQ is empty.)
                if wr_id::is_ring(batch[0].wr_id) {
                    self.complete_ring(&batch[0]);
                } else {
                    self.complete_reserved(&batch[0]);
                }
                total += 1;
            } else if polled > 0 {
                total += self.complete_batch(key, polled, &mut batch);
            }
            key += 1;
        }
        drop(batch);
        if total > 0 {
            self.completed(total);
        }
        total
    }

    /// Completes the `polled` completions at the start of `batch`, taken
    /// from CQ `key`, and whatever else that CQ holds. Returns how many.
    #[inline(never)]
    fn complete_batch(&self, key: usize, mut polled: usize, batch: &mut [Completion]) -> usize {
        let mut total = 0;
        loop {
            self.ops
                .complete_all(&batch[..polled], |c| self.complete_reserved(c));
            total += polled;
            // Only a full batch leaves the CQ possibly holding more.
            if polled < batch.len() {
                return total;
            }
            polled = self.poll_cq(key, batch);
            if polled == 0 {
                return total;
            }
        }
    }

    /// After `n` completions: counts them, frees the data of dropped ops
    /// they finished, forgets the dropped queues that drained. Two flag
    /// tests inline; the work out of line.
    #[inline(always)]
    fn completed(&self, n: usize) {
        let c = &self.ops.counters.completions;
        c.set(c.get() + n as u64);
        self.ops.bury();
        if self.draining.get() > 0 {
            self.forget_drained();
        }
    }

    /// Polls CQ `key` into `batch`; 0 if it is gone or broken.
    #[inline(always)]
    fn poll_cq(&self, key: usize, batch: &mut [Completion]) -> usize {
        let res = match self.cqs.borrow().get(key) {
            Some(e) if !e.broken => e.cq.poll(batch),
            _ => return 0,
        };
        match res {
            Ok(n) => n,
            Err(err) => {
                self.cq_broken(key, err);
                0
            }
        }
    }

    #[cold]
    fn cq_broken(&self, key: usize, err: crate::provider::ProviderError) {
        if let Some(e) = self.cqs.borrow_mut().get_mut(key) {
            tracing::error!(cq = e.cq.handle(), error = %crate::report::ErrorChain(&err), "CQ poll failed; CQ abandoned");
            e.broken = true;
        }
    }
}
