//! `-R`: the QPs connect through the RDMA CM (`verbio::runtime::cm`) on the
//! `-p` port instead of the TCP handshake, as perftest's `-R`. On an
//! ibverbs device that is librdmacm (the RDMA CM protocol on the wire); on
//! the software device, its equivalent over the device's TCP side.
//!
//! The control frames still travel on a TCP connection: the server's
//! accept of the first QP carries, as private data, the port of a control
//! listener and a token; the client dials it, sends the token, then the
//! hello, and connects the remaining QPs. A control connection without the
//! token is dropped and the server waits on (within [`HANDSHAKE`]).

use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::io::{AsyncReadExt, AsyncWriteExt};
use verbio::provider::Mtu;
use verbio::runtime::cm::{CmConnection, CmConnector, CmError, CmListener, CmOptions};
use verbio::runtime::{sleep, timeout, Device, TcpListener, TcpStream};

use crate::args::Config;
use crate::ctl::{self, Frame};
use crate::error::{msg, Context, Result};
use crate::session::{finish, listen_addr, qp_config, Conn, HANDSHAKE};

/// The first bytes of every private data verbio-perf sends: a CM request
/// or accept without them is not verbio-perf's.
const MAGIC: &[u8; 4] = b"vpR1";
/// An accept's private data: [`MAGIC`], the control port (big-endian),
/// the token (big-endian).
const ACCEPT_LEN: usize = 4 + 2 + 8;
/// How long a client retries a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);

/// The connection options of a run: its QP sizes, and a peer whose SEND
/// finds no receive retries after 10 µs (as the TCP handshake's QPs).
fn options(cfg: &Config) -> CmOptions {
    CmOptions {
        caps: qp_config(cfg).caps,
        min_rnr_timer: 1,
        resolve_timeout: HANDSHAKE,
        connect_timeout: HANDSHAKE,
        ..CmOptions::default()
    }
}

/// The port's active MTU (the CM settles the path MTU itself), for the
/// banner.
fn port_mtu(cfg: &Config, dev: &Device) -> Mtu {
    dev.context()
        .query_port(cfg.ib_port)
        .map_or(Mtu::Mtu1024, |p| p.active_mtu)
}

/// The server's CM listener and its control listener.
pub struct CmServer {
    cm: CmListener,
    ctl: TcpListener,
}

/// Server: listens for CM requests on the `-p` port (printing its address
/// on stderr) and for the control connection on a port of the system's
/// choice.
pub fn bind(cfg: &Config, dev: &Device) -> Result<CmServer> {
    let cm = CmListener::bind(dev, listen_addr(cfg.port), &options(cfg)).ctx(format!(
        "listening through the RDMA CM on port {}",
        cfg.port
    ))?;
    let local = cm
        .local_addr()
        .ok_or_else(|| msg("the RDMA CM listener has no address"))?;
    let ctl = TcpListener::bind(listen_addr(0)).ctx("listening for the control connection")?;
    eprintln!(
        "verbio-perf: {} server listening on {local} (RDMA CM)",
        cfg.test.name()
    );
    Ok(CmServer { cm, ctl })
}

/// Server: accepts one client's QPs and its control connection, checks its
/// hello and swaps memory grants.
pub async fn accept(cfg: &Config, dev: &Device, s: &CmServer) -> Result<Conn> {
    let port = s
        .ctl
        .local_addr()
        .ctx("reading the control listener's address")?
        .port();
    let token = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    let mut reply = Vec::with_capacity(ACCEPT_LEN);
    reply.extend_from_slice(MAGIC);
    reply.extend_from_slice(&port.to_be_bytes());
    reply.extend_from_slice(&token.to_be_bytes());
    let mut cms = vec![accept_qp(&s.cm, &reply).await?];
    let mut ctl = accept_ctl(&s.ctl, token).await?;
    let hello = ctl::recv(&mut ctl)
        .await
        .ctx("reading the client's hello")?;
    let (n, max_size) = ctl::check_hello(hello, cfg.test, cfg.api, cfg.connection, cfg.mode())
        .ctx("the client's hello")?;
    while cms.len() < n as usize {
        cms.push(accept_qp(&s.cm, &reply).await?);
    }
    let qps = cms.iter().map(|c| c.qp().clone()).collect();
    let mut conn = finish(dev, ctl, qps, port_mtu(cfg, dev), max_size, None, false).await?;
    conn.cm = cms;
    Ok(conn)
}

