//! `--api raw`: perftest's loops in Rust on the provider's QP and CQ
//! (`verbio::provider`), without the runtime: post, then spin on
//! `Cq::poll`. The runtime is idle meanwhile (its thread runs the loop).
//! Every loop ends with a signaled WR and polls until it completed, so the
//! runtime finds the send queue and the CQ free of the loop's WRs; the
//! receives posted for the run stay posted until the QPs are closed
//! (their memory lives in [`State`], dropped after the close). The
//! wr_ids have the top bit set: the runtime's untracked range, which its
//! reactor ignores should one reach it.

use verbio::provider::{
    Completion, Cq, Qp, RecvWr, SendFlags, SendOp, SendWr, SgList, Sge, WcStatus,
};
use verbio::runtime::buf::{LocalBuf, MrPool, RegisteredBuf};
use verbio::runtime::Device;

use crate::args::{Config, Test, Verb};
use crate::clock::CycleClock;
use crate::error::{msg, Context, Result};
use crate::measure::{lat_value, LatLoop, Measured, LAT_STOP, STOP_IMM};
use crate::session::{Budget, Conn, LAT_RX_DEPTH, RX_DEPTH};
use crate::stats::BwSamples;

/// perftest's `CQ_MODERATION`: one signaled WR in this many (bandwidth).
const CQ_MOD: u32 = 100;
const TAG: u64 = 1 << 63;
const RECV: u64 = 1;
const SEND: u64 = 2;
/// A loop's closing WR: every WR before it on its QP is done once it is.
const LAST: u64 = 3;

/// A wr_id: kind, QP index and a count (the WRs a signaled WR completes).
fn wr_id(kind: u64, qp: usize, count: u32) -> u64 {
    TAG | kind << 56 | (qp as u64 & 0xff_ffff) << 32 | u64::from(count)
}

/// Decodes [`wr_id`].
fn decode(id: u64) -> (u64, usize, u32) {
    (
        (id >> 56) & 0x7f,
        ((id >> 32) & 0xff_ffff) as usize,
        id as u32,
    )
}

/// The raw loops' memory: a buffer pool, and the one buffer every receive
/// of the run lands in (its contents matter only to send_lat's echo).
pub struct State {
    pool: MrPool,
    rx: Option<LocalBuf>,
}

/// The provider QPs and the CQ of a connection.
struct Raw<'a> {
    qps: Vec<&'a Qp>,
    cq: &'a Cq,
    wcs: [Completion; 16],
}

