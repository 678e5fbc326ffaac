//! Runs verbio-perf's server and client as two processes on the software
//! device, for every test and API, and checks the JSON they print.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_verbio-perf");

/// Starts `verbio-perf ARGS -p 0` as the server; returns it and its port.
fn server(args: &[&str]) -> (std::process::Child, u16) {
    let (child, port, _) = server_with_log(args);
    (child, port)
}

/// [`server`], and the server's stderr lines after its address.
fn server_with_log(args: &[&str]) -> (std::process::Child, u16, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(BIN)
        .args(args)
        .args(["-p", "0", "-d", "soft0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the server");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut lines = BufReader::new(stderr).lines();
    let port = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .expect("readable stderr");
        if let Some(addr) = line.split("listening on ").nth(1) {
            let port = addr
                .split_whitespace()
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .expect("a port");
            break port;
        }
    };
    // Keep draining the server's stderr so it never blocks on a full pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in lines.map_while(|l| l.ok()) {
            let _ = tx.send(line);
        }
    });
    (child, port, rx)
}

/// Runs one client against a fresh server; returns the client's JSON.
fn run(server_args: &[&str], client_args: &[&str]) -> serde_json::Value {
    let (mut srv, port) = server(server_args);
    let port = port.to_string();
    let out = Command::new(BIN)
        .args(client_args)
        .args(["127.0.0.1", "-p", &port, "-d", "soft0", "--json"])
        .output()
        .expect("run the client");
    let status = srv.wait().expect("the server ends");
    assert!(
        out.status.success(),
        "client {client_args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "server {server_args:?} failed");
    serde_json::from_slice(&out.stdout).expect("the client prints JSON")
}

fn check(v: &serde_json::Value, test: &str, sizes: &[u64]) {
    assert_eq!(v["test"], test);
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), sizes.len(), "{v}");
    for (row, &size) in rows.iter().zip(sizes) {
        assert_eq!(row["bytes"], size, "{v}");
        assert!(row["iterations"].as_u64().expect("iterations") >= 5, "{v}");
        let figure = if test.ends_with("_lat") {
            row["t_typical"].as_f64()
        } else {
            row["bw_avg_mbps"].as_f64()
        };
        assert!(figure.expect("a figure") > 0.0, "{v}");
    }
}

#[test]
fn every_test_on_every_api() {
    let tests = [
        "write_bw",
        "read_bw",
        "send_bw",
        "atomic_bw",
        "write_lat",
        "read_lat",
        "send_lat",
        "atomic_lat",
    ];
    for api in ["verbs", "raw", "rdma"] {
        for test in tests {
            let atomic = test.starts_with("atomic");
            let mut client = vec![test, "--api", api, "-n", "10", "-t", "4"];
            if !atomic {
                client.extend(["-s", "100"]);
            }
            let v = run(&[test, "--api", api], &client);
            check(&v, test, &[if atomic { 8 } else { 100 }]);
            assert_eq!(v["api"], api);
        }
    }
}

#[test]
fn several_qps_a_duration_and_tcp() {
    let v = run(
        &["write_bw"],
        &["write_bw", "-q", "2", "-t", "4", "-s", "256", "-n", "10"],
    );
    check(&v, "write_bw", &[256]);
    assert_eq!(v["qps"], 2);
    assert_eq!(v["results"][0]["iterations"], 20);
    let v = run(
        &["send_bw", "--api", "raw"],
        &["send_bw", "--api", "raw", "-D", "1", "-s", "64"],
    );
    check(&v, "send_bw", &[64]);
    let v = run(
        &["send_lat", "--transport", "tcp"],
        &["send_lat", "--transport", "tcp", "-n", "10"],
    );
    check(&v, "send_lat", &[2]);
    assert_eq!(v["transport"], "tcp");
    // TCP receives into a ring sized for the run's largest message, and
    // send_bw sends from a window of buffers, as the verbs path (more
    // messages than buffers: each is used again).
    let v = run(
        &["send_lat", "--transport", "tcp"],
        &[
            "send_lat",
            "--transport",
            "tcp",
            "-n",
            "20",
            "--sizes",
            "64,64K",
        ],
    );
    check(&v, "send_lat", &[64, 65536]);
    let v = run(
        &["send_bw", "--transport", "tcp"],
        &[
            "send_bw",
            "--transport",
            "tcp",
            "-n",
            "40",
            "-t",
            "4",
            "--sizes",
            "64,64K",
        ],
    );
    check(&v, "send_bw", &[64, 65536]);
    let v = run(
        &["send_lat", "-c", "UD"],
        &["send_lat", "-c", "UD", "-n", "50", "-s", "1000"],
    );
    check(&v, "send_lat", &[1000]);
    assert_eq!(v["connection"], "ud");
    // Up to 64 bytes the UD loop sends INLINE (its own path in the loop).
    let v = run(
        &["send_lat", "-c", "UD"],
        &["send_lat", "-c", "UD", "-n", "50", "-s", "64"],
    );
    check(&v, "send_lat", &[64]);
    assert_eq!(v["connection"], "ud");
}

