//! The examples fail promptly and say why on what a new user first tries
//! (issue 33): a missing input file, a message size above the buffer
//! pool's classes, no server listening yet, a server of another kind; their
//! errors carry the whole cause chain (a port in use, a refused connect, a
//! device that does not exist and the ones that do); an empty
//! `VERBIO_DEVICE` means none; `--iters 0` and a huge preload are refused;
//! logs to a pipe have no colour codes; the benchmark examples take a
//! `--timeout` and refuse a bad one. Uses the example binaries `cargo
//! test` builds; skipped (with the reason) when they are not there.

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
    run_with(exe, args, &[])
}

/// [`run`] with environment variables `env` set (`RUST_LOG=warn` unless
/// they set it, `VERBIO_DEVICE` removed unless they set it).
fn run_with(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("RUST_LOG", "warn")
        .env_remove("VERBIO_DEVICE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
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
        let (ok, err) = run(&exe, &["--client", &addr, "--calls", "1", "--timeout", "1"]);
        assert!(!ok, "rpc_echo --client at a stranger succeeded");
        assert!(
            err.contains(expect) && err.contains("rpc_echo --server") && err.contains("within 1 s"),
            "rpc_echo --client: {err}"
        );
    }
    drop(held); // detached: it ends with the test process
}

/// A TCP port nobody listens on (bound, then freed).
fn free_port() -> String {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string()
}

#[test]
fn pingpong_says_the_port_is_in_use() {
    let Some(exe) = example("pingpong_port_in_use", "pingpong") else {
        return;
    };
    let taken = TcpListener::bind("127.0.0.1:0").expect("a listener");
    let addr = taken.local_addr().expect("its address").to_string();
    let (ok, err) = run(&exe, &["--server", &addr]);
    assert!(!ok, "pingpong --server on a port in use succeeded");
    // The cause, not only "I/O error while binding the listener".
    assert!(
        err.contains("binding the listener") && err.contains("in use"),
        "pingpong --server {addr}: {err}"
    );
}

#[test]
fn file_transfer_says_why_the_connect_failed() {
    let Some(exe) = example("file_transfer_refused", "file_transfer") else {
        return;
    };
    let input = std::env::current_exe().expect("this test's binary");
    let to = format!("127.0.0.1:{}", free_port());
    let (ok, err) = run(&exe, &["--client", &to, input.to_str().unwrap()]);
    assert!(!ok, "file_transfer --client {to} succeeded");
    // "connect: connection setup" and why.
    assert!(
        err.contains("connect") && err.to_lowercase().contains("refused"),
        "file_transfer --client {to}: {err}"
    );
}

#[test]
fn a_device_that_does_not_exist_is_named_alone_with_the_ones_that_do() {
    for (test, name, args) in [
        ("pingpong_no_such_device", "pingpong", vec!["--iters", "1"]),
        ("lab_client_no_such_device", "lab_client", vec![]),
        ("rpc_kv_no_such_device", "rpc_kv", vec!["--seconds", "1"]),
    ] {
        let Some(exe) = example(test, name) else {
            return;
        };
        let mut args = args;
        args.extend(["-d", "nonexistent"]);
        let (ok, err) = run(&exe, &args);
        assert!(!ok, "{name} -d nonexistent succeeded");
        assert!(
            err.contains("no RDMA device named \"nonexistent\"; ") && err.contains("soft0"),
            "{name} -d nonexistent: {err}"
        );
        // rpc_kv's workers say why they did not start.
        assert!(!err.contains("a worker failed to start"), "{name}: {err}");
    }
}

#[test]
fn an_empty_verbio_device_means_none() {
    let Some(exe) = example("pingpong_empty_verbio_device", "pingpong") else {
        return;
    };
    let (ok, err) = run_with(&exe, &["--iters", "3"], &[("VERBIO_DEVICE", "")]);
    assert!(ok, "pingpong with VERBIO_DEVICE=\"\": {err}");
}

