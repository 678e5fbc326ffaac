//! [`AgentQps`]: the agent's [`QpFactory`]: every connection's QP gets a
//! protection domain of its own, so memory registered for one connection
//! (its receive pool, its grants) cannot be reached through another; or,
//! on a listener with a shared receive queue (`srq.rs`), every QP is made
//! on the SRQ, in the device's protection domain.

use std::rc::Rc;

use verbio_runtime::provider::{Endpoint, Pd, ProviderKind};
use verbio_runtime::QueuePair;

use super::srq::{SrqHub, SrqRoute};
use crate::connect::{DeviceQps, HandshakeError, QpFactory};

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
}

/// Makes each QP in a fresh protection domain of the device.
#[derive(Debug, Clone)]
pub(crate) struct AgentQps {
    inner: DeviceQps,
    srq: Option<Rc<SrqHub>>,
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

    /// Every QP on `hub`'s shared receive queue.
    pub(crate) fn on_srq(mut self, hub: Rc<SrqHub>) -> AgentQps {
        self.srq = Some(hub);
        self
    }

    /// If the device refuses to create a QP, retries once with `fallback`
    /// (the same QPs with a smaller `max_inline_data`).
    pub(crate) fn with_fallback(mut self, fallback: Option<DeviceQps>) -> AgentQps {
        self.fallback = fallback;
        self
    }

    fn create_with(&self, qps: &DeviceQps) -> Result<(ConnQp, Endpoint), HandshakeError> {
        if let Some(hub) = &self.srq {
            let (qp, ep) = qps.create_on_srq(hub.srq())?;
            let route = Some(SrqHub::route(hub, qp.qp_num()));
            let pd = ConnPd(qps.device().pd().clone());
            return Ok((ConnQp { qp, pd, route }, ep));
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
