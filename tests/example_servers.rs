//! The example servers survive what took them down before (issue 30): the
//! rping server a malformed connect request (address family 0, a QPN of
//! 2^24), idle connections and a requester that never confirms; the
//! pingpong server running out of file descriptors (`EMFILE`, its limit
//! lowered with `prlimit`). Each then serves a real client of its own
//! example. Uses the example binaries `cargo test` builds; skipped (with the
//! reason) when they are not there (`cargo test --test example_servers`
//! alone does not build them: run `cargo build --examples` first).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::example_bin::example;
use common::WAIT;

/// Kills the server if the test ends early.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads the server's stdout until a line contains `marker`; returns what
/// follows it.
fn wait_line(out: &mut BufReader<ChildStdout>, marker: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("the server's output");
        assert!(n > 0, "the server ended before printing {marker:?}");
        if let Some(at) = line.find(marker) {
            return line[at + marker.len()..].trim().to_string();
        }
    }
}

/// A soft CM connect request with the given engine address family and QPN.
fn cm_request(family: u8, qpn: u32) -> Vec<u8> {
    let mut body = vec![16, 16, 0];
    body.extend_from_slice(&qpn.to_be_bytes());
    body.extend_from_slice(&[0, 0, 0, 0x42, 0, 0]); // PSN, LID
    body.extend_from_slice(&[0; 16]); // GID
    body.extend_from_slice(&[5, family]); // MTU 4096, family
    if family == 4 {
        body.extend_from_slice(&[127, 0, 0, 1, 0x12, 0xb7]);
    }
    let mut f = b"vCM1\x01\x00".to_vec();
    f.extend_from_slice(&(body.len() as u16).to_be_bytes());
    f.extend_from_slice(&body);
    f
}

fn answer(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn the_rping_server_survives_bad_requests_and_serves_a_client() {
    let Some(rping) = example("the_rping_server_survives_bad_requests", "rping") else {
        return;
    };
    let mut server = Server(
        Command::new(&rping)
            .args([
                "-s",
                "-a",
                "127.0.0.1",
                "-p",
                "0",
                "-C",
                "3",
                "--timeout",
                "60",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the rping server"),
    );
    let mut out = BufReader::new(server.0.stdout.take().unwrap());
    let addr: SocketAddr = wait_line(&mut out, "listening on").parse().unwrap();
    // Idle connections, held through the whole test.
    let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // What made it exit before: address family 0, a QPN of 2^24. Both are
    // rejected (reasons 12 and 5).
    for (family, qpn, reason) in [(0, 7, 12u8), (4, 1 << 24, 5)] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&cm_request(family, qpn)).unwrap();
        let got = answer(s);
        assert_eq!(got.get(..5), Some(&b"vCM1\x03"[..]), "a reject: {got:?}");
        assert_eq!(got.get(9), Some(&reason), "reason: {got:?}");
    }
    // A valid request whose requester reads the accept and never confirms.
    let mut stalled = TcpStream::connect(addr).unwrap();
    stalled.write_all(&cm_request(4, 7)).unwrap();
    let client = Command::new(&rping)
        .args([
            "-c",
            "-a",
            "127.0.0.1",
            "-p",
            &addr.port().to_string(),
            "-C",
            "3",
        ])
        .args(["--timeout", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .output()
        .expect("the rping client");
    assert!(client.status.success(), "the rping client: {client:?}");
    // The server ends after the client's three pings.
    assert_eq!(
        wait_line(&mut out, "rping server: 3 pings"),
        "of 64 B, data checked"
    );
    let status = server.0.wait().unwrap();
    assert!(status.success(), "the rping server: {status}");
    drop((idle, stalled));
}

/// The server's open descriptors.
fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the server's /proc entry")
        .count() as u64
}

#[test]
fn the_pingpong_server_survives_emfile_and_serves_a_client() {
    let Some(pingpong) = example("the_pingpong_server_survives_emfile", "pingpong") else {
        return;
    };
    let mut server = Server(
        Command::new(&pingpong)
            .args(["--server", "127.0.0.1:0"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the pingpong server"),
    );
    let mut out = BufReader::new(server.0.stdout.take().unwrap());
    let addr: SocketAddr = wait_line(&mut out, "listening on").parse().unwrap();
    let pid = server.0.id();
    // A few descriptors over what it holds now: the idle connections below
    // exhaust them.
    let limit = open_fds(pid) + 4;
    let lowered = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: prlimit reads `lowered`, writes nothing (old limit: null).
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lowered,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let idle: Vec<TcpStream> = (0..12).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Until the server has hit the limit (it then holds `limit` descriptors).
    let deadline = Instant::now() + WAIT;
    while open_fds(pid) < limit {
        if let Some(status) = server.0.try_wait().unwrap() {
            panic!("the server exited at its descriptor limit: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "the server never reached its limit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        server.0.try_wait().unwrap().is_none(),
        "the server exited at its descriptor limit"
    );
    // Freed: the idle handshakes fail, their descriptors close, and the
    // backed-off accept takes the client.
    drop(idle);
    let client = Command::new(&pingpong)
        .args(["--client", &addr.to_string(), "--iters", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .output()
        .expect("the pingpong client");
    assert!(client.status.success(), "the pingpong client: {client:?}");
    assert_eq!(wait_line(&mut out, "echoed"), "200 messages");
    assert!(
        server.0.try_wait().unwrap().is_none(),
        "the server keeps serving"
    );
    let _ = server.0.kill();
    let mut log = String::new();
    server
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(
        log.contains("accept failed for lack of resources"),
        "the server met EMFILE: {log}"
    );
}
