//! scripts/perf-sweep.sh end to end on the software device with this
//! build's verbio-perf: a table with each path's figure and ratios, and a
//! size one path cannot carry printed as n/a with the reason while the
//! sweep goes on.

use std::path::Path;
use std::process::Command;

#[test]
fn the_sweep_prints_ratios_and_an_unfit_size_as_na() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("perf-sweep-script");
    // Ports of this run only (other sweeps may run on this host), below
    // the kernel's ephemeral range (32768 and up by default): a port there
    // may be the local end of a connection of the runs themselves (the
    // soft device's engines), and a server then cannot bind it (CI's ASan
    // run read "Connection refused" for TCP at 64 B on port 32872). The
    // sweep uses up to 300 ports from this one.
    let port = 10000 + std::process::id() % 20000;
    let out = match Command::new("bash")
        .current_dir(&root)
        .env("PERF_SWEEP_PORT", port.to_string())
        .arg("scripts/perf-sweep.sh")
        .args(["--bin", env!("CARGO_BIN_EXE_verbio-perf")])
        .args(["--paths", "verbs,rpc,tcp", "--tests", "send_lat"])
        .args(["--sizes", "64,17M", "-D", "0.05", "--limit", "60"])
        .arg("--out")
        .arg(&out_dir)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED: bash does not run here ({e})");
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if text.contains("python3: not found") || text.contains("python3: command not found") {
        eprintln!("SKIPPED: no python3 here");
        return;
    }
    assert!(out.status.success(), "{text}");
    let row = |size: &str| -> Vec<String> {
        text.lines()
            .find(|l| l.trim_start().starts_with(size))
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    // size, verbs, verbs/TCP, RPC, RPC/verbs, RPC/TCP, TCP, TCP/verbs
    let small = row("64 B");
    assert_eq!(small.len(), 9, "{text}");
    for cell in &small[2..] {
        let v: f64 = cell.parse().unwrap_or_else(|_| panic!("{cell}: {text}"));
        assert!(v > 0.0, "{text}");
    }
    let big = row("17 MiB");
    assert_eq!(big.len(), 9, "{text}");
    assert_eq!(big[4..7], ["n/a", "n/a", "n/a"], "{text}");
    assert!(
        big[2].parse::<f64>().is_ok(),
        "verbs carries 17 MiB: {text}"
    );
    assert!(
        text.contains("n/a: RPC/UD 17 MiB: --api rpc carries messages up to 16777216 bytes"),
        "{text}"
    );
}
