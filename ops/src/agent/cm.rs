//! [`RdmaBuilder::connect_cm`] / [`RdmaBuilder::listen_cm`]: agent
//! connections set up by the connection manager ([`verbio_runtime::cm`]:
//! RDMA CM on libibverbs devices, its TCP equivalent on the software
//! device) instead of the TCP endpoint handshake. The agent settings ride
//! in the connect request's and the accept's private data; the
//! connection's disconnect is the agent's "peer gone" signal.

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use verbio_runtime::cm::{CmConnection, CmConnector, CmError, CmListener, CmOptions};
use verbio_runtime::provider::Mtu;
use verbio_runtime::{timeout, Device};

use super::builder::{Config, RdmaBuilder};
use super::error::AgentError;
use super::qps::ConnPd;
use super::rdma::{Link, Rdma, Redial};
use super::settings::{settings_frame, settings_from_private};
use super::side::SideChannel;
use crate::connect::QpConfig;

fn cm_err(stage: &'static str) -> impl FnOnce(CmError) -> AgentError {
    move |source| AgentError::Cm { stage, source }
}

/// The connection manager's options for the builder's QP settings; every
/// connection's QP in a protection domain of its own, as with TCP set-up.
fn options(qp: &QpConfig, limit: Duration) -> CmOptions {
    CmOptions {
        caps: qp.caps,
        responder_resources: qp.max_dest_rd_atomic,
        initiator_depth: qp.rts.max_rd_atomic,
        retry_count: qp.rts.retry_cnt,
        rnr_retry_count: qp.rts.rnr_retry,
        min_rnr_timer: qp.min_rnr_timer,
        resolve_timeout: limit,
        own_pd: true,
        ..CmOptions::default()
    }
}

/// The path MTU of a CM connection: the port's active MTU, capped.
fn path_mtu(device: &Device, qp: &QpConfig) -> Result<Mtu, AgentError> {
    let port = device
        .context()
        .query_port(qp.init.port)
        .map_err(|source| AgentError::Device {
            stage: "querying the port's MTU",
            source,
        })?;
    Ok(qp.mtu.map_or(port.active_mtu, |c| port.active_mtu.min(c)))
}

/// Starts the agent on an established CM connection.
fn start(
    conn: CmConnection,
    device: Device,
    config: Rc<Config>,
    qp: &QpConfig,
) -> Result<Rdma, AgentError> {
    let own = config.settings(conn.qp().caps().max_recv_wr);
    let peer = settings_from_private(conn.peer_private_data())?;
    let path_mtu = path_mtu(&device, qp)?;
    let span = tracing::info_span!(
        "rdma",
        peer = ?conn.peer_addr(),
        local_qpn = conn.qp().qp_num(),
        cm = true,
    );
    let link = Link {
        qp: conn.qp().clone(),
        pd: ConnPd(conn.pd().clone()),
        device,
        config,
        path_mtu,
        side: SideChannel::Cm(conn),
        // CM connections have their own receive queues.
        route: None,
        seat: None,
        span: span.clone(),
    };
    let _in = span.enter();
    Rdma::assemble(link, &own, &peer)
}

async fn bounded<T>(
    limit: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, AgentError>>,
) -> Result<T, AgentError> {
    timeout(limit, f)
        .await
        .unwrap_or(Err(AgentError::Timeout { what, after: limit }))
}

impl RdmaBuilder {
    /// Connects to a [`listen_cm`](Self::listen_cm) listener at `addr`
    /// through the connection manager: on libibverbs devices RDMA CM
    /// (`addr` is an IP address of the peer's RDMA interface and the CM
    /// port), on the software device its TCP equivalent. The agent settings
    /// travel in the connect request and the accept. Must run on a verbio
    /// runtime; bounded by the handshake timeout.
    ///
    /// [`Rdma::new_connection`] makes another connection the same way.
    pub async fn connect_cm(&self, addr: SocketAddr) -> Result<Rdma, AgentError> {
        let (qp, config, device, limit) = self.cm_parts()?;
        let opts = options(&qp, limit);
        let conn = bounded(limit, "RDMA CM connect", async {
            let connector = CmConnector::resolve(&device, addr, &opts)
                .await
                .map_err(cm_err("resolving the address"))?;
            let own = config.settings(connector.qp().caps().max_recv_wr);
            connector
                .connect(&settings_frame(&own)?)
                .await
                .map_err(cm_err("connecting"))
        })
        .await?;
        let mut rdma = start(conn, device.clone(), config, &qp)?;
        rdma.set_redial(self.clone().device(device), Redial::Cm(addr));
        Ok(rdma)
    }

    /// Listens for [`connect_cm`](Self::connect_cm) peers on `addr` (an IP
    /// address of the device's interface, or unspecified; port 0 picks one).
    /// Must run on a verbio runtime.
    ///
    /// Refused with [`AgentError::Config`] when
    /// [`shared_receive_queue`](Self::shared_receive_queue) is set: CM
    /// connections have receive queues of their own.
    pub fn listen_cm(&self, addr: SocketAddr) -> Result<RdmaCmListener, AgentError> {
        if self.srq_set && self.srq.is_some() {
            return Err(AgentError::Config {
                setting: "shared_receive_queue",
                reason: "not available on RDMA CM connections (listen_cm); use listen",
            });
        }
        let (qp, config, device, limit) = self.cm_parts()?;
        let listener =
            CmListener::bind(&device, addr, &options(&qp, limit)).map_err(cm_err("listening"))?;
        Ok(RdmaCmListener {
            listener,
            device,
            config,
            qp,
            limit,
        })
    }
}

/// Accepts [`Rdma`] connections made with [`RdmaBuilder::connect_cm`].
pub struct RdmaCmListener {
    listener: CmListener,
    device: Device,
    config: Rc<Config>,
    qp: QpConfig,
    limit: Duration,
}

impl std::fmt::Debug for RdmaCmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaCmListener")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl RdmaCmListener {
    /// The address it listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection. A request without valid agent settings is
    /// rejected and its error returned (it concerns that peer only: keep
    /// accepting); the settings check then runs on both sides as with TCP
    /// set-up.
    pub async fn accept(&self) -> Result<Rdma, AgentError> {
        let req = self
            .listener
            .request()
            .await
            .map_err(cm_err("waiting for a connect request"))?;
        if let Err(e) = settings_from_private(req.private_data()) {
            if let Err(r) = req.reject(&[]) {
                tracing::debug!(error = %crate::error::ErrorChain(&r), "rejecting a connect request");
            }
            return Err(e);
        }
        let own = self.config.settings(req.qp().caps().max_recv_wr);
        let frame = settings_frame(&own)?;
        let conn = bounded(self.limit, "RDMA CM accept", async {
            req.accept(&frame).await.map_err(cm_err("accepting"))
        })
        .await?;
        start(conn, self.device.clone(), self.config.clone(), &self.qp)
    }
}
