//! Creating and connecting the queue pair of a connection: [`QpFactory`],
//! and [`DeviceQps`], its implementation on a runtime [`Device`].

use verbio_runtime::provider::{
    Endpoint, InitAttr, Mtu, Pd, ProviderKind, QpCaps, RtrAttr, RtsAttr,
};
use verbio_runtime::{Device, QueuePair};

use super::error::HandshakeError;

/// What connection setup needs from a device: make a QP in INIT and tell its
/// endpoint, then connect it to the peer's (INIT → RTR → RTS). Both calls are
/// synchronous (verbs calls); they run inside the handshake, within its
/// deadline.
pub trait QpFactory: 'static {
    /// The queue-pair handle handed to the user.
    type Qp: 'static;
    /// The provider the QPs belong to (both sides must match).
    fn provider(&self) -> ProviderKind;
    /// Creates a QP, moves it to INIT and returns it with its endpoint.
    fn create(&self) -> Result<(Self::Qp, Endpoint), HandshakeError>;
    /// Moves `qp` (with endpoint `local`) to RTS, connected to `remote`.
    fn connect(
        &self,
        qp: &Self::Qp,
        local: &Endpoint,
        remote: &Endpoint,
    ) -> Result<(), HandshakeError>;
}

/// Queue-pair attributes used when connecting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// Queue sizes.
    pub caps: QpCaps,
    /// RESET → INIT attributes (port, remote access the QP allows).
    pub init: InitAttr,
    /// GID index for the endpoint and the GRH; `None` = the device's default.
    pub gid_index: Option<u8>,
    /// RNR NAK timer this side advertises (encoded, see `rnr_timer_duration`).
    pub min_rnr_timer: u8,
    /// Incoming READ/atomic requests in flight.
    pub max_dest_rd_atomic: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// RTR → RTS attributes (timeouts, retries).
    pub rts: RtsAttr,
    /// Largest path MTU this side accepts (`None` = the port's active MTU).
    /// The endpoint advertises the smaller of the two, so both sides settle
    /// on the same path MTU: the minimum of both ports and both settings.
    pub mtu: Option<Mtu>,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            caps: QpCaps::default(),
            init: InitAttr::default(),
            gid_index: None,
            min_rnr_timer: 12,
            max_dest_rd_atomic: 16,
            hop_limit: 64,
            rts: RtsAttr::default(),
            mtu: None,
        }
    }
}

/// Makes RC queue pairs on a runtime [`Device`].
#[derive(Clone, Debug)]
pub struct DeviceQps {
    device: Device,
    config: QpConfig,
}

impl DeviceQps {
    /// QPs on `device` with `config`.
    pub fn new(device: Device, config: QpConfig) -> DeviceQps {
        DeviceQps { device, config }
    }

    /// The device the QPs are made on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Like [`QpFactory::create`], but the QP is in `pd` (one of
    /// [`Device::alloc_pd`]) instead of the device's protection domain.
    pub fn create_in(&self, pd: &Pd) -> Result<(QueuePair, Endpoint), HandshakeError> {
        let qp = self
            .device
            .create_qp_in(pd, self.config.caps)
            .map_err(provider_err("creating the QP"))?;
        self.init(qp)
    }

    /// Like [`QpFactory::create`], but the QP takes its receives from
    /// `srq` (and is in the device's protection domain, the SRQ's).
    pub fn create_on_srq(
        &self,
        srq: &verbio_runtime::SharedRecvQueue,
    ) -> Result<(QueuePair, Endpoint), HandshakeError> {
        let qp = self
            .device
            .create_qp_on_srq(srq, self.config.caps)
            .map_err(provider_err("creating the QP on the shared receive queue"))?;
        self.init(qp)
    }

    /// Two QPs of this device connected to each other (loopback through
    /// the device), with no handshake: for tests and benchmarks on one
    /// device.
    pub fn connected_pair(&self) -> Result<(QueuePair, QueuePair), HandshakeError> {
        let (a, ea) = self.create()?;
        let (b, eb) = self.create()?;
        self.connect(&a, &ea, &eb)?;
        self.connect(&b, &eb, &ea)?;
        Ok((a, b))
    }

    fn init(&self, qp: QueuePair) -> Result<(QueuePair, Endpoint), HandshakeError> {
        qp.modify_to_init(&self.config.init)
            .map_err(provider_err("moving the QP to INIT"))?;
        let mut ep = qp
            .endpoint(self.gid_index()?)
            .map_err(provider_err("querying the QP's endpoint"))?;
        if let Some(cap) = self.config.mtu {
            ep.mtu = ep.mtu.min(cap);
        }
        Ok((qp, ep))
    }

    fn gid_index(&self) -> Result<u8, HandshakeError> {
        match self.config.gid_index {
            Some(i) => Ok(i),
            None => self
                .device
                .context()
                .default_gid_index(self.config.init.port)
                .map_err(|source| HandshakeError::Provider {
                    stage: "choosing the GID index",
                    source,
                }),
        }
    }
}

/// The path MTU of a connection: the smaller endpoint MTU, capped by `cap`.
pub fn path_mtu(local: &Endpoint, remote: &Endpoint, cap: Option<Mtu>) -> Mtu {
    let m = local.mtu.min(remote.mtu);
    cap.map_or(m, |c| m.min(c))
}

fn provider_err(
    stage: &'static str,
) -> impl FnOnce(verbio_runtime::provider::ProviderError) -> HandshakeError {
    move |source| HandshakeError::Provider { stage, source }
}

impl QpFactory for DeviceQps {
    type Qp = QueuePair;

    fn provider(&self) -> ProviderKind {
        self.device.context().kind()
    }

    fn create(&self) -> Result<(QueuePair, Endpoint), HandshakeError> {
        let qp = self
            .device
            .create_qp(self.config.caps)
            .map_err(provider_err("creating the QP"))?;
        self.init(qp)
    }

    fn connect(
        &self,
        qp: &QueuePair,
        local: &Endpoint,
        remote: &Endpoint,
    ) -> Result<(), HandshakeError> {
        qp.modify_to_rtr(&RtrAttr {
            remote: *remote,
            path_mtu: path_mtu(local, remote, self.config.mtu),
            min_rnr_timer: self.config.min_rnr_timer,
            max_dest_rd_atomic: self.config.max_dest_rd_atomic,
            sgid_index: self.gid_index()?,
            hop_limit: self.config.hop_limit,
        })
        .map_err(provider_err("moving the QP to RTR"))?;
        qp.modify_to_rts(&self.config.rts)
            .map_err(provider_err("moving the QP to RTS"))
    }
}
