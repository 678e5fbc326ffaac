//! `--transport tcp`: send_bw and send_lat over kernel TCP sockets
//! (blocking, Nagle off), as a baseline beside the RDMA figures. Messages
//! are framed with a 4-byte length; length 0 ends a step.
//!
//! The memory the loops touch is the verbs path's (`verbs.rs`), so that
//! the two compare the transports, not the caches: messages are received
//! into a ring of as many buffers as the verbs path posts (`rx_depth`:
//! send_lat's ring for the run's largest message, send_bw's for each
//! size), in turn; send_bw sends from as many buffers as the verbs path
//! keeps in flight (`-t`), in turn; send_lat's server copies each message
//! into one echo buffer and sends that, as the verbs server does. (With
//! one reused buffer instead, a large message stayed in the CPU's cache
//! for TCP only: see docs/benchmarks.md.)
//!
//! Reads go through a [`BufReader`], as a TCP application's would: small
//! messages that arrive together are taken in one `read`, and a message
//! larger than its buffer is read straight into the ring buffer.

use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::args::{Api, Config, Test};
use crate::clock::CycleClock;
use crate::ctl::{self, Frame, FRAME};
use crate::error::{msg, Context, Result};
use crate::measure::{LatLoop, Measured};
use crate::progress::Progress;
use crate::report::{Printer, RunInfo};
use crate::session::{self, rx_depth, Budget};
use crate::stats::BwSamples;

/// How long a client retries connecting to a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);

/// The read buffer's size: several small messages per `read`; a message
/// this large or larger bypasses it.
const READ_BUFFER: usize = 64 * 1024;

/// One connection: reads through a buffer, writes straight to the socket.
struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Conn {
    fn new(s: TcpStream) -> Result<Conn> {
        s.set_nodelay(true).ctx("setting TCP_NODELAY")?;
        let w = s.try_clone().ctx("cloning the socket for writes")?;
        Ok(Conn {
            r: BufReader::with_capacity(READ_BUFFER, s),
            w,
        })
    }

    fn send_frame(&mut self, f: Frame) -> Result<()> {
        self.w.write_all(&f.encode()).ctx("writing a control frame")
    }

    fn recv_frame(&mut self) -> Result<Frame> {
        let mut b = [0u8; FRAME];
        self.r.read_exact(&mut b).ctx("reading a control frame")?;
        Frame::decode(&b).ctx("decoding a control frame")
    }

    fn expect(&mut self, want: Frame) -> Result<()> {
        match self.recv_frame()? {
            f if f == want => Ok(()),
            got => Err(msg(format!("expected {want:?} from the peer, got {got:?}"))),
        }
    }
}

/// A message with its length prefix.
fn framed(size: usize) -> Vec<u8> {
    let mut m = Vec::with_capacity(size + 4);
    m.extend_from_slice(&(size as u32).to_le_bytes());
    m.extend((0..size).map(|i| i as u8));
    m
}

/// Reads one framed message into `buf`; returns its length (0: the end).
fn read_msg(s: &mut impl Read, buf: &mut Vec<u8>) -> Result<usize> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ctx("reading a message length")?;
    let len = u32::from_le_bytes(len) as usize;
    buf.resize(len, 0);
    s.read_exact(buf).ctx("reading a message")?;
    Ok(len)
}

/// Receive buffers used in turn, as the verbs path's receive ring.
struct Ring {
    bufs: Vec<Vec<u8>>,
    next: usize,
}

impl Ring {
    /// `depth` buffers of `size` bytes, touched now (before any clock
    /// starts), as the verbs path registers its ring.
    fn new(depth: u32, size: usize) -> Ring {
        Ring {
            bufs: (0..depth.max(1)).map(|_| vec![1u8; size]).collect(),
            next: 0,
        }
    }

    /// Reads one framed message into the next buffer: its length (0: the
    /// end) and the buffer.
    fn read(&mut self, s: &mut impl Read) -> Result<(usize, &[u8])> {
        let i = self.next;
        self.next = (i + 1) % self.bufs.len();
        let buf = &mut self.bufs[i];
        let len = read_msg(s, buf)?;
        Ok((len, &buf[..len]))
    }
}