#[test]
fn pingpong_refuses_zero_iterations() {
    let Some(exe) = example("pingpong_zero_iterations", "pingpong") else {
        return;
    };
    let (ok, err) = run(&exe, &["--iters", "0"]);
    assert!(!ok, "pingpong --iters 0 succeeded");
    assert!(
        err.contains("--iters") && err.contains("at least 1"),
        "{err}"
    );
}

#[test]
fn rpc_kv_refuses_a_preload_of_gigabytes() {
    let Some(exe) = example("rpc_kv_huge_preload", "rpc_kv") else {
        return;
    };
    // 100,000 keys of 100,000 B: 10 GB, refused before any allocation.
    let (ok, err) = run(&exe, &["--value-size", "100000"]);
    assert!(!ok, "rpc_kv --value-size 100000 succeeded");
    assert!(
        err.contains("9536 MiB") && err.contains("--max-preload-mib"),
        "rpc_kv --value-size 100000: {err}"
    );
}

#[test]
fn logs_to_a_pipe_have_no_colour_codes() {
    let Some(exe) = example("logs_to_a_pipe", "pingpong") else {
        return;
    };
    let (ok, err) = run_with(&exe, &["--iters", "2"], &[("RUST_LOG", "info")]);
    assert!(ok, "pingpong: {err}");
    assert!(
        err.contains("opened the RDMA device"),
        "no log lines: {err}"
    );
    assert!(
        !err.contains('\x1b'),
        "ANSI escape codes in a piped log: {err:?}"
    );
}

/// A listener that accepts TCP connections and never says a word: the
/// peer of a client whose server hangs. Held connections live until the
/// test process ends.
fn silent_server() -> String {
    let silent = TcpListener::bind("127.0.0.1:0").expect("a listener");
    let addr = silent.local_addr().expect("its address").to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming() {
            held.extend(conn.ok());
        }
    });
    addr
}

