//! A peer process for the multi-process tests: the test binary re-executed
//! (possibly through a wrapper such as `ip netns exec`), which announces its
//! listen address on stdout with [`ADDR_PREFIX`].

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::WAIT;

/// What a peer prints before its address.
pub const ADDR_PREFIX: &str = "VERBIO_PEER_ADDR=";

/// A peer process; killed (and reaped) if the test ends early.
pub struct Peer(pub Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Peer {
    /// Waits (bounded by [`WAIT`]) for the peer to exit, and checks that it
    /// succeeded.
    pub fn wait_success(mut self) {
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "peer did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "peer failed: {status}");
    }
}

/// `cmd ... <this test binary> --exact <entry> --nocapture` with `env`
/// set: `cmd` is the program to run (the binary itself, or a wrapper whose
/// arguments are already added); returns the peer and the address it
/// announced.
pub fn spawn_announcing(mut cmd: Command, entry: &str, env: (&str, &str)) -> (Peer, SocketAddr) {
    let mut child = cmd
        .args(["--exact", entry, "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn peer");
    let stdout = child.stdout.take().unwrap();
    let peer = Peer(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may print "test NAME ... " before it on the same line.
            if let Some(pos) = line.find(ADDR_PREFIX) {
                let _ = tx.send(line[pos + ADDR_PREFIX.len()..].trim().parse::<SocketAddr>());
            }
        }
    });
    let addr = rx
        .recv_timeout(WAIT)
        .expect("peer did not announce its address")
        .expect("bad address line");
    (peer, addr)
}
