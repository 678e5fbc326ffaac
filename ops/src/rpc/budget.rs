//! The endpoint's budget of request memory: every byte a server holds for
//! a request (reassembly buffer and packet bitmap) from its first packet
//! until its handler drops the [`Request`](super::Request) is charged here,
//! so what peers can make an endpoint hold is bounded by
//! [`RpcConfig::request_memory`](super::RpcConfig::request_memory) however
//! large the lengths they claim.
//!
//! A request is reserved whole (its length and packet bitmap) at its first
//! packet, so an admitted request never stalls half way; its buffer is
//! allocated as its packets arrive (a packet past the end grows it to that
//! packet's end), never to the claimed length at once. A multi-packet
//! request that does not fit is not admitted: its packet is dropped, the
//! client told to keep waiting (a credit return for its last packet, as
//! while a handler runs) and it sends the packet again after its timeout.
//! A single-packet request is charged without that check: its bytes are
//! the packet's, which the peer sent.

use std::cell::Cell;
use std::rc::Rc;

/// The shared budget (cloned into every [`Charge`]).
#[derive(Clone, Debug)]
pub(crate) struct Budget(Rc<State>);

#[derive(Debug)]
struct State {
    limit: usize,
    used: Cell<usize>,
    /// Most ever charged at once.
    peak: Cell<usize>,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub(crate) fn new(limit: usize) -> Budget {
        Budget(Rc::new(State {
            limit,
            used: Cell::new(0),
            peak: Cell::new(0),
        }))
    }

    /// Bytes charged now.
    pub(crate) fn used(&self) -> usize {
        self.0.used.get()
    }

    /// The most bytes charged at once so far.
    pub(crate) fn peak(&self) -> usize {
        self.0.peak.get()
    }

    /// The limit.
    pub(crate) fn limit(&self) -> usize {
        self.0.limit
    }

    /// Charges `bytes` more to `charge`: false (and nothing charged) if
    /// that would pass the limit, unless `force`.
    pub(crate) fn grow(&self, charge: &mut Charge, bytes: usize, force: bool) -> bool {
        let used = self.0.used.get();
        let Some(after) = used.checked_add(bytes) else {
            return false;
        };
        if after > self.0.limit && !force {
            return false;
        }
        self.0.used.set(after);
        self.0.peak.set(self.0.peak.get().max(after));
        match &charge.budget {
            Some(b) => debug_assert!(Rc::ptr_eq(&b.0, &self.0)),
            None => charge.budget = Some(self.clone()),
        }
        charge.bytes += bytes;
        true
    }
}

/// Bytes charged for one request; given back when dropped (or
/// [`release`](Charge::release)d).
#[derive(Debug, Default)]
pub(crate) struct Charge {
    budget: Option<Budget>,
    bytes: usize,
}

impl Charge {
    /// Bytes charged.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Gives the bytes back.
    pub(crate) fn release(&mut self) {
        if let Some(b) = self.budget.take() {
            b.0.used.set(b.0.used.get() - self.bytes);
        }
        self.bytes = 0;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_bounded_and_given_back() {
        let b = Budget::new(100);
        let mut c = Charge::default();
        assert!(b.grow(&mut c, 60, false));
        assert!(!b.grow(&mut c, 41, false), "past the limit");
        assert_eq!(b.used(), 60);
        assert!(b.grow(&mut c, 40, false));
        assert!(b.grow(&mut c, 10, true), "forced");
        assert_eq!((b.used(), c.bytes(), b.peak()), (110, 110, 110));
        let mut d = Charge::default();
        assert!(!b.grow(&mut d, usize::MAX, true), "no overflow");
        drop(c);
        assert_eq!(b.used(), 0);
        assert!(b.grow(&mut d, 5, false));
        d.release();
        d.release();
        assert_eq!((b.used(), d.bytes(), b.peak()), (0, 0, 110));
    }
}
