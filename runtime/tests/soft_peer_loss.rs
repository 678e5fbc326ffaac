//! Soft device: a lost peer is detected and outstanding WRs complete with
//! RETRY_EXC_ERR within the QP's timeout, never hang.
//!
//! The SIGKILL test re-executes this test binary as the peer process
//! (selected by an environment variable) and exchanges endpoints over pipes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;
const PEER_ENV: &str = "VERBIO_SOFT_TEST_PEER";
const TEST_NAME: &str = "sigkilled_peer_gives_retry_exc_err";

fn ep_line(ep: &Endpoint) -> String {
    format!(
        "EP {} {} {}",
        ep.qpn,
        ep.psn,
        ep.addr.to_socket().expect("soft")
    )
}

fn parse_ep(line: &str) -> Option<Endpoint> {
    let mut it = line.strip_prefix("EP ")?.split_whitespace();
    let qpn = it.next()?.parse().ok()?;
    let psn = it.next()?.parse().ok()?;
    let addr: std::net::SocketAddr = it.next()?.parse().ok()?;
    Some(Endpoint {
        provider: ProviderKind::Soft,
        qpn,
        psn,
        lid: 0,
        gid: Gid::default(),
        mtu: Mtu::Mtu4096,
        addr: addr.into(),
    })
}

/// The peer process: one QP with one RECV posted, then waits to be killed.
fn run_peer() {
    let ctx = open_test_context();
    let opts = PairOpts::default();
    let side = make_side(&ctx, &opts);
    let buf = side.buf(64, LW);
    println!("{}", ep_line(&side.qp.endpoint(0).unwrap()));
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let remote = parse_ep(line.trim()).unwrap_or_else(|| panic!("bad endpoint line {line:?}"));
    bring_up(&side.qp, remote, &opts);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { side.qp.post_recv(&[rwr(1, &[buf.sge(0, 64)])]) }.unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    // Wait to be killed (bounded, in case the parent died).
    std::thread::sleep(Duration::from_secs(60));
}

/// Kills the peer process if the test fails early.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sigkilled_peer_gives_retry_exc_err() {
    if std::env::var_os(PEER_ENV).is_some() {
        run_peer();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let child = Command::new(exe)
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        while out.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            if tx.send(line.trim().to_string()).is_err() {
                break;
            }
            line.clear();
        }
    });
    let next = |prefix: &str| loop {
        // libtest may print "test name ... " on the same line first.
        let l = rx.recv_timeout(WAIT).expect("peer output");
        if let Some(i) = l.find(prefix) {
            return l[i..].to_string();
        }
    };
    let remote = parse_ep(&next("EP ")).unwrap();
    let ctx = open_test_context();
    let opts = PairOpts::default(); // timeout 14, retry_cnt 6, rnr_retry 7
    let me = make_side(&ctx, &opts);
    writeln!(stdin, "{}", ep_line(&me.qp.endpoint(0).unwrap())).unwrap();
    bring_up(&me.qp, remote, &opts);
    next("READY");
    let src = me.buf(64, LW);
    // One SEND goes through: the peer is really connected.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        me.qp
            .post_send(&[wr(1, SendOp::Send, &[src.sge(0, 64)], SIG)])
    }
    .unwrap();
    let c = poll_one(&me.scq);
    assert_eq!(c.status, WcStatus::Success);
    // The next one waits on RNR (no RECV left), then the peer dies.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        me.qp
            .post_send(&[wr(2, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        me.qp
            .post_send(&[wr(3, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    child.0.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    let _ = child.0.wait();
    let c = poll_n_within(&me.scq, 2, Duration::from_secs(5));
    let elapsed = killed.elapsed();
    assert_eq!((c[0].wr_id, c[0].status), (2, WcStatus::RetryExcErr));
    assert_eq!((c[1].wr_id, c[1].status), (3, WcStatus::WrFlushErr));
    assert_eq!(me.qp.state(), QpState::Err);
    // Timeout 14 x (retry_cnt 6 + 1) ≈ 470 ms is the bound; a closed
    // connection is noticed much sooner.
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
}

#[test]
fn silent_peer_times_out_with_retry_exc_err() {
    // The remote QP is destroyed: its engine drops our packets, the connection
    // stays up, and only the ACK timer can notice.
    let ctx = open_test_context();
    let opts = PairOpts {
        rts: RtsAttr {
            timeout: 12, // 16.8 ms
            retry_cnt: 3,
            ..RtsAttr::default()
        },
        ..PairOpts::default()
    };
    let (a, b) = connect_pair(&ctx, &ctx, &opts);
    drop(b);
    let src = a.buf(64, LW);
    let start = Instant::now();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    let elapsed = start.elapsed();
    assert_eq!(c.status, WcStatus::RetryExcErr);
    // 4 periods of ~16.8 ms
    assert!(
        elapsed >= Duration::from_millis(60),
        "too early: {elapsed:?}"
    );
    assert!(elapsed < Duration::from_secs(5), "too late: {elapsed:?}");
}

#[test]
fn unreachable_peer_fails_instead_of_hanging() {
    let ctx = open_test_context();
    let opts = PairOpts::default();
    let a = make_side(&ctx, &opts);
    // A port nobody listens on: bind one, then close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut ep = a.qp.endpoint(0).unwrap();
    ep.addr = port.into();
    ep.qpn = 0x42;
    bring_up(&a.qp, ep, &opts);
    let src = a.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::RetryExcErr);
}
