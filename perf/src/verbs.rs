//! `--api verbs`: the measured loops on the runtime's owned-buffer op
//! futures (`verbio::Verbs` on a `QueuePair`), the runtime's reactor
//! waiting for the completions.

use std::future::Future;

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use verbio::ops::verbs::{Batch, RemoteBuf, Verbs};
use verbio::runtime::buf::{LocalBuf, MrPool};
use verbio::runtime::{Device, QueuePair, RecvRing, RecvRingConfig, UdPeer};

use crate::args::{Config, Test};
use crate::clock::CycleClock;
use crate::error::{msg, Context, Result};
use crate::measure::{lat_value, wait_byte, LatLoop, Measured, LAT_STOP, STOP_IMM};
use crate::session::{rx_depth, Budget, Conn};
use crate::stats::BwSamples;

/// The memory of the verbs loops: a buffer pool and the receive rings:
/// send_lat's posted for the whole run (sized for its largest message),
/// send_bw's server's posted for one size at a time, or for the whole run
/// with `-b` or `--use-srq`.
pub struct State {
    pool: MrPool,
    rings: Vec<RecvRing>,
    /// The rings stay posted for the whole run.
    run_rings: bool,
    /// Stop markers a ring waits for in a send_bw step: 1 on a QP's own
    /// ring, one per QP on a shared receive queue's.
    stops: usize,
    /// Receives the last send_bw step left posted (per QP, at most).
    drain: u64,
}

impl State {
    /// Posts the receive rings of the whole run: send_lat's (both sides),
    /// and with `-b` or `--use-srq` send_bw's (the server's; both sides'
    /// with `-b`).
    pub fn new(cfg: &Config, dev: &Device, conn: &Conn, server: bool) -> Result<State> {
        let pool = MrPool::new(dev.pd());
        let run_rings = cfg.test == Test::SendLat
            || (cfg.test == Test::SendBw && (cfg.bidirectional || conn.srq.is_some()));
        let receives = cfg.test == Test::SendLat
            || (cfg.test == Test::SendBw && (server || cfg.bidirectional));
        let rings = if run_rings && receives {
            post_rings(dev, conn, conn.max_size, cfg.test.is_lat())?
        } else {
            Vec::new()
        };
        Ok(State {
            pool,
            rings,
            run_rings,
            stops: if conn.srq.is_some() {
                conn.qps.len()
            } else {
                1
            },
            drain: 0,
        })
    }

    /// Server, before a step's go: posts send_bw's receive rings for
    /// `size`-byte messages (unless posted for the whole run). Returns how
    /// many empty messages the client sends first on each QP: the receives
    /// the previous step's rings left posted consume them (RC takes
    /// receives in posting order); any more land in the new rings, which
    /// skip them.
    pub fn prepare_step(
        &mut self,
        cfg: &Config,
        dev: &Device,
        conn: &Conn,
        size: usize,
    ) -> Result<u64> {
        if cfg.test == Test::SendBw && !self.run_rings {
            self.rings = post_rings(dev, conn, size, false)?;
        }
        Ok(std::mem::take(&mut self.drain))
    }

    fn alloc(&self, size: usize) -> Result<LocalBuf> {
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        self.pool
            .alloc_from(&data)
            .ctx(format!("allocating a {size}-byte buffer"))
    }

    /// Client: runs one size (with `-b` send_bw, while receiving the
    /// server's messages).
    pub async fn client_step(
        &mut self,
        cfg: &Config,
        conn: &Conn,
        size: usize,
        budget: &Budget,
        drain: u64,
    ) -> Result<Measured> {
        match cfg.test {
            Test::SendBw if cfg.bidirectional => {
                let (m, ()) = futures::try_join!(
                    bw_traffic(&self.pool, cfg, conn, size, budget, drain),
                    sink(&mut self.rings, self.stops)
                )?;
                Ok(m)
            }
            t if !t.is_lat() => bw_traffic(&self.pool, cfg, conn, size, budget, drain).await,
            Test::SendLat => self.send_lat(conn, size, budget).await,
            Test::WriteLat => {
                let remote = conn
                    .remote
                    .at(0, size as u64)
                    .ctx("the peer's memory is smaller than the message")?;
                self.write_lat(conn, remote, size, budget).await
            }
            Test::ReadLat => {
                let remote = conn
                    .remote
                    .at(0, size as u64)
                    .ctx("the peer's memory is smaller than the message")?;
                let qp = &conn.qps[0];
                let mut buf = self.alloc(size)?;
                let mut lat = LatLoop::start(budget);
                while lat.next() {
                    let (r, b) = qp.read(buf, remote).await;
                    r.ctx_with(|| format!("read {}", lat.i))?;
                    buf = b;
                }
                Ok(lat.finish())
            }
            _ => {
                let qp = &conn.qps[0];
                let word = conn.remote.word(0).ctx("the peer's atomic word")?;
                let mut buf = self.alloc(8)?;
                let mut lat = LatLoop::start(budget);
                while lat.next() {
                    let (r, b) = qp.fetch_and_add(buf, word, 1).await;
                    r.ctx_with(|| format!("fetch_and_add {}", lat.i))?;
                    buf = b;
                }
                Ok(lat.finish())
            }
        }
    }