impl<'a> Raw<'a> {
    fn new(dev: &'a Device, conn: &'a Conn) -> Result<Raw<'a>> {
        let qps = conn
            .qps
            .iter()
            .map(|q| q.provider().ok_or_else(|| msg("the QP has no provider QP")))
            .collect::<Result<_>>()?;
        Ok(Raw {
            qps,
            cq: dev.cq(),
            wcs: [Completion::EMPTY; 16],
        })
    }

    /// Posts one send WR on QP `i`.
    ///
    /// The caller keeps the memory its SGEs name registered, alive and
    /// unwritten (INLINE: copied at post time) until the WR completed,
    /// which its loop waits for (a later signaled WR of the QP, at the
    /// latest its [`LAST`]).
    fn post_send(&self, i: usize, wr: &SendWr) -> Result<()> {
        // SAFETY: the SGEs name registered memory of the loop's `State` or
        // `Conn`, alive until the QPs are closed, and only the device
        // writes it while the WR is outstanding (see above).
        unsafe { self.qps[i].post_send(std::slice::from_ref(wr)) }.ctx("raw post_send")
    }

    /// Posts one receive on QP `i` into `sge`, memory of [`State`] that
    /// outlives the QPs (dropped after the close).
    fn post_recv(&self, i: usize, sge: Sge) -> Result<()> {
        let mut sg_list = SgList::new();
        sg_list.push(sge);
        let wr = RecvWr {
            wr_id: wr_id(RECV, i, 0),
            sg_list,
        };
        // SAFETY: the SGE names `State::rx`, registered and alive until
        // after the QPs are closed (which flushes the receive); its bytes
        // are only read through raw copies.
        unsafe { self.qps[i].post_recv(std::slice::from_ref(&wr)) }.ctx("raw post_recv")
    }

    /// One poll of the CQ: the number of completions in `wcs`; a failed
    /// one is an error.
    #[inline]
    fn poll(&mut self) -> Result<usize> {
        let n = self.cq.poll(&mut self.wcs).ctx("raw poll")?;
        for c in &self.wcs[..n] {
            if c.status != WcStatus::Success {
                let (kind, qp, _) = decode(c.wr_id);
                return Err(msg(format!(
                    "raw loop: a WR (kind {kind}, QP {qp}) failed: {}",
                    c.status
                )));
            }
        }
        Ok(n)
    }

    /// A signaled zero-length RDMA WRITE (no memory named) as QP `i`'s
    /// closing WR, waited for: every WR before it is then done.
    fn retire(&mut self, i: usize) -> Result<()> {
        let wr = SendWr {
            wr_id: wr_id(LAST, i, 0),
            sg_list: SgList::new(),
            op: SendOp::Write {
                remote_addr: 0,
                rkey: 0,
            },
            flags: SendFlags::SIGNALED,
        };
        self.post_send(i, &wr)?;
        self.wait_last(1, |_, _| Ok(()))
    }

    /// Polls until `n` [`LAST`] WRs completed; other completions go to
    /// `other`.
    fn wait_last(
        &mut self,
        n: usize,
        mut other: impl FnMut(&Raw, &Completion) -> Result<()>,
    ) -> Result<()> {
        let mut seen = 0;
        while seen < n {
            let k = self.poll()?;
            for j in 0..k {
                let c = self.wcs[j];
                if decode(c.wr_id).0 == LAST {
                    seen += 1;
                } else {
                    other(self, &c)?;
                }
            }
        }
        Ok(())
    }
}

fn one_sge(sge: Sge) -> SgList {
    let mut l = SgList::new();
    if sge.length > 0 {
        l.push(sge);
    }
    l
}

impl State {
    /// Posts the receives of the run: every QP of a send test's server
    /// and the client's QP of send_lat, all into one buffer.
    pub fn new(cfg: &Config, dev: &Device, conn: &Conn, server: bool) -> Result<State> {
        let pool = MrPool::new(dev.pd());
        let wanted = cfg.test.verb() == Verb::Send && (server || cfg.test == Test::SendLat);
        let mut rx = None;
        if wanted {
            let buf = pool
                .alloc_zeroed(conn.max_size)
                .ctx("allocating the receive buffer")?;
            let sge = buf.sge_total().ctx("the receive buffer's SGE")?;
            let raw = Raw::new(dev, conn)?;
            // All receives share one buffer: only the queue bounds them.
            let depth = if cfg.test.is_lat() {
                LAT_RX_DEPTH
            } else {
                RX_DEPTH
            };
            for (i, qp) in conn.qps.iter().enumerate() {
                for _ in 0..depth.min(qp.caps().max_recv_wr) {
                    raw.post_recv(i, sge)?;
                }
            }
            rx = Some(buf);
        }
        Ok(State { pool, rx })
    }

    fn alloc(&self, size: usize) -> Result<LocalBuf> {
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        self.pool
            .alloc_from(&data)
            .ctx(format!("allocating a {size}-byte buffer"))
    }

    fn rx_sge(&self) -> Result<Sge> {
        self.rx
            .as_ref()
            .ok_or_else(|| msg("no receive buffer"))?
            .sge_total()
            .ctx("the receive buffer's SGE")
    }

