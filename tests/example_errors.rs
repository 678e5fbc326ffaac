//! The examples fail promptly and say why on what a new user first tries
//! (issue 33): a missing input file, a message size above the buffer
//! pool's classes, no server listening yet, a server of another kind. Uses the example binaries
//! `cargo test` builds; skipped (with the reason) when they are not there.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::example_bin::example;

/// Far below the waits these runs used to sit in (30 s, 60 s, forever),
/// far above what they take on a loaded machine.
const PROMPT: Duration = Duration::from_secs(20);

/// Runs `exe args`, killing it after [`PROMPT`]; its exit success and
/// stderr.
fn run(exe: &Path, args: &[&str]) -> (bool, String) {
    let mut child = Command::new(exe)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the example");
    let deadline = Instant::now() + PROMPT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the example") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{} {args:?} still running after {PROMPT:?}", exe.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut err)
        .expect("the example's stderr");
    (status.success(), err)
}

#[test]
fn file_transfer_fails_at_once_on_a_missing_input() {
    let Some(exe) = example("file_transfer_missing_input", "file_transfer") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("verbio-ft-missing-{}", std::process::id()));
    let missing = dir.join("no-such-input");
    let out = dir.join("out");
    let (missing, out) = (missing.to_str().unwrap(), out.to_str().unwrap());
    for args in [vec![missing, out], vec!["--client", "127.0.0.1:9", missing]] {
        let (ok, err) = run(&exe, &args);
        assert!(!ok, "file_transfer {args:?} succeeded");
        assert!(
            err.contains("no-such-input") && err.contains("No such file"),
            "file_transfer {args:?}: {err}"
        );
    }
    assert!(!Path::new(out).exists(), "an output was created");
}

#[test]
fn pingpong_runs_messages_above_the_pool_classes() {
    let Some(exe) = example("pingpong_above_the_pool_classes", "pingpong") else {
        return;
    };
    // 2 MiB: above the pool's largest class (1 MiB), which used to leave
    // the one-process run waiting forever.
    let (ok, err) = run(&exe, &["--size", "2097152", "--iters", "2"]);
    assert!(ok, "pingpong --size 2097152: {err}");
}

#[test]
fn rc_pingpong_says_it_waits_for_the_server_and_gives_up() {
    let Some(exe) = example("rc_pingpong_waits_for_the_server", "rc_pingpong") else {
        return;
    };
    // A port nobody listens on (bound, then freed).
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let (ok, err) = run(&exe, &["--timeout", "1", "-p", &port, "127.0.0.1"]);
    assert!(!ok, "rc_pingpong without a server succeeded");
    assert!(
        err.contains("waiting for the server") && err.contains("no server at"),
        "rc_pingpong: {err}"
    );
}

#[test]
fn rpc_echo_client_says_what_it_expected_from_a_stranger() {
    let Some(exe) = example("rpc_echo_client_meets_a_stranger", "rpc_echo") else {
        return;
    };
    // Not an rpc_echo server: one connection gets nothing (held open), the
    // next a line of something else.
    let stranger = TcpListener::bind("127.0.0.1:0").expect("a listener");
    let addr = stranger.local_addr().expect("its address").to_string();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for (i, conn) in stranger.incoming().take(2).enumerate() {
            let Ok(mut conn) = conn else { continue };
            if i == 1 {
                let _ = conn.write_all(b"SSH-2.0-OpenSSH_9.2\r\n");
            }
            conns.push(conn);
        }
        // Held until the clients are gone.
        std::thread::sleep(PROMPT);
        drop(conns);
    });
    for expect in ["no greeting arrived", "it greeted with"] {
        let (ok, err) = run(&exe, &["--client", &addr, "--calls", "1"]);
        assert!(!ok, "rpc_echo --client at a stranger succeeded");
        assert!(
            err.contains(expect) && err.contains("rpc_echo --server"),
            "rpc_echo --client: {err}"
        );
    }
    drop(held); // detached: it ends with the test process
}
