//! [`AgentQps`]: the agent's [`QpFactory`]: every connection's QP gets a
//! protection domain of its own, so memory registered for one connection
//! (its receive pool, its grants) cannot be reached through another; or,
//! on a listener with a shared receive queue (`srq.rs`), a QP is made on
//! the SRQ, in the device's protection domain, once the listener holds
//! its [`SrqPolicy::above`] connections with receive queues of their own
//! (the memory such a connection exposes to its peer is then reached
//! through windows its QP binds: `exposed.rs`).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use verbio_runtime::provider::{Endpoint, Pd, ProviderKind};
use verbio_runtime::{Device, QueuePair};

use super::srq::{SrqHub, SrqRoute};
use crate::connect::{DeviceQps, HandshakeError, QpFactory};

/// When a listener's connections go on a shared receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SrqPolicy {
    /// Connections with receive queues of their own the listener holds
    /// before it puts new ones on the SRQ (0: every connection).
    pub(crate) above: usize,
    /// Buffers of the SRQ.
    pub(crate) depth: u32,
}

/// A listener's shared receive queue, started when the first connection
/// goes on it, and its count of connections with their own receive queue.
pub(crate) struct ListenerSrq {
    policy: SrqPolicy,
    buf_size: usize,
    device: Device,
    hub: RefCell<Option<Rc<SrqHub>>>,
    /// Starting the SRQ failed: connections keep their own receive queues.
    failed: Cell<bool>,
    own: Rc<Cell<usize>>,
}

impl std::fmt::Debug for ListenerSrq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerSrq")
            .field("policy", &self.policy)
            .field("hub", &self.hub.borrow())
            .field("own", &self.own.get())
            .finish()
    }
}

impl ListenerSrq {
    /// The SRQ of a listener on `device` whose receive buffers are
    /// `buf_size` bytes; with `policy.above` 0 it is started at once (its
    /// failure is the listener's).
    pub(crate) fn new(
        device: &Device,
        policy: SrqPolicy,
        buf_size: usize,
    ) -> Result<ListenerSrq, super::AgentError> {
        let srq = ListenerSrq {
            policy,
            buf_size,
            device: device.clone(),
            hub: RefCell::new(None),
            failed: Cell::new(false),
            own: Rc::new(Cell::new(0)),
        };
        if policy.above == 0 {
            let hub = SrqHub::start(device, policy.depth, buf_size)?;
            *srq.hub.borrow_mut() = Some(Rc::new(hub));
        }
        Ok(srq)
    }

    /// The hub for the next connection, if it goes on the SRQ.
    fn for_next(&self) -> Option<Rc<SrqHub>> {
        if self.own.get() < self.policy.above || self.failed.get() {
            return None;
        }
        if let Some(hub) = &*self.hub.borrow() {
            return Some(hub.clone());
        }
        match SrqHub::start(&self.device, self.policy.depth, self.buf_size) {
            Ok(hub) => {
                let hub = Rc::new(hub);
                tracing::debug!(
                    above = self.policy.above,
                    depth = self.policy.depth,
                    "listener: new connections go on its shared receive queue"
                );
                *self.hub.borrow_mut() = Some(hub.clone());
                Some(hub)
            }
            Err(e) => {
                tracing::warn!(
                    error = %crate::error::ErrorChain(&e),
                    "starting the listener's shared receive queue failed: \
                     connections keep receive queues of their own"
                );
                self.failed.set(true);
                None
            }
        }
    }
}

impl ListenerSrq {
    /// Connections with a receive queue of their own, live.
    pub(crate) fn own_queues(&self) -> usize {
        self.own.get()
    }
}

/// A connection with its own receive queue, counted by its listener while
/// it lives.
#[derive(Debug)]
pub(crate) struct Seat(Rc<Cell<usize>>);

impl Seat {
    fn take(count: &Rc<Cell<usize>>) -> Seat {
        count.set(count.get() + 1);
        Seat(count.clone())
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// A connection's protection domain (the provider's `Pd` has no `Debug`).
#[derive(Clone)]
pub(crate) struct ConnPd(pub(crate) Pd);

impl std::fmt::Debug for ConnPd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnPd")
    }
}

/// A connection's QP and the protection domain it (and all the
/// connection's memory) lives in.
#[derive(Debug)]
pub(crate) struct ConnQp {
    pub(crate) qp: QueuePair,
    pub(crate) pd: ConnPd,
    /// Its messages, when its QP is on a shared receive queue.
    pub(crate) route: Option<SrqRoute>,
    /// Its place in its listener's count of connections with their own
    /// receive queue.
    pub(crate) seat: Option<Seat>,
}

