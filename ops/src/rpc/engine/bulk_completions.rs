//! The large-message path's completions: READs and WRITEs finished and
//! WRITEs with immediate landed, taken from the transport for the jobs
//! they belong to.

use std::task::Context;

use super::Core;

impl<P: Clone> Core<P> {
    /// Whether the large-message path may have something to report: READs
    /// or WRITEs under way, or requests exposed (a WRITE with immediate
    /// may land in them).
    pub(crate) fn bulk_busy(&self) -> bool {
        !self.reads.is_empty() || !self.writes.is_empty() || self.requests_exposed > 0
    }

    /// Takes the READs and WRITEs that finished and the WRITEs with
    /// immediate that landed; registers `cx` for the next.
    pub(crate) fn poll_bulk(&mut self, cx: &mut Context<'_>) {
        if self.links_opened {
            self.poll_link_packets(cx);
        }
        // Completions before immediates: a server's response WRITE done
        // before its client's next request lands makes that buffer the
        // slot's next room (`written_requests.rs`, `on_request_landed`).
        if let Some(bulk) = self.bulk.as_mut() {
            bulk.poll_done(cx, &mut self.bulk_done);
            if !self.bulk_done.is_empty() {
                let mut done = std::mem::take(&mut self.bulk_done);
                for (token, buf, result) in done.drain(..) {
                    self.on_read_done(token, buf, result);
                }
                self.bulk_done = done;
            }
        }
        self.poll_written(cx);
    }

    /// Polls the large-message path's operations once with the
    /// dispatcher's waker, so that one just started (a written request's
    /// WRITE) wakes the dispatcher when it completes, or when it can be
    /// posted if it waits for credits, without a run of the dispatcher
    /// for it now (a task run and a poll of every receive source, per
    /// call). What finished already stays in `bulk_done` for the
    /// dispatcher's next run, woken for it.
    pub(crate) fn arm_bulk_ops(&mut self) {
        let (Some(bulk), Some(w)) = (self.bulk.as_mut(), self.dispatcher.as_ref()) else {
            return;
        };
        bulk.poll_done(&mut Context::from_waker(w), &mut self.bulk_done);
        if !self.bulk_done.is_empty() {
            w.wake_by_ref();
        }
    }
}
