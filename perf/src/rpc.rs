//! `--api rpc`: send_lat and send_bw through the RPC engine
//! (`verbio::rpc`) on a UD queue pair of the chosen device, the way an
//! application calls it: `Rpc::connect` opens one session to the server,
//! `Rpc::call` sends each request and awaits its response.
//!
//! * send_lat: one call at a time to an echo handler (request and response
//!   of `-s` bytes); reports half the call's round trip, as the SEND
//!   ping-pong of the other APIs. Each response is the next request
//!   (`Rpc::call_owned`), and the handler answers with the request's
//!   buffer (`Request::into_data`): no copy in either process, as the
//!   TCP loop's.
//! * send_lat `--rpc-get`: one call at a time of an 8-byte request
//!   answered by a response of `-s` bytes (a GET: small request, large
//!   response).
//! * send_bw: `-t` calls in flight of `-s`-byte requests to a handler that
//!   answers with an empty response; a call's completion is its response.
//!   A session runs at most [`SESSION_SLOTS`] calls at once, so the client
//!   opens a session per 8 calls of the window (at most
//!   [`BW_SESSIONS`], and as many as keep [`BW_BYTES`] under way) and
//!   starts the calls on them in turn, as an eRPC
//!   client keeps a window larger than a session's: with one session, 8
//!   of the 128 calls would be under way and the rest wait for a slot.
//!
//! The client dials the server's TCP port (the control stream: the hello,
//! then a step and go around each size, and the bye); the server answers
//! the hello with its RPC endpoint's UD address in the frames of `-c UD`
//! (`ud.rs`). Messages larger than [`RPC_MAX`] are refused when the flags
//! are read.

use std::future::Future;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use verbio::rpc::ud::{encode_ud_addr, UdConfig, UdTransport};
use verbio::rpc::{MsgBuf, Request, Rpc, RpcConfig, RpcError, SessionId, SESSION_SLOTS};
use verbio::runtime::{Device, TcpStream};

use crate::args::{Config, Test, RPC_MAX};
use crate::clock::CycleClock;
use crate::ctl::{self, Frame};
use crate::error::{msg, Context, Result};
use crate::measure::{LatLoop, Measured};
use crate::progress::Progress;
use crate::report::{Printer, RunInfo};
use crate::session::{self, Budget};
use crate::stats::BwSamples;
use crate::ud;

/// Request type of send_lat's echo: the response is the request's bytes.
const ECHO: u8 = 1;
/// Request type of send_bw's sink: the response is empty.
const SINK: u8 = 2;
/// Request type of send_lat's GET (`--rpc-get`): the request is the
/// response's length (8 bytes, little-endian), the response that many
/// bytes.
const GET: u8 = 3;
/// Retransmissions before a call fails: a benchmark on a loaded (or
/// emulated) host should measure slowness, not fail on it; with the
/// engine's 20 ms timeout, a peer silent for about 5 s fails the run.
/// (30, 0.6 s, failed 1-16 MiB send_bw in the rxe VM under TCG: a
/// side stays silent longer while a window of large messages is
/// registered and READ by the emulated kernel.)
const MAX_RETRIES: u32 = 250;
/// Most sessions send_bw opens to the server (a session per
/// [`SESSION_SLOTS`] calls of the window): within the server's sessions
/// per peer (`RpcConfig::max_sessions_per_peer`, 32 by default).
const BW_SESSIONS: usize = 16;
/// Bytes of requests send_bw's sessions have under way at most: a
/// session per [`SESSION_SLOTS`] calls of this many bytes together.
const BW_BYTES: usize = 512 << 10;

/// An RPC endpoint on a new UD queue pair of `dev`, for messages up to
/// `max_size` bytes.
fn endpoint(cfg: &Config, dev: &Device, max_size: usize) -> Result<Rpc<UdTransport>> {
    let mut ud = UdConfig {
        gid_index: cfg.gid_index,
        ..UdConfig::default()
    };
    ud.attr.port = cfg.ib_port;
    if let Some(n) = cfg.inline_given {
        ud.max_inline = n;
    }
    let transport = UdTransport::new(dev, &ud).ctx("creating the RPC endpoint's UD queue pair")?;
    let defaults = RpcConfig::default();
    let read_threshold = match cfg.rpc_read_threshold {
        None => defaults.read_threshold,
        Some(0) => usize::MAX,
        Some(n) => n,
    };
    let config = RpcConfig {
        max_msg_len: max_size.max(defaults.max_msg_len).min(RPC_MAX),
        max_retries: MAX_RETRIES,
        read_threshold,
        ..defaults
    };
    Ok(Rpc::new(transport, config))
}

fn serve_echo(req: Request) -> impl Future<Output = MsgBuf> {
    // The request's buffer is the response: no copy (as the TCP echo
    // writes back the buffer it read into).
    std::future::ready(req.into_data())
}

fn serve_sink(req: Request) -> impl Future<Output = MsgBuf> {
    std::future::ready(req.response())
}

