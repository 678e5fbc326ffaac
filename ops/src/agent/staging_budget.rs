//! [`StagingBudget`]: the bytes of staging rings (`staging.rs`) that the
//! `Rdma` connections sharing it may hold registered at once, so that the
//! memory peers can make a side pin for rings is bounded however many
//! connections they open.
//!
//! A connection takes its ring's bytes from the budget when it would
//! register the ring (the first time the peer sends a message the ring
//! would carry) and gives them back when its agent stops or the
//! connection is dropped. A connection that finds the budget spent does
//! not announce a ring (no message on the wire): its peer keeps sending
//! mid-size messages in pieces or offering them by READ, and the
//! connection asks again at the peer's next such message, so that rings
//! given back go to the connections that still use the mid-size path.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Default [`StagingBudget`] of each runtime thread: 64 MiB, sixteen
/// rings of the default [`DEFAULT_STAGING_RING`](super::DEFAULT_STAGING_RING)
/// (4 MiB). Sixteen connections streaming mid-size messages at once is
/// beyond what one runtime thread moves at full speed (each ring is
/// sized for one connection's window of messages up to 1 MiB), and 64 MiB
/// pinned is what a server commits to however many peers connect.
pub const DEFAULT_STAGING_BUDGET: usize = 64 << 20;

/// Bytes of staging rings that the `Rdma` connections sharing this budget
/// may hold registered at once (see
/// [`RdmaBuilder::staging_budget`](super::RdmaBuilder::staging_budget)).
/// Cheap to clone (the clones share one count) and usable from any
/// thread. By default every connection of a runtime thread shares that
/// thread's budget of [`DEFAULT_STAGING_BUDGET`] bytes
/// ([`StagingBudget::this_thread`]).
#[derive(Debug, Clone)]
pub struct StagingBudget(Arc<Counts>);

#[derive(Debug)]
struct Counts {
    limit: usize,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    refused: AtomicU64,
}

thread_local! {
    static THIS_THREAD: StagingBudget = StagingBudget::new(DEFAULT_STAGING_BUDGET);
}

impl StagingBudget {
    /// A budget of `limit` bytes (0: no connection gets a ring).
    pub fn new(limit: usize) -> StagingBudget {
        StagingBudget(Arc::new(Counts {
            limit,
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        }))
    }

    /// The budget that connections built on this thread share unless
    /// their builder names another: [`DEFAULT_STAGING_BUDGET`] bytes.
    pub fn this_thread() -> StagingBudget {
        THIS_THREAD.with(StagingBudget::clone)
    }

    /// Bytes the rings may hold at once.
    pub fn limit(&self) -> usize {
        self.0.limit
    }

    /// Bytes of rings held now.
    pub fn in_use(&self) -> usize {
        self.0.in_use.load(Ordering::Acquire)
    }

    /// Most bytes of rings held at once so far (never above
    /// [`limit`](Self::limit)).
    pub fn peak(&self) -> usize {
        self.0.peak.load(Ordering::Acquire)
    }

    /// Times a connection wanted a ring and found the budget spent.
    pub fn refused(&self) -> u64 {
        self.0.refused.load(Ordering::Acquire)
    }

    /// Takes `bytes` for a ring, or `None` (counted) if they would take
    /// the rings beyond the limit.
    pub(crate) fn take(&self, bytes: usize) -> Option<Lease> {
        let c = &self.0;
        let taken = c
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&n| n <= c.limit)
            });
        match taken {
            Ok(before) => {
                c.peak.fetch_max(before + bytes, Ordering::AcqRel);
                Some(Lease {
                    budget: self.clone(),
                    bytes,
                })
            }
            Err(_) => {
                c.refused.fetch_add(1, Ordering::AcqRel);
                None
            }
        }
    }
}

/// A ring's bytes taken from a [`StagingBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Lease {
    budget: StagingBudget,
    bytes: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.0.in_use.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::StagingBudget;

    #[test]
    fn takes_within_the_limit_and_gives_back_on_drop() {
        let b = StagingBudget::new(10);
        let first = b.take(4).expect("4 of 10");
        let second = b.take(6).expect("10 of 10");
        assert!(b.take(1).is_none(), "the budget is spent");
        assert_eq!((b.in_use(), b.peak(), b.refused()), (10, 10, 1));
        drop(first);
        assert_eq!(b.in_use(), 6);
        assert!(b.take(5).is_none(), "11 of 10");
        let third = b.take(4).expect("10 of 10 again");
        drop((second, third));
        assert_eq!((b.in_use(), b.peak(), b.refused()), (0, 10, 2));
        assert!(StagingBudget::new(0).take(1).is_none());
        assert!(b.take(usize::MAX).is_none(), "never overflows");
    }
}
