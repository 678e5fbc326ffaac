//! [`AgentQps`]: the agent's [`QpFactory`]: every connection's QP gets a
//! protection domain of its own, so memory registered for one connection
//! (its receive pool, its grants) cannot be reached through another.

use verbio_runtime::provider::{Endpoint, Pd, ProviderKind};
use verbio_runtime::QueuePair;

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
}

/// Makes each QP in a fresh protection domain of the device.
#[derive(Debug, Clone)]
pub(crate) struct AgentQps {
    inner: DeviceQps,
}

impl AgentQps {
    pub(crate) fn new(inner: DeviceQps) -> AgentQps {
        AgentQps { inner }
    }
}

impl QpFactory for AgentQps {
    type Qp = ConnQp;

    fn provider(&self) -> ProviderKind {
        self.inner.provider()
    }

    fn create(&self) -> Result<(ConnQp, Endpoint), HandshakeError> {
        let pd = self
            .inner
            .device()
            .alloc_pd()
            .map_err(|source| HandshakeError::Provider {
                stage: "allocating the connection's protection domain",
                source,
            })?;
        let (qp, ep) = self.inner.create_in(&pd)?;
        Ok((ConnQp { qp, pd: ConnPd(pd) }, ep))
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
