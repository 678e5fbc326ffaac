//! `--api rdma`: the tests on the high-level `Rdma` agent connection.
//! send_bw / send_lat use `Rdma::send_buf` from registered buffers (as
//! `--api verbs` posts its SENDs from them; the server echoes from a buffer
//! of its own, as verbs does) and `Rdma::receive_msg` (zero-copy, as
//! `--api verbs` reads its receive ring in place); write_bw,
//! read_bw and read_lat use `Rdma::write` / `Rdma::read` on memory the
//! client requests from the server (`request_remote_mr`); the atomics use
//! `Rdma::fetch_and_add` on it. write_lat is a ping-pong of
//! `Rdma::write_with_imm`, each side awaiting the other's immediate with
//! `Rdma::receive_write_imm` (the API's way to learn of a peer's WRITE:
//! it gives no local view of memory granted to the peer, which perftest's
//! write_lat polls); the server writes into memory it requests from the
//! client. Control frames travel on the same connection as messages with
//! the immediate [`CTL_IMM`]; data messages carry none.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use verbio::ops::agent::wire::DATA_OVERHEAD;
use verbio::ops::agent::{AgentError, LocalMr, Rdma, RdmaBuilder, RemoteMr};
use verbio::runtime::buf::LocalBuf;
use verbio::runtime::sleep;

use crate::args::{Config, Test, Verb, SWEEP_MAX};
use crate::clock::CycleClock;
use crate::ctl::{self, Frame};
use crate::error::{msg, Context, Result};
use crate::measure::{LatLoop, Measured};
use crate::progress::Progress;
use crate::report::{Printer, RunInfo};
use crate::session::{self, Budget};
use crate::stats::BwSamples;

/// The immediate that marks a control frame.
const CTL_IMM: u32 = 0x5646_5031;
/// The write_lat immediate that ends a step (the client's last WRITE).
const STOP_IMM: u32 = u32::MAX;
/// How long a client retries connecting to a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);

fn builder(cfg: &Config, dev: verbio::runtime::Device) -> RdmaBuilder {
    let mut b = RdmaBuilder::new()
        .device(dev)
        .port(cfg.ib_port)
        .max_send_wr(cfg.tx_depth.max(16) + 2)
        .max_message_len(SWEEP_MAX.max(cfg.max_size()));
    if let Some(x) = cfg.gid_index {
        b = b.gid_index(x);
    }
    // -I counts payload bytes; a message goes inline with its Data header.
    if let Some(n) = cfg.inline_given {
        b = b.max_inline_data(match n {
            0 => 0,
            n => n.saturating_add(DATA_OVERHEAD as u32),
        });
    }
    b
}

async fn send_ctl(rdma: &Rdma, f: Frame) -> Result<()> {
    rdma.send_with_imm(&f.encode(), CTL_IMM)
        .await
        .ctx("sending a control frame")
}

async fn recv_ctl(rdma: &Rdma) -> Result<Frame> {
    let (data, imm) = rdma
        .receive_with_imm()
        .await
        .ctx("receiving a control frame")?;
    if imm != Some(CTL_IMM) {
        return Err(msg(format!(
            "expected a control frame, got a {}-byte message",
            data.len()
        )));
    }
    ctl::Frame::decode(&data).ctx("decoding a control frame")
}

async fn expect_ctl(rdma: &Rdma, want: Frame) -> Result<()> {
    match recv_ctl(rdma).await? {
        f if f == want => Ok(()),
        got => Err(msg(format!("expected {want:?} from the peer, got {got:?}"))),
    }
}

