//! Connected [`QueuePair`]s over TCP: [`Listener`] (server) and [`connect`]
//! (client) create a QP on a [`Device`], run the versioned handshake of
//! [`connect`](crate::connect) over the reactor's [`TcpStream`], and bring the
//! QP to RTS. Every step is bounded by [`ConnectOptions::timeout`].
//!
//! ```no_run
//! # async fn demo(dev: &verbio_runtime::Device) -> verbio_ops::Result<()> {
//! use verbio_ops::{connect, ConnectOptions, Listener};
//! let listener = Listener::bind(dev, "127.0.0.1:0".parse().unwrap(), ConnectOptions::default())?;
//! let addr = listener.local_addr()?;
//! // elsewhere (another runtime/thread/process):
//! let client_qp = connect(dev, addr, &ConnectOptions::default()).await?;
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use verbio_runtime::provider::{AccessFlags, Endpoint, InitAttr, Mtu, QpCaps, RtrAttr, RtsAttr};
use verbio_runtime::{sleep, timeout, Device, QueuePair, TcpListener, TcpStream};

use crate::connect::{accept_exchange, connect_exchange, Deadline, HandshakeError};
use crate::error::Error;

/// How connected QPs are created and brought up.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Queue sizes of the QP.
    pub caps: QpCaps,
    /// Remote access the QP allows (REMOTE_WRITE/READ/ATOMIC).
    pub access: AccessFlags,
    /// Physical port (1-based).
    pub port: u8,
    /// GID index; `None` = the device's default for `port`.
    pub gid_index: Option<u8>,
    /// RNR NAK timer this side's responder advertises (encoded).
    pub min_rnr_timer: u8,
    /// Incoming READ/atomic requests allowed in flight.
    pub max_dest_rd_atomic: u8,
    /// Hop limit of the GRH.
    pub hop_limit: u8,
    /// Timeouts and retry counts of the requester.
    pub rts: RtsAttr,
    /// Limit for the TCP connect plus the whole handshake.
    pub timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            caps: QpCaps::default(),
            access: InitAttr::default().access,
            port: 1,
            gid_index: None,
            min_rnr_timer: 1,
            max_dest_rd_atomic: 16,
            hop_limit: 64,
            rts: RtsAttr::default(),
            timeout: Duration::from_secs(10),
        }
    }
}

impl ConnectOptions {
    fn gid_index(&self, dev: &Device) -> Result<u8, Error> {
        match self.gid_index {
            Some(g) => Ok(g),
            None => dev
                .context()
                .default_gid_index(self.port)
                .map_err(|source| Error::Provider {
                    context: "choosing the GID index",
                    source,
                }),
        }
    }
}

fn provider(
    stage: &'static str,
) -> impl FnOnce(verbio_runtime::provider::ProviderError) -> HandshakeError {
    move |source| HandshakeError::Provider { stage, source }
}

/// Creates a QP and moves it to INIT; returns it with its endpoint.
fn new_qp(
    dev: &Device,
    opts: &ConnectOptions,
    gid: u8,
) -> Result<(QueuePair, Endpoint), HandshakeError> {
    let qp = dev
        .create_qp(opts.caps)
        .map_err(provider("creating the QP"))?;
    qp.modify_to_init(&InitAttr {
        port: opts.port,
        pkey_index: 0,
        access: opts.access,
    })
    .map_err(provider("moving the QP to INIT"))?;
    let ep = qp
        .endpoint(gid)
        .map_err(provider("reading the QP's endpoint"))?;
    Ok((qp, ep))
}

/// INIT → RTR → RTS towards `remote`.
fn bring_up(
    qp: &QueuePair,
    local: &Endpoint,
    remote: &Endpoint,
    opts: &ConnectOptions,
    gid: u8,
) -> Result<(), HandshakeError> {
    let path_mtu: Mtu = local.mtu.min(remote.mtu);
    qp.modify_to_rtr(&RtrAttr {
        remote: *remote,
        path_mtu,
        min_rnr_timer: opts.min_rnr_timer,
        max_dest_rd_atomic: opts.max_dest_rd_atomic,
        sgid_index: gid,
        hop_limit: opts.hop_limit,
    })
    .map_err(provider("moving the QP to RTR"))?;
    qp.modify_to_rts(&opts.rts)
        .map_err(provider("moving the QP to RTS"))
}

/// Connects to a [`Listener`] at `addr`: returns a QP in RTS connected to a
/// new QP on the server's side. Bounded by `opts.timeout`.
pub async fn connect(
    dev: &Device,
    addr: SocketAddr,
    opts: &ConnectOptions,
) -> Result<QueuePair, Error> {
    let gid = opts.gid_index(dev)?;
    let mut stream = match timeout(opts.timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => {
            return Err(Error::Io {
                context: "connecting to the listener",
                source,
            })
        }
        Err(_) => {
            return Err(HandshakeError::Timeout {
                stage: "connecting to the listener",
                after: opts.timeout,
            }
            .into())
        }
    };
    let _ = stream.set_nodelay(true);
    let (qp, local) = new_qp(dev, opts, gid)?;
    connect_exchange(
        &mut stream,
        &local,
        |remote| bring_up(&qp, &local, remote, opts, gid),
        Deadline {
            timer: sleep(opts.timeout),
            after: opts.timeout,
        },
    )
    .await?;
    tracing::debug!(qp = qp.qp_num(), %addr, "connected");
    Ok(qp)
}

/// Accepts connections over TCP and hands out a connected QP per client.
///
/// Handshakes run one at a time inside [`accept`](Self::accept), each bounded
/// by the options' timeout; a client that fails the handshake (garbage,
/// wrong version, timeout) makes that `accept` return the error and leaves
/// the listener ready for the next one.
#[derive(Debug)]
pub struct Listener {
    tcp: TcpListener,
    dev: Device,
    opts: ConnectOptions,
}

impl Listener {
    /// Listens on `addr` (port 0 for an ephemeral port) for clients of `dev`'s QPs.
    pub fn bind(dev: &Device, addr: SocketAddr, opts: ConnectOptions) -> Result<Listener, Error> {
        let tcp = TcpListener::bind(addr).map_err(|source| Error::Io {
            context: "binding the listener",
            source,
        })?;
        Ok(Listener {
            tcp,
            dev: dev.clone(),
            opts,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.tcp.local_addr().map_err(|source| Error::Io {
            context: "reading the listener's address",
            source,
        })
    }

    /// Waits for the next client and runs its handshake: returns a QP in RTS
    /// connected to the client's QP, and the client's address.
    pub async fn accept(&self) -> Result<(QueuePair, SocketAddr), Error> {
        let (mut stream, peer) = self.tcp.accept().await.map_err(|source| Error::Io {
            context: "accepting a connection",
            source,
        })?;
        let _ = stream.set_nodelay(true);
        let opts = &self.opts;
        let gid = opts.gid_index(&self.dev)?;
        let dev = &self.dev;
        let res = accept_exchange(
            &mut stream,
            dev.context().kind(),
            |remote| {
                let (qp, local) = new_qp(dev, opts, gid)?;
                bring_up(&qp, &local, remote, opts, gid)?;
                Ok((local, qp))
            },
            Deadline {
                timer: sleep(opts.timeout),
                after: opts.timeout,
            },
        )
        .await;
        match res {
            Ok((_, qp)) => {
                tracing::debug!(qp = qp.qp_num(), %peer, "accepted");
                Ok((qp, peer))
            }
            Err(e) => {
                tracing::debug!(%peer, error = %e, "handshake failed");
                Err(e.into())
            }
        }
    }
}
