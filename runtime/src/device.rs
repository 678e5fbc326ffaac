//! [`Device`]: the per-runtime resources of one opened RDMA device: its
//! context, a protection domain, CQs (each with a completion channel
//! registered with the reactor) shared by the QPs created through it, one
//! added when the QPs claim more entries than the CQs hold, and the
//! context's async-event fd (events are logged and can be awaited).

use std::cell::RefCell;
use std::rc::Rc;

use crate::op::QueueEntries;
use crate::provider::{
    AsyncEvent, CompChannel, Context, Cq, Pd, ProviderError, Qp, QpCaps, UdAttr,
};
use crate::qp::{QueuePair, SharedRecvQueue, UdState};
use crate::reactor::{CqClaim, CqRegistration, Handle, RuntimeError};

/// Default number of CQ entries of a [`Device`]'s first CQ.
pub const DEFAULT_CQ_SIZE: u32 = 4096;

/// One CQ of a [`Device`], its entries and its registration with the
/// reactor (which counts the entries its QPs claimed). Each CQ has a
/// completion channel of its own (the reactor learns from a channel's
/// event which CQ to arm again).
#[derive(Clone)]
struct CqSlot {
    cq: Cq,
    entries: Rc<QueueEntries>,
    registration: Rc<CqRegistration>,
}

impl CqSlot {
    fn create(
        handle: &Handle,
        ctx: &Context,
        channel: Option<&CompChannel>,
        cqe: u32,
    ) -> Result<CqSlot, RuntimeError> {
        let own;
        let channel = match channel {
            Some(c) => c,
            None => {
                own = ctx.create_comp_channel()?;
                &own
            }
        };
        let cq = ctx.create_cq(cqe, Some(channel))?;
        let registration = Rc::new(CqRegistration::new(
            handle.clone(),
            cq.clone(),
            channel.clone(),
        )?);
        let entries = Rc::new(QueueEntries::new(cq.capacity()));
        Ok(CqSlot {
            cq,
            entries,
            registration,
        })
    }

    /// Entries not claimed by the QPs and SRQs on this CQ.
    fn unclaimed(&self) -> u64 {
        u64::from(self.entries.capacity()).saturating_sub(self.registration.claimed())
    }

    fn claim(&self, entries: u64) -> CqClaim {
        CqClaim::new(self.registration.clone(), entries)
    }
}

struct DeviceInner {
    handle: Handle,
    ctx: Context,
    pd: Pd,
    channel: CompChannel,
    /// The first CQ ([`Device::cq`]); SRQs and the QPs on them live here.
    first: CqSlot,
    /// CQs added as QPs claimed more entries than the CQs before them
    /// hold; one left without claims is dropped when the next QP is placed.
    added: RefCell<Vec<CqSlot>>,
    /// The provider's largest CQ; 0: no CQs are added (the device was
    /// opened with a CQ size of the caller's).
    max_cqe: u32,
    async_key: Option<usize>,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if let Some(k) = self.async_key {
            self.handle.driver().deregister_async(k);
        }
    }
}

impl DeviceInner {
    /// The CQ for a QP that may have `entries` completions outstanding:
    /// the first CQ whose claims leave room for them, else a new CQ as
    /// large as all of them together (so their count grows with the log of
    /// the connections), else (the provider refused one) the CQ with the
    /// most room, whose entries its QPs then share, waiting in turn.
    fn place(&self, entries: u64) -> CqSlot {
        if self.max_cqe == 0 {
            return self.first.clone();
        }
        let mut added = self.added.borrow_mut();
        // Give back CQs nobody claims any more (keep one for the next QP).
        let mut kept_idle = false;
        added.retain(|slot| {
            let idle = slot.registration.claimed() == 0;
            let keep = !idle || !kept_idle;
            kept_idle |= idle;
            keep
        });
        if let Some(slot) = std::iter::once(&self.first)
            .chain(added.iter())
            .find(|slot| slot.unclaimed() >= entries)
        {
            return slot.clone();
        }
        let total: u64 = std::iter::once(&self.first)
            .chain(added.iter())
            .map(|slot| u64::from(slot.entries.capacity()))
            .sum();
        let cqe = total
            .max(entries)
            .max(u64::from(DEFAULT_CQ_SIZE))
            .min(u64::from(self.max_cqe)) as u32;
        match CqSlot::create(&self.handle, &self.ctx, None, cqe) {
            Ok(slot) => {
                tracing::debug!(
                    device = %self.ctx.name(),
                    cqe,
                    cqs = added.len() + 2,
                    "added a CQ for more queue pairs"
                );
                added.push(slot.clone());
                slot
            }
            Err(e) => {
                tracing::warn!(
                    device = %self.ctx.name(),
                    cqe,
                    error = %crate::report::ErrorChain(&e),
                    "could not add a CQ: queue pairs share the CQ with the most room"
                );
                std::iter::once(&self.first)
                    .chain(added.iter())
                    .max_by_key(|slot| slot.unclaimed())
                    .unwrap_or(&self.first)
                    .clone()
            }
        }
    }
}