/// The client.
pub fn client(cfg: &Config, host: &str) -> Result<()> {
    if cfg.sizes.iter().any(|&s| u32::try_from(s).is_err()) {
        return Err(msg("message sizes must fit in 32 bits"));
    }
    let addr = session::resolve(host, cfg.port)?;
    let deadline = Instant::now() + CONNECT_RETRY;
    let mut s = Conn::new(loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e).ctx(format!("connecting to {addr}")),
        }
    })?;
    s.send_frame(Frame::Hello {
        test: cfg.test,
        api: Api::Verbs.code(),
        connection: cfg.connection.code(),
        qps: 1,
        max_size: cfg.max_size() as u64,
        mode: cfg.mode(),
    })?;
    s.expect(Frame::Go)?;
    let info = RunInfo {
        test: cfg.test,
        api: cfg.api,
        transport: cfg.transport,
        connection: cfg.connection,
        device: "tcp".into(),
        provider: format!("kernel TCP to {addr}"),
        qps: 1,
        tx_depth: cfg.tx_depth,
        inline_size: 0,
        mtu: 0,
        completions: "blocking socket calls".into(),
        bw_units: if cfg.gbits { "Gb/sec" } else { "MB/sec" }.into(),
        bidirectional: false,
        srq: false,
        rdma_cm: false,
    };
    let mut printer = Printer::new(cfg, info);
    let mut progress = Progress::new(cfg);
    // send_lat's receive ring, for the run (the verbs path's `State::new`).
    let mut lat_ring = (cfg.test == Test::SendLat)
        .then(|| Ring::new(rx_depth(cfg.max_size(), true), cfg.max_size()));
    for &size in &cfg.sizes {
        progress.start(size);
        let wire = Budget::step(cfg, size).wire_iters();
        s.send_frame(Frame::Step {
            size: size as u64,
            iters: wire,
            ms: 0,
        })?;
        s.expect(Frame::Go)?;
        let budget = Budget::step(cfg, size);
        let measured = if cfg.test == Test::SendBw {
            // As many buffers as the verbs path keeps in flight (`bufs`).
            let window = match wire {
                0 => u64::from(cfg.tx_depth),
                iters => iters.min(u64::from(cfg.tx_depth)),
            }
            .max(1);
            let window: Vec<Vec<u8>> = (0..window).map(|_| framed(size)).collect();
            let mut samples = BwSamples::with_capacity(wire as usize + 2);
            let clock = CycleClock::start();
            samples.push(clock.stamp(), 0);
            let mut n = 0u64;
            while budget.more(n) {
                let m = &window[(n % window.len() as u64) as usize];
                s.w.write_all(m).ctx(format!("send {n}"))?;
                n += 1;
                samples.push(clock.stamp(), n);
            }
            s.w.write_all(&0u32.to_le_bytes()).ctx("sending the end")?;
            s.expect(Frame::Done)?;
            // The last message is in when the server says so.
            samples.push(clock.stamp(), n);
            Measured::Bw {
                samples,
                ticks_per_us: clock.ticks_per_us(),
            }
        } else {
            let m = framed(size);
            let ring = lat_ring.as_mut().ok_or_else(|| msg("no receive ring"))?;
            let mut lat = LatLoop::start(&budget);
            while lat.next() {
                s.w.write_all(&m).ctx(format!("send {}", lat.i))?;
                let (len, _) = ring.read(&mut s.r)?;
                if len != size {
                    return Err(msg(format!("echo of {len} bytes, expected {size}")));
                }
            }
            s.w.write_all(&0u32.to_le_bytes()).ctx("sending the end")?;
            s.expect(Frame::Done)?;
            lat.finish()
        };
        let row = measured.row(cfg.test, size, 1)?;
        progress.done(&row);
        printer.row(row);
    }
    s.send_frame(Frame::Bye)?;
    printer.finish()
}

/// The server: serves one client, then returns.
pub fn server(cfg: &Config) -> Result<()> {
    let l = TcpListener::bind(session::listen_addr(cfg.port))
        .ctx(format!("listening on TCP port {}", cfg.port))?;
    let local = l.local_addr().ctx("reading the listening address")?;
    eprintln!(
        "verbio-perf: {} server listening on {local} (tcp)",
        cfg.test.name()
    );
    let (s, _) = l.accept().ctx("accepting the client")?;
    let mut s = Conn::new(s)?;
    let hello = s.recv_frame()?;
    ctl::check_hello(hello, cfg.test, Api::Verbs, cfg.connection, cfg.mode())
        .ctx("the client's hello")?;
    let max_size = match hello {
        Frame::Hello { max_size, .. } => usize::try_from(max_size)
            .ok()
            .filter(|&m| u32::try_from(m).is_ok())
            .ok_or_else(|| {
                msg(format!(
                    "the client's largest message, {max_size} bytes, is too large"
                ))
            })?,
        _ => 0,
    };
    s.send_frame(Frame::Go)?;
    let lat = cfg.test == Test::SendLat;
    // send_lat's ring is posted for the run, send_bw's per size (as the
    // verbs server's); the echo leaves from one buffer, which the verbs
    // server copies each message into too.
    let mut ring = lat.then(|| Ring::new(rx_depth(max_size, true), max_size));
    let mut echo = Vec::with_capacity(if lat { max_size + 4 } else { 0 });
    loop {
        match s.recv_frame()? {
            Frame::Step { size, .. } => {
                if !lat {
                    let size = usize::try_from(size)
                        .ok()
                        .filter(|&z| z <= max_size)
                        .ok_or_else(|| {
                            msg(format!(
                                "a step of {size}-byte messages, above the client's largest"
                            ))
                        })?;
                    ring = Some(Ring::new(rx_depth(size, false), size));
                }
                let ring = ring.as_mut().ok_or_else(|| msg("no receive ring"))?;
                s.send_frame(Frame::Go)?;
                loop {
                    let (len, got) = ring.read(&mut s.r)?;
                    if len == 0 {
                        break;
                    }
                    if lat {
                        echo.clear();
                        echo.extend_from_slice(&(len as u32).to_le_bytes());
                        echo.extend_from_slice(got);
                        s.w.write_all(&echo).ctx("echoing")?;
                    }
                }
                s.send_frame(Frame::Done)?;
            }
            Frame::Bye => return Ok(()),
            got => return Err(msg(format!("unexpected {got:?} from the client"))),
        }
    }
}
