//! The dispatcher: an endpoint's engine with its transport ([`Engine`]),
//! and the tasks that drive it: the dispatcher task (receives, starts
//! handlers, sends) and the timer task (retransmission, idle sweep,
//! keepalive).

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tracing::warn;
use verbio_runtime::Sleep;

use super::engine::client_calls::Req;
use super::engine::idle::SWEEPS_PER_TIMEOUT;
use super::engine::resend::TICKS_PER_RTO;
use super::engine::Core;
use super::error::RpcError;
use super::header::HEADER_LEN;
use super::transport::Transport;
use super::waker::keep_waker;

/// The transport and the rest of the engine.
pub(crate) struct Engine<T: Transport> {
    pub(crate) transport: T,
    pub(crate) core: Core<T::Peer>,
}

impl<T: Transport> Engine<T> {
    /// Sends the queued packets with one transport call. Inline, the check
    /// that there is nothing to do: a small call's client dispatcher, which
    /// only completed the call, sends nothing.
    #[inline]
    pub(crate) fn flush(&mut self) {
        let c = &self.core;
        if c.tx.is_empty() && c.pumps.is_empty() && c.links_wanted.is_empty() && c.acks.is_empty() {
            return;
        }
        self.flush_queued();
    }

    /// [`flush`](Self::flush) with something queued.
    #[inline(never)]
    fn flush_queued(&mut self) {
        self.core.run_pumps();
        if !self.core.acks.is_empty() {
            self.core.send_acks();
        }
        if self.core.tx.is_empty() {
            return;
        }
        self.core.stats.packets_sent += self.core.tx.len() as u64;
        if let Err(error) = self.transport.send(&self.core.tx) {
            // Lost like a dropped packet: retransmission covers it.
            warn!(%error, packets = self.core.tx.len(), "rpc: send failed");
        }
        self.core.tx.clear();
    }

    /// Has the dispatcher send the queued packets when it next runs: after
    /// the tasks woken before it, e.g. the other handlers finishing in this
    /// turn, so that their responses leave in one transport call (one post
    /// list: on the soft device one socket write, not one per response).
    /// Sends them now if the dispatcher has not run yet.
    fn flush_soon(&mut self) {
        match &self.core.dispatcher {
            Some(w) => w.wake_by_ref(),
            None => self.flush(),
        }
    }

    /// A handler task answered its request: the last request open sends
    /// the responses queued now, as no other handler can add to the batch
    /// (no dispatcher run just to flush: a small call's task runs drop
    /// from five to four); with others open, [`flush_soon`](Self::flush_soon).
    pub(crate) fn flush_after_handler(&mut self) {
        self.core.jobs_open = self.core.jobs_open.saturating_sub(1);
        if self.core.jobs_open == 0 {
            self.flush();
        } else {
            self.flush_soon();
        }
    }

    /// Starts a call ([`Call`](super::call::Call)): takes a free slot of session `sid` and
    /// sends what the credits allow (`Core::poll_start`); `Pending` while
    /// every slot is busy.
    #[inline]
    pub(crate) fn start_call(
        &mut self,
        sid: u32,
        req_type: u8,
        req: &mut Req<'_>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(usize, u64), RpcError>> {
        // The request's first packet.
        let packet_len = req.len().saturating_add(HEADER_LEN);
        let r = self.core.poll_start(sid, req_type, req, cx);
        match r {
            // Other calls of the session under way: sent by the
            // dispatcher, woken now, with the others started before it
            // runs (in this loop pass): one transport call for them.
            Poll::Ready(Ok((slot, _)))
                if self
                    .transport
                    .batch_call_starts(packet_len.min(self.core.max_packet))
                    && self.core.others_active(sid, slot) =>
            {
                self.flush_soon();
            }
            Poll::Ready(_) => self.flush(),
            Poll::Pending => {}
        }
        r
    }

    /// Answers the connect packets received (`engine/admission.rs`).
    fn accept_connects(&mut self) {
        if self.core.connect_requests.is_empty() {
            return;
        }
        let Engine { transport, core } = self;
        core.accept_connects(|addr| transport.resolve(addr));
    }

    /// Receives one batch: hands each packet to the engine, polls the
    /// READs, answers connects. Whether to go on (the transport may have
    /// more). Inlined into the dispatcher, its only caller (two call sites).
    #[inline(always)]
    fn recv_batch(&mut self, cx: &mut Context<'_>) -> bool {
        let Engine { transport, core } = self;
        let batch = core.config.recv_batch;
        let got = transport.poll_recv(cx, batch, &mut |p| core.on_packet(p));
        if core.bulk_busy() || core.links_opened {
            // Only READs, WRITEs and WRITEs with immediate into exposed
            // requests report there: with none under way and no request
            // exposed, nothing to poll (nor a waker to register).
            core.poll_bulk(cx);
        }
        let drained = transport.short_batch_registers();
        self.accept_connects();
        match got {
            // Fewer than asked for: the transport is drained and
            // wakes this task for the next packet.
            Poll::Ready(Ok(n)) if n < batch && drained => false,
            Poll::Ready(Ok(n)) => n > 0,
            Poll::Ready(Err(error)) => {
                warn!(%error, "rpc: receive failed");
                false
            }
            Poll::Pending => false,
        }
    }

