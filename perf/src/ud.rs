//! `-c UD`: the setup of a run over UD queue pairs. The client dials the
//! server's TCP port (the control stream), each side creates one UD QP and
//! they swap its address (QP number, Q_Key, LID, GID, MTU and, on the
//! software device, the engine's address) as control frames; each then
//! makes a `UdPeer` of the other. The measured loops are the verbs API's,
//! sending to that peer (`verbs.rs`).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use verbio::provider::{Endpoint, Gid, Mtu, ProviderKind, QpCaps, UdAttr, DEFAULT_QKEY};
use verbio::runtime::{sleep, Device, QueuePair, TcpListener, TcpStream, UdEndpoint};

use crate::args::Config;
use crate::ctl::{self, Frame};
use crate::error::{msg, Context, Result};
use crate::session::{self, Conn, LAT_RX_DEPTH};

/// How long a client retries connecting to a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);

fn ud_qp(cfg: &Config, dev: &Device) -> Result<QueuePair> {
    let caps = QpCaps {
        max_send_wr: cfg.tx_depth.max(16) + 2,
        max_recv_wr: 2 * LAT_RX_DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: cfg.inline,
    };
    let attr = UdAttr {
        port: cfg.ib_port,
        qkey: DEFAULT_QKEY,
        ..UdAttr::default()
    };
    dev.create_ud_qp(caps, &attr).ctx("creating the UD QP")
}

fn gid_index(cfg: &Config, dev: &Device) -> Result<u8> {
    match cfg.gid_index {
        Some(i) => Ok(i),
        None => dev
            .context()
            .default_gid_index(cfg.ib_port)
            .ctx("choosing the GID index"),
    }
}

fn provider_code(p: ProviderKind) -> u8 {
    match p {
        ProviderKind::Ibverbs => 1,
        _ => 0,
    }
}

fn halves(b: [u8; 16]) -> (u64, u64) {
    let (hi, lo) = b.split_at(8);
    let word = |s: &[u8]| u64::from_be_bytes(s.try_into().expect("8 bytes"));
    (word(hi), word(lo))
}

fn bytes(hi: u64, lo: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&hi.to_be_bytes());
    b[8..].copy_from_slice(&lo.to_be_bytes());
    b
}

/// Sends this side's UD address.
pub async fn send_endpoint(ctl: &mut TcpStream, ep: &UdEndpoint) -> Result<()> {
    let e = &ep.endpoint;
    let (hi, lo) = halves(e.gid.0);
    let mut frames = vec![
        Frame::UdQp {
            qpn: e.qpn,
            qkey: ep.qkey,
            lid: e.lid,
            mtu: e.mtu as u8,
            provider: provider_code(e.provider),
        },
        Frame::Gid { hi, lo },
    ];
    if let Some(a) = e.addr.to_socket() {
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        let (hi, lo) = halves(ip.octets());
        frames.push(Frame::SoftAddr {
            port: a.port(),
            hi,
            lo,
        });
    }
    for f in frames {
        ctl::send(ctl, f).await.ctx("sending the UD address")?;
    }
    Ok(())
}

/// Reads the peer's UD address (`soft`: it runs on the software device,
/// so a [`Frame::SoftAddr`] follows).
pub async fn recv_endpoint(ctl: &mut TcpStream) -> Result<UdEndpoint> {
    let (qpn, qkey, lid, mtu, provider) =
        match ctl::recv(ctl).await.ctx("reading the UD address")? {
            Frame::UdQp {
                qpn,
                qkey,
                lid,
                mtu,
                provider,
            } => (qpn, qkey, lid, mtu, provider),
            got => return Err(msg(format!("expected the peer's UD QP, got {got:?}"))),
        };
    let gid = match ctl::recv(ctl).await.ctx("reading the UD address")? {
        Frame::Gid { hi, lo } => Gid(bytes(hi, lo)),
        got => return Err(msg(format!("expected the peer's GID, got {got:?}"))),
    };
    let provider = if provider == 1 {
        ProviderKind::Ibverbs
    } else {
        ProviderKind::Soft
    };
    let soft_addr = if provider == ProviderKind::Soft {
        match ctl::recv(ctl).await.ctx("reading the UD address")? {
            Frame::SoftAddr { port, hi, lo } => {
                let v6 = Ipv6Addr::from(bytes(hi, lo));
                let ip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
                Some(SocketAddr::new(ip, port))
            }
            got => {
                return Err(msg(format!(
                    "expected the peer's engine address, got {got:?}"
                )))
            }
        }
    } else {
        None
    };
    let mtu = Mtu::from_raw(mtu).ok_or_else(|| msg(format!("the peer sent MTU code {mtu}")))?;
    Ok(UdEndpoint {
        endpoint: Endpoint {
            provider,
            qpn,
            psn: 0,
            lid,
            gid,
            mtu,
            addr: soft_addr.map_or(verbio::provider::ProviderAddr::NONE, Into::into),
        },
        qkey,
    })
}