#[test]
fn rpc_calls_of_one_packet_and_of_many() {
    // 100 B fits one packet; 10000 B and 100 KiB take several.
    let v = run(
        &["send_lat", "--api", "rpc"],
        &[
            "send_lat",
            "--api",
            "rpc",
            "-n",
            "20",
            "--sizes",
            "100,10000",
        ],
    );
    check(&v, "send_lat", &[100, 10000]);
    assert_eq!((&v["api"], &v["connection"]), (&"rpc".into(), &"ud".into()));
    // A window of 24: three sessions of 8 slots at 64 B (one at 100 KiB).
    let v = run(
        &["send_bw", "--api", "rpc"],
        &[
            "send_bw", "--api", "rpc", "-n", "30", "-t", "24", "--sizes", "64,100K",
        ],
    );
    check(&v, "send_bw", &[64, 100 << 10]);
    assert_eq!(v["results"][0]["iterations"], 30);
    assert_eq!(v["results"][1]["iterations"], 30);
    // A timed run of a fraction of a second still runs its 5 iterations.
    let v = run(
        &["send_lat", "--api", "rpc"],
        &["send_lat", "--api", "rpc", "-D", "0.001", "-s", "64"],
    );
    check(&v, "send_lat", &[64]);
}

#[test]
fn mismatched_sides_fail_with_a_reason() {
    let (mut srv, port) = server(&["send_bw", "--api", "raw"]);
    let out = Command::new(BIN)
        .args([
            "send_lat",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-d",
            "soft0",
        ])
        .output()
        .expect("run the client");
    let _ = srv.wait();
    assert!(!out.status.success());
}

