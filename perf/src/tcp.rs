//! `--transport tcp`: send_bw and send_lat over kernel TCP sockets
//! (blocking, Nagle off), as a baseline beside the RDMA figures. Messages
//! are framed with a 4-byte length; length 0 ends a step.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::args::{Api, Config, Test};
use crate::clock::CycleClock;
use crate::ctl::{self, Frame, FRAME};
use crate::error::{msg, Context, Result};
use crate::measure::{LatLoop, Measured};
use crate::progress::Progress;
use crate::report::{Printer, RunInfo};
use crate::session::{self, Budget};
use crate::stats::BwSamples;

/// How long a client retries connecting to a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);

fn send_frame(s: &mut TcpStream, f: Frame) -> Result<()> {
    s.write_all(&f.encode()).ctx("writing a control frame")
}

fn recv_frame(s: &mut TcpStream) -> Result<Frame> {
    let mut b = [0u8; FRAME];
    s.read_exact(&mut b).ctx("reading a control frame")?;
    Frame::decode(&b).ctx("decoding a control frame")
}

fn expect(s: &mut TcpStream, want: Frame) -> Result<()> {
    match recv_frame(s)? {
        f if f == want => Ok(()),
        got => Err(msg(format!("expected {want:?} from the peer, got {got:?}"))),
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
fn read_msg(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<usize> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ctx("reading a message length")?;
    let len = u32::from_le_bytes(len) as usize;
    buf.resize(len, 0);
    s.read_exact(buf).ctx("reading a message")?;
    Ok(len)
}

/// The client.
pub fn client(cfg: &Config, host: &str) -> Result<()> {
    if cfg.sizes.iter().any(|&s| u32::try_from(s).is_err()) {
        return Err(msg("message sizes must fit in 32 bits"));
    }
    let addr = session::resolve(host, cfg.port)?;
    let deadline = Instant::now() + CONNECT_RETRY;
    let mut s = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e).ctx(format!("connecting to {addr}")),
        }
    };
    s.set_nodelay(true).ctx("setting TCP_NODELAY")?;
    send_frame(
        &mut s,
        Frame::Hello {
            test: cfg.test,
            api: Api::Verbs.code(),
            connection: cfg.connection.code(),
            qps: 1,
            max_size: cfg.max_size() as u64,
            mode: cfg.mode(),
        },
    )?;
    expect(&mut s, Frame::Go)?;
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
    let mut back = Vec::new();
    for &size in &cfg.sizes {
        progress.start(size);
        let wire = Budget::step(cfg, size).wire_iters();
        send_frame(
            &mut s,
            Frame::Step {
                size: size as u64,
                iters: wire,
                ms: 0,
            },
        )?;
        expect(&mut s, Frame::Go)?;
        let budget = Budget::step(cfg, size);
        let m = framed(size);
        let measured = if cfg.test == Test::SendBw {
            let mut samples = BwSamples::with_capacity(wire as usize + 2);
            let clock = CycleClock::start();
            samples.push(clock.stamp(), 0);
            let mut n = 0u64;
            while budget.more(n) {
                s.write_all(&m).ctx(format!("send {n}"))?;
                n += 1;
                samples.push(clock.stamp(), n);
            }
            s.write_all(&0u32.to_le_bytes()).ctx("sending the end")?;
            expect(&mut s, Frame::Done)?;
            // The last message is in when the server says so.
            samples.push(clock.stamp(), n);
            Measured::Bw {
                samples,
                ticks_per_us: clock.ticks_per_us(),
            }
        } else {
            let mut lat = LatLoop::start(&budget);
            while lat.next() {
                s.write_all(&m).ctx(format!("send {}", lat.i))?;
                let len = read_msg(&mut s, &mut back)?;
                if len != size {
                    return Err(msg(format!("echo of {len} bytes, expected {size}")));
                }
            }
            s.write_all(&0u32.to_le_bytes()).ctx("sending the end")?;
            expect(&mut s, Frame::Done)?;
            lat.finish()
        };
        let row = measured.row(cfg.test, size, 1)?;
        progress.done(&row);
        printer.row(row);
    }
    send_frame(&mut s, Frame::Bye)?;
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
    let (mut s, _) = l.accept().ctx("accepting the client")?;
    s.set_nodelay(true).ctx("setting TCP_NODELAY")?;
    let hello = recv_frame(&mut s)?;
    ctl::check_hello(hello, cfg.test, Api::Verbs, cfg.connection, cfg.mode())
        .ctx("the client's hello")?;
    send_frame(&mut s, Frame::Go)?;
    let mut buf = Vec::new();
    loop {
        match recv_frame(&mut s)? {
            Frame::Step { .. } => {
                send_frame(&mut s, Frame::Go)?;
                loop {
                    let len = read_msg(&mut s, &mut buf)?;
                    if len == 0 {
                        break;
                    }
                    if cfg.test == Test::SendLat {
                        let mut m = Vec::with_capacity(len + 4);
                        m.extend_from_slice(&(len as u32).to_le_bytes());
                        m.extend_from_slice(&buf);
                        s.write_all(&m).ctx("echoing")?;
                    }
                }
                send_frame(&mut s, Frame::Done)?;
            }
            Frame::Bye => return Ok(()),
            got => return Err(msg(format!("unexpected {got:?} from the client"))),
        }
    }
}