/// An opened device bound to the current thread's runtime. Cheap to clone.
///
/// Every QP created here uses one of the device's CQs for both its send and
/// receive completions; a CQ's capacity is shared out as entries, so it can
/// never overflow (each posted WR may produce one CQE, flushes too). A QP
/// claims its send and receive queue depths on the CQ it is placed on; when
/// no CQ has that much unclaimed the device adds one (as large as all
/// before it), so the number of QPs is not bounded by one CQ's size, and a
/// CQ no QP claims any more is given back. SRQs and the QPs on them use the
/// first CQ ([`Device::cq`]).
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
            .field("cq_capacity", &self.inner.first.entries.capacity())
            .field("cq_available", &self.inner.first.entries.available())
            .field("added_cqs", &self.inner.added.borrow().len())
            .finish()
    }
}

impl Device {
    /// Binds `ctx` to the current runtime with a CQ of [`DEFAULT_CQ_SIZE`],
    /// and more CQs as its QPs need them (see [`Device`]).
    ///
    /// Fails with [`RuntimeError::NoRuntime`] if no runtime exists on this
    /// thread.
    pub fn open(ctx: Context) -> Result<Device, RuntimeError> {
        Device::with_cqs(ctx, DEFAULT_CQ_SIZE, true)
    }

    /// Binds `ctx` to the current runtime with one CQ of at least `cqe`
    /// entries, shared by every QP: no CQs are added, so the QPs share its
    /// entries (a submission waits for its turn, a receive ring that does
    /// not fit is refused).
    ///
    /// Fails with [`RuntimeError::NoRuntime`] if no runtime exists on this
    /// thread.
    pub fn with_cq_size(ctx: Context, cqe: u32) -> Result<Device, RuntimeError> {
        Device::with_cqs(ctx, cqe, false)
    }