/// The client.
pub fn client(cfg: &Config, host: &str) -> Result<()> {
    let addr = session::resolve(host, cfg.port)?;
    let (rt, dev, busy) = session::open(cfg, true)?;
    let b = builder(cfg, dev.clone());
    rt.block_on(async {
        let deadline = Instant::now() + CONNECT_RETRY;
        let rdma = loop {
            match b.connect(addr).await {
                Ok(r) => break r,
                Err(AgentError::Handshake(_)) if Instant::now() < deadline => {
                    sleep(Duration::from_millis(50)).await
                }
                Err(e) => return Err(e).ctx(format!("connecting to {addr}")),
            }
        };
        send_ctl(
            &rdma,
            Frame::Hello {
                test: cfg.test,
                api: cfg.api.code(),
                connection: cfg.connection.code(),
                qps: 1,
                max_size: cfg.max_size() as u64,
                mode: cfg.mode(),
            },
        )
        .await?;
        expect_ctl(&rdma, Frame::Go).await?;
        let remote = if cfg.test.verb() != Verb::Send {
            Some(
                rdma.request_remote_mr(cfg.max_size().max(8))
                    .await
                    .ctx("requesting the server's memory")?,
            )
        } else {
            None
        };
        let info = RunInfo {
            test: cfg.test,
            api: cfg.api,
            transport: cfg.transport,
            connection: cfg.connection,
            device: dev.context().name().to_string(),
            provider: dev.context().kind().to_string(),
            qps: 1,
            tx_depth: cfg.tx_depth,
            inline_size: rdma.qp().caps().max_inline_data,
            mtu: rdma.path_mtu().bytes(),
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
            let wire = Budget::step(cfg, size).wire_iters();
            send_ctl(
                &rdma,
                Frame::Step {
                    size: size as u64,
                    iters: wire,
                    ms: 0,
                },
            )
            .await?;
            expect_ctl(&rdma, Frame::Go).await?;
            let budget = Budget::step(cfg, size);
            let m = step(cfg, &rdma, remote.as_ref(), size, &budget).await?;
            if cfg.test.verb() == Verb::Send {
                send_ctl(&rdma, Frame::Stop).await?;
                expect_ctl(&rdma, Frame::Done).await?;
            }
            let row = m.row(cfg.test, size, cfg.in_flight())?;
            progress.done(&row);
            printer.row(row);
        }
        send_ctl(&rdma, Frame::Bye).await?;
        drop(remote);
        let _ = verbio::runtime::timeout(Duration::from_secs(5), rdma.close()).await;
        printer.finish()
    })
}

