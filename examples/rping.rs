//! `rping`: the ping-pong of rdma-core's `rping` (librdmacm/examples/rping.c),
//! on verbio's connection manager ([`verbio::runtime::cm`]), wire-compatible
//! with `rping` on either side.
//!
//! The protocol, per ping: the client fills its source buffer
//! (`"rdma-ping-%d: "` then letters cycling from `A` to `z`, a NUL last)
//! and SENDs `{addr: be64, rkey: be32, size: be32}` of it; the server RDMA
//! READs that buffer and SENDs a 16-byte "go ahead"; the client SENDs the
//! same descriptor of its sink buffer; the server RDMA WRITEs what it read
//! (up to and with its first NUL) into the sink and SENDs "go ahead"
//! again; the client compares sink and source. After `-C` pings the client
//! disconnects; the server ends when a client has made its pings and
//! disconnected (with `-P`, rping's persistent server, it never ends).
//!
//! The server serves each client in a task of its own: a client that fails
//! (a bad request, a protocol error, one that stalls for 30 s) ends its own
//! session, logged, and the server keeps listening.
//!
//! verbio always checks the data: as client, the sink against the source
//! (`rping -V` does the same); as server, every buffer it reads against the
//! pattern of that ping number.
//!
//! ```text
//! rping -s -a 10.77.0.1 -C 300 -V &                                   # rdma-core server
//! cargo run --example rping --features ibverbs -- -c -a 10.77.0.1 -C 300
//! cargo run --example rping --features ibverbs -- -s -a 10.77.0.1 -C 300 &
//! rping -c -a 10.77.0.1 -C 300 -V                                     # rdma-core client
//! ```
//!
//! The device is `-d`, else `VERBIO_DEVICE`, else the first ibverbs device
//! with an active port, else the software device (then both sides must be
//! verbio). `scripts/rxe-test.sh` runs both pairings against `rping` in the
//! rxe VM.

mod cli;

use std::error::Error;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use futures::future::{join, select, Either};
use futures::StreamExt;

use verbio::ops::verbs::{RemoteBuf, SendVerb, Verbs};
use verbio::provider::{open_device, AccessFlags, Context, ProviderKind, QpCaps, SoftConfig};
use verbio::runtime::buf::{LocalBuf, MrPool, RemoteAccessRegion};
use verbio::runtime::cm::CmRequest;
use verbio::runtime::cm::{CmConnector, CmListener, CmOptions, DisconnectReason};
use verbio::runtime::{spawn, timeout, Device, QueuePair, Runtime, Submit};