fn serve_get(req: Request) -> impl Future<Output = MsgBuf> {
    let len = <[u8; 8]>::try_from(req.data()).map_or(0, u64::from_le_bytes);
    let len = usize::try_from(len).unwrap_or(0).min(RPC_MAX);
    let mut resp = req.response_with_capacity(len);
    resp.resize(len, 0x5a);
    std::future::ready(resp)
}

/// The client: calls the server for every size, prints the results.
pub fn client(cfg: &Config, host: &str) -> Result<()> {
    let addr = session::resolve(host, cfg.port)?;
    let (rt, dev, busy) = session::open(cfg, true)?;
    rt.block_on(async {
        let mut ctl = ud::dial_ctl(addr).await?;
        ctl::send(
            &mut ctl,
            Frame::Hello {
                test: cfg.test,
                api: cfg.api.code(),
                connection: cfg.connection.code(),
                qps: 1,
                max_size: cfg.max_size() as u64,
                mode: cfg.mode(),
            },
        )
        .await
        .ctx("sending the hello")?;
        let server = ud::recv_endpoint(&mut ctl).await?;
        let rpc = endpoint(cfg, &dev, cfg.max_size())?;
        let me = rpc.with_transport(|t| *t.endpoint());
        if server.endpoint.provider != me.endpoint.provider {
            return Err(msg("the two sides run on different providers"));
        }
        let remote = encode_ud_addr(&server).ctx("encoding the server's RPC address")?;
        let sid = rpc.connect(&remote).await.ctx("opening the RPC session")?;
        // send_bw's window over sessions of 8 slots each.
        let mut sids = vec![sid];
        if cfg.test == Test::SendBw {
            let want = (cfg.tx_depth as usize)
                .div_ceil(SESSION_SLOTS)
                .clamp(1, BW_SESSIONS);
            while sids.len() < want {
                let more = rpc
                    .connect(&remote)
                    .await
                    .ctx("opening another RPC session for send_bw's window")?;
                sids.push(more);
            }
        }
        let info = RunInfo {
            test: cfg.test,
            api: cfg.api,
            transport: cfg.transport,
            connection: cfg.connection,
            device: dev.context().name().to_string(),
            provider: dev.context().kind().to_string(),
            qps: 1,
            tx_depth: cfg.tx_depth,
            inline_size: rpc.with_transport(|t| t.queue_pair().caps().max_inline_data),
            mtu: me.endpoint.mtu.min(server.endpoint.mtu).bytes(),
            completions: session::completions(cfg.api, busy),
            bw_units: if cfg.gbits { "Gb/sec" } else { "MB/sec" }.into(),
            bidirectional: false,
            srq: false,
            rdma_cm: false,
        };
        let mut printer = Printer::new(cfg, info);
        let mut progress = Progress::new(cfg);
        for &size in &cfg.sizes {
            progress.start(size);
            run_step(&mut ctl, cfg, size).await?;
            let budget = Budget::step(cfg, size);
            let m = step(cfg, &rpc, &sids, size, &budget).await?;
            tracing::info!(size, stats = ?rpc.stats(), "step done");
            if let Some(soft) = dev.context().as_soft() {
                tracing::info!(ud = ?soft.ud_counters(), "the soft device's datagrams");
            }
            let row = m.row(cfg.test, size, cfg.in_flight())?;
            progress.done(&row);
            printer.row(row);
        }
        ctl::send(&mut ctl, Frame::Bye).await.ctx("saying bye")?;
        for &sid in &sids {
            rpc.disconnect(sid);
        }
        printer.finish()
    })
}

/// Announces a step and waits for the server's go.
async fn run_step(ctl: &mut TcpStream, cfg: &Config, size: usize) -> Result<()> {
    let iters = Budget::step(cfg, size).wire_iters();
    ctl::send(
        ctl,
        Frame::Step {
            size: size as u64,
            iters,
            ms: 0,
        },
    )
    .await
    .ctx("starting a step")?;
    ctl::expect(ctl, Frame::Go, "the server's go")
        .await
        .ctx("starting a step")
}

