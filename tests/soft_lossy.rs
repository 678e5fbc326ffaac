//! RC on the software device over a lossy link, and dead peers noticed by
//! a QP that only waits for a receive.
//!
//! The peer is a second process in a network namespace joined by a veth
//! pair; nftables in that namespace drops a given share of the packets
//! each way (the kernel has no netem). At 1% and 5% loss a 64-byte
//! ping-pong and a 1 MiB SEND must deliver every byte, in order (each echo
//! is compared, the 1 MiB message's hash too), and the time against a TCP
//! loop doing the same over the same link is printed (not asserted: the
//! machine is shared). Then a receive waiting on a peer whose process was
//! killed, or whose host vanished (every packet dropped), must complete
//! with an error: at once, and within `SoftConfig::peer_timeout`.
//!
//! Needs root, iproute2 and nft; where one is missing the test prints
//! `SKIPPED: <reason>` and returns. Soft device only.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::Netns;
use common::peer::{spawn_announcing, Peer, ADDR_PREFIX};
use common::*;
use verbio::ops::connect::{connect, Listener};
use verbio::ops::verbs::Verbs;
use verbio::provider::{Context, SoftConfig};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, timeout, Device, QueuePair, Runtime};

/// Set in the peer process: `IP,ROLE`.
const PEER_ENV: &str = "VERBIO_LOSSY_TEST_PEER";
/// The ping-pong's message size.
const SMALL: usize = 64;
/// The large message.
const BIG: usize = 1 << 20;
/// A message of this length ends the echo loop.
const QUIT: usize = 1;
/// How long a peer process lives at most.
const PEER_LIFE: Duration = Duration::from_secs(120);

/// A runtime with a soft device whose engine listens on `ip`.
fn soft_on(ip: IpAddr, peer_timeout: Option<Duration>) -> (Runtime, Device) {
    let rt = Runtime::new().expect("runtime");
    let ctx = Context::open_soft(SoftConfig {
        bind: SocketAddr::new(ip, 0),
        peer_timeout: peer_timeout.unwrap_or(SoftConfig::default().peer_timeout),
        ..SoftConfig::default()
    })
    .expect("soft device");
    (rt, Device::open(ctx).expect("device"))
}

/// FNV-1a: what the receiver of a large message answers.
fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The answer to a message: itself up to [`SMALL`] bytes, else its hash.
fn answer(msg: &[u8]) -> Vec<u8> {
    if msg.len() <= SMALL {
        msg.to_vec()
    } else {
        hash(msg).to_le_bytes().to_vec()
    }
}

/// The TCP loop's server: `[u32 len][bytes]` in, [`answer`] out, until
/// the client closes.
fn tcp_echo(listener: TcpListener) {
    let (mut s, _) = listener.accept().expect("tcp accept");
    s.set_nodelay(true).expect("nodelay");
    let mut msg = vec![0u8; BIG];
    loop {
        let mut len = [0u8; 4];
        if s.read_exact(&mut len).is_err() {
            return;
        }
        let len = u32::from_le_bytes(len) as usize;
        assert!(len <= BIG, "tcp message of {len} bytes");
        s.read_exact(&mut msg[..len]).expect("tcp read");
        s.write_all(&answer(&msg[..len])).expect("tcp write");
    }
}

/// Entry point of the peer process (inside the namespace). Run directly
/// (no env var), it returns at once.
#[test]
fn lossy_peer_entry() {
    let Ok(spec) = std::env::var(PEER_ENV) else {
        return;
    };
    let (ip, role) = spec.split_once(',').expect("IP,ROLE");
    let ip: IpAddr = ip.parse().expect("peer IP");
    let (rt, dev) = soft_on(ip, None);
    let listener = Listener::bind(SocketAddr::new(ip, 0), qps(&dev), HANDSHAKE).expect("listener");
    let tcp = TcpListener::bind(SocketAddr::new(ip, 0)).expect("tcp listener");
    let tcp_port = tcp.local_addr().expect("tcp addr").port();
    std::thread::spawn(move || tcp_echo(tcp));
    println!("{ADDR_PREFIX}{}", listener.local_addr().unwrap());
    let pool = MrPool::new(dev.pd());
    // (Bounded: a lossy run takes seconds to tens of seconds.)
    let run = timeout(PEER_LIFE, async {
        let qp = listener.accept().await.expect("accept").qp;
        // The first message: where the TCP loop's server listens.
        let (res, _) = qp.send(buf_from(&pool, &tcp_port.to_le_bytes())).await;
        res.expect("send the tcp port");
        match role {
            "echo" => {
                let mut msg = buf(&pool, BIG);
                loop {
                    let (res, b) = qp.recv(msg).await;
                    let n = res.expect("echo recv").len;
                    if n == QUIT {
                        break;
                    }
                    let reply = answer(&b[..n]);
                    msg = b;
                    let (res, _) = qp.send(buf_from(&pool, &reply)).await;
                    res.expect("echo send");
                }
            }
            // Waits to be killed (bounded, in case the test died).
            "quiet" => sleep(Duration::from_secs(60)).await,
            other => panic!("unknown peer role {other}"),
        }
    });
    rt.block_on(run).expect("the peer outlived its bound");
}