#[test]
fn unsupported_combinations_exit_with_usage_errors() {
    let out = Command::new(BIN)
        .args(["send_bw", "--api", "rdma", "-q", "2"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api rdma runs one connection"));
    let out = Command::new(BIN)
        .args(["send_lat", "--api", "rpc", "-s", "17M"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api rpc carries messages up to"));
}

/// Logs to a pipe are plain text: no ANSI colour codes (issue 33).
#[test]
fn logs_to_a_pipe_have_no_colour_codes() {
    let mut child = Command::new(BIN)
        .args(["write_lat", "-p", "0", "-d", "soft0"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the server");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut seen = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.expect("readable stderr");
        let done = line.contains("listening on ");
        seen.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        seen.iter().any(|l| l.contains("INFO")),
        "no log line before the address: {seen:?}"
    );
    assert!(
        !seen.iter().any(|l| l.contains('\x1b')),
        "ANSI escape codes in a piped log: {seen:?}"
    );
}

/// perftest's output flags on a real run: `-N` prints the peak as 0.00,
/// `--out_json_file` writes the JSON document while the table still goes
/// to stdout, `-F` and `--report-both` (without `-b`) change nothing, and `-w` above the
/// measured bandwidth makes the client fail with the figure and the limit.
#[test]
fn perftest_output_flags_apply_to_a_run() {
    let json = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("out-json-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let flags = [
        "write_bw",
        "-s",
        "4K",
        "-n",
        "50",
        "-F",
        "-N",
        "--report-both",
    ];
    let (mut srv, port) = server(&flags);
    let out = Command::new(BIN)
        .args(flags)
        .args(["127.0.0.1", "-p", &port.to_string(), "-d", "soft0"])
        .args(["-w", "1000000000", "--out_json_file"])
        .arg(&json)
        .output()
        .expect("run the client");
    assert!(srv.wait().expect("the server ends").success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("bandwidth below the -w limit"), "{stderr}");
    assert!(stderr.contains("at 4096 bytes"), "{stderr}");
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("4096 "))
        .unwrap_or_else(|| panic!("no table row: {stdout}"))
        .split_whitespace()
        .collect();
    assert_eq!(row[2], "0.00", "-N prints no peak: {stdout}");
    assert!(row[3].parse::<f64>().expect("average") > 0.0, "{stdout}");
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("--out_json_file written"))
            .expect("JSON");
    check(&doc, "write_bw", &[4096]);
    assert_eq!(doc["results"][0]["bw_peak_mbps"], 0.0);
    let _ = std::fs::remove_file(&json);
}

/// A perftest flag that would change what is measured, or a combination
/// that cannot be honoured, exits with status 2 and names the flag and
/// why, before anything runs.
#[test]
fn perftest_flags_not_supported_are_refused_by_name() {
    for (args, needle) in [
        (
            &["send_bw", "-W", "x"][..],
            "does not support -W (--report-counters",
        ),
        (&["write_bw", "-Q", "100"][..], "-Q must equal -l"),
        (
            &["read_bw", "-l", "4"][..],
            "-l (--post_list) and -Q (--cq-mod) apply to",
        ),
        (
            &["send_lat", "-b"][..],
            "-b (--bidirectional) applies to bandwidth tests",
        ),
        (
            &["send_bw", "-b", "--api", "raw"][..],
            "-b (--bidirectional) runs with --api verbs",
        ),
        (
            &["write_bw", "--use-srq"][..],
            "--use-srq applies to send_bw and send_lat",
        ),
        (&["send_bw", "--use-srq", "-R"][..], "--use-srq with -R"),
        (
            &["send_lat", "-R", "-c", "UD"][..],
            "-R (--rdma_cm) runs with --api verbs or raw over RC",
        ),
        (
            &["send_lat", "--run_infinitely"][..],
            "--run_infinitely runs with bandwidth tests only",
        ),
        (
            &["send_bw", "--run_infinitely", "--json"][..],
            "--run_infinitely runs with the table",
        ),
    ] {
        let out = Command::new(BIN).args(args).output().expect("run");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// `-b`: the server runs the test's loop towards the client too, and the
/// client's row adds both directions (perftest's sum): the iterations of
/// both sides, per QP; send_bw's messages go both ways, each side's ring
/// taking the other's.
#[test]
fn bidirectional_runs_add_both_directions() {
    for (test, qps) in [
        ("write_bw", "1"),
        ("read_bw", "1"),
        ("send_bw", "2"),
        ("atomic_bw", "1"),
    ] {
        let mut args = vec![test, "-b", "-q", qps, "-t", "4", "-n", "10"];
        if test != "atomic_bw" {
            args.extend(["-s", "256"]);
        }
        let v = run(&args, &args);
        let size = if test == "atomic_bw" { 8 } else { 256 };
        check(&v, test, &[size]);
        assert_eq!(v["bidirectional"], true, "{v}");
        let per_side = 10 * qps.parse::<u64>().unwrap();
        assert_eq!(v["results"][0]["iterations"], 2 * per_side, "{test}: {v}");
    }
    // Timed: the server's loop runs the client's duration.
    let args = ["send_bw", "-b", "-D", "0.2", "-s", "1K"];
    let v = run(&args, &args);
    check(&v, "send_bw", &[1024]);
}

/// `--use-srq`: every QP of a side takes its receives from one shared
/// receive queue; send_bw's server counts every QP's messages off it, and
/// send_lat's ping-pong runs over it on both sides, at several sizes.
#[test]
fn shared_receive_queue_runs() {
    let args = [
        "send_bw",
        "--use-srq",
        "-q",
        "3",
        "-t",
        "8",
        "-n",
        "20",
        "--sizes",
        "64,4K",
    ];
    let v = run(&args, &args);
    check(&v, "send_bw", &[64, 4096]);
    assert_eq!(v["srq"], true, "{v}");
    assert_eq!(v["results"][1]["iterations"], 60, "{v}");
    let args = ["send_lat", "--use-srq", "-n", "20", "--sizes", "8,1000"];
    let v = run(&args, &args);
    check(&v, "send_lat", &[8, 1000]);
    // With -b too: both sides' SRQs.
    let args = [
        "send_bw",
        "--use-srq",
        "-b",
        "-q",
        "2",
        "-t",
        "4",
        "-n",
        "10",
    ];
    let v = run(&args, &args);
    assert_eq!(v["results"][0]["iterations"], 40, "{v}");
}

/// `-R`: the QPs connect through the RDMA CM (several QPs, the verbs and
/// raw loops); a server and a client started with different flags refuse
/// each other, naming them.
#[test]
fn rdma_cm_connections_and_mismatched_modes() {
    let args = [
        "write_bw", "-R", "-q", "2", "-t", "4", "-n", "10", "-s", "512",
    ];
    let v = run(&args, &args);
    check(&v, "write_bw", &[512]);
    assert_eq!((&v["rdma_cm"], &v["qps"]), (&true.into(), &2.into()), "{v}");
    assert_eq!(v["results"][0]["iterations"], 20, "{v}");
    let args = ["send_lat", "-R", "--api", "raw", "-n", "20"];
    check(&run(&args, &args), "send_lat", &[2]);
    let args = ["send_bw", "-R", "-b", "-n", "10", "-t", "4"];
    assert_eq!(run(&args, &args)["results"][0]["iterations"], 20);

    let (mut srv, port, log) = server_with_log(&["send_bw", "-b"]);
    let out = Command::new(BIN)
        .args([
            "send_bw",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-d",
            "soft0",
        ])
        .output()
        .expect("run the client");
    assert!(!srv.wait().expect("the server ends").success());
    assert!(!out.status.success());
    let stderr: Vec<String> = log.iter().collect();
    let stderr = stderr.join("\n");
    assert!(
        stderr.contains("the client runs with none of -b")
            && stderr.contains("this server with -b"),
        "{stderr}"
    );
}

/// `--run_infinitely -D 0.2`: the client prints a result line per interval
/// until it is killed; the server serves until its client is gone.
#[test]
fn run_infinitely_prints_a_line_per_interval() {
    let flags = [
        "send_bw",
        "--run_infinitely",
        "-D",
        "0.2",
        "-s",
        "4K",
        "-t",
        "8",
    ];
    let (mut srv, port) = server(&flags);
    let mut client = Command::new(BIN)
        .args(flags)
        .args(["127.0.0.1", "-p", &port.to_string(), "-d", "soft0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the client");
    let stdout = client.stdout.take().expect("piped stdout");
    let rows: Vec<String> = BufReader::new(stdout)
        .lines()
        .map(|l| l.expect("readable stdout"))
        .filter(|l| l.trim_start().starts_with("4096 "))
        .take(3)
        .collect();
    let running = client.try_wait().expect("the client's status").is_none();
    let _ = client.kill();
    let _ = client.wait();
    assert_eq!(rows.len(), 3, "the client stopped printing: {rows:?}");
    assert!(running, "the client ended by itself");
    for row in &rows {
        let f: Vec<&str> = row.split_whitespace().collect();
        assert!(f[1].parse::<u64>().expect("iterations") >= 5, "{row}");
        assert!(f[3].parse::<f64>().expect("average") > 0.0, "{row}");
    }
    // The server notices its client is gone and ends (bounded by the test
    // harness's own limits otherwise: it would hang here).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(status) = srv.try_wait().expect("the server's status") {
            assert!(!status.success(), "the server's client was killed mid-run");
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = srv.kill();
            panic!("the server still runs 60 s after its client was killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `-l 4 -Q 4` (perftest's `-l 4`): write_bw and send_bw post lists of 4
/// WRs, one signaled; every WR is counted and the figure is sane.
#[test]
fn post_lists_with_cq_moderation() {
    for test in ["write_bw", "send_bw"] {
        let args = [
            test, "-l", "4", "-Q", "4", "-t", "16", "-n", "40", "-s", "4096",
        ];
        let v = run(&args, &args);
        check(&v, test, &[4096]);
        assert_eq!(v["results"][0]["iterations"], 40, "{v}");
    }
}