#[test]
fn clients_give_up_on_a_silent_server_within_their_timeout() {
    let addr = silent_server();
    let input = std::env::current_exe().expect("this test's binary");
    let input = input.to_str().unwrap();
    for (test, name, args) in [
        (
            "pingpong_silent_server",
            "pingpong",
            vec!["--client", &addr, "--timeout", "1"],
        ),
        (
            "lab_client_silent_server",
            "lab_client",
            vec![&addr, "--timeout", "1"],
        ),
        (
            "file_transfer_silent_server",
            "file_transfer",
            vec!["--client", &addr, "--timeout", "1", input],
        ),
    ] {
        let Some(exe) = example(test, name) else {
            return;
        };
        let started = Instant::now();
        let (ok, err) = run(&exe, &args);
        assert!(!ok, "{name} {args:?} against a silent server succeeded");
        let want = format!("no answer from the server at {addr} within 1 s while connecting");
        assert!(err.contains(&want), "{name} {args:?}: {err}");
        // Bounded by the flag, not by the old defaults (10 s to 30 s);
        // generous for a loaded machine.
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{name} took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn thread_per_core_gives_up_at_its_timeout() {
    let Some(exe) = example("thread_per_core_timeout", "thread_per_core") else {
        return;
    };
    // Far more round trips than a second holds.
    let (ok, err) = run(&exe, &["--timeout", "1", "--rounds", "100000000"]);
    assert!(!ok, "thread_per_core --timeout 1 finished 4e8 round trips");
    assert!(
        err.contains("no result from the workers and clients within 1 s"),
        "thread_per_core: {err}"
    );
}

#[test]
fn pool_echo_gives_up_on_a_silent_server_within_its_timeout() {
    let Some(exe) = example("pool_echo_silent_server", "pool_echo") else {
        return;
    };
    let addr = silent_server();
    let started = Instant::now();
    let (ok, err) = run(
        &exe,
        &[
            "--server",
            &addr,
            "--timeout",
            "1",
            "--sizes",
            "64",
            "--windows",
            "1",
        ],
    );
    assert!(!ok, "pool_echo against a silent server succeeded");
    let want =
        format!("no answer from the server at {addr} within 1 s while connecting the local client");
    assert!(err.contains(&want), "pool_echo: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "pool_echo took {:?}",
        started.elapsed()
    );
}

#[test]
fn pool_echo_runs_against_a_server_in_another_process() {
    let Some(exe) = example("pool_echo_two_processes", "pool_echo") else {
        return;
    };
    let port = free_port();
    let at = format!("127.0.0.1:{port}");
    let mut server = Command::new(&exe)
        .args(["--serve", &at, "--sizes", "64", "--timeout", "15"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the echo server");
    // The clients retry nothing: wait until the server listens.
    let deadline = Instant::now() + PROMPT;
    while std::net::TcpStream::connect(&at).is_err() {
        assert!(Instant::now() < deadline, "the echo server never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new(&exe)
        .args([
            "--server",
            &at,
            "--sizes",
            "64",
            "--windows",
            "1",
            "--secs",
            "0.1",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("the clients");
    let status = server.wait().expect("the echo server ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "the echo server failed");
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("64 "))
        .unwrap_or_else(|| panic!("no row: {stdout}"))
        .split_whitespace()
        .collect();
    for rate in &row[2..4] {
        assert!(rate.parse::<f64>().expect("a rate") > 0.0, "{stdout}");
    }
}

/// rpc_kv gives up at its --timeout: far less than its --seconds of load.
#[test]
fn rpc_kv_gives_up_at_its_timeout() {
    let Some(exe) = example("rpc_kv_timeout", "rpc_kv") else {
        return;
    };
    let started = Instant::now();
    let (ok, err) = run(
        &exe,
        &["--timeout", "1", "--seconds", "60", "--keys", "1000"],
    );
    assert!(!ok, "rpc_kv --timeout 1 finished 60 s of load");
    assert!(
        err.contains(
            "no result from the workers and clients within 1 s (--timeout sets the bound)"
        ),
        "rpc_kv: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
}

/// pool_echo, cm_setup, agent_stream_bw, srq_throughput and rpc_kv take
/// `--timeout SECONDS`: their help lists it, and 0 or a word is refused
/// with what is wrong, before anything starts.
#[test]
fn benchmark_examples_take_a_timeout_and_refuse_a_bad_one() {
    for name in [
        "pool_echo",
        "cm_setup",
        "agent_stream_bw",
        "srq_throughput",
        "rpc_kv",
    ] {
        let Some(exe) = example(&format!("{name}_timeout_flag"), name) else {
            continue;
        };
        let help = Command::new(&exe)
            .arg("--help")
            .env("RUST_LOG", "warn")
            .output()
            .expect("the example's help");
        let help = String::from_utf8_lossy(&help.stdout);
        assert!(
            help.contains("--timeout"),
            "{name} --help does not list --timeout:\n{help}"
        );
        for bad in ["0", "soon"] {
            let (ok, err) = run(&exe, &["--timeout", bad]);
            assert!(!ok, "{name} --timeout {bad} was taken");
            assert!(
                err.contains("--timeout")
                    && (err.contains("at least 1 second") || err.contains("invalid digit")),
                "{name} --timeout {bad} said: {err}"
            );
        }
    }
}

#[test]
fn srq_throughput_gives_up_at_its_timeout() {
    let Some(exe) = example("srq_throughput_timeout", "srq_throughput") else {
        return;
    };
    // Far more messages than a second holds (64 connections x 1e8).
    let (ok, err) = run(
        &exe,
        &["--timeout", "1", "--msgs", "100000000", "--rounds", "1"],
    );
    assert!(!ok, "srq_throughput --timeout 1 moved 6.4e9 messages");
    assert!(
        err.contains("within 1 s while moving round 0's messages")
            && err.contains("--timeout sets the bound"),
        "srq_throughput: {err}"
    );
}