async fn step(
    cfg: &Config,
    rdma: &Rdma,
    remote: Option<&RemoteMr>,
    size: usize,
    budget: &Budget,
) -> Result<Measured> {
    let view = match remote {
        Some(r) => Some(
            r.get(0..size)
                .ok_or_else(|| msg("the server's memory is smaller than the message"))?,
        ),
        None => None,
    };
    let view = view.as_ref();
    let need = || view.ok_or_else(|| msg("no remote memory"));
    let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let slots = match budget.wire_iters() {
        0 => cfg.tx_depth as usize,
        n => n.min(u64::from(cfg.tx_depth)) as usize,
    };
    let mrs = |n: usize| -> Result<Vec<LocalMr>> {
        (0..n)
            .map(|_| rdma.alloc_local_mr(size).ctx("allocating local memory"))
            .collect()
    };
    match cfg.test {
        Test::SendBw => {
            let bufs = (0..slots)
                .map(|_| registered(rdma, &payload))
                .collect::<Result<Vec<_>>>()?;
            pipeline(bufs, budget, |b| rdma.send_buf(b)).await
        }
        Test::WriteBw => {
            let v = need()?;
            pipeline(mrs(slots)?, budget, |mr| rdma.write(mr, v)).await
        }
        Test::ReadBw => {
            let v = need()?;
            pipeline(mrs(slots)?, budget, |mr| rdma.read(mr, v)).await
        }
        Test::AtomicBw => {
            let v = need()?;
            let items = vec![(); slots];
            pipeline(items, budget, |()| async {
                (rdma.fetch_and_add(v, 1).await.map(drop), ())
            })
            .await
        }
        Test::SendLat => {
            let mut ping = registered(rdma, &payload)?;
            // The previous echo, held until the next ping is out: its
            // receive buffer goes back to the device after the send, not
            // before it (as the verbs loop reposts its echo's buffer).
            let mut last_echo = None;
            let mut lat = LatLoop::start(budget);
            while lat.next() {
                // Errors are wrapped only when they happen, in a match, not
                // through a helper that moves every message (the verbs
                // loop has no such layer either).
                let (r, back) = rdma.send_buf(ping).await;
                ping = back;
                if let Err(e) = r {
                    return Err(e).ctx_with(|| format!("send {}", lat.i));
                }
                drop(last_echo.take());
                let back = match rdma.receive_msg().await {
                    Ok(m) => m,
                    Err(e) => return Err(e).ctx_with(|| format!("receive {}", lat.i)),
                };
                if back.len() != size {
                    return Err(msg(format!(
                        "echo of {} bytes, expected {size}",
                        back.len()
                    )));
                }
                last_echo = Some(back);
            }
            drop(last_echo);
            Ok(lat.finish())
        }
        Test::ReadLat => {
            let v = need()?;
            let mut mr = rdma.alloc_local_mr(size).ctx("allocating local memory")?;
            let mut lat = LatLoop::start(budget);
            while lat.next() {
                let (r, back) = rdma.read(mr, v).await;
                r.ctx_with(|| format!("read {}", lat.i))?;
                mr = back;
            }
            Ok(lat.finish())
        }
        Test::AtomicLat => {
            let v = need()?;
            let mut lat = LatLoop::start(budget);
            while lat.next() {
                rdma.fetch_and_add(v, 1)
                    .await
                    .ctx_with(|| format!("fetch_and_add {}", lat.i))?;
            }
            Ok(lat.finish())
        }
        Test::WriteLat => {
            let v = need()?;
            let mut mr = rdma.alloc_local_mr(size).ctx("allocating local memory")?;
            mr.get_mut(..)
                .ok_or_else(|| msg("local memory"))?
                .copy_from_slice(&payload);
            let mut lat = LatLoop::start(budget);
            while lat.next() {
                let imm = (lat.i % u64::from(STOP_IMM)) as u32;
                let (r, back) = rdma.write_with_imm(mr, v, imm).await;
                r.ctx_with(|| format!("write_with_imm {}", lat.i))?;
                mr = back;
                let got = rdma
                    .receive_write_imm()
                    .await
                    .ctx_with(|| format!("receive_write_imm {}", lat.i))?;
                if got != imm {
                    return Err(msg(format!("immediate {got} back, expected {imm}")));
                }
            }
            let m = lat.finish();
            let (r, _) = rdma.write_with_imm(mr, v, STOP_IMM).await;
            r.ctx("ending the step")?;
            Ok(m)
        }
    }
}

/// write_lat's server side: answers each of the client's WRITEs with an
/// immediate by a WRITE of `size` bytes with the same immediate, until
/// the client's [`STOP_IMM`].
async fn echo_writes(rdma: &Rdma, remote: &RemoteMr, size: usize) -> Result<()> {
    let view = remote
        .get(0..size)
        .ok_or_else(|| msg("the client's memory is smaller than the message"))?;
    let mut mr = rdma.alloc_local_mr(size).ctx("allocating local memory")?;
    loop {
        let imm = rdma.receive_write_imm().await.ctx("receive_write_imm")?;
        if imm == STOP_IMM {
            return Ok(());
        }
        let (r, back) = rdma.write_with_imm(mr, &view, imm).await;
        r.ctx("write_with_imm")?;
        mr = back;
    }
}

/// `payload` in a buffer of the connection's registered pool (what
/// `Rdma::send_buf` sends without a copy).
fn registered(rdma: &Rdma, payload: &[u8]) -> Result<LocalBuf> {
    rdma.pool()
        .alloc_from(payload)
        .ctx(format!("allocating a {}-byte send buffer", payload.len()))
}

/// Keeps one op per item in flight until the budget is spent, stamping
/// every completion.
async fn pipeline<T, F, Fut>(items: Vec<T>, budget: &Budget, mut op: F) -> Result<Measured>
where
    F: FnMut(T) -> Fut,
    Fut: Future<Output = (std::result::Result<(), AgentError>, T)>,
{
    let mut samples = BwSamples::with_capacity(budget.wire_iters() as usize + 1);
    let mut in_flight = FuturesUnordered::new();
    let clock = CycleClock::start();
    samples.push(clock.stamp(), 0);
    let mut posted = 0u64;
    for it in items {
        if budget.more(posted) {
            posted += 1;
            in_flight.push(op(it));
        }
    }
    let mut done = 0u64;
    while let Some((r, it)) = in_flight.next().await {
        r.ctx_with(|| format!("op {done}"))?;
        done += 1;
        samples.push(clock.stamp(), done);
        if budget.more(posted) {
            posted += 1;
            in_flight.push(op(it));
        }
    }
    Ok(Measured::Bw {
        samples,
        ticks_per_us: clock.ticks_per_us(),
    })
}

