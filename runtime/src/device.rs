//! [`Device`]: the per-runtime resources of one opened RDMA device: its
//! context, a protection domain, a completion channel registered with the
//! reactor, one CQ shared by every QP created through it, and the context's
//! async-event fd (events are logged and can be awaited).

use std::rc::Rc;

use crate::op::Credits;
use crate::provider::{
    AsyncEvent, CompChannel, Context, Cq, Pd, ProviderError, Qp, QpCaps, UdAttr,
};
use crate::qp::{QueuePair, SharedRecvQueue, UdState};
use crate::reactor::{CqRegistration, Handle, RuntimeError};

/// Default number of CQ entries of a [`Device`]'s shared CQ.
pub const DEFAULT_CQ_SIZE: u32 = 4096;

struct DeviceInner {
    handle: Handle,
    ctx: Context,
    pd: Pd,
    channel: CompChannel,
    cq: Cq,
    cq_credits: Rc<Credits>,
    /// Shared with every QP on the CQ: the CQ stays registered while any
    /// of them lives.
    cq_registration: Rc<CqRegistration>,
    async_key: Option<usize>,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if let Some(k) = self.async_key {
            self.handle.driver().deregister_async(k);
        }
    }
}

/// An opened device bound to the current thread's runtime. Cheap to clone.
///
/// Every QP created here uses the device's one CQ for both its send and
/// receive completions; the CQ's capacity is shared out as credits, so the
/// CQ can never overflow (each posted WR may produce one CQE, flushes too).
///
/// # Example
///
/// ```
/// # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use verbio::provider::{Context, QpCaps, SoftConfig, UdAttr};
/// use verbio::runtime::buf::MrPool;
/// use verbio::runtime::{Device, Runtime};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?; // a device belongs to its thread's runtime
/// // A software device; `verbio::provider::open_device(None)` opens the
/// // one VERBIO_DEVICE names, else a hardware device, else this.
/// let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
/// println!("{} ({})", dev.context().name(), dev.context().kind());
/// let pool = MrPool::new(dev.pd()); // memory registered with its PD
/// // An RC queue pair, to connect (`verbio::ops::connect`, RDMA CM)...
/// let rc = dev.create_qp(QpCaps::default())?;
/// // ...and a UD one, ready to send and receive datagrams.
/// let ud = dev.create_ud_qp(QpCaps::default(), &UdAttr::default())?;
/// assert_ne!(rc.qp_num(), ud.qp_num());
/// # drop((pool, rt));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Device {
    inner: Rc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("context", &self.inner.ctx)
            .field("cq_capacity", &self.inner.cq_credits.capacity())
            .field("cq_available", &self.inner.cq_credits.available())
            .finish()
    }
}

impl Device {
    /// Binds `ctx` to the current runtime with a CQ of [`DEFAULT_CQ_SIZE`].
    ///
    /// Fails with [`RuntimeError::NoRuntime`] if no runtime exists on this
    /// thread.
    pub fn open(ctx: Context) -> Result<Device, RuntimeError> {
        Device::with_cq_size(ctx, DEFAULT_CQ_SIZE)
    }

