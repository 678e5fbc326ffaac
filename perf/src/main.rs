//! `verbio-perf`: perftest-style bandwidth and latency tests of RDMA verbs
//! through verbio. `verbio-perf TEST` is the server, `verbio-perf TEST HOST`
//! the client, as perftest's `ib_write_bw` and friends; see
//! docs/verbio-perf.md.

mod args;
mod clock;
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
use std::time::Duration;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use args::{Api, Cli, Config, Transport};

/// Bound of a run besides its sizes' own time: a peer that vanished
/// mid-step leaves the other side polling forever otherwise.
const SLACK: Duration = Duration::from_secs(300);
/// Bound per size of a run counted in iterations.
const PER_SIZE: Duration = Duration::from_secs(120);

/// Ends the process if the run takes far longer than it should.
fn watchdog(cfg: &Config) {
    // A timed size still runs its first iterations whatever their time.
    let per = cfg.duration.map_or(PER_SIZE, |d| d + PER_SIZE);
    let limit = SLACK + per * cfg.sizes.len() as u32;
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("verbio-perf: did not finish within {limit:?} (is the peer gone?)");
        std::process::exit(1);
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