    /// Client: runs one size.
    pub fn client_step(
        &mut self,
        cfg: &Config,
        dev: &Device,
        conn: &Conn,
        size: usize,
        budget: &Budget,
    ) -> Result<Measured> {
        let mut raw = Raw::new(dev, conn)?;
        let remote = conn
            .remote
            .at(0, size as u64)
            .ctx("the peer's memory is smaller than the message")?;
        let (addr, rkey) = (remote.addr(), remote.rkey());
        let buf = self.alloc(size)?;
        let mut sge = buf.sge_init().ctx("the message's SGE")?;
        let inline = size <= conn.qps[0].caps().max_inline_data as usize;
        let sig_every = (conn.qps[0].caps().max_send_wr / 2).max(1);
        match cfg.test {
            Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw => {
                let (op, inline) = match cfg.test {
                    Test::WriteBw => (
                        SendOp::Write {
                            remote_addr: addr,
                            rkey,
                        },
                        inline,
                    ),
                    Test::ReadBw => (
                        SendOp::Read {
                            remote_addr: addr,
                            rkey,
                        },
                        false,
                    ),
                    Test::AtomicBw => (
                        SendOp::FetchAndAdd {
                            remote_addr: addr,
                            rkey,
                            add: 1,
                        },
                        false,
                    ),
                    _ => (SendOp::Send, inline),
                };
                let m = bw_loop(&mut raw, op, sge, inline, cfg.tx_depth, budget)?;
                if cfg.test == Test::SendBw {
                    for i in 0..raw.qps.len() {
                        let wr = SendWr {
                            wr_id: wr_id(LAST, i, 0),
                            sg_list: SgList::new(),
                            op: SendOp::SendWithImm { imm: STOP_IMM },
                            flags: SendFlags::SIGNALED,
                        };
                        raw.post_send(i, &wr)?;
                    }
                    raw.wait_last(raw.qps.len(), |_, _| Ok(()))?;
                }
                drop(buf);
                Ok(m)
            }
            Test::ReadLat | Test::AtomicLat => {
                let op = if cfg.test == Test::ReadLat {
                    SendOp::Read {
                        remote_addr: addr,
                        rkey,
                    }
                } else {
                    sge.length = 8;
                    SendOp::FetchAndAdd {
                        remote_addr: addr,
                        rkey,
                        add: 1,
                    }
                };
                let wr = SendWr {
                    wr_id: wr_id(LAST, 0, 1),
                    sg_list: one_sge(sge),
                    op,
                    flags: SendFlags::SIGNALED,
                };
                let mut lat = LatLoop::start(budget);
                while lat.next() {
                    raw.post_send(0, &wr)?;
                    raw.wait_last(1, |_, _| Ok(()))?;
                }
                drop(buf);
                Ok(lat.finish())
            }
            Test::SendLat => {
                let rx = self.rx_sge()?;
                let mut wr = SendWr {
                    wr_id: wr_id(SEND, 0, 0),
                    sg_list: one_sge(sge),
                    op: SendOp::Send,
                    flags: SendFlags::NONE,
                };
                let mut sent = 0u32;
                let mut lat = LatLoop::start(budget);
                while lat.next() {
                    sent += 1;
                    wr.flags = send_flags(inline, sent % sig_every == 0);
                    raw.post_send(0, &wr)?;
                    wait_recv(&mut raw, rx, size)?;
                }
                let m = lat.finish();
                // The stop marker, signaled: once it completed, so did
                // every send before it.
                let stop = SendWr {
                    wr_id: wr_id(LAST, 0, 0),
                    sg_list: SgList::new(),
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED,
                };
                raw.post_send(0, &stop)?;
                raw.wait_last(1, |_, _| Ok(()))?;
                drop(buf);
                Ok(m)
            }
            Test::WriteLat => {
                let mut buf = buf;
                let mut wr = SendWr {
                    wr_id: wr_id(SEND, 0, 0),
                    sg_list: one_sge(sge),
                    op: SendOp::Write {
                        remote_addr: addr,
                        rkey,
                    },
                    flags: SendFlags::NONE,
                };
                let mut sent = 0u32;
                let mut lat = LatLoop::start(budget);
                while lat.next() {
                    let v = lat_value(lat.i);
                    buf[size - 1] = v;
                    sent += 1;
                    wr.flags = send_flags(inline, sent % sig_every == 0);
                    raw.post_send(0, &wr)?;
                    poll_byte(&mut raw, conn, size - 1, |x| x == v)?;
                }
                let m = lat.finish();
                buf[size - 1] = LAT_STOP;
                wr.wr_id = wr_id(LAST, 0, 0);
                wr.flags = SendFlags::SIGNALED;
                raw.post_send(0, &wr)?;
                raw.wait_last(1, |_, _| Ok(()))?;
                drop(buf);
                Ok(m)
            }
        }
    }