    /// An empty SEND: the end of a send test's messages on `qp` (to
    /// `peer` on UD).
    async fn stop_marker(&self, qp: &QueuePair, peer: Option<&UdPeer>) -> Result<()> {
        let empty = self.pool.alloc(0).ctx("allocating the stop marker")?;
        send_buf(qp, peer, empty)
            .await
            .0
            .ctx("sending the stop marker")?;
        Ok(())
    }

    /// SEND ping-pong, perftest's loop: receives always posted ahead (the
    /// ring), small messages sent INLINE without waiting for their
    /// completion; each echo's buffer is reposted once the next ping is out.
    async fn send_lat(&mut self, conn: &Conn, size: usize, budget: &Budget) -> Result<Measured> {
        let qp = &conn.qps[0];
        let peer = conn.peer.as_ref();
        let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut msg_buf = self.alloc(size)?;
        let inline = size <= qp.caps().max_inline_data as usize;
        let ring = self
            .rings
            .first_mut()
            .ok_or_else(|| msg("no receive ring"))?;
        let mut last_echo = None;
        let mut lat = LatLoop::start(budget);
        while lat.next() {
            let i = lat.i;
            if inline {
                // Awaited in this loop, not through a helper future, and
                // errors are wrapped only when they happen: perftest's loop
                // has no such layers either.
                let sent = match peer {
                    None => qp.send_inline(&payload).await,
                    Some(p) => send_inline_to(qp, p, &payload).await,
                };
                if let Err(e) = sent {
                    return Err(failed(format!("send {i}"), e));
                }
                drop(last_echo.take());
                let back = match ring.next().await {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => return Err(failed(format!("recv {i}"), e)),
                    None => return Err(msg("the receive ring ended")),
                };
                check_len(i, back.len(), size)?;
                last_echo = Some(back);
            } else {
                let (sent, back) = futures::join!(send_buf(qp, peer, msg_buf), ring.next());
                let (r, b) = sent;
                r.ctx_with(|| format!("send {i}"))?;
                msg_buf = b;
                let back = back
                    .ok_or_else(|| msg("the receive ring ended"))?
                    .ctx_with(|| format!("recv {i}"))?;
                check_len(i, back.len(), size)?;
            }
        }
        drop(last_echo);
        let m = lat.finish();
        self.stop_marker(qp, peer).await?;
        Ok(m)
    }

    /// WRITE ping-pong: write the message (its last byte the iteration's
    /// value), then poll this side's memory for the peer's answer.
    async fn write_lat(
        &mut self,
        conn: &Conn,
        remote: RemoteBuf,
        size: usize,
        budget: &Budget,
    ) -> Result<Measured> {
        let qp = &conn.qps[0];
        let mut buf = self.alloc(size)?;
        let mut lat = LatLoop::start(budget);
        while lat.next() {
            let i = lat.i;
            let v = lat_value(i);
            buf[size - 1] = v;
            let (r, b) = qp.write(buf, remote).await;
            r.ctx_with(|| format!("write {i}"))?;
            buf = b;
            wait_byte(&conn.region, size - 1, |x| x == v);
        }
        let m = lat.finish();
        buf[size - 1] = LAT_STOP;
        qp.write(buf, remote)
            .await
            .0
            .ctx("writing the stop value")?;
        Ok(m)
    }

