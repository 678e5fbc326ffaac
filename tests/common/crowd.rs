//! Helpers of the tests that hold many connections (`agent_crowd`,
//! `handshake_crowd`): the file limit, the process's memory and CPU time,
//! and a bound that grows with the connection count.

use std::future::Future;
use std::time::Duration;

use verbio::runtime::{timeout, Runtime};

use super::WAIT;

/// Bound of the whole run: `VERBIO_CROWD_SECS` seconds if set (the rxe
/// VM, emulated, sets up about 25 connections a second), else [`WAIT`] and
/// 10 ms per connection (a debug build with 10,000 QPs on a device).
pub fn limit(n: usize) -> Duration {
    std::env::var("VERBIO_CROWD_SECS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(WAIT + Duration::from_millis(10 * n as u64))
}

/// Runs `f` on `rt`, failing the test after `limit(n)`.
pub fn run<F: Future>(rt: &Runtime, n: usize, f: F) -> F::Output {
    rt.block_on(timeout(limit(n), f))
        .unwrap_or_else(|_| panic!("{n} connections: not done within {:?}", limit(n)))
}

/// File descriptors besides the connections' (runtimes, engines, test
/// harness).
pub const OTHER_FDS: u64 = 512;

/// Raises the soft `RLIMIT_NOFILE` to hold `n` connections of `sockets`
/// sockets each in this process; returns how many it holds.
pub fn fds_for(n: usize, sockets: u64) -> usize {
    let need = sockets * n as u64 + OTHER_FDS;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return n;
    }
    if lim.rlim_cur < need {
        // The hard limit too, where the process may (CAP_SYS_RESOURCE);
        // else the soft one up to the hard one.
        let wished = libc::rlimit {
            rlim_cur: need,
            rlim_max: need.max(lim.rlim_max),
        };
        let within = libc::rlimit {
            rlim_cur: need.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: valid rlimits, read by setrlimit only.
        let raised = if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &wished) } == 0 {
            wished
        } else {
            within
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            eprintln!(
                "RLIMIT_NOFILE raised from {} to {} for {n} connections",
                lim.rlim_cur, raised.rlim_cur
            );
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    let fit = (lim.rlim_cur.saturating_sub(OTHER_FDS) / sockets) as usize;
    if fit < n {
        eprintln!(
            "RLIMIT_NOFILE {} (hard {}) holds {fit} connections of {sockets} sockets, not {n}",
            lim.rlim_cur, lim.rlim_max
        );
    }
    fit.min(n)
}

/// CPU time of the process so far (user, system), in seconds.
pub fn cpu_secs() -> (f64, f64) {
    // SAFETY: an all-zero rusage is valid for getrusage to fill.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return (f64::NAN, f64::NAN);
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    (t(u.ru_utime), t(u.ru_stime))
}

/// The process's resident memory, in KiB (`VmRSS`).
pub fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}