    /// Starts the requests queued for idle handler tasks in their slots
    /// (`runner.rs`), with no borrow of the engine held while a handler
    /// runs (it may use the endpoint: call another server, say); then
    /// sends what is queued.
    fn start_handlers(engine: &RefCell<Engine<T>>) {
        loop {
            let mut e = engine.borrow_mut();
            let Some(super::engine::Start {
                id,
                req_type,
                runner,
            }) = e.core.starts.pop_front()
            else {
                // Sent with the borrow this check took.
                e.flush();
                return;
            };
            let Some(request) = e.core.take_request(id) else {
                // Its session closed meanwhile: the task's slot is free.
                e.core.runner_free(req_type, runner);
                continue;
            };
            drop(e);
            let outcome = runner.1.start(request, &mut Context::from_waker(&runner.0));
            engine
                .borrow_mut()
                .core
                .started(id, req_type, runner, outcome);
        }
    }

    /// The dispatcher: receives, answers, starts handlers.
    pub(crate) fn poll_dispatch(engine: &RefCell<Engine<T>>, cx: &mut Context<'_>) -> Poll<()> {
        let mut e = engine.borrow_mut();
        #[cfg(test)]
        {
            e.core.work.dispatches += 1;
        }
        keep_waker(&mut e.core.dispatcher, cx);
        let mut more = e.recv_batch(cx);
        drop(e);
        let mut rounds = 0;
        loop {
            Self::start_handlers(engine);
            if !more {
                break;
            }
            rounds += 1;
            if rounds == 8 {
                // Let the calls and handlers woken so far run.
                cx.waker().wake_by_ref();
                break;
            }
            more = engine.borrow_mut().recv_batch(cx);
        }
        Poll::Pending
    }

    /// The timer task: the retransmission timer while calls or connects
    /// are under way, the idle sweep while server sessions are open, the
    /// keepalive while client sessions ping. Apart from the dispatcher so
    /// that receiving polls no timer (woken by `Core::wake_ticker` when a
    /// timer is to be armed, and by its timers).
    pub(crate) fn poll_timers(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        keep_waker(&mut self.core.ticker, cx);
        let tick = self.core.config.rto / TICKS_PER_RTO;
        while self.core.timer_wanted && fired(&mut self.core.timer, tick, cx) {
            self.core.now += 1;
            self.core.timer_wanted = self.core.on_timer();
            self.flush();
        }
        self.poll_idle_sweep(cx);
        self.poll_keepalive(cx);
        Poll::Pending
    }

    /// Pings the client sessions due (`engine/idle.rs`) while any ping; the timer
    /// is dropped when none do.
    fn poll_keepalive(&mut self, cx: &mut Context<'_>) {
        while let Some(period) = self.core.keepalive_period {
            if !fired(&mut self.core.keepalive_timer, period, cx) {
                break;
            }
            self.core.send_pings();
            self.flush();
        }
        if self.core.keepalive_period.is_none() {
            self.core.keepalive_timer = None;
        }
    }

    /// Runs the idle sweep (`engine/idle.rs`) while server sessions are open and
    /// an idle timeout is set; its timer is dropped when none are.
    fn poll_idle_sweep(&mut self, cx: &mut Context<'_>) {
        let Some(timeout) = self.core.config.session_idle_timeout else {
            return;
        };
        let period = timeout / SWEEPS_PER_TIMEOUT;
        while self.core.server_sessions > 0 && fired(&mut self.core.idle_timer, period, cx) {
            self.core.sweep_idle();
            self.flush();
        }
        if self.core.server_sessions == 0 {
            self.core.idle_timer = None;
        }
    }
}

/// Polls a periodic timer (armed for `period` when `None`): true once it
/// fired, then disarmed for the next period.
fn fired(timer: &mut Option<Sleep>, period: Duration, cx: &mut Context<'_>) -> bool {
    let t = timer.get_or_insert_with(|| verbio_runtime::sleep(period));
    if Pin::new(t).poll(cx).is_pending() {
        return false;
    }
    *timer = None;
    true
}

impl<T: Transport> Drop for Engine<T> {
    fn drop(&mut self) {
        if let Some(w) = self.core.dispatcher.take() {
            w.wake();
        }
        if let Some(w) = self.core.ticker.take() {
            w.wake();
        }
        for queue in self.core.handlers.iter_mut().flatten() {
            for (w, _) in queue.idle.drain(..) {
                w.wake();
            }
        }
    }
}
