//! The client's and the server's run for the verbs and raw APIs: connect,
//! then one step per message size, synchronized over the control stream.

use verbio::runtime::{Device, Runtime};

use crate::args::{Api, Config, Connection, Test};
use crate::cm;
use crate::ctl::{self, Frame};
use crate::error::{msg, Context, Result};
use crate::measure::Measured;
use crate::progress::Progress;
use crate::raw;
use crate::report::{Figures, Printer, Row};
use crate::session::{self, Budget, Conn};
use crate::ud;
use crate::verbs;

/// The loops of the chosen API and their memory.
enum Loops {
    Verbs(verbs::State),
    Raw(raw::State),
}

impl Loops {
    fn new(cfg: &Config, dev: &Device, conn: &Conn, server: bool) -> Result<Loops> {
        Ok(match cfg.api {
            Api::Raw => Loops::Raw(raw::State::new(cfg, dev, conn, server)?),
            _ => Loops::Verbs(verbs::State::new(cfg, dev, conn, server)?),
        })
    }

    async fn client_step(
        &mut self,
        cfg: &Config,
        dev: &Device,
        conn: &Conn,
        size: usize,
        budget: &Budget,
        drain: u64,
    ) -> Result<Measured> {
        match self {
            Loops::Verbs(v) => v.client_step(cfg, conn, size, budget, drain).await,
            Loops::Raw(r) => r.client_step(cfg, dev, conn, size, budget),
        }
    }

    fn prepare_step(
        &mut self,
        cfg: &Config,
        dev: &Device,
        conn: &Conn,
        size: usize,
    ) -> Result<u64> {
        match self {
            Loops::Verbs(v) => v.prepare_step(cfg, dev, conn, size),
            Loops::Raw(_) => Ok(0),
        }
    }

    /// The server's part of a step; with `-b` (`own`), its own loop's
    /// figures.
    async fn serve_step(
        &mut self,
        cfg: &Config,
        dev: &Device,
        conn: &Conn,
        size: usize,
        own: Option<&Budget>,
    ) -> Result<Option<Measured>> {
        match self {
            Loops::Verbs(v) => v.serve_step(cfg, conn, size, own).await,
            Loops::Raw(r) => r.serve_step(cfg, dev, conn, size).map(|()| None),
        }
    }
}

/// Whether the server takes part in the test's traffic (and so reports
/// the end of each step): the send tests, write_lat, and every test with
/// `-b`.
pub fn server_active(cfg: &Config) -> bool {
    cfg.bidirectional || matches!(cfg.test, Test::SendBw | Test::SendLat | Test::WriteLat)
}

/// `-b`: the client's row with the server's direction added (perftest's
/// sum of both sides' reports): messages, average, peak and rate.
fn add_peer(mut row: Row, peer: Frame) -> Result<Row> {
    let Frame::PeerBw {
        iterations,
        avg_mbps,
        peak_mbps,
    } = peer
    else {
        return Err(msg(format!("expected the server's figures, got {peer:?}")));
    };
    if let Figures::Bw(b) = &mut row.figures {
        b.bw_avg_mbps += avg_mbps;
        b.bw_peak_mbps += f64::from(peak_mbps);
        b.msg_rate_mpps += avg_mbps * (1u64 << 20) as f64 / row.bytes.max(1) as f64 / 1e6;
    }
    row.iterations += iterations;
    Ok(row)
}

/// Whether the server's loop spins (busy-polls) on hardware.
fn server_spins(test: Test) -> bool {
    matches!(test, Test::SendLat | Test::WriteLat)
}

/// The client: connects to `host`, runs every size, prints the results.
pub fn client(cfg: &Config, host: &str) -> Result<()> {
    let addr = session::resolve(host, cfg.port)?;
    let (rt, dev, busy) = session::open(cfg, true)?;
    run_client(cfg, &rt, &dev, addr, busy)
}