    /// Binds `ctx` to the current runtime with a CQ of at least `cqe` entries.
    ///
    /// Fails with [`RuntimeError::NoRuntime`] if no runtime exists on this
    /// thread.
    pub fn with_cq_size(ctx: Context, cqe: u32) -> Result<Device, RuntimeError> {
        let handle = Handle::try_current().ok_or(RuntimeError::NoRuntime {
            what: "opening a Device",
        })?;
        let pd = ctx.alloc_pd()?;
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(cqe, Some(&channel))?;
        let cq_registration = Rc::new(CqRegistration::new(
            handle.clone(),
            cq.clone(),
            channel.clone(),
        )?);
        let cq_credits = Rc::new(Credits::new(cq.capacity()));
        let async_key = handle.driver().register_async(ctx.clone());
        Ok(Device {
            inner: Rc::new(DeviceInner {
                handle,
                ctx,
                pd,
                channel,
                cq,
                cq_credits,
                cq_registration,
                async_key,
            }),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The protection domain every QP and MR of this device uses.
    pub fn pd(&self) -> &Pd {
        &self.inner.pd
    }

    /// The shared CQ.
    ///
    /// The reactor polls it and owns its arming: it remembers that it armed
    /// the CQ until it takes the event that arming raises. Code that arms
    /// this CQ or takes events from [`Device::comp_channel`] itself (a raw
    /// post/poll loop on the same device) must call
    /// [`Device::forget_cq_arming`] before the reactor sleeps again.
    pub fn cq(&self) -> &Cq {
        &self.inner.cq
    }

    /// The completion channel the reactor sleeps on (see [`Device::cq`]
    /// for the rule on taking its events elsewhere).
    pub fn comp_channel(&self) -> &CompChannel {
        &self.inner.channel
    }

    /// Tells the reactor that code outside it armed the CQ or took events
    /// from the completion channel: the reactor arms the CQ again before it
    /// next sleeps. Without this, a reactor that armed the CQ, and whose
    /// event was then taken by someone else, would sleep on a CQ that can no
    /// longer raise an event (its ops' completions would wait for an
    /// unrelated wake-up).
    pub fn forget_cq_arming(&self) {
        self.inner.cq_registration.forget_arming();
    }

    /// The next asynchronous event of the device (port state, QP or CQ
    /// errors); every event is also logged. Up to 64 are kept until taken.
    /// Resolves to `None` if this `Device` does not watch the context's
    /// async-event fd (another `Device` opened on the same context does).
    pub fn next_async_event(&self) -> impl std::future::Future<Output = Option<AsyncEvent>> + '_ {
        std::future::poll_fn(move |cx| match self.inner.async_key {
            Some(k) => self.inner.handle.driver().poll_async_event(k, cx),
            None => std::task::Poll::Ready(None),
        })
    }

    /// CQ entries not reserved by outstanding WRs.
    pub fn cq_credits(&self) -> u32 {
        self.inner.cq_credits.available()
    }

    /// Allocates a new protection domain on the device's context (for
    /// isolating one connection's QP and memory from the others).
    pub fn alloc_pd(&self) -> Result<Pd, ProviderError> {
        self.inner.ctx.alloc_pd()
    }

    /// Creates an RC QP (in RESET) on the shared CQ, tracked by the runtime.
    pub fn create_qp(&self, caps: QpCaps) -> Result<QueuePair, ProviderError> {
        self.create_qp_in(&self.inner.pd, caps)
    }

    /// Creates an RC QP (in RESET) in `pd` (one of [`Device::alloc_pd`]), on
    /// the shared CQ and its credit accounting, like [`Device::create_qp`].
    pub fn create_qp_in(&self, pd: &Pd, caps: QpCaps) -> Result<QueuePair, ProviderError> {
        self.check_alive()?;
        let qp = pd.create_qp(&self.inner.cq, &self.inner.cq, caps)?;
        Ok(self.track(qp, None))
    }

    /// Creates a UD QP on the shared CQ, brought to RTS with `attr` (its
    /// port, P_Key index, Q_Key and send PSN): ready to send datagrams to
    /// [`UdPeer`](crate::qp::UdPeer)s and receive them (post receives or a
    /// [`RecvRing`](crate::RecvRing) first: a datagram that finds no
    /// receive posted is dropped).
    pub fn create_ud_qp(&self, caps: QpCaps, attr: &UdAttr) -> Result<QueuePair, ProviderError> {
        self.create_ud_qp_in(&self.inner.pd, caps, attr)
    }

    /// [`create_ud_qp`](Self::create_ud_qp) in `pd`.
    pub fn create_ud_qp_in(
        &self,
        pd: &Pd,
        caps: QpCaps,
        attr: &UdAttr,
    ) -> Result<QueuePair, ProviderError> {
        self.check_alive()?;
        let qp = pd.create_ud_qp(&self.inner.cq, &self.inner.cq, caps)?;
        qp.modify_ud_to_rts(attr)?;
        let sgid_index = self.inner.ctx.default_gid_index(attr.port)?;
        let mtu = self.inner.ctx.query_port(attr.port)?.active_mtu.bytes();
        let ud = UdState::new(Some(pd.clone()), attr.qkey, sgid_index, mtu);
        let qp = self.track(qp, Some(ud));
        qp.prepare_ud_retire()?;
        Ok(qp)
    }

    /// Creates a shared receive queue of `max_wr` receive WRs (one SGE
    /// each) in the device's PD; fill it with a
    /// [`RecvRing::on_srq`](crate::RecvRing::on_srq) and create RC QPs on it
    /// with [`create_qp_on_srq`](Self::create_qp_on_srq).
    pub fn create_srq(&self, max_wr: u32) -> Result<SharedRecvQueue, ProviderError> {
        self.check_alive()?;
        let srq = self.inner.pd.create_srq(&crate::provider::SrqAttr {
            max_wr,
            max_sge: 1,
            srq_limit: 0,
        })?;
        SharedRecvQueue::new(
            self.inner.handle.clone(),
            srq,
            self.inner.cq_credits.clone(),
            self.inner.async_key,
        )
    }

    /// Creates an RC QP (in RESET) in the device's PD on the shared CQ,
    /// whose receives come from `srq` (it has no receive queue of its own:
    /// `caps`' receive sizes are ignored and receives posted to it are
    /// refused).
    pub fn create_qp_on_srq(
        &self,
        srq: &SharedRecvQueue,
        caps: QpCaps,
    ) -> Result<QueuePair, ProviderError> {
        self.check_alive()?;
        let qp = self.inner.pd.create_qp_with_srq(
            &self.inner.cq,
            &self.inner.cq,
            caps,
            srq.provider(),
        )?;
        let qp = self.track(qp, None);
        qp.hold_srq(srq);
        Ok(qp)
    }

    fn check_alive(&self) -> Result<(), ProviderError> {
        if self.inner.handle.ops().is_shut_down() {
            return Err(ProviderError::DeviceLost {
                device: self.inner.ctx.name().to_string(),
                reason: "its runtime was dropped".to_string(),
            });
        }
        Ok(())
    }

    /// A runtime queue pair over `qp`, on the shared CQ's credits.
    fn track(&self, qp: Qp, ud: Option<UdState>) -> QueuePair {
        let actual = qp.caps();
        let qp_num = qp.qp_num();
        QueuePair::from_provider(
            self.inner.handle.clone(),
            qp,
            qp_num,
            actual,
            self.inner.cq_credits.clone(),
            self.inner.cq_credits.clone(),
            Some(self.inner.cq_registration.clone()),
            ud,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Device;
    use crate::provider::{Context, SoftConfig};
    use crate::reactor::RuntimeError;

    #[test]
    fn opening_a_device_off_runtime_is_an_error_not_a_panic() {
        let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
        match Device::open(ctx) {
            Err(RuntimeError::NoRuntime { what }) => assert_eq!(what, "opening a Device"),
            other => panic!("expected NoRuntime, got {other:?}"),
        }
    }
}