    /// Server: the traffic of one size (the send tests and write_lat;
    /// the other tests need nothing of the server). With `-b` (`own`: the
    /// step's budget), the test's loop towards the client too, whose
    /// figures it returns.
    pub async fn serve_step(
        &mut self,
        cfg: &Config,
        conn: &Conn,
        size: usize,
        own: Option<&Budget>,
    ) -> Result<Option<Measured>> {
        if let Some(budget) = own {
            let m = if cfg.test == Test::SendBw {
                let (m, ()) = futures::try_join!(
                    bw_traffic(&self.pool, cfg, conn, size, budget, 0),
                    sink(&mut self.rings, self.stops)
                )?;
                m
            } else {
                bw_traffic(&self.pool, cfg, conn, size, budget, 0).await?
            };
            return Ok(Some(m));
        }
        match cfg.test {
            Test::SendBw => {
                sink(&mut self.rings, self.stops).await?;
                if !self.run_rings {
                    // The rings' receives stay posted until the next step's
                    // drain messages consume them.
                    self.drain = self
                        .rings
                        .iter()
                        .map(|r| u64::from(r.posted()))
                        .max()
                        .unwrap_or(0);
                    self.rings.clear();
                }
                Ok(None)
            }
            Test::SendLat => self.echo_sends(conn, size).await.map(|()| None),
            Test::WriteLat => {
                let qp = &conn.qps[0];
                let remote = conn
                    .remote
                    .at(0, size as u64)
                    .ctx("the client's memory is smaller than the message")?;
                let mut buf = self.alloc(size)?;
                let mut i = 0u64;
                loop {
                    let v = lat_value(i);
                    let got = wait_byte(&conn.region, size - 1, |x| x == v || x == LAT_STOP);
                    if got == LAT_STOP {
                        return Ok(None);
                    }
                    buf[size - 1] = v;
                    let (r, b) = qp.write(buf, remote).await;
                    r.ctx_with(|| format!("write {i}"))?;
                    buf = b;
                    i += 1;
                }
            }
            _ => Ok(None),
        }
    }

    /// Echoes every message until an empty one; each receive buffer is
    /// reposted once its echo is posted (INLINE: copied at post time) or
    /// copied out.
    async fn echo_sends(&mut self, conn: &Conn, size: usize) -> Result<()> {
        let qp = &conn.qps[0];
        let peer = conn.peer.as_ref();
        let inline = size <= qp.caps().max_inline_data as usize;
        let mut spare = self.pool.alloc(size).ctx("allocating the echo buffer")?;
        let ring = self
            .rings
            .first_mut()
            .ok_or_else(|| msg("no receive ring"))?;
        loop {
            let got = ring
                .next()
                .await
                .ok_or_else(|| msg("the receive ring ended"))?
                .ctx("receiving")?;
            if got.is_empty() {
                return Ok(());
            }
            if inline {
                let sent = match peer {
                    None => qp.send_inline(&got).await,
                    Some(p) => send_inline_to(qp, p, &got).await,
                };
                if let Err(e) = sent {
                    return Err(failed("echoing".into(), e));
                }
            } else {
                spare.clear();
                spare.extend_from_slice(&got).ctx("copying the echo")?;
                drop(got);
                let (r, b) = send_buf(qp, peer, spare).await;
                r.ctx("echoing")?;
                spare = b;
            }
        }
    }
}

