//! [`CqRegistration`]: a CQ and its completion channel registered with the
//! reactor, for as long as anything that may still complete on it lives.

use super::Handle;

/// A CQ the reactor polls and sleeps on. The registration ends when the
/// last guard is dropped: the [`Device`](crate::Device) that created the CQ
/// holds one, and so does every queue pair on it, so a QP that outlives its
/// `Device` still gets its completions.
pub(crate) struct CqRegistration {
    handle: Handle,
    key: usize,
}

impl CqRegistration {
    /// Registers `cq` (which raises its events on `channel`).
    pub(crate) fn new(
        handle: Handle,
        cq: crate::provider::Cq,
        channel: crate::provider::CompChannel,
    ) -> Result<CqRegistration, super::RuntimeError> {
        let key = handle.driver().register_cq(cq, channel)?;
        Ok(CqRegistration { handle, key })
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