/// Swaps UD addresses over `ctl` and grants memory as the RC setup does;
/// the client speaks first.
async fn finish(
    cfg: &Config,
    dev: &Device,
    mut ctl: TcpStream,
    qp: QueuePair,
    max_size: usize,
    client: bool,
) -> Result<Conn> {
    let me = qp
        .ud_endpoint(gid_index(cfg, dev)?)
        .ctx("reading this side's UD address")?;
    let peer_ep = if client {
        send_endpoint(&mut ctl, &me).await?;
        recv_endpoint(&mut ctl).await?
    } else {
        let p = recv_endpoint(&mut ctl).await?;
        send_endpoint(&mut ctl, &me).await?;
        p
    };
    if peer_ep.endpoint.provider != me.endpoint.provider {
        return Err(msg("the two sides run on different providers"));
    }
    let mtu = me.endpoint.mtu.min(peer_ep.endpoint.mtu);
    if max_size > mtu.bytes() as usize {
        return Err(msg(format!(
            "-c UD sends datagrams of at most the MTU ({} bytes), not {max_size}",
            mtu.bytes()
        )));
    }
    let peer = qp
        .ud_peer(&peer_ep)
        .ctx("making the peer's address handle")?;
    session::finish(dev, ctl, vec![qp], mtu, max_size, Some(peer), client).await
}

/// Client: the control stream to the server at `addr` (retried for a
/// while: the server may not be up yet), Nagle off.
pub async fn dial_ctl(addr: SocketAddr) -> Result<TcpStream> {
    let deadline = Instant::now() + CONNECT_RETRY;
    let ctl = loop {
        match TcpStream::connect(addr).await {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => sleep(Duration::from_millis(50)).await,
            Err(e) => return Err(e).ctx(format!("connecting to {addr}")),
        }
    };
    ctl.set_nodelay(true).ctx("setting TCP_NODELAY")?;
    Ok(ctl)
}

/// Client: dials the server, announces the run, swaps UD addresses.
pub async fn dial(cfg: &Config, dev: &Device, addr: SocketAddr) -> Result<Conn> {
    let mut ctl = dial_ctl(addr).await?;
    let max_size = cfg.max_size();
    ctl::send(
        &mut ctl,
        Frame::Hello {
            test: cfg.test,
            api: cfg.api.code(),
            connection: cfg.connection.code(),
            qps: 1,
            max_size: max_size as u64,
            mode: cfg.mode(),
        },
    )
    .await
    .ctx("sending the hello")?;
    let qp = ud_qp(cfg, dev)?;
    finish(cfg, dev, ctl, qp, max_size, true).await
}

/// Server: binds the control port (printing it on stderr).
pub fn bind(cfg: &Config) -> Result<TcpListener> {
    let l = TcpListener::bind(session::listen_addr(cfg.port))
        .ctx(format!("listening on TCP port {}", cfg.port))?;
    let local = l.local_addr().ctx("reading the listening address")?;
    eprintln!(
        "verbio-perf: {} server (UD) listening on {local}",
        cfg.test.name()
    );
    Ok(l)
}

/// Server: accepts one client, checks its hello, swaps UD addresses.
pub async fn accept(cfg: &Config, dev: &Device, l: &TcpListener) -> Result<Conn> {
    let (mut ctl, _) = l.accept().await.ctx("accepting the client")?;
    ctl.set_nodelay(true).ctx("setting TCP_NODELAY")?;
    let hello = ctl::recv(&mut ctl)
        .await
        .ctx("reading the client's hello")?;
    let (_, max_size) = ctl::check_hello(hello, cfg.test, cfg.api, cfg.connection, cfg.mode())
        .ctx("the client's hello")?;
    let qp = ud_qp(cfg, dev)?;
    finish(cfg, dev, ctl, qp, max_size, false).await
}
