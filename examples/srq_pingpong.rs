//! `srq_pingpong`: RC SEND ping-pong on many QPs sharing one receive
//! queue, speaking rdma-core's `ibv_srq_pingpong` protocol, so either side
//! can be verbio or `ibv_srq_pingpong` (from rdma-core's
//! `ibverbs-utils`): the same flags (`-q` QPs, 16 by default), the same
//! address exchange over TCP port 18515 (256 52-byte texts
//! `LID:QPN:PSN:GID` each way, zeros past the QPs, then `done`), the same
//! QP attributes and the same ping-pong (see `examples/rc_exchange/mod.rs`).
//! Verbio's QPs are made on a shared receive queue
//! ([`Device::create_qp_on_srq`](verbio::runtime::Device::create_qp_on_srq))
//! fed by one [`RecvRing::on_srq`](verbio::runtime::RecvRing::on_srq),
//! whose messages say which QP they came in on.
//!
//! ```text
//! ibv_srq_pingpong -d rxe0 -g 1 -n 300 -c &    # rdma-core server
//! cargo run --example srq_pingpong --features ibverbs -- -d rxe0 -g 1 -n 300 -c 127.0.0.1
//! ```
//!
//! `scripts/rxe-test.sh` runs both pairings against `ibv_srq_pingpong` in
//! the rxe VM; `cargo test --example srq_pingpong` runs both sides
//! (verbio) on software devices.

mod cli;
mod rc_exchange;

use std::process::ExitCode;

use clap::Parser;
use verbio::provider::open_device;

/// SRQ ping-pong, wire-compatible with rdma-core's `ibv_srq_pingpong`.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: rc_exchange::Common,
    /// QPs (on one shared receive queue).
    #[arg(short = 'q', long = "num-qp", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..256))]
    num_qp: u32,
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.num_qp > args.common.rx_depth {
        return Err(format!(
            "rx_depth {} is too small for {} QPs",
            args.common.rx_depth, args.num_qp
        )
        .into());
    }
    let ctx = open_device(args.common.device.as_deref())?;
    let ctx = rc_exchange::wire::reachable(ctx, args.common.server.as_deref(), args.common.port)?;
    rc_exchange::run(
        "srq_pingpong",
        &args.common,
        ctx,
        args.num_qp as usize,
        rc_exchange::Receive::Shared,
    )
}

fn main() -> ExitCode {
    cli::init_tracing();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("srq_pingpong", &*e),
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
            let mut a = vec!["srq_pingpong", "-d", "soft0", "-s", "512", "-n", "400"];
            a.extend(["-r", "64", "-q", "16", "-c", "-p", &port, "--timeout", "20"]);
            a.extend(server);
            Args::parse_from(a)
        }
        let server = std::thread::spawn(move || run(&args(port, None)).map_err(|e| e.to_string()));
        let client = run(&args(port, Some("127.0.0.1"))).map_err(|e| e.to_string());
        let server = server.join().expect("server thread");
        assert_eq!((client, server), (Ok(()), Ok(())));
    }
}
