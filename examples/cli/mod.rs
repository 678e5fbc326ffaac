//! What the examples share: the device flag, the log subscriber (so that
//! which device was opened is visible) and the thread's CPU clock. Each
//! example uses the parts it needs.
#![allow(dead_code)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use verbio::provider::{open_device, Context, SoftConfig};

/// Logs to stderr at `info` unless `RUST_LOG` says otherwise.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Opens `name` if given, else a software device whose engine listens on
/// `ip` (so a peer on another host can reach it); logs which.
pub fn open_device_or_soft(
    name: Option<&str>,
    ip: IpAddr,
) -> Result<Context, verbio::provider::ProviderError> {
    let ctx = match name {
        Some(n) => open_device(Some(n))?,
        None => Context::open_soft(SoftConfig {
            bind: SocketAddr::new(ip, 0),
            ..SoftConfig::default()
        })?,
    };
    tracing::info!(device = ctx.name(), kind = %ctx.kind(), "opened the RDMA device");
    Ok(ctx)
}

/// Parses a count or size that must be at least 1.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// CPU time the calling thread has used (a loaded machine stretches
/// wall-clock time, not this).
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
