//! Every example with a client/server mode, between two "hosts" (issue 31
//! item 2): the server runs inside a network namespace joined to this one
//! by a veth pair, on the namespace's address, and the client runs here
//! against it, each with a software device of its own (the server's engine
//! on its address, the client's where the example puts it). Each must
//! finish its run and report success: `pingpong`, `file_transfer` (the
//! file arrives byte for byte), `rpc_echo`, `lab_server`/`lab_client`,
//! `pool_echo --serve`/`--server`, `rping` (over the connection manager).
//!
//! Needs root and iproute2; where either is missing, or the examples are
//! not built (`cargo build --examples`; `cargo test` builds them), each test
//! prints `SKIPPED: <reason>` and returns. Soft device only.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::example_bin::example;
use common::netns::Netns;
use common::*;

/// Bound of a server's start and of a client's run.
const RUN: Duration = Duration::from_secs(60);

/// A server process inside the namespace; killed (and reaped) on drop.
struct Server {
    child: Child,
    /// Its stdout, line by line.
    lines: mpsc::Receiver<String>,
    /// What it printed so far.
    seen: Vec<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `exe ARGS` inside `ns` and waits (bounded) for a line
    /// containing `ready`.
    fn start(ns: &Netns, exe: &PathBuf, args: &[&str], ready: &str) -> Server {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns.name])
            .arg(exe)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the server in the namespace");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child,
            lines,
            seen: Vec::new(),
        };
        server.wait_for(ready);
        server
    }

    /// Waits (bounded) for a line containing `text`.
    fn wait_for(&mut self, text: &str) {
        if self.seen.iter().any(|l| l.contains(text)) {
            return;
        }
        loop {
            match self.lines.recv_timeout(RUN) {
                Ok(line) => {
                    let hit = line.contains(text);
                    self.seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!(
                    "the server never printed {text:?}; it printed {:?} (exit: {:?})",
                    self.seen,
                    self.child.try_wait()
                ),
            }
        }
    }

    /// Waits (bounded) for the server to exit, successfully.
    fn exits_ok(mut self) {
        let deadline = std::time::Instant::now() + RUN;
        loop {
            if let Some(status) = self.child.try_wait().expect("server status") {
                assert!(
                    status.success(),
                    "server: {status}; printed {:?}",
                    self.seen
                );
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the server did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs `exe ARGS` here, bounded; its output, checked for success.
fn client(exe: &PathBuf, args: &[&str]) -> Output {
    let out = Command::new("timeout")
        .arg(RUN.as_secs().to_string())
        .arg(exe)
        .args(args)
        .output()
        .expect("run the client");
    assert!(
        out.status.success(),
        "{} {args:?}: {}\nstdout: {}\nstderr: {}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The namespace for test `tag`, or `None` (skipped, with the reason).
fn netns_or_skip(tag: u8) -> Option<Netns> {
    if let Some(dev) = test_device() {
        println!("SKIPPED: soft-device test ({TEST_DEVICE_ENV}={dev})");
        return None;
    }
    match Netns::create("examples", 237, tag) {
        Ok(ns) => Some(ns),
        Err(why) => {
            println!("SKIPPED: no network namespace for a second host: {why}");
            None
        }
    }
}

/// The example `name` and a namespace, or `None` (skipped).
fn setup(test: &str, name: &str, tag: u8) -> Option<(PathBuf, Netns)> {
    let exe = example(test, name)?;
    Some((exe, netns_or_skip(tag)?))
}

#[test]
fn pingpong_across_namespaces() {
    let Some((exe, ns)) = setup("pingpong_across_namespaces", "pingpong", 0) else {
        return;
    };
    let at = format!("{}:18515", ns.peer_ip);
    let size = ["--size", "256"];
    let mut args = vec!["--server", at.as_str()];
    args.extend(size);
    let server = Server::start(&ns, &exe, &args, "server listening on");
    let mut args = vec!["--client", at.as_str(), "--iters", "300"];
    args.extend(size);
    let out = client(&exe, &args);
    assert!(!out.stdout.is_empty(), "the client reports its run");
    drop(server);
}

#[test]
fn file_transfer_across_namespaces() {
    let Some((exe, ns)) = setup("file_transfer_across_namespaces", "file_transfer", 1) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("verbio-ft-netns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (input, output) = (dir.join("in"), dir.join("out"));
    // Several chunks and a ragged end.
    let data = pattern(3 * 65536 + 1234, 17);
    std::fs::write(&input, &data).unwrap();
    let at = format!("{}:18516", ns.peer_ip);
    let server = Server::start(
        &ns,
        &exe,
        &["--server", &at, output.to_str().unwrap()],
        "server listening on",
    );
    client(&exe, &["--client", &at, input.to_str().unwrap()]);
    server.exits_ok();
    let got = std::fs::read(&output).expect("the server wrote the file");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(got.len(), data.len());
    assert!(got == data, "the file arrived byte for byte");
}

#[test]
fn rpc_echo_across_namespaces() {
    let Some((exe, ns)) = setup("rpc_echo_across_namespaces", "rpc_echo", 2) else {
        return;
    };
    let at = format!("{}:7100", ns.peer_ip);
    let server = Server::start(&ns, &exe, &["--server", &at], "serving RPC echo at");
    let out = client(&exe, &["--client", &at, "--calls", "500", "--size", "64"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rpc/ud, 1 in flight"), "{text}");
    drop(server);
}

#[test]
fn lab_server_and_client_across_namespaces() {
    let test = "lab_server_and_client_across_namespaces";
    let Some(client_exe) = example(test, "lab_client") else {
        return;
    };
    let Some((server_exe, ns)) = setup(test, "lab_server", 3) else {
        return;
    };
    let at = format!("{}:18520", ns.peer_ip);
    let mut server = Server::start(&ns, &server_exe, &[&at], "lab server listening on");
    client(&client_exe, &[&at]);
    server.wait_for("lab server: all checks passed");
    server.exits_ok();
}

#[test]
fn pool_echo_across_namespaces() {
    let Some((exe, ns)) = setup("pool_echo_across_namespaces", "pool_echo", 4) else {
        return;
    };
    let at = format!("{}:18530", ns.peer_ip);
    let point = ["--sizes", "64", "--windows", "1", "--secs", "1"];
    let mut args = vec!["--serve", at.as_str()];
    args.extend(point);
    let server = Server::start(&ns, &exe, &args, "echo server listening on");
    let mut args = vec!["--server", at.as_str()];
    args.extend(point);
    let out = client(&exe, &args);
    assert!(!out.stdout.is_empty(), "the clients report their points");
    server.exits_ok();
}

#[test]
fn rping_across_namespaces() {
    let Some((exe, ns)) = setup("rping_across_namespaces", "rping", 5) else {
        return;
    };
    let ip = ns.peer_ip.to_string();
    let pings = ["-C", "50", "-S", "1024", "--timeout", "50"];
    let mut args = vec!["-s", "-a", ip.as_str()];
    args.extend(pings);
    let server = Server::start(&ns, &exe, &args, "rping server: listening on");
    let mut args = vec!["-c", "-a", ip.as_str()];
    args.extend(pings);
    let out = client(&exe, &args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("rping client: 50 pings of 1024 B, data checked"),
        "{text}"
    );
    server.exits_ok();
}

/// rdma-core's `ibv_*_pingpong` pairs (`rc_pingpong`, `srq_pingpong`,
/// `ud_pingpong`): the server in the namespace, the client here; both
/// print their summary, the data checked.
fn ibv_pingpong_across_namespaces(test: &str, name: &str, tag: u8, port: u16, extra: &[&str]) {
    let Some((exe, ns)) = setup(test, name, tag) else {
        return;
    };
    let port = port.to_string();
    let mut args = vec!["-d", "soft0", "-c", "-n", "100", "-s", "512"];
    args.extend(["-p", port.as_str(), "--timeout", "50"]);
    args.extend(extra);
    let mut server = Server::start(&ns, &exe, &args, "local address");
    let ip = ns.peer_ip.to_string();
    let mut client_args = args.clone();
    client_args.push(ip.as_str());
    let out = client(&exe, &client_args);
    let text = String::from_utf8_lossy(&out.stdout);
    let done = format!("{name}: ");
    assert!(text.contains(&done), "{text}");
    server.wait_for(&done);
    server.exits_ok();
}

#[test]
fn rc_pingpong_across_namespaces() {
    ibv_pingpong_across_namespaces(
        "rc_pingpong_across_namespaces",
        "rc_pingpong",
        6,
        18540,
        &[],
    );
}

#[test]
fn srq_pingpong_across_namespaces() {
    ibv_pingpong_across_namespaces(
        "srq_pingpong_across_namespaces",
        "srq_pingpong",
        7,
        18541,
        &["-q", "4"],
    );
}

#[test]
fn ud_pingpong_across_namespaces() {
    ibv_pingpong_across_namespaces(
        "ud_pingpong_across_namespaces",
        "ud_pingpong",
        8,
        18542,
        &[],
    );
}
