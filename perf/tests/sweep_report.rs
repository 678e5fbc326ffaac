//! scripts/perf_sweep.py (the tables and the CI guard of
//! scripts/perf-sweep.sh) on results made up here: the ratios it prints,
//! its n/a lines, and the guard's verdict at the 3x limit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/perf_sweep.py")
}

/// A fresh directory under the target dir.
fn dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("make the results directory");
    d
}

fn lat(d: &Path, path: &str, size: u64, round: u32, usec: f64) {
    let doc = format!(
        r#"{{"test":"send_lat","results":[{{"bytes":{size},"iterations":100,"t_typical":{usec}}}]}}"#
    );
    std::fs::write(d.join(format!("send_lat_{path}_{size}_r{round}.json")), doc).expect("write");
}

fn bw(d: &Path, path: &str, size: u64, mbps: f64) {
    let doc = format!(
        r#"{{"test":"send_bw","results":[{{"bytes":{size},"iterations":100,"bw_avg_mbps":{mbps}}}]}}"#
    );
    std::fs::write(d.join(format!("send_bw_{path}_{size}_r1.json")), doc).expect("write");
}

/// Runs the script with `--guard 3` and `more` flags; None if there is no
/// python3 here.
fn guard_with(d: &Path, more: &[&str]) -> Option<Output> {
    match Command::new("python3")
        .arg(script())
        .arg(d)
        .args(["--guard", "3"])
        .args(more)
        .output()
    {
        Ok(o) => Some(o),
        Err(e) => {
            eprintln!("SKIPPED: python3 does not run here ({e})");
            None
        }
    }
}

fn guard(d: &Path) -> Option<Output> {
    guard_with(d, &[])
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn the_guard_passes_within_3x_and_prints_the_ratios() {
    let d = dir("sweep-pass");
    // Three rounds of latency: the median (10, 25, 30 -> 25) counts.
    for (r, v) in [(1, 10.0), (2, 30.0), (3, 25.0)] {
        lat(&d, "verbs", 4096, r, v);
    }
    for r in 1..=3 {
        lat(&d, "rdma", 4096, r, 50.0);
        lat(&d, "rpc", 4096, r, 74.0);
        lat(&d, "tcp", 4096, r, 100.0);
    }
    bw(&d, "verbs", 65536, 1000.0);
    bw(&d, "rdma", 65536, 500.0);
    bw(&d, "rpc", 65536, 400.0);
    bw(&d, "tcp", 65536, 2000.0);
    let Some(o) = guard(&d) else { return };
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("guard: PASS"), "{out}");
    // send_lat 4 KiB: Rdma 50 / verbs 25 = 2.00, / TCP 100 = 0.50;
    // send_bw 64 KiB: RPC 1000 / 400 = 2.50 against verbs, 5.00 against TCP.
    let row = |size: &str, test: &str| {
        let part = out.split(test).nth(1).unwrap_or_default();
        part.lines()
            .find(|l| l.trim_start().starts_with(size))
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let l = row("4 KiB", "send_lat:");
    assert_eq!(
        l[2..],
        ["25.00", "0.25", "50.00", "2.00", "0.50", "74.00", "2.96", "0.74", "100.00", "4.00"],
        "{out}"
    );
    let b = row("64 KiB", "send_bw:");
    assert_eq!(
        b[2..],
        [
            "1000.00", "2.00", "500.00", "2.00", "4.00", "400.00", "2.50", "5.00", "2000.00",
            "0.50"
        ],
        "{out}"
    );
}

#[test]
fn the_guard_fails_past_3x_and_on_a_path_that_could_not_run() {
    let d = dir("sweep-fail");
    lat(&d, "verbs", 65536, 1, 25.0);
    lat(&d, "rdma", 65536, 1, 76.0);
    lat(&d, "rpc", 65536, 1, 30.0);
    bw(&d, "verbs", 1 << 20, 1500.0);
    bw(&d, "rdma", 1 << 20, 1400.0);
    std::fs::write(
        d.join("send_bw_rpc_1048576_r1.na"),
        "did not finish within 30 s\n",
    )
    .expect("write");
    let Some(o) = guard(&d) else { return };
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("guard: FAIL (2)"), "{out}");
    assert!(
        out.contains("Rdma send_lat 64 KiB: 3.0x slower than verbs"),
        "{out}"
    );
    assert!(
        out.contains("RPC/UD send_bw 1 MiB: could not run (did not finish within 30 s)"),
        "{out}"
    );
    assert!(
        out.contains("n/a: RPC/UD 1 MiB: did not finish within 30 s"),
        "{out}"
    );
}

#[test]
fn the_best_round_counts_with_stat_best() {
    let d = dir("sweep-best");
    // verbs: 4, 27, 26 (a host that is fast or slow from run to run);
    // Rdma: 28, 4.4, 27; RPC: 30, 29, 31 (slow in every round).
    for (r, v, rd, rp) in [
        (1, 4.0, 28.0, 30.0),
        (2, 27.0, 4.4, 29.0),
        (3, 26.0, 27.0, 31.0),
    ] {
        lat(&d, "verbs", 4096, r, v);
        lat(&d, "rdma", 4096, r, rd);
        lat(&d, "rpc", 4096, r, rp);
    }
    let Some(o) = guard_with(&d, &["--stat", "best"]) else {
        return;
    };
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("the best of the rounds"), "{out}");
    // Rdma 4.4 / 4 = 1.10 passes; RPC 29 / 4 = 7.25 fails.
    assert!(out.contains("guard: FAIL (1)"), "{out}");
    assert!(
        out.contains("RPC/UD send_lat 4 KiB: 7.2x slower than verbs"),
        "{out}"
    );
    // The median: verbs 26, Rdma 27, RPC 30: all within 3x.
    let Some(o) = guard(&d) else { return };
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn a_known_miss_is_printed_and_held_to_its_own_limit() {
    let d = dir("sweep-known");
    bw(&d, "verbs", 4096, 1800.0);
    bw(&d, "rdma", 4096, 1000.0);
    bw(&d, "rpc", 4096, 450.0); // 4.0x verbs
    let known = ["--known", "rpc:send_bw:4K=6"];
    let Some(o) = guard_with(&d, &known) else {
        return;
    };
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("KNOWN MISS RPC/UD send_bw 4 KiB: 4.0x verbs, a known miss held to 6x"),
        "{out}"
    );
    assert!(out.contains("but the 1 known miss(es) above"), "{out}");
    // Without --known the same figures fail.
    let Some(o) = guard(&d) else { return };
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    // Worse than its own limit: it fails again.
    bw(&d, "rpc", 4096, 250.0); // 7.2x
    let Some(o) = guard_with(&d, &known) else {
        return;
    };
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("RPC/UD send_bw 4 KiB: 7.2x slower than verbs (a known miss, limit 6x)"),
        "{out}"
    );
    // A malformed --known is refused with the expected form.
    let Some(o) = guard_with(&d, &["--known", "rpc:send_bw"]) else {
        return;
    };
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("expected PATH:TEST:SIZE=LIMIT"), "{out}");
}