/// A namespace for a second host, or `None` after printing why the test
/// is skipped.
fn netns_or_skip(tag: u8) -> Option<Netns> {
    if let Some(dev) = test_device() {
        println!("SKIPPED: soft-device test ({TEST_DEVICE_ENV}={dev})");
        return None;
    }
    match Netns::create("lossy", 235, tag) {
        Ok(ns) => Some(ns),
        Err(why) => {
            println!("SKIPPED: no network namespace for a second host: {why}");
            None
        }
    }
}

/// The peer process in `ns`, connected: its QP (on `dev`) and the address
/// of its TCP loop's server.
fn start_peer(ns: &Netns, role: &str, rt: &Runtime, dev: &Device) -> (Peer, QueuePair, SocketAddr) {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name])
        .arg(std::env::current_exe().unwrap());
    let spec = format!("{},{role}", ns.peer_ip);
    let (peer, addr) = spawn_announcing(cmd, "lossy_peer_entry", (PEER_ENV, &spec));
    let pool = MrPool::new(dev.pd());
    let (qp, port) = block(rt, async {
        let qp = connect(addr, &qps(dev), HANDSHAKE)
            .await
            .expect("connect across namespaces")
            .qp;
        let (res, b) = qp.recv(buf(&pool, SMALL)).await;
        assert_eq!(res.expect("recv the tcp port").len, 2);
        (qp, u16::from_le_bytes([b[0], b[1]]))
    });
    (peer, qp, SocketAddr::new(addr.ip(), port))
}

/// Times of one way of exchanging messages.
#[derive(Default)]
struct Timing {
    total: Duration,
    worst: Duration,
}

impl Timing {
    fn add(&mut self, d: Duration) {
        self.total += d;
        self.worst = self.worst.max(d);
    }
}

/// One exchange over TCP: `msg` out, its answer back, checked.
fn tcp_round(s: &mut TcpStream, msg: &[u8]) -> Duration {
    let start = Instant::now();
    s.write_all(&(msg.len() as u32).to_le_bytes())
        .expect("tcp write");
    s.write_all(msg).expect("tcp write");
    let want = answer(msg);
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).expect("tcp read");
    assert_eq!(got, want, "tcp: a message came back wrong");
    start.elapsed()
}