    /// Server: the traffic of one size (the send tests and write_lat).
    pub fn serve_step(
        &mut self,
        cfg: &Config,
        dev: &Device,
        conn: &Conn,
        size: usize,
    ) -> Result<()> {
        let mut raw = Raw::new(dev, conn)?;
        match cfg.test {
            Test::SendBw => {
                let rx = self.rx_sge()?;
                let mut stops = 0;
                while stops < raw.qps.len() {
                    let n = raw.poll()?;
                    for j in 0..n {
                        let c = raw.wcs[j];
                        let (kind, i, _) = decode(c.wr_id);
                        if kind == RECV {
                            raw.post_recv(i, rx)?;
                            if c.imm_data == Some(STOP_IMM) {
                                stops += 1;
                            }
                        }
                    }
                }
                Ok(())
            }
            Test::SendLat => {
                let rx = self.rx_sge()?;
                let inline = size <= conn.qps[0].caps().max_inline_data as usize;
                let sig_every = (conn.qps[0].caps().max_send_wr / 2).max(1);
                let mut echo = SendWr {
                    wr_id: wr_id(SEND, 0, 0),
                    sg_list: one_sge(Sge {
                        length: size as u32,
                        ..rx
                    }),
                    op: SendOp::Send,
                    flags: SendFlags::NONE,
                };
                let mut sent = 0u32;
                'serve: loop {
                    let n = raw.poll()?;
                    for j in 0..n {
                        let c = raw.wcs[j];
                        if decode(c.wr_id).0 != RECV {
                            continue;
                        }
                        raw.post_recv(0, rx)?;
                        if c.byte_len == 0 {
                            break 'serve;
                        }
                        // Echoed from the receive buffer: the client sends
                        // nothing before this echo arrived.
                        sent += 1;
                        echo.flags = send_flags(inline, sent % sig_every == 0);
                        raw.post_send(0, &echo)?;
                    }
                }
                raw.retire(0)
            }
            Test::WriteLat => {
                let remote = conn
                    .remote
                    .at(0, size as u64)
                    .ctx("the client's memory is smaller than the message")?;
                let mut buf = self.alloc(size)?;
                let inline = size <= conn.qps[0].caps().max_inline_data as usize;
                let sig_every = (conn.qps[0].caps().max_send_wr / 2).max(1);
                let mut wr = SendWr {
                    wr_id: wr_id(SEND, 0, 0),
                    sg_list: one_sge(buf.sge_init().ctx("the message's SGE")?),
                    op: SendOp::Write {
                        remote_addr: remote.addr(),
                        rkey: remote.rkey(),
                    },
                    flags: SendFlags::NONE,
                };
                let mut i = 0u64;
                loop {
                    let v = lat_value(i);
                    let got = poll_byte(&mut raw, conn, size - 1, |x| x == v || x == LAT_STOP)?;
                    if got == LAT_STOP {
                        break;
                    }
                    buf[size - 1] = v;
                    i += 1;
                    wr.flags = send_flags(inline, i % u64::from(sig_every) == 0);
                    raw.post_send(0, &wr)?;
                }
                raw.retire(0)?;
                drop(buf);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn send_flags(inline: bool, signaled: bool) -> SendFlags {
    let mut f = if inline {
        SendFlags::INLINE
    } else {
        SendFlags::NONE
    };
    if signaled {
        f |= SendFlags::SIGNALED;
    }
    f
}

/// Spins until a receive completes on QP 0 (reposting it); checks its size.
fn wait_recv(raw: &mut Raw, rx: Sge, size: usize) -> Result<()> {
    loop {
        let n = raw.poll()?;
        let mut got = None;
        for j in 0..n {
            let c = raw.wcs[j];
            if decode(c.wr_id).0 == RECV {
                raw.post_recv(0, rx)?;
                got = Some(c.byte_len);
            }
        }
        if let Some(len) = got {
            if len as usize != size {
                return Err(msg(format!("echo of {len} bytes, expected {size}")));
            }
            return Ok(());
        }
    }
}

/// Spins until the byte at `off` of this side's memory satisfies `ok`,
/// polling the CQ meanwhile (the signaled WRITEs' completions).
fn poll_byte(raw: &mut Raw, conn: &Conn, off: usize, ok: impl Fn(u8) -> bool) -> Result<u8> {
    loop {
        let v = crate::measure::read_byte(&conn.region, off);
        if ok(v) {
            return Ok(v);
        }
        raw.poll()?;
    }
}

/// perftest's bandwidth loop: keeps `depth` WRs posted per QP, one in
/// [`CQ_MOD`] signaled (its completion accounts for the WRs before it),
/// until the budget is spent; stamps every completion.
fn bw_loop(
    raw: &mut Raw,
    op: SendOp,
    sge: Sge,
    inline: bool,
    depth: u32,
    budget: &Budget,
) -> Result<Measured> {
    let q = raw.qps.len();
    let cq_mod = CQ_MOD.min(depth);
    let mut posted = vec![0u64; q];
    let mut done = vec![0u64; q];
    let mut since = vec![0u32; q];
    let mut finished = vec![!budget.more(0); q];
    let mut wr = SendWr {
        wr_id: 0,
        sg_list: one_sge(sge),
        op,
        flags: SendFlags::NONE,
    };
    let mut samples =
        BwSamples::with_capacity((budget.wire_iters() as usize * q) / cq_mod as usize + 2);
    let mut total = 0u64;
    let clock = CycleClock::start();
    samples.push(clock.stamp(), 0);
    loop {
        for i in 0..q {
            while !finished[i] && posted[i] - done[i] < u64::from(depth) {
                let last = !budget.more(posted[i] + 1);
                since[i] += 1;
                let signaled = last || since[i] >= cq_mod;
                wr.wr_id = wr_id(SEND, i, if signaled { since[i] } else { 0 });
                wr.flags = send_flags(inline, signaled);
                raw.post_send(i, &wr)?;
                posted[i] += 1;
                if signaled {
                    since[i] = 0;
                }
                finished[i] = last;
            }
        }
        let n = raw.poll()?;
        if n > 0 {
            for j in 0..n {
                let (_, i, count) = decode(raw.wcs[j].wr_id);
                if i < q {
                    done[i] += u64::from(count);
                    total += u64::from(count);
                }
            }
            samples.push(clock.stamp(), total);
        }
        if (0..q).all(|i| finished[i] && done[i] == posted[i]) {
            break;
        }
    }
    Ok(Measured::Bw {
        samples,
        ticks_per_us: clock.ticks_per_us(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip_in_the_untracked_range() {
        let id = wr_id(SEND, 7, 100);
        assert_ne!(id & TAG, 0);
        assert_eq!(decode(id), (SEND, 7, 100));
        assert_eq!(decode(wr_id(LAST, 0, 0)), (LAST, 0, 0));
    }
}
