//! scripts/perf-sweep.sh end to end on the software device with this
//! build's verbio-perf: a table with each path's figure and ratios, and a
//! size one path cannot carry printed as n/a with the reason while the
//! sweep goes on.

use std::path::Path;
use std::process::Command;

/// Runs scripts/perf-sweep.sh from ports `port`.. with `bin` and `args`,
/// writing into `out`; asserts it succeeded and returns what it printed
/// (None, having said SKIPPED, where bash or python3 does not run).
fn sweep(port: u32, bin: &Path, args: &[&str], out: &Path) -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run = match Command::new("bash")
        .current_dir(&root)
        .env("PERF_SWEEP_PORT", port.to_string())
        .arg("scripts/perf-sweep.sh")
        .arg("--bin")
        .arg(bin)
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED: bash does not run here ({e})");
            return None;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    if text.contains("python3: not found") || text.contains("python3: command not found") {
        eprintln!("SKIPPED: no python3 here");
        return None;
    }
    assert!(run.status.success(), "{text}");
    Some(text)
}

#[test]
fn the_sweep_prints_ratios_and_an_unfit_size_as_na() {
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("perf-sweep-script");
    // Ports of this run only (other sweeps may run on this host), below
    // the kernel's ephemeral range (32768 and up by default): a port there
    // may be the local end of a connection of the runs themselves (the
    // soft device's engines), and a server then cannot bind it (CI's ASan
    // run read "Connection refused" for TCP at 64 B on port 32872). The
    // sweep uses up to 300 ports from this one.
    let port = 10000 + std::process::id() % 20000;
    let Some(text) = sweep(
        port,
        env!("CARGO_BIN_EXE_verbio-perf").as_ref(),
        &[
            "--paths",
            "verbs,rpc,tcp",
            "--tests",
            "send_lat",
            "--sizes",
            "64,17M",
            "-D",
            "0.05",
            "--limit",
            "60",
        ],
        &out_dir,
    ) else {
        return;
    };
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

/// A client that fails before its server has printed a line (as `--api
/// rpc` at 17 MiB may, refusing the size at once) leaves two empty greps
/// behind: the run is n/a with the client's exit status, and the sweep
/// goes on (under `set -eo pipefail` an empty grep once ended the whole
/// sweep with no word).
#[test]
fn a_client_that_fails_before_its_server_speaks_is_na_and_the_sweep_goes_on() {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("perf-sweep-silent");
    std::fs::create_dir_all(&tmp).expect("a scratch directory");
    // The server sleeps without a word; the client prints only a
    // bracketed log line and exits 3.
    let bin = tmp.join("silent-perf.sh");
    std::fs::write(
        &bin,
        "#!/bin/bash\nfor a in \"$@\"; do [ \"$a\" = 127.0.0.1 ] && { echo '[log] only' >&2; exit 3; }; done\nsleep 5\n",
    )
    .expect("writing the fake binary");
    let mut perm = std::fs::metadata(&bin).expect("its metadata").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&bin, perm).expect("making it executable");
    let port = 10000 + (std::process::id() + 7919) % 20000;
    let Some(text) = sweep(
        port,
        &bin,
        &[
            "--paths", "verbs", "--tests", "send_lat", "--sizes", "64,1K", "-D", "0.05", "--limit",
            "20",
        ],
        &tmp.join("out"),
    ) else {
        return;
    };
    for size in ["64 B", "1 KiB"] {
        assert!(
            text.contains(&format!("n/a: verbs {size}: client exit status 3")),
            "{size}: {text}"
        );
    }
}
