//! [`Backlog`]: what the peer delivered that this side's application has
//! not taken yet (messages, immediates, handed-over regions, pieces of
//! messages being reassembled), in bytes, and the send credits withheld
//! while it is over its limit.
//!
//! Credits are the peer's permission to send: withholding them is how a
//! receiver whose application does not keep up pushes back. The agent
//! still reposts every buffer (so the peer's `Credit`, `Error` and `Close`
//! messages and answers to this side's own requests keep flowing) but,
//! while the backlog is over the limit, it does not return the credit of
//! a consumed buffer. The peer's senders then wait for credits instead of
//! this side's memory growing without bound. Once the application has
//! taken enough for the backlog to fall to half the limit, the withheld
//! credits go back to the peer.

use std::cell::Cell;

/// What one queued immediate, or one handed-over token, counts for.
pub(crate) const SMALL_ITEM_CHARGE: u64 = 64;

/// What a region of this side's memory handed back by the peer counts for.
pub(crate) fn local_mr_charge(mem: &[u8]) -> u64 {
    (mem.len() as u64).max(SMALL_ITEM_CHARGE)
}

/// Unread bytes and withheld credits of one connection (single-threaded).
#[derive(Debug)]
pub(crate) struct Backlog {
    bytes: Cell<u64>,
    limit: u64,
    withheld: Cell<u32>,
}

impl Backlog {
    /// A backlog that withholds credits above `limit` bytes.
    pub(crate) fn new(limit: u64) -> Backlog {
        Backlog {
            bytes: Cell::new(0),
            limit,
            withheld: Cell::new(0),
        }
    }

    /// Something of `charge` bytes was queued for the application.
    pub(crate) fn add(&self, charge: u64) {
        self.bytes.set(self.bytes.get().saturating_add(charge));
    }

    /// The application took (or the peer aborted) something of `charge`
    /// bytes: the withheld credits to return now (the backlog fell to half
    /// its limit or below), else 0.
    #[must_use = "withheld credits returned here must go back to the peer"]
    pub(crate) fn remove(&self, charge: u64) -> u32 {
        let left = self.bytes.get().saturating_sub(charge);
        self.bytes.set(left);
        if left <= self.limit / 2 {
            self.withheld.replace(0)
        } else {
            0
        }
    }

    /// A credit-bearing buffer was reposted: true if its credit may go back
    /// to the peer now; false if it is withheld (the backlog is over the
    /// limit) until the application catches up.
    pub(crate) fn credit_may_return(&self) -> bool {
        if self.bytes.get() > self.limit {
            self.withheld.set(self.withheld.get().saturating_add(1));
            false
        } else {
            true
        }
    }

    /// The limit (`max_unread_bytes`).
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes queued and not taken.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.get()
    }

    /// Credits withheld now.
    pub(crate) fn withheld(&self) -> u32 {
        self.withheld.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn withholds_over_the_limit_and_returns_at_half() {
        let b = Backlog::new(1000);
        b.add(600);
        assert!(b.credit_may_return(), "under the limit");
        b.add(600);
        assert!(!b.credit_may_return(), "over the limit");
        assert!(!b.credit_may_return());
        assert_eq!(b.withheld(), 2);
        assert_eq!(b.remove(600), 0, "600 left: above half the limit");
        assert_eq!(b.remove(100), 2, "500 left: the withheld credits return");
        assert_eq!(b.withheld(), 0);
        assert_eq!(b.remove(10_000), 0, "nothing withheld; never below 0");
        assert_eq!(b.bytes(), 0);
    }
}