    /// Binds `ctx` with a first CQ of `cqe` entries; `grow`: more are added
    /// as QPs claim more.
    fn with_cqs(ctx: Context, cqe: u32, grow: bool) -> Result<Device, RuntimeError> {
        let handle = Handle::try_current().ok_or(RuntimeError::NoRuntime {
            what: "opening a Device",
        })?;
        let pd = ctx.alloc_pd()?;
        let channel = ctx.create_comp_channel()?;
        let first = CqSlot::create(&handle, &ctx, Some(&channel), cqe)?;
        let max_cqe = match grow {
            true => ctx
                .query_device()
                .map(|a| a.max_cqe)
                .unwrap_or(cqe)
                .max(cqe),
            false => 0,
        };
        let async_key = handle.driver().register_async(ctx.clone());
        Ok(Device {
            inner: Rc::new(DeviceInner {
                handle,
                ctx,
                pd,
                channel,
                first,
                added: RefCell::new(Vec::new()),
                max_cqe,
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

    /// The device's first CQ (QPs are placed on it until their claims fill
    /// it; SRQs and the QPs on them always).
    ///
    /// The reactor polls it and owns its arming: it remembers that it armed
    /// the CQ until it takes the event that arming raises. Code that arms
    /// this CQ or takes events from [`Device::comp_channel`] itself (a raw
    /// post/poll loop on the same device) must call
    /// [`Device::forget_cq_arming`] before the reactor sleeps again.
    pub fn cq(&self) -> &Cq {
        &self.inner.first.cq
    }

    /// How many CQs the device has: its first and those added for more
    /// queue pairs.
    pub fn cq_count(&self) -> usize {
        1 + self.inner.added.borrow().len()
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
        self.inner.first.registration.forget_arming();
        for slot in self.inner.added.borrow().iter() {
            slot.registration.forget_arming();
        }
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

    /// CQ entries not reserved by outstanding WRs, over all the device's
    /// CQs.
    pub fn cq_credits(&self) -> u32 {
        let added: u32 = self
            .inner
            .added
            .borrow()
            .iter()
            .map(|slot| slot.entries.available())
            .sum();
        self.inner.first.entries.available() + added
    }

    /// Allocates a new protection domain on the device's context (for
    /// isolating one connection's QP and memory from the others).
    pub fn alloc_pd(&self) -> Result<Pd, ProviderError> {
        self.inner.ctx.alloc_pd()
    }

    /// Creates an RC QP (in RESET) on one of the device's CQs (see
    /// [`Device`]), tracked by the runtime.
    pub fn create_qp(&self, caps: QpCaps) -> Result<QueuePair, ProviderError> {
        self.create_qp_in(&self.inner.pd, caps)
    }

    /// Creates an RC QP (in RESET) in `pd` (one of [`Device::alloc_pd`]), on
    /// the shared CQ and its entry accounting, like [`Device::create_qp`].
    pub fn create_qp_in(&self, pd: &Pd, caps: QpCaps) -> Result<QueuePair, ProviderError> {
        self.check_alive()?;
        let slot = self.inner.place(claim_of(&caps));
        let qp = pd.create_qp(&slot.cq, &slot.cq, caps)?;
        Ok(self.track(qp, None, &slot, false))
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
        let slot = self.inner.place(claim_of(&caps));
        let qp = pd.create_ud_qp(&slot.cq, &slot.cq, caps)?;
        qp.modify_ud_to_rts(attr)?;
        let sgid_index = self.inner.ctx.default_gid_index(attr.port)?;
        let mtu = self.inner.ctx.query_port(attr.port)?.active_mtu.bytes();
        let ud = UdState::new(Some(pd.clone()), attr.qkey, sgid_index, mtu);
        let qp = self.track(qp, Some(ud), &slot, false);
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
        let first = &self.inner.first;
        SharedRecvQueue::new(
            self.inner.handle.clone(),
            srq,
            first.entries.clone(),
            first.claim(u64::from(max_wr)),
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
        let first = &self.inner.first;
        let qp = self
            .inner
            .pd
            .create_qp_with_srq(&first.cq, &first.cq, caps, srq.provider())?;
        let qp = self.track(qp, None, first, true);
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

    /// A runtime queue pair over `qp`, on the entries of `slot`'s CQ, with
    /// its claim there (an SRQ's QP claims only its send queue).
    fn track(&self, qp: Qp, ud: Option<UdState>, slot: &CqSlot, on_srq: bool) -> QueuePair {
        let actual = qp.caps();
        let qp_num = qp.qp_num();
        let claim = if on_srq {
            u64::from(actual.max_send_wr)
        } else {
            claim_of(&actual)
        };
        QueuePair::from_provider(
            self.inner.handle.clone(),
            qp,
            qp_num,
            actual,
            slot.entries.clone(),
            slot.entries.clone(),
            Some(slot.claim(claim)),
            ud,
        )
    }
}

/// The CQ entries a QP of `caps` may hold at once: one per send and
/// receive WR.
fn claim_of(caps: &QpCaps) -> u64 {
    u64::from(caps.max_send_wr) + u64::from(caps.max_recv_wr)
}

#[cfg(test)]
mod tests {
    use super::Device;
    use crate::provider::{Context, QpCaps, SoftConfig};
    use crate::reactor::RuntimeError;

    #[test]
    fn queue_pairs_past_one_cq_get_cqs_added_and_given_back() {
        let rt = crate::Runtime::new().expect("runtime");
        let dev = Device::open(Context::open_soft(SoftConfig::default()).expect("soft device"))
            .expect("device");
        // 256 entries claimed per QP: 16 fill the first CQ of 4,096.
        let mut qps: Vec<_> = (0..40)
            .map(|_| dev.create_qp(QpCaps::default()).expect("qp"))
            .collect();
        // 16 on the first, 16 on a second of 4,096, 8 on a third of 8,192.
        assert_eq!(dev.cq_count(), 3, "{dev:?}");
        assert_eq!(dev.cq_credits(), 4096 * 2 + 8192);
        qps.truncate(10);
        rt.block_on(async { crate::reactor::sleep(std::time::Duration::from_millis(20)).await });
        // The next QP finds room on the first CQ; the emptied CQs but one
        // are given back.
        qps.push(dev.create_qp(QpCaps::default()).expect("qp"));
        assert_eq!(dev.cq_count(), 2, "{dev:?}");
        drop(qps);
        drop(rt);
    }

    /// The layers above the provider test its flags, not its name: the
    /// software device says it is one and batches posts, its completion
    /// channels say their fd is no edge-triggered source, and a QP made on it
    /// batches its single-WR posts from the start.
    #[test]
    fn the_software_device_says_what_it_does_differently() {
        let rt = crate::Runtime::new().expect("runtime");
        let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
        let caps = ctx.provider_caps();
        assert!(caps.software && caps.batches_posts, "{caps:?}");
        assert!(!caps.edge_triggered_channel, "{caps:?}");
        let ch = ctx.create_comp_channel().expect("channel");
        assert_eq!(ch.provider_caps(), caps);
        let dev = Device::open(ctx).expect("device");
        let qp = dev.create_qp(QpCaps::default()).expect("qp");
        assert!(qp.doorbell_batching(), "a soft QP batches by default");
        drop(qp);
        drop(rt);
    }

    #[test]
    fn opening_a_device_off_runtime_is_an_error_not_a_panic() {
        let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
        match Device::open(ctx) {
            Err(RuntimeError::NoRuntime { what }) => assert_eq!(what, "opening a Device"),
            other => panic!("expected NoRuntime, got {other:?}"),
        }
    }
}