/// The next CM request that is verbio-perf's, accepted with `reply`;
/// others are rejected and the wait goes on.
async fn accept_qp(l: &CmListener, reply: &[u8]) -> Result<CmConnection> {
    loop {
        let req = l.request().await.ctx("waiting for a CM connect request")?;
        if !req.private_data().starts_with(MAGIC) {
            tracing::warn!(peer = ?req.peer_addr(), "a CM request that is not verbio-perf's: rejected");
            let _ = req.reject(b"not a verbio-perf -R client");
            continue;
        }
        return timeout(HANDSHAKE, req.accept(reply))
            .await
            .map_err(|_| {
                msg(format!(
                    "the client did not confirm the CM connection within {HANDSHAKE:?}"
                ))
            })?
            .ctx("accepting the client's CM request");
    }
}

/// The control connection that presents `token`, within [`HANDSHAKE`];
/// others are dropped.
async fn accept_ctl(l: &TcpListener, token: u64) -> Result<TcpStream> {
    let deadline = Instant::now() + HANDSHAKE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = async {
            let (mut s, peer) = l.accept().await?;
            let mut got = [0u8; 8];
            s.read_exact(&mut got).await?;
            Ok::<_, std::io::Error>((s, peer, u64::from_be_bytes(got)))
        };
        match timeout(left, wait).await {
            Err(_) => {
                return Err(msg(format!(
                    "no control connection from the client within {HANDSHAKE:?} of its CM connect"
                )))
            }
            Ok(Ok((s, _, got))) if got == token => return Ok(s),
            Ok(Ok((_, peer, _))) => {
                tracing::warn!(%peer, "a control connection without the run's token: dropped")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "a control connection failed"),
        }
    }
}

/// Client: connects `cfg.qps` QPs to the server through the RDMA CM and
/// the control connection, announces the run and swaps memory grants.
pub async fn dial(cfg: &Config, dev: &Device, addr: SocketAddr) -> Result<Conn> {
    let opts = options(cfg);
    let deadline = Instant::now() + CONNECT_RETRY;
    let first = loop {
        match connect_qp(dev, addr, &opts).await {
            Ok(c) => break c,
            // A server that is not up yet: refused, or no answer.
            Err(e) if !matches!(e, CmError::Rejected { .. }) && Instant::now() < deadline => {
                tracing::debug!(error = %verbio::ErrorChain(&e), "retrying the CM connect");
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(e).ctx(format!("connecting to {addr} through the RDMA CM")),
        }
    };
    let data = first.peer_private_data();
    if data.len() < ACCEPT_LEN || !data.starts_with(MAGIC) {
        return Err(msg(format!(
            "the CM peer at {addr} is not a verbio-perf -R server (its accept's private data \
             is {data:02x?})"
        )));
    }
    let port = u16::from_be_bytes([data[4], data[5]]);
    let token = u64::from_be_bytes(data[6..14].try_into().map_err(|_| msg("token"))?);
    let ctl_addr = SocketAddr::new(addr.ip(), port);
    let mut ctl = timeout(HANDSHAKE, TcpStream::connect(ctl_addr))
        .await
        .map_err(|_| {
            msg(format!(
                "no answer from the control port {ctl_addr} within {HANDSHAKE:?}"
            ))
        })?
        .ctx(format!("connecting the control connection to {ctl_addr}"))?;
    ctl.write_all(&token.to_be_bytes())
        .await
        .ctx("sending the control token")?;
    ctl::send(
        &mut ctl,
        Frame::Hello {
            test: cfg.test,
            api: cfg.api.code(),
            connection: cfg.connection.code(),
            qps: u16::try_from(cfg.qps).map_err(|_| msg("-q is too large"))?,
            max_size: cfg.max_size() as u64,
            mode: cfg.mode(),
        },
    )
    .await
    .ctx("sending the hello")?;
    let mut cms = vec![first];
    while cms.len() < cfg.qps as usize {
        let c = connect_qp(dev, addr, &opts).await.ctx(format!(
            "connecting QP {} to {addr} through the RDMA CM",
            cms.len()
        ))?;
        cms.push(c);
    }
    let qps = cms.iter().map(|c| c.qp().clone()).collect();
    let mut conn = finish(
        dev,
        ctl,
        qps,
        port_mtu(cfg, dev),
        cfg.max_size(),
        None,
        true,
    )
    .await?;
    conn.cm = cms;
    Ok(conn)
}

/// One QP through the CM: resolve, connect with [`MAGIC`].
async fn connect_qp(
    dev: &Device,
    addr: SocketAddr,
    opts: &CmOptions,
) -> std::result::Result<CmConnection, CmError> {
    CmConnector::resolve(dev, addr, opts)
        .await?
        .connect(MAGIC)
        .await
}