/// The bandwidth tests' traffic of one size from this side: `-t` ops in
/// flight per QP (post lists with `-l`); send_bw sends `drain` empty
/// messages on each QP first and a stop marker after.
async fn bw_traffic(
    pool: &MrPool,
    cfg: &Config,
    conn: &Conn,
    size: usize,
    budget: &Budget,
    drain: u64,
) -> Result<Measured> {
    let remote = conn
        .remote
        .at(0, size as u64)
        .ctx("the peer's memory is smaller than the message")?;
    match cfg.test {
        Test::WriteBw if cfg.post_list > 1 => {
            let lists = lists(pool, conn, cfg, size, budget)?;
            pipeline(lists, budget, u64::from(cfg.post_list), |i, l| {
                let qp = &conn.qps[i];
                let batch = l
                    .into_iter()
                    .fold(Batch::with_capacity(cfg.post_list as usize), |b, buf| {
                        b.write(buf, remote)
                    });
                async move { qp.post_batch(batch).await }
            })
            .await
        }
        Test::WriteBw => {
            let bufs = bufs(pool, conn, cfg.tx_depth, size, budget)?;
            pipeline(bufs, budget, 1, |i, b| {
                let qp = &conn.qps[i];
                async move {
                    let (r, b) = qp.write(b, remote).await;
                    (r.map(drop), b)
                }
            })
            .await
        }
        Test::ReadBw => {
            let bufs = bufs(pool, conn, cfg.tx_depth, size, budget)?;
            pipeline(bufs, budget, 1, |i, b| {
                let qp = &conn.qps[i];
                async move {
                    let (r, b) = qp.read(b, remote).await;
                    (r.map(drop), b)
                }
            })
            .await
        }
        Test::AtomicBw => {
            let word = conn.remote.word(0).ctx("the peer's atomic word")?;
            let bufs = bufs(pool, conn, cfg.tx_depth, size, budget)?;
            pipeline(bufs, budget, 1, |i, b| {
                let qp = &conn.qps[i];
                async move {
                    let (r, b) = qp.fetch_and_add(b, word, 1).await;
                    (r.map(drop), b)
                }
            })
            .await
        }
        Test::SendBw => {
            for qp in &conn.qps {
                for _ in 0..drain {
                    let empty = pool.alloc(0).ctx("allocating a drain message")?;
                    qp.send(empty).await.0.ctx("sending a drain message")?;
                }
            }
            let m = if cfg.post_list > 1 {
                let lists = lists(pool, conn, cfg, size, budget)?;
                pipeline(lists, budget, u64::from(cfg.post_list), |i, l| {
                    let qp = &conn.qps[i];
                    let batch = l
                        .into_iter()
                        .fold(Batch::with_capacity(cfg.post_list as usize), |b, buf| {
                            b.send(buf)
                        });
                    async move { qp.post_batch(batch).await }
                })
                .await?
            } else {
                let bufs = bufs(pool, conn, cfg.tx_depth, size, budget)?;
                pipeline(bufs, budget, 1, |i, b| {
                    let qp = &conn.qps[i];
                    async move {
                        let (r, b) = qp.send(b).await;
                        (r.map(drop), b)
                    }
                })
                .await?
            };
            for qp in &conn.qps {
                let empty = pool.alloc(0).ctx("allocating the stop marker")?;
                qp.send_with_imm(empty, STOP_IMM)
                    .await
                    .0
                    .ctx("sending the stop marker")?;
            }
            Ok(m)
        }
        t => Err(msg(format!("{} is not a bandwidth test", t.name()))),
    }
}

/// send_bw's receiving side of one step: takes messages off every ring
/// until each has seen `stops` stop markers (one per QP it serves).
async fn sink(rings: &mut [RecvRing], stops: usize) -> Result<()> {
    let sinks = rings.iter_mut().map(|ring| async move {
        let mut left = stops;
        while left > 0 {
            let m = ring
                .next()
                .await
                .ok_or_else(|| msg("the receive ring ended"))?
                .ctx("receiving")?;
            if m.imm() == Some(STOP_IMM) {
                left -= 1;
            }
        }
        Ok::<(), crate::error::Error>(())
    });
    futures::future::try_join_all(sinks).await?;
    Ok(())
}

/// `depth` buffers of `size` bytes per QP, registered before the clock
/// starts; each is reused by its QP's next op once its op completed. No
/// more than the iterations need.
fn bufs(
    pool: &MrPool,
    conn: &Conn,
    depth: u32,
    size: usize,
    budget: &Budget,
) -> Result<Vec<Vec<LocalBuf>>> {
    let n = match budget.wire_iters() {
        0 => u64::from(depth),
        iters => iters.min(u64::from(depth)),
    };
    let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
    conn.qps
        .iter()
        .map(|_| {
            (0..n)
                .map(|_| {
                    pool.alloc_from(&data)
                        .ctx(format!("allocating a {size}-byte buffer"))
                })
                .collect()
        })
        .collect()
}