/// Makes each QP in a fresh protection domain of the device.
#[derive(Debug, Clone)]
pub(crate) struct AgentQps {
    inner: DeviceQps,
    srq: Option<Rc<ListenerSrq>>,
    /// The same QPs with a smaller `max_inline_data`, for a device that
    /// refuses the builder's default one (not for a value the
    /// application set: that refusal is reported).
    fallback: Option<DeviceQps>,
}

impl AgentQps {
    pub(crate) fn new(inner: DeviceQps) -> AgentQps {
        AgentQps {
            inner,
            srq: None,
            fallback: None,
        }
    }

    /// QPs on `srq` by its policy.
    pub(crate) fn on_srq(mut self, srq: Rc<ListenerSrq>) -> AgentQps {
        self.srq = Some(srq);
        self
    }

    /// If the device refuses to create a QP, retries once with `fallback`
    /// (the same QPs with a smaller `max_inline_data`).
    pub(crate) fn with_fallback(mut self, fallback: Option<DeviceQps>) -> AgentQps {
        self.fallback = fallback;
        self
    }

    fn create_with(&self, qps: &DeviceQps) -> Result<(ConnQp, Endpoint), HandshakeError> {
        if let Some(hub) = self.srq.as_ref().and_then(|s| s.for_next()) {
            let (qp, ep) = qps.create_on_srq(hub.srq())?;
            let route = Some(SrqHub::route(&hub, qp.qp_num()));
            let pd = ConnPd(qps.device().pd().clone());
            let seat = None;
            return Ok((
                ConnQp {
                    qp,
                    pd,
                    route,
                    seat,
                },
                ep,
            ));
        }
        let pd = qps
            .device()
            .alloc_pd()
            .map_err(|source| HandshakeError::Provider {
                stage: "allocating the connection's protection domain",
                source,
            })?;
        let (qp, ep) = qps.create_in(&pd)?;
        Ok((
            ConnQp {
                qp,
                pd: ConnPd(pd),
                route: None,
                seat: self.srq.as_ref().map(|s| Seat::take(&s.own)),
            },
            ep,
        ))
    }
}

impl QpFactory for AgentQps {
    type Qp = ConnQp;

    fn provider(&self) -> ProviderKind {
        self.inner.provider()
    }

    fn create(&self) -> Result<(ConnQp, Endpoint), HandshakeError> {
        match (self.create_with(&self.inner), &self.fallback) {
            (Err(HandshakeError::Provider { stage, source }), Some(fallback)) => {
                tracing::debug!(
                    stage,
                    error = %crate::error::ErrorChain(&source),
                    "the device refused the agent's QP (the default max_inline_data?): \
                     retrying with a smaller max_inline_data"
                );
                self.create_with(fallback)
            }
            (r, _) => r,
        }
    }

    fn connect(
        &self,
        qp: &ConnQp,
        local: &Endpoint,
        remote: &Endpoint,
    ) -> Result<(), HandshakeError> {
        self.inner.connect(&qp.qp, local, remote)
    }
}

#[cfg(test)]
mod tests {
    use verbio_runtime::provider::{Context, QpCaps, SoftConfig};
    use verbio_runtime::{Device, Runtime};

    use super::*;
    use crate::connect::QpConfig;

    fn qps(dev: &Device, max_inline_data: u32) -> DeviceQps {
        DeviceQps::new(
            dev.clone(),
            QpConfig {
                caps: QpCaps {
                    max_inline_data,
                    ..QpCaps::default()
                },
                ..QpConfig::default()
            },
        )
    }

    #[test]
    fn a_refused_qp_is_made_again_with_the_fallback_caps() {
        let _rt = Runtime::new().unwrap();
        let dev = Device::open(Context::open_soft(SoftConfig::default()).unwrap()).unwrap();
        // The software device takes at most 1024 inline bytes.
        let refused = AgentQps::new(qps(&dev, 4096));
        assert!(matches!(
            refused.create(),
            Err(HandshakeError::Provider { .. })
        ));
        let (conn, _ep) = refused
            .with_fallback(Some(qps(&dev, 64)))
            .create()
            .expect("made with the fallback");
        assert_eq!(conn.qp.caps().max_inline_data, 64);
        // Accepted at once: the fallback is not used.
        let (conn, _ep) = AgentQps::new(qps(&dev, 128))
            .with_fallback(Some(qps(&dev, 64)))
            .create()
            .expect("made");
        assert_eq!(conn.qp.caps().max_inline_data, 128);
    }
}