/// One exchange over RC: `msg` out, its answer back, checked.
async fn rc_round(qp: &QueuePair, pool: &MrPool, msg: &[u8]) -> Duration {
    let start = Instant::now();
    let reply = qp.recv(buf(pool, SMALL));
    let (res, _) = qp.send(buf_from(pool, msg)).await;
    res.unwrap_or_else(|e| panic!("RC send of {} bytes: {e}", msg.len()));
    let (res, b) = reply.await;
    let n = res.unwrap_or_else(|e| panic!("RC recv: {e}")).len;
    assert_eq!(&b[..n], &answer(msg)[..], "RC: a message came back wrong");
    start.elapsed()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `rounds` 64-byte round trips and one 1 MiB message over RC and over
/// TCP, side by side, with `percent`% of the packets dropped each way.
fn rc_over_lossy_link(tag: u8, percent: u8, rounds: usize) {
    let Some(ns) = netns_or_skip(tag) else { return };
    let (rt, dev) = soft_on(IpAddr::V4(ns.host_ip), None);
    let (peer, qp, tcp_addr) = start_peer(&ns, "echo", &rt, &dev);
    let mut tcp = TcpStream::connect_timeout(&tcp_addr, WAIT).expect("tcp connect");
    tcp.set_nodelay(true).expect("nodelay");
    tcp.set_read_timeout(Some(WAIT)).expect("tcp timeout");
    if let Err(why) = ns.drop_randomly(percent) {
        println!("SKIPPED: no packet loss on the link: {why}");
        return;
    }
    let pool = MrPool::new(dev.pd());
    let (mut rc_small, mut tcp_small) = (Timing::default(), Timing::default());
    let big = pattern(BIG, percent);
    // (Each round is bounded, not the whole run.)
    let (rc_big, tcp_big) = rt.block_on(async {
        for i in 0..rounds {
            // Every round a different message: one delivered twice, late
            // or out of order would not match.
            let msg = pattern(SMALL, i as u8 ^ (i >> 8) as u8);
            tcp_small.add(tcp_round(&mut tcp, &msg));
            let d = timeout(WAIT, rc_round(&qp, &pool, &msg))
                .await
                .unwrap_or_else(|_| panic!("RC round {i} took over {WAIT:?}"));
            rc_small.add(d);
        }
        let tcp_big = tcp_round(&mut tcp, &big);
        let rc_big = timeout(WAIT, rc_round(&qp, &pool, &big))
            .await
            .expect("the 1 MiB message took too long");
        let (res, _) = qp.send(buf_from(&pool, &[0u8; QUIT])).await;
        res.expect("quit");
        (rc_big, tcp_big)
    });
    drop(tcp);
    println!(
        "{percent}% loss each way, {rounds} x {SMALL} B ping-pong: RC {:.0} ms (worst round {:.0} ms), \
         TCP {:.0} ms (worst {:.0} ms), RC/TCP {:.2}; 1 MiB: RC {:.0} ms, TCP {:.0} ms, RC/TCP {:.2}",
        ms(rc_small.total),
        ms(rc_small.worst),
        ms(tcp_small.total),
        ms(tcp_small.worst),
        rc_small.total.as_secs_f64() / tcp_small.total.as_secs_f64(),
        ms(rc_big),
        ms(tcp_big),
        rc_big.as_secs_f64() / tcp_big.as_secs_f64(),
    );
    peer.wait_success();
}

/// The same without loss: what the ratios above compare against (the
/// debug build's RC ping-pong costs about a millisecond per round here).
#[test]
fn rc_and_tcp_on_the_same_link_without_loss() {
    rc_over_lossy_link(4, 0, 500);
}

#[test]
fn rc_survives_one_percent_loss() {
    rc_over_lossy_link(0, 1, 500);
}

#[test]
fn rc_survives_five_percent_loss() {
    rc_over_lossy_link(1, 5, 400);
}

/// A receive waits on a QP whose peer then dies (`kill`: its process is
/// killed; else its host vanishes: every packet dropped). Returns how long
/// after the death the receive failed.
fn receive_outlives_its_peer(tag: u8, kill: bool, peer_timeout: Duration) -> Option<Duration> {
    let ns = netns_or_skip(tag)?;
    let (rt, dev) = soft_on(IpAddr::V4(ns.host_ip), Some(peer_timeout));
    let (mut peer, qp, _) = start_peer(&ns, "quiet", &rt, &dev);
    let pool = MrPool::new(dev.pd());
    let elapsed = block(&rt, async {
        let pending = qp.recv(buf(&pool, SMALL));
        // (The QP is idle: nothing was sent since the peer's first message.)
        sleep(Duration::from_millis(100)).await;
        if kill {
            peer.0.kill().expect("kill the peer");
        } else if let Err(why) = ns.drop_randomly(100) {
            println!("SKIPPED: cannot make the peer's host vanish: {why}");
            return None;
        }
        let died = Instant::now();
        let (res, _) = timeout(WAIT, pending)
            .await
            .expect("the receive still waits on a dead peer");
        let err = res.expect_err("a receive completed from a dead peer");
        println!(
            "the receive failed {:?} after the peer died: {err}",
            died.elapsed()
        );
        Some(died.elapsed())
    })?;
    // The QP is in ERR: a new receive fails too, at once.
    let (res, _) = block(&rt, timeout(WAIT, qp.recv(buf(&pool, SMALL))))
        .expect("a receive on a failed QP waits");
    assert!(
        res.is_err(),
        "a receive succeeded on a QP whose peer is dead"
    );
    Some(elapsed)
}

#[test]
fn a_receive_fails_at_once_when_the_peer_process_is_killed() {
    let bound = Duration::from_secs(30);
    if let Some(took) = receive_outlives_its_peer(2, true, bound) {
        // The peer's kernel closes the connection: no timeout involved.
        assert!(took < bound / 3, "noticed only after {took:?}");
    }
}

#[test]
fn a_receive_fails_within_the_peer_timeout_when_the_peer_host_vanishes() {
    let bound = Duration::from_secs(2);
    if let Some(took) = receive_outlives_its_peer(3, false, bound) {
        // TCP keepalive probes every second and gives up at the bound.
        assert!(
            took >= bound / 2,
            "noticed after {took:?}, before the bound"
        );
        assert!(took < bound * 4, "noticed only after {took:?}");
    }
}
