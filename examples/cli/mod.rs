//! What the examples share: the device flag, the log subscriber (so that
//! which device was opened is visible), the error report (the whole cause
//! chain, [`fail`]) and the CPU clocks. Each example uses the parts
//! it needs.
#![allow(dead_code)]

use std::error::Error;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use verbio::provider::{open_device, Context, SoftConfig};
use verbio::ErrorChain;

/// Logs to stderr at `info` unless `RUST_LOG` says otherwise; in colour
/// only when stderr is a terminal (a log file or a pipe gets plain text).
pub fn init_tracing() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// `e` and every cause in its `source()` chain on one line
/// (`top: cause: root cause`), as [`ErrorChain`] shows it. verbio's errors
/// keep their cause out of their own message: printing only `{e}` drops
/// it ("binding the listener" without "address in use"). For an error
/// that crosses a thread as text.
pub fn chain(e: &(dyn Error + 'static)) -> String {
    ErrorChain(e).to_string()
}

/// Prints `program: ` and `e`'s whole cause chain to stderr and returns
/// the failure exit code: how every example ends on an error.
pub fn fail(program: &str, e: &(dyn Error + 'static)) -> ExitCode {
    eprintln!("{program}: {}", ErrorChain(e));
    ExitCode::FAILURE
}

/// Opens `name` if given, else a software device whose engine listens on
/// `ip` (so a peer on another host can reach it); logs which.
pub fn open_device_or_soft(
    name: Option<&str>,
    ip: IpAddr,
) -> Result<Context, verbio::provider::ProviderError> {
    // A blank name (an empty VERBIO_DEVICE) is no name.
    let ctx = match name.map(str::trim).filter(|n| !n.is_empty()) {
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
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID, "CLOCK_THREAD_CPUTIME_ID")
}

/// CPU time of the whole process (every thread) so far.
pub fn process_cpu() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID, "CLOCK_PROCESS_CPUTIME_ID")
}

fn cpu_clock(id: libc::clockid_t, name: &str) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; both CPU-time clocks exist on Linux.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime({name})");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Parses `--timeout SECONDS`: a whole number of seconds, at least 1.
pub fn seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1 second".into()),
        Ok(n) => Ok(Duration::from_secs(n)),
        Err(e) => Err(e.to_string()),
    }
}

/// The message of a wait on a peer that ran out:
/// `no answer from {peer} within {limit} s while {doing}`.
pub fn no_answer(peer: &str, limit: Duration, doing: &str) -> String {
    format!(
        "no answer from {peer} within {} s while {doing} (--timeout sets the bound)",
        limit.as_secs()
    )
}

/// Awaits `f` for at most `limit`; on expiry fails with [`no_answer`]
/// (`peer`, `doing`), so a silent peer ends the run saying what it waited
/// for. `f`'s own error passes through with `doing` in front.
pub async fn bounded<T, E: Into<Box<dyn Error>>>(
    limit: Duration,
    peer: &str,
    doing: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, Box<dyn Error>> {
    match verbio::runtime::timeout(limit, f).await {
        Ok(r) => r.map_err(|e| format!("{doing}: {}", ErrorChain(&*e.into())).into()),
        Err(_) => Err(no_answer(peer, limit, doing).into()),
    }
}

/// A peer the run waits on and the bound of each wait (`--timeout`).
pub struct Peer {
    /// Who it is, for the expiry message ("the server at 10.0.0.1:18515").
    pub name: String,
    /// The bound of each wait.
    pub limit: Duration,
}

impl Peer {
    /// [`bounded`] by this peer's limit, naming it.
    pub async fn within<T, E: Into<Box<dyn Error>>>(
        &self,
        doing: &str,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, Box<dyn Error>> {
        bounded(self.limit, &self.name, doing, f).await
    }
}

/// A TCP port on the loopback interface that nothing listens on right now,
/// for a test that runs an example's server and client in one process: the
/// kernel picks it (a port made from the process id can be anyone's
/// ephemeral port, and then the server fails with "Address already in use").
#[cfg(test)]
pub fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}