/// The server: serves one client, then returns.
pub fn server(cfg: &Config) -> Result<()> {
    let spin = cfg.test == Test::SendLat;
    let (rt, dev, _) = session::open(cfg, spin)?;
    let b = builder(cfg, dev);
    rt.block_on(async {
        let listener = b
            .listen(session::listen_addr(cfg.port))
            .ctx(format!("listening on TCP port {}", cfg.port))?;
        let local = listener.local_addr().ctx("reading the listening address")?;
        eprintln!(
            "verbio-perf: {} server listening on {local}",
            cfg.test.name()
        );
        let rdma = listener.accept().await.ctx("accepting the client")?;
        let hello = recv_ctl(&rdma).await?;
        ctl::check_hello(hello, cfg.test, cfg.api, cfg.connection, cfg.mode())
            .ctx("the client's hello")?;
        send_ctl(&rdma, Frame::Go).await?;
        let res = serve(cfg, &rdma).await;
        let _ = verbio::runtime::timeout(Duration::from_secs(5), rdma.close()).await;
        res
    })
}

async fn serve(cfg: &Config, rdma: &Rdma) -> Result<()> {
    // write_lat: the server writes back into the client's memory, asked
    // for at the first step that needs more than it has.
    let mut client_mem: Option<RemoteMr> = None;
    loop {
        match recv_ctl(rdma).await? {
            Frame::Step { size, .. } => {
                let size = usize::try_from(size).map_err(|_| msg("step size"))?;
                if cfg.test == Test::WriteLat && client_mem.as_ref().is_none_or(|m| m.len() < size)
                {
                    if let Some(old) = client_mem.take() {
                        rdma.release(old)
                            .await
                            .ctx("releasing the client's memory")?;
                    }
                    let mem = rdma
                        .request_remote_mr(size.max(8))
                        .await
                        .ctx("requesting the client's memory")?;
                    client_mem = Some(mem);
                }
                send_ctl(rdma, Frame::Go).await?;
                if let Some(remote) = &client_mem {
                    echo_writes(rdma, remote, size).await?;
                }
                if cfg.test.verb() == Verb::Send {
                    // send_lat's echo: a message of the step's size from a
                    // buffer of its own (as the verbs server does).
                    let mut echo = match cfg.test {
                        Test::SendLat if size > 0 => Some(registered(rdma, &vec![0u8; size])?),
                        _ => None,
                    };
                    loop {
                        let data = match rdma.receive_msg().await {
                            Ok(m) => m,
                            Err(e) => return Err(e).ctx("receiving"),
                        };
                        if data.imm() == Some(CTL_IMM) {
                            match ctl::Frame::decode(&data).ctx("decoding a control frame")? {
                                Frame::Stop => break,
                                got => return Err(msg(format!("unexpected {got:?} in a step"))),
                            }
                        }
                        if cfg.test == Test::SendLat {
                            match echo.take() {
                                Some(buf) => {
                                    // The message's receive buffer goes
                                    // back to the device once the echo is
                                    // out (as the verbs server's does).
                                    let (r, back) = rdma.send_buf(buf).await;
                                    drop(data);
                                    echo = Some(back);
                                    if let Err(e) = r {
                                        return Err(e).ctx("echoing");
                                    }
                                }
                                None => rdma.send(&data).await.ctx("echoing")?,
                            }
                        }
                    }
                    send_ctl(rdma, Frame::Done).await?;
                }
            }
            Frame::Bye => return Ok(()),
            got => return Err(msg(format!("unexpected {got:?} from the client"))),
        }
    }
}
