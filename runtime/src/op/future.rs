//! [`Op`]: the future of one in-flight chain of work requests.

use std::ptr::NonNull;
use std::task::{Context, Poll};

use super::{wr_id, Completable, OpTable};

/// An in-flight op: resolves to `T::Output` when its completion arrives.
///
/// Dropping it before completion parks `T` in the reactor until the device
/// is done.
pub struct Op<T: 'static> {
    /// The runtime's op table, not reference-counted: while the op holds
    /// its data (the only time it uses the table) its slot is live, and a
    /// table with live slots is never freed (the runtime leaks it if it is
    /// dropped with any, see `Driver`'s `Drop`).
    table: NonNull<OpTable>,
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
    pub(crate) fn posted(table: &OpTable, first: u64, data: T) -> Op<T> {
        Op {
            table: NonNull::from(table),
            wr_id: first,
            data: Some(data),
        }
    }

    /// True once the op has handed its data to its output (polled `Ready`).
    #[inline(always)]
    pub(crate) fn is_done(&self) -> bool {
        self.data.is_none()
    }

    /// True once its completion has arrived and it was not polled
    /// `Ready` yet: the next poll returns `Ready` without looking at the
    /// waker.
    pub(crate) fn is_completed(&self) -> bool {
        self.data.is_some() && self.table().is_completed(self.key())
    }

    /// The op table, while the op holds its data.
    #[inline(always)]
    fn table(&self) -> &OpTable {
        debug_assert!(self.data.is_some());
        // SAFETY: called only while `data` is `Some` (`poll` after its
        // check, `drop_in_flight`): the op's slot is then live (it is
        // released only when the data is taken or parked), and the table
        // is never freed with a live slot (see the field's docs).
        unsafe { self.table.as_ref() }
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
        // SAFETY: as in `table` (`data` is `Some`, just checked); the
        // reference is not tied to `this`, whose `data` the closure takes.
        let table = unsafe { this.table.as_ref() };
        let data = &mut this.data;
        table.poll_op(key, cx, |c, post_error| {
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
        if self.data.is_some() {
            let table: *const OpTable = self.table();
            if let Some(data) = self.data.take() {
                // SAFETY: `table` was taken while `data` was `Some` (see
                // `table`); the slot stays live until `drop_op` below.
                unsafe { &*table }.drop_op(self.key(), data);
            }
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
