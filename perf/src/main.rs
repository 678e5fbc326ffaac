//! `verbio-perf`: perftest-style bandwidth and latency tests of RDMA verbs
//! through verbio. `verbio-perf TEST` is the server, `verbio-perf TEST HOST`
//! the client, as perftest's `ib_write_bw` and friends; see
//! docs/verbio-perf.md.

mod args;
mod clock;
mod cm;
mod ctl;
mod driver;
mod error;
mod measure;
mod progress;
mod raw;
mod rdma;
mod report;
mod rpc;
mod session;
mod stats;
mod tcp;
mod ud;
mod verbs;

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use clap::Parser;
use tracing_subscriber::EnvFilter;

use args::{Api, Cli, Config, Transport};

/// Bound of a run besides its sizes' own time: a peer that vanished
/// mid-step leaves the other side polling forever otherwise.
const SLACK: Duration = Duration::from_secs(300);
/// Bound per size of a run counted in iterations.
const PER_SIZE: Duration = Duration::from_secs(120);

/// When the process started (the watchdog's clock).
static STARTED: OnceLock<Instant> = OnceLock::new();
/// The watchdog's deadline, in milliseconds from [`STARTED`].
static DEADLINE_MS: AtomicU64 = AtomicU64::new(u64::MAX);

/// The bound of one size: its time (timed runs still run their first
/// iterations whatever their time) and [`PER_SIZE`].
fn per_size(cfg: &Config) -> Duration {
    cfg.duration.map_or(PER_SIZE, |d| d + PER_SIZE)
}

fn set_deadline(from_now: Duration) {
    let started = *STARTED.get_or_init(Instant::now);
    let at = started.elapsed() + from_now;
    DEADLINE_MS.store(
        u64::try_from(at.as_millis()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
}

/// `--run_infinitely`: a step has ended; the watchdog gives the next one
/// the bound of a size (and the slack) from now.
pub fn watchdog_extend(cfg: &Config) {
    set_deadline(SLACK + per_size(cfg));
}

/// Ends the process if the run takes far longer than it should (with
/// `--run_infinitely`, if one step does).
fn watchdog(cfg: &Config) {
    let sizes = if cfg.run_infinitely {
        1
    } else {
        cfg.sizes.len() as u32
    };
    set_deadline(SLACK + per_size(cfg) * sizes);
    let started = *STARTED.get_or_init(Instant::now);
    std::thread::spawn(move || loop {
        let deadline = Duration::from_millis(DEADLINE_MS.load(Ordering::Relaxed));
        let now = started.elapsed();
        if now >= deadline {
            eprintln!(
                "verbio-perf: did not finish within {:?} (is the peer gone?)",
                deadline
            );
            std::process::exit(1);
        }
        std::thread::sleep(deadline - now);
    });
}

fn run(cfg: &Config) -> error::Result<()> {
    match (cfg.transport, cfg.host.as_deref(), cfg.api) {
        (Transport::Tcp, Some(h), _) => tcp::client(cfg, h),
        (Transport::Tcp, None, _) => tcp::server(cfg),
        (Transport::Rdma, Some(h), Api::Rpc) => rpc::client(cfg, h),
        (Transport::Rdma, None, Api::Rpc) => rpc::server(cfg),
        (Transport::Rdma, Some(h), Api::Rdma) => rdma::client(cfg, h),
        (Transport::Rdma, None, Api::Rdma) => rdma::server(cfg),
        (Transport::Rdma, Some(h), _) => driver::client(cfg, h),
        (Transport::Rdma, None, _) => driver::server(cfg),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cfg = match Cli::parse().resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("verbio-perf: {e}");
            return ExitCode::from(2);
        }
    };
    watchdog(&cfg);
    match run(&cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verbio-perf: {}", error::chain(&e));
            ExitCode::FAILURE
        }
    }
}