/// One size's calls: send_lat's on the first session of `sids`,
/// send_bw's on all of them in turn.
async fn step(
    cfg: &Config,
    rpc: &Rpc<UdTransport>,
    sids: &[SessionId],
    size: usize,
    budget: &Budget,
) -> Result<Measured> {
    let sid = sids[0];
    let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
    if cfg.test == Test::SendLat {
        // One untimed call first, as send_bw makes one per session: a
        // session's first mid-size or large call sets up its RC link
        // (60-200 ms in the rxe VM), which would otherwise sit inside
        // the timed run and leave it only a few calls.
        rpc.call(sid, SINK, &payload).await.ctx("a warm-up call")?;
    }
    if cfg.test == Test::SendLat && cfg.rpc_get {
        let want = (size as u64).to_le_bytes();
        let mut lat = LatLoop::start(budget);
        while lat.next() {
            let back = rpc
                .call(sid, GET, &want)
                .await
                .ctx_with(|| format!("call {}", lat.i))?;
            if back.len() != size {
                return Err(msg(format!(
                    "response of {} bytes, expected {size}",
                    back.len()
                )));
            }
        }
        return Ok(lat.finish());
    }
    if cfg.test == Test::SendLat {
        // Each echo goes out again as the next request, uncopied (as the
        // TCP loop writes from and reads into buffers of its own).
        let mut buf = MsgBuf::from(payload);
        let mut lat = LatLoop::start(budget);
        while lat.next() {
            let back = rpc
                .call_owned(sid, ECHO, buf)
                .await
                .ctx_with(|| format!("call {}", lat.i))?;
            if back.len() != size {
                return Err(msg(format!(
                    "echo of {} bytes, expected {size}",
                    back.len()
                )));
            }
            buf = back;
        }
        return Ok(lat.finish());
    }
    let window = match budget.wire_iters() {
        0 => u64::from(cfg.tx_depth),
        n => n.min(u64::from(cfg.tx_depth)),
    };
    // Larger messages keep to fewer sessions: at most BW_BYTES under way
    // (one session from 64 KiB on, where calls go by READ over an RC
    // link per session: more sessions measured slower there).
    let in_use = sids
        .len()
        .min((BW_BYTES / (SESSION_SLOTS * size.max(1))).max(1));
    // One untimed call per session first: a session's first mid-size or
    // large call sets up its RC link (a round trip of datagrams and two
    // QP transitions, tens of ms in the rxe VM), which the timed run
    // would otherwise count for every session.
    let warm = sids[..in_use].iter().map(|&s| rpc.call(s, SINK, &payload));
    for r in futures::future::join_all(warm).await {
        r.ctx("a warm-up call")?;
    }
    let mut next = 0;
    pipeline(window, budget, || {
        next = (next + 1) % in_use;
        rpc.call(sids[next], SINK, &payload)
    })
    .await
}

/// Keeps `window` calls in flight until the budget is spent, stamping
/// every response.
async fn pipeline<T, F, Fut>(window: u64, budget: &Budget, mut call: F) -> Result<Measured>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, RpcError>>,
{
    let mut samples = BwSamples::with_capacity(budget.wire_iters() as usize + 1);
    let mut in_flight = FuturesUnordered::new();
    let clock = CycleClock::start();
    samples.push(clock.stamp(), 0);
    let mut posted = 0u64;
    while posted < window && budget.more(posted) {
        posted += 1;
        in_flight.push(call());
    }
    let mut done = 0u64;
    while let Some(r) = in_flight.next().await {
        r.ctx_with(|| format!("call {done}"))?;
        done += 1;
        samples.push(clock.stamp(), done);
        if budget.more(posted) {
            posted += 1;
            in_flight.push(call());
        }
    }
    Ok(Measured::Bw {
        samples,
        ticks_per_us: clock.ticks_per_us(),
    })
}

/// The server: serves one client's calls until its bye, then returns.
pub fn server(cfg: &Config) -> Result<()> {
    let (rt, dev, _) = session::open(cfg, cfg.test == Test::SendLat)?;
    let listener = ud::bind(cfg)?;
    rt.block_on(async {
        let (mut ctl, _) = listener.accept().await.ctx("accepting the client")?;
        ctl.set_nodelay(true).ctx("setting TCP_NODELAY")?;
        let hello = ctl::recv(&mut ctl)
            .await
            .ctx("reading the client's hello")?;
        let (_, max_size) = ctl::check_hello(hello, cfg.test, cfg.api, cfg.connection, cfg.mode())
            .ctx("the client's hello")?;
        if max_size > RPC_MAX {
            return Err(msg(format!(
                "the client asks for {max_size}-byte messages; RPC carries up to {RPC_MAX}"
            )));
        }
        let rpc = endpoint(cfg, &dev, max_size)?;
        rpc.register(ECHO, serve_echo)
            .ctx("registering the echo handler")?;
        rpc.register(SINK, serve_sink)
            .ctx("registering the sink handler")?;
        rpc.register(GET, serve_get)
            .ctx("registering the GET handler")?;
        let me = rpc.with_transport(|t| *t.endpoint());
        ud::send_endpoint(&mut ctl, &me).await?;
        loop {
            match ctl::recv(&mut ctl).await.ctx("waiting for the client")? {
                Frame::Step { .. } => ctl::send(&mut ctl, Frame::Go).await.ctx("sending go")?,
                Frame::Bye => break,
                got => return Err(msg(format!("unexpected {got:?} from the client"))),
            }
        }
        tracing::info!(stats = ?rpc.stats(), "served");
        if let Some(soft) = dev.context().as_soft() {
            // Datagrams dropped for want of a posted receive show here.
            tracing::info!(ud = ?soft.ud_counters(), "the soft device's datagrams");
        }
        // Let the last responses leave before the endpoint goes.
        verbio::runtime::sleep(Duration::from_millis(10)).await;
        Ok(())
    })
}
