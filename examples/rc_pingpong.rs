//! `rc_pingpong`: RC SEND ping-pong that speaks rdma-core's
//! `ibv_rc_pingpong` protocol, so either side can be verbio or
//! `ibv_rc_pingpong` (from rdma-core's `ibverbs-utils`): the same flags,
//! the same address exchange over TCP port 18515 (a 52-byte text
//! `LID:QPN:PSN:GID` each way, then `done`), the same QP attributes
//! (path MTU 1024 by default, RNR timer 12, timeout 14, 7 retries) and the
//! same ping-pong (see `examples/rc_exchange/mod.rs`). Verbio receives
//! through a [`RecvRing`](verbio::runtime::RecvRing) on the QP.
//!
//! ```text
//! ibv_rc_pingpong -d rxe0 -g 1 -n 300 -c &     # rdma-core server
//! cargo run --example rc_pingpong --features ibverbs -- -d rxe0 -g 1 -n 300 -c 127.0.0.1
//! ```
//!
//! `scripts/rxe-test.sh` runs both pairings against `ibv_rc_pingpong` in
//! the rxe VM; `cargo test --example rc_pingpong` runs both sides (verbio)
//! on software devices.

mod cli;
mod rc_exchange;

use std::process::ExitCode;

use clap::Parser;
use verbio::provider::open_device;

/// RC ping-pong, wire-compatible with rdma-core's `ibv_rc_pingpong`.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: rc_exchange::Common,
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = open_device(args.common.device.as_deref())?;
    let ctx = rc_exchange::wire::reachable(ctx, args.common.server.as_deref(), args.common.port)?;
    rc_exchange::run(
        "rc_pingpong",
        &args.common,
        ctx,
        1,
        rc_exchange::Receive::OwnQueue,
    )
}

fn main() -> ExitCode {
    cli::init_tracing();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("rc_pingpong", &*e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides verbio on software devices, in two threads.
    #[test]
    fn soft_devices_ping_pong_with_checks() {
        let port = cli::free_tcp_port();
        fn args(port: u16, server: Option<&str>) -> Args {
            let port = port.to_string();
            let mut a = vec!["rc_pingpong", "-d", "soft0", "-s", "512", "-n", "200"];
            a.extend(["-r", "16", "-c", "-p", &port, "--timeout", "20"]);
            a.extend(server);
            Args::parse_from(a)
        }
        let server = std::thread::spawn(move || run(&args(port, None)).map_err(|e| e.to_string()));
        let client = run(&args(port, Some("127.0.0.1"))).map_err(|e| e.to_string());
        let server = server.join().expect("server thread");
        assert_eq!((client, server), (Ok(()), Ok(())));
    }
}
