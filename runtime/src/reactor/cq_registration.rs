//! [`CqRegistration`]: a CQ and its completion channel registered with the
//! reactor, for as long as anything that may still complete on it lives.

use std::cell::Cell;
use std::rc::Rc;

use super::Handle;

/// A CQ the reactor polls and sleeps on. The registration ends when the
/// last guard is dropped: the [`Device`](crate::Device) that created the CQ
/// holds one, and so does every queue pair on it, so a QP that outlives its
/// `Device` still gets its completions.
///
/// It also counts the CQ entries claimed by the QPs and SRQs placed on the
/// CQ ([`CqClaim`]): the `Device` places a new QP on a CQ whose claims
/// leave room for it, or adds a CQ.
pub(crate) struct CqRegistration {
    handle: Handle,
    key: usize,
    /// Entries claimed by live [`CqClaim`]s.
    claimed: Cell<u64>,
}

impl CqRegistration {
    /// Registers `cq` (which raises its events on `channel`).
    pub(crate) fn new(
        handle: Handle,
        cq: crate::provider::Cq,
        channel: crate::provider::CompChannel,
    ) -> Result<CqRegistration, super::RuntimeError> {
        let key = handle.driver().register_cq(cq, channel)?;
        Ok(CqRegistration {
            handle,
            key,
            claimed: Cell::new(0),
        })
    }

    /// CQ entries claimed by the live [`CqClaim`]s on this CQ.
    pub(crate) fn claimed(&self) -> u64 {
        self.claimed.get()
    }

    /// Tells the reactor that code outside it armed the CQ or took events
    /// from its channel: it arms the CQ again before it next sleeps.
    pub(crate) fn forget_arming(&self) {
        self.handle.driver().forget_arming(self.key);
    }
}

impl Drop for CqRegistration {
    fn drop(&mut self) {
        self.handle.driver().deregister_cq(self.key);
    }
}

/// A QP's (or SRQ's) share of a CQ: it keeps the CQ registered and counts
/// `entries` as claimed until it is dropped (when the QP's last work
/// request has completed).
pub(crate) struct CqClaim {
    registration: Rc<CqRegistration>,
    entries: u64,
}

impl CqClaim {
    /// Claims `entries` of the CQ `registration` names.
    pub(crate) fn new(registration: Rc<CqRegistration>, entries: u64) -> CqClaim {
        registration
            .claimed
            .set(registration.claimed.get() + entries);
        CqClaim {
            registration,
            entries,
        }
    }
}

impl Drop for CqClaim {
    fn drop(&mut self) {
        let r = &self.registration;
        r.claimed.set(r.claimed.get().saturating_sub(self.entries));
    }
}