fn run_client(
    cfg: &Config,
    rt: &Runtime,
    dev: &Device,
    addr: std::net::SocketAddr,
    busy: std::time::Duration,
) -> Result<()> {
    rt.block_on(async {
        let mut conn = match cfg.connection {
            Connection::Rc if cfg.rdma_cm => cm::dial(cfg, dev, addr).await?,
            Connection::Rc => session::dial(cfg, dev, addr).await?,
            Connection::Ud => ud::dial(cfg, dev, addr).await?,
        };
        let mut loops = Loops::new(cfg, dev, &conn, false)?;
        let mut printer = Printer::new(cfg, session::run_info(cfg, dev, &conn, busy));
        let mut progress = Progress::new(cfg);
        let res = async {
            // --run_infinitely: the one size, step after step, until killed.
            let forever = cfg
                .sizes
                .iter()
                .copied()
                .cycle()
                .take_while(|_| cfg.run_infinitely);
            let sizes = cfg.sizes.iter().copied().filter(|_| !cfg.run_infinitely);
            for size in sizes.chain(forever) {
                progress.start(size);
                if cfg.test == Test::WriteLat {
                    conn.region
                        .write_from(0, &vec![0u8; size])
                        .ctx("clearing this side's memory")?;
                }
                let step = Budget::step(cfg, size);
                ctl::send(
                    &mut conn.ctl,
                    Frame::Step {
                        size: size as u64,
                        iters: step.wire_iters(),
                        ms: step.wire_ms(),
                    },
                )
                .await
                .ctx("starting a step")?;
                let drain = match ctl::recv(&mut conn.ctl).await.ctx("starting a step")? {
                    Frame::GoDrain { drain } => drain,
                    got => return Err(msg(format!("expected the server's go, got {got:?}"))),
                };
                let budget = Budget::step(cfg, size);
                let m = loops
                    .client_step(cfg, dev, &conn, size, &budget, drain)
                    .await?;
                if server_active(cfg) {
                    ctl::expect(&mut conn.ctl, Frame::Done, "the server's done")
                        .await
                        .ctx("ending a step")?;
                }
                let mut row = m.row(cfg.test, size, cfg.in_flight())?;
                if cfg.bidirectional {
                    let peer = ctl::recv(&mut conn.ctl)
                        .await
                        .ctx("reading the server's figures")?;
                    row = add_peer(row, peer)?;
                }
                progress.done(&row);
                printer.row(row);
                if cfg.run_infinitely {
                    crate::watchdog_extend(cfg);
                }
            }
            ctl::send(&mut conn.ctl, Frame::Bye)
                .await
                .ctx("saying bye")?;
            Ok::<(), crate::error::Error>(())
        }
        .await;
        // Closing flushes the receives the loops posted; their memory goes after.
        session::close(&conn).await;
        drop(loops);
        res?;
        printer.finish()
    })
}

/// The server's listening socket: RC handshakes, the RDMA CM (`-R`), or
/// UD's control port.
enum Listening {
    Rc(session::RcListener),
    Cm(cm::CmServer),
    Ud(verbio::runtime::TcpListener),
}

/// The server: serves one client, then returns.
pub fn server(cfg: &Config) -> Result<()> {
    let (rt, dev, _) = session::open(cfg, server_spins(cfg.test))?;
    let listener = match cfg.connection {
        Connection::Rc if cfg.rdma_cm => Listening::Cm(cm::bind(cfg, &dev)?),
        Connection::Rc => Listening::Rc(session::bind(cfg, &dev)?),
        Connection::Ud => Listening::Ud(ud::bind(cfg)?),
    };
    rt.block_on(async {
        let mut conn = match &listener {
            Listening::Rc(l) => session::accept(cfg, &dev, l).await?,
            Listening::Cm(l) => cm::accept(cfg, &dev, l).await?,
            Listening::Ud(l) => ud::accept(cfg, &dev, l).await?,
        };
        let mut loops = Loops::new(cfg, &dev, &conn, true)?;
        let res = async {
            loop {
                match ctl::recv(&mut conn.ctl)
                    .await
                    .ctx("waiting for the client")?
                {
                    Frame::Step { size, iters, ms } => {
                        let size = usize::try_from(size)
                            .ok()
                            .filter(|&s| s > 0 && s <= conn.max_size)
                            .ok_or_else(|| msg(format!("the client asked for {size} bytes")))?;
                        if cfg.test == Test::WriteLat {
                            conn.region
                                .write_from(0, &vec![0u8; size])
                                .ctx("clearing this side's memory")?;
                        }
                        let drain = loops.prepare_step(cfg, &dev, &conn, size)?;
                        ctl::send(&mut conn.ctl, Frame::GoDrain { drain })
                            .await
                            .ctx("sending go")?;
                        let own = cfg
                            .bidirectional
                            .then(|| Budget::from_wire(iters, ms, size));
                        let mine = loops
                            .serve_step(cfg, &dev, &conn, size, own.as_ref())
                            .await?;
                        if server_active(cfg) {
                            ctl::send(&mut conn.ctl, Frame::Done)
                                .await
                                .ctx("sending done")?;
                        }
                        if let Some(m) = mine {
                            let row = m.row(cfg.test, size, cfg.in_flight())?;
                            let Figures::Bw(b) = row.figures else {
                                return Err(msg("-b runs bandwidth tests only"));
                            };
                            let peer = Frame::PeerBw {
                                iterations: row.iterations,
                                avg_mbps: b.bw_avg_mbps,
                                peak_mbps: b.bw_peak_mbps as f32,
                            };
                            ctl::send(&mut conn.ctl, peer)
                                .await
                                .ctx("sending this side's figures")?;
                        }
                        if cfg.run_infinitely {
                            crate::watchdog_extend(cfg);
                        }
                    }
                    Frame::Bye => return Ok(()),
                    got => return Err(msg(format!("unexpected {got:?} from the client"))),
                }
            }
        }
        .await;
        session::close(&conn).await;
        drop(loops);
        res
    })
}
