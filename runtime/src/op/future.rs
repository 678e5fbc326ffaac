//! [`Op`]: the future of one in-flight chain of work requests.

use std::rc::Rc;
use std::task::{Context, Poll};

use super::{wr_id, Completable, OpTable};

/// An in-flight op: resolves to `T::Output` when its completion arrives.
///
/// Dropping it before completion parks `T` in the reactor until the device
/// is done.
pub struct Op<T: 'static> {
    table: Rc<OpTable>,
    /// The first WR's wr_id (its slot key in the low bits). An `Op` exists
    /// only once its WRs are posted (the data waits in the `Submit` before).
    wr_id: u64,
    data: Option<T>,
}

// `Op` never pins its data: it is plain owned state handed to `complete`.
impl<T: 'static> Unpin for Op<T> {}

impl<T: 'static> Op<T> {
    /// The op of WRs just posted: `first` is the first WR's wr_id, `data`
    /// what they lend to the device (kept until the completion, or parked).
    #[inline(always)]
    pub(crate) fn posted(table: Rc<OpTable>, first: u64, data: T) -> Op<T> {
        Op {
            table,
            wr_id: first,
            data: Some(data),
        }
    }

    /// True once the op has handed its data to its output (polled `Ready`).
    #[inline(always)]
    pub(crate) fn is_done(&self) -> bool {
        self.data.is_none()
    }

    /// Drops a done op's fields in place, without running `Drop` for it
    /// (which does nothing for a done op): only its table handle owns
    /// anything. Inlined where an op's future is dropped after its output
    /// was taken (the common case), in place of the drop glue's call.
    ///
    /// # Safety
    ///
    /// The op is done ([`is_done`](Self::is_done)) and is never used nor
    /// dropped again (its owner is being dropped, without drop glue for it).
    #[inline(always)]
    pub(crate) unsafe fn drop_done(&mut self) {
        debug_assert!(self.is_done());
        // SAFETY: the caller guarantees the op is not used nor dropped
        // again, so `table` is dropped exactly once; `data` is `None` and
        // `wr_id` a plain value: nothing else to drop.
        unsafe { std::ptr::drop_in_place(&mut self.table) }
    }

    #[inline(always)]
    fn key(&self) -> usize {
        (self.wr_id & wr_id::KEY_MASK) as usize
    }

    /// The wr_id of the op's first WR (index 0 of its chain).
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The op's data, while it is in flight.
    pub fn data(&self) -> Option<&T> {
        self.data.as_ref()
    }
}

impl<T: Completable> std::future::Future for Op<T> {
    type Output = T::Output;

    #[inline(always)]
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = &mut *self;
        if this.data.is_none() {
            tracing::error!(wr_id = this.wr_id, "op polled after completion");
            return Poll::Pending;
        }
        let key = this.key();
        let data = &mut this.data;
        this.table.poll_op(key, cx, |c, post_error| {
            // Invariant: `data` is `Some` (checked at the top of this
            // function, and nothing took it since).
            let data = data.take().expect("op data present until Ready");
            match post_error {
                Some(e) => data.fail(*e),
                None => data.complete(c),
            }
        })
    }
}

impl<T: 'static> Drop for Op<T> {
    /// Inline: a completed op (the common case) has nothing to give back.
    #[inline]
    fn drop(&mut self) {
        if self.data.is_some() {
            self.drop_in_flight();
        }
    }
}

impl<T: 'static> Op<T> {
    /// Dropped before its completion was collected: parks the data.
    #[cold]
    #[inline(never)]
    fn drop_in_flight(&mut self) {
        if let Some(data) = self.data.take() {
            self.table.drop_op(self.key(), data);
        }
    }
}

impl<T: 'static> std::fmt::Debug for Op<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("wr_id", &format_args!("{:#x}", self.wr_id))
            .field("done", &self.data.is_none())
            .finish()
    }
}