/// `-l`: `-t / -l` post lists of `-l` buffers of `size` bytes per QP,
/// registered before the clock starts; no more lists than the iterations
/// need.
fn lists(
    pool: &MrPool,
    conn: &Conn,
    cfg: &Config,
    size: usize,
    budget: &Budget,
) -> Result<Vec<Vec<Vec<LocalBuf>>>> {
    let per = u64::from(cfg.post_list);
    let depth = u64::from(cfg.tx_depth / cfg.post_list);
    let n = match budget.wire_iters() {
        0 => depth,
        iters => iters.div_ceil(per).min(depth),
    };
    let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
    conn.qps
        .iter()
        .map(|_| {
            (0..n)
                .map(|_| {
                    (0..per)
                        .map(|_| {
                            pool.alloc_from(&data)
                                .ctx(format!("allocating a {size}-byte buffer"))
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// Sends `data` INLINE to `peer` (UD).
#[inline]
async fn send_inline_to(
    qp: &QueuePair,
    peer: &UdPeer,
    data: &[u8],
) -> std::result::Result<(), verbio::ops::Error> {
    qp.post_send_inline_to(peer, data, None)
        .await
        .map_err(|source| verbio::ops::Error::Submit {
            op: "send_inline_to",
            source,
        })
}

/// The error of a failed step of a measured loop (out of line: the loop
/// builds it only when it happens).
#[cold]
fn failed(what: String, source: impl std::error::Error + 'static) -> crate::error::Error {
    crate::error::Error::Ctx {
        what,
        source: Box::new(source),
    }
}

/// Sends `buf`: to the connected peer on RC, to `peer` on UD.
#[inline]
async fn send_buf(
    qp: &QueuePair,
    peer: Option<&UdPeer>,
    buf: LocalBuf,
) -> (std::result::Result<usize, verbio::ops::Error>, LocalBuf) {
    match peer {
        None => qp.send(buf).await,
        Some(p) => qp.send_to(p, buf).await,
    }
}

/// A receive ring of `size`-byte buffers on every QP (at most half the
/// receive queue: the previous step's may still be posted); with
/// `--use-srq`, one ring on the shared receive queue.
fn post_rings(dev: &Device, conn: &Conn, size: usize, lat: bool) -> Result<Vec<RecvRing>> {
    let depth = rx_depth(size, lat);
    if let Some(srq) = &conn.srq {
        let d = depth.min(srq.capacity()).max(1);
        let ring = RecvRing::on_srq(srq, dev.pd(), RecvRingConfig::new(d, size))
            .ctx("posting the receive ring on the shared receive queue")?;
        return Ok(vec![ring]);
    }
    conn.qps
        .iter()
        .map(|qp| {
            let d = depth.min(qp.caps().max_recv_wr / 2).max(1);
            RecvRing::new(qp, dev.pd(), RecvRingConfig::new(d, size))
                .ctx("posting the receive ring")
        })
        .collect()
}

fn check_len(i: u64, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(msg(format!("echo {i}: {got} bytes, expected {want}")));
    }
    Ok(())
}

/// Pairs an op's output with its QP index (one closure type for every push).
fn tag<T>(i: usize) -> impl FnOnce(T) -> (usize, T) {
    move |r| (i, r)
}

/// Keeps every buffer of `bufs[qp]` in flight on its QP through `op`,
/// reposting each as its op completes, until the budget is spent; stamps
/// every completion. Each op carries `wrs` WRs (a post list with `-l`), so
/// the budget and the samples count WRs.
async fn pipeline<B, F, Fut>(
    bufs: Vec<Vec<B>>,
    budget: &Budget,
    wrs: u64,
    mut op: F,
) -> Result<Measured>
where
    F: FnMut(usize, B) -> Fut,
    Fut: Future<Output = (verbio::ops::Result<()>, B)>,
{
    let mut samples = BwSamples::with_capacity(budget.wire_iters() as usize * bufs.len() + 1);
    let mut posted = vec![0u64; bufs.len()];
    let mut in_flight = FuturesUnordered::new();
    let clock = CycleClock::start();
    samples.push(clock.stamp(), 0);
    for (i, list) in bufs.into_iter().enumerate() {
        for b in list {
            if budget.more(posted[i]) {
                posted[i] += wrs;
                in_flight.push(op(i, b).map(tag(i)));
            }
        }
    }
    let mut done = 0u64;
    while let Some((i, (r, b))) = in_flight.next().await {
        r.ctx_with(|| format!("op {done} on QP {i}"))?;
        done += wrs;
        samples.push(clock.stamp(), done);
        if budget.more(posted[i]) {
            posted[i] += wrs;
            in_flight.push(op(i, b).map(tag(i)));
        }
    }
    Ok(Measured::Bw {
        samples,
        ticks_per_us: clock.ticks_per_us(),
    })
}