/// rping's ping-pong over RDMA CM (SEND, RDMA READ, RDMA WRITE).
#[derive(Parser)]
struct Args {
    /// Server side.
    #[arg(short = 's', conflicts_with = "client")]
    server: bool,
    /// Client side.
    #[arg(short = 'c')]
    client: bool,
    /// Address: the server's to connect to, or the one to listen on.
    #[arg(short = 'a', default_value = "0.0.0.0")]
    addr: IpAddr,
    /// RDMA CM port.
    #[arg(short = 'p', default_value_t = 7174)]
    port: u16,
    /// Pings (the client's; the server expects that many, 0 = any).
    #[arg(short = 'C', default_value_t = 0)]
    count: u32,
    /// Ping data size in bytes (rping's bounds: 26 ..= 65535).
    #[arg(short = 'S', default_value_t = 64, value_parser = clap::value_parser!(u32).range(26..=65535))]
    size: u32,
    /// Print the ping data.
    #[arg(short = 'v')]
    verbose: bool,
    /// Accepted for rping compatibility: verbio always checks the data.
    #[arg(short = 'V')]
    validate: bool,
    /// RDMA device (e.g. rxe0).
    #[arg(short = 'd', long = "ib-dev")]
    device: Option<String>,
    /// Persistent server: serve clients until killed (rping's `-P`).
    #[arg(short = 'P', conflicts_with = "client")]
    persistent: bool,
    /// Seconds the whole run may take (0 = no limit).
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

/// How long the server waits for a client's next message before giving
/// up on that client.
const CLIENT_IDLE: Duration = Duration::from_secs(30);

type Res<T> = Result<T, Box<dyn Error>>;

/// Bytes of `struct rping_rdma_info`.
const INFO_LEN: usize = 16;

/// `{buf, rkey, size}` in network order, as `rping_format_send` writes it.
fn encode_info(addr: u64, rkey: u32, size: u32) -> [u8; INFO_LEN] {
    let mut b = [0u8; INFO_LEN];
    b[..8].copy_from_slice(&addr.to_be_bytes());
    b[8..12].copy_from_slice(&rkey.to_be_bytes());
    b[12..].copy_from_slice(&size.to_be_bytes());
    b
}

fn decode_info(b: &[u8]) -> Res<RemoteBuf> {
    if b.len() != INFO_LEN {
        return Err(format!("received {} bytes, rping's message has {INFO_LEN}", b.len()).into());
    }
    let addr = u64::from_be_bytes(b[..8].try_into()?);
    let rkey = u32::from_be_bytes(b[8..12].try_into()?);
    let size = u32::from_be_bytes(b[12..].try_into()?);
    Ok(RemoteBuf::new(addr, u64::from(size), rkey))
}

/// The source data of ping `ping` as `rping_test_client` writes it: the
/// prefix, then letters from `start` (65 + ping mod 58) cycling over 65..=122,
/// and a NUL in the last byte.
fn ping_data(ping: u32, size: usize) -> Vec<u8> {
    let mut buf = format!("rdma-ping-{ping}: ").into_bytes();
    buf.truncate(size);
    let mut c = 65 + (ping % 58) as u8;
    while buf.len() < size {
        buf.push(c);
        c += 1;
        if c > 122 {
            c = 65;
        }
    }
    buf[size - 1] = 0;
    buf
}

fn print_ping(who: &str, data: &[u8]) {
    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    println!("{who}ping data: {}", String::from_utf8_lossy(&data[..end]));
}

/// The connection's queues: rping's (send 16, receive 2), SGEs of one.
fn options() -> CmOptions {
    CmOptions {
        caps: QpCaps {
            max_send_wr: 16,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        ..CmOptions::default()
    }
}

async fn client(dev: &Device, args: &Args) -> Res<u32> {
    let size = args.size as usize;
    let pool = MrPool::new(dev.pd());
    let source = RemoteAccessRegion::grant(dev.pd(), vec![0u8; size], AccessFlags::REMOTE_READ)
        .map_err(|r| r.error)?;
    let sink = RemoteAccessRegion::grant(
        dev.pd(),
        vec![0u8; size],
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    )
    .map_err(|r| r.error)?;
    let server = SocketAddr::new(args.addr, args.port);
    let connector = CmConnector::resolve(dev, server, &options()).await?;
    let qp = connector.qp().clone();
    let mut go_ahead = qp.recv(pool.alloc(INFO_LEN)?);
    let conn = connector.connect(&[]).await?;
    println!("rping client: connected to {server}");
    let source_info = encode_info(source.addr(), source.rkey(), args.size);
    let sink_info = encode_info(sink.addr(), sink.rkey(), args.size);
    let mut ping = 0;
    while args.count == 0 || ping < args.count {
        let data = ping_data(ping, size);
        source.write_from(0, &data)?;
        // As rping: wait for the answer, not for the SEND's own completion
        // first (both are awaited, side by side).
        let ((sent, _), answer) = futures::join!(qp.send(pool.alloc_from(&source_info)?), go_ahead);
        sent?;
        expect_go_ahead(answer)?;
        go_ahead = qp.recv(pool.alloc(INFO_LEN)?);
        let ((sent, _), answer) = futures::join!(qp.send(pool.alloc_from(&sink_info)?), go_ahead);
        sent?;
        expect_go_ahead(answer)?;
        go_ahead = qp.recv(pool.alloc(INFO_LEN)?);
        let got = sink.to_vec();
        if got != data {
            return Err(
                format!("ping {ping}: data mismatch: sent {data:?}, got back {got:?}").into(),
            );
        }
        if args.verbose {
            print_ping("", &got);
        }
        ping += 1;
    }
    conn.disconnect().await?;
    drop(go_ahead);
    Ok(ping)
}

fn expect_go_ahead<B>((res, _buf): (verbio::ops::Result<verbio::Received>, B)) -> Res<()> {
    let n = res?.len;
    if n != INFO_LEN {
        return Err(format!("go-ahead of {n} bytes, rping sends {INFO_LEN}").into());
    }
    Ok(())
}

/// What a finished session reports: the client's address and how many
/// pings it made, or why the session failed.
type Session = (String, Res<u32>);

/// Serves clients, each in a task of its own, until one has made its
/// pings (`-C`, if given) and disconnected: returns how many. With `-P`,
/// never returns (only the listener's own failure ends it). A client's
/// failure ends its session only.
async fn server(dev: &Device, args: &Args) -> Res<u32> {
    let listener = CmListener::bind(dev, SocketAddr::new(args.addr, args.port), &options())?;
    println!(
        "rping server: listening on {}",
        listener.local_addr().map_or("?".into(), |a| a.to_string())
    );
    let (done_tx, mut done_rx) = futures::channel::mpsc::unbounded::<Session>();
    loop {
        let next = match select(std::pin::pin!(listener.request()), done_rx.next()).await {
            Either::Left((req, _)) => Either::Left(req),
            Either::Right((done, _)) => Either::Right(done),
        };
        match next {
            // Only the listener's own failure: a bad request never gets here.
            Either::Left(req) => {
                let req = req?;
                let peer = req.peer_addr().map_or("?".into(), |a| a.to_string());
                let (dev, tx) = (dev.clone(), done_tx.clone());
                let (size, verbose) = (args.size as usize, args.verbose);
                spawn(async move {
                    let r = serve_client(&dev, req, size, verbose).await;
                    let _ = tx.unbounded_send((peer, r));
                });
            }
            Either::Right(Some((peer, Ok(n)))) => {
                if args.count != 0 && n != args.count {
                    eprintln!(
                        "rping server: {peer} made {n} pings, expected {}; still listening",
                        args.count
                    );
                } else if args.persistent {
                    println!(
                        "rping server: {peer}: {n} pings of {} B, data checked",
                        args.size
                    );
                } else {
                    return Ok(n);
                }
            }
            Either::Right(Some((peer, Err(e)))) => {
                eprintln!(
                    "rping server: {peer}: {}; still listening",
                    verbio::runtime::ErrorChain(&*e)
                );
            }
            // Never: this loop holds a sender.
            Either::Right(None) => return Err("the sessions' channel closed".into()),
        }
    }
}

/// Awaits the client's next message (or the completion of `f`), for at
/// most [`CLIENT_IDLE`].
async fn from_client<T>(what: &str, f: impl std::future::Future<Output = T>) -> Res<T> {
    timeout(CLIENT_IDLE, f)
        .await
        .map_err(|_| format!("no {what} from the client within {CLIENT_IDLE:?}").into())
}

/// Serves one client; returns how many pings it made.
async fn serve_client(dev: &Device, req: CmRequest, size: usize, verbose: bool) -> Res<u32> {
    let pool = MrPool::new(dev.pd());
    let qp: QueuePair = req.qp().clone();
    let mut adv = qp.recv(pool.alloc(INFO_LEN)?);
    let conn = req.accept(&[]).await?;
    println!(
        "rping server: connection from {}",
        conn.peer_addr().map_or("?".into(), |a| a.to_string())
    );
    let go_ahead = [0u8; INFO_LEN];
    let mut ping = 0u32;
    // The last go-ahead, completing while the next advertisement arrives.
    let mut last_go: Option<Submit<SendVerb<LocalBuf>>> = None;
    loop {
        // The client's source buffer, or its disconnect.
        let last = async {
            match last_go.take() {
                Some(go) => go.await.0.map(|_| ()),
                None => Ok(()),
            }
        };
        let ((res, msg), sent) = from_client("source advertisement", join(adv, last)).await?;
        let n = match res {
            Ok(r) => r.len,
            Err(e) => {
                // A flush after the client disconnected ends the run.
                let reason = timeout(Duration::from_secs(5), conn.disconnected()).await;
                if reason == Ok(DisconnectReason::Peer) {
                    break;
                }
                return Err(e.into());
            }
        };
        sent?;
        let source = decode_info(&msg[..n])?;
        adv = qp.recv(pool.alloc(INFO_LEN)?);
        if source.len() > size as u64 {
            return Err(format!("the client offers {} bytes, -S is {size}", source.len()).into());
        }
        let (res, data) = from_client(
            "RDMA READ",
            qp.read(pool.alloc(source.len() as usize)?, source),
        )
        .await?;
        res?;
        let want = ping_data(ping, source.len() as usize);
        if data[..] != want[..] {
            return Err(format!("ping {ping}: read {:?}, expected {want:?}", &data[..]).into());
        }
        if verbose {
            print_ping("server ", &data);
        }
        // The client's sink buffer.
        let ((sent, _), (res, msg)) = from_client(
            "sink advertisement",
            join(qp.send(pool.alloc_from(&go_ahead)?), adv),
        )
        .await?;
        sent?;
        let n = res?.len;
        let sink = decode_info(&msg[..n])?;
        adv = qp.recv(pool.alloc(INFO_LEN)?);
        let len = data
            .iter()
            .position(|&b| b == 0)
            .map_or(data.len(), |i| i + 1);
        let sink = sink.slice(..len as u64)?;
        let mut echo = data;
        echo.truncate(len);
        let (res, _) = from_client("RDMA WRITE", qp.write(echo, sink)).await?;
        res?;
        last_go = Some(qp.send(pool.alloc_from(&go_ahead)?));
        ping += 1;
    }
    Ok(ping)
}

/// The device `-d` names, else the first ibverbs device with an active
/// port, else the software device: its engine, on loopback by default,
/// goes where a peer on another host reaches it (the server's on `-a`,
/// the client's on the unspecified address: it announces the address the
/// server reaches it at) unless the peer is on loopback.
fn open(args: &Args) -> Res<Context> {
    let ctx = open_device(args.device.as_deref())?;
    if ctx.kind() != ProviderKind::Soft || args.addr.is_loopback() {
        return Ok(ctx);
    }
    let ip = if args.server {
        args.addr
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    drop(ctx);
    Ok(Context::open_soft(SoftConfig {
        bind: SocketAddr::new(ip, 0),
        ..SoftConfig::default()
    })?)
}

fn run(args: &Args) -> Res<()> {
    if args.server == args.client {
        return Err("give -s (server) or -c (client)".into());
    }
    if args.client && args.addr == IpAddr::V4(Ipv4Addr::UNSPECIFIED) {
        return Err("the client needs the server's address (-a)".into());
    }
    let rt = Runtime::new()?;
    let dev = Device::open(open(args)?)?;
    tracing::info!(device = dev.context().name(), "opened the RDMA device");
    let limit = Duration::from_secs(args.timeout);
    let size = args.size;
    if args.client {
        let n = rt.block_on(timeout(limit, client(&dev, args)))??;
        println!("rping client: {n} pings of {size} B, data checked");
    } else {
        let n = if args.timeout == 0 {
            rt.block_on(server(&dev, args))?
        } else {
            rt.block_on(timeout(limit, server(&dev, args)))??
        };
        println!("rping server: {n} pings of {size} B, data checked");
    }
    Ok(())
}

fn main() -> ExitCode {
    cli::init_tracing();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rping: {}", verbio::runtime::ErrorChain(&*e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_data_matches_rping() {
        let d = ping_data(0, 30);
        assert_eq!(&d[..14], b"rdma-ping-0: A");
        assert_eq!(d[29], 0);
        assert_eq!(&ping_data(1, 26)[..14], b"rdma-ping-1: B");
        // Letters wrap from 'z' to 'A'.
        let d = ping_data(57, 40);
        assert_eq!(&d[14..16], b"zA");
    }

    #[test]
    fn info_round_trips() {
        let b = encode_info(0x1122_3344_5566_7788, 0xabcd, 64);
        assert_eq!(b[0], 0x11);
        let r = decode_info(&b).unwrap();
        assert_eq!(
            (r.addr(), r.rkey(), r.len()),
            (0x1122_3344_5566_7788, 0xabcd, 64)
        );
        assert!(decode_info(&b[..15]).is_err());
    }
}
