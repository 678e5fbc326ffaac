//! The server of the classic RDMA lab on the high-level [`verbio::Rdma`]
//! API: serves one `lab_client` through five steps, each checked, and exits
//! non-zero if any check fails or any wait (bounded) runs out.
//!
//! 1. send/receive;
//! 2. send/receive with an immediate;
//! 3. RDMA READ of memory the client lent (`send_local_mr_with_tag`; every
//!    hand-over's tag names its step), then a stamp written into it and the
//!    grant handed back (`send_remote_mr_with_tag`);
//! 4. memory the client requested (`request_remote_mr`), wrote the second
//!    half of and handed back: the server checks that half
//!    (`receive_local_mr_with_tag`);
//! 5. the same with `write_with_imm`, whose immediate marks where the
//!    written bytes end (`receive_write_imm`).
//!
//! ```text
//! cargo run --example lab_server -- [ADDR]      # default 127.0.0.1:18520
//! cargo run --example lab_client -- ADDR
//! ```
//!
//! `cargo run --example lab_client` alone runs both sides in one process.
//! `-d DEVICE` uses a named device instead of a soft one.

mod cli;
mod lab_common;

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Parser;

/// The server of the RDMA lab: serves one lab_client through five checked steps.
#[derive(Parser)]
struct Args {
    /// Address to listen on.
    #[arg(default_value = "127.0.0.1:18520")]
    addr: SocketAddr,
    /// RDMA device (default: a software device bound to ADDR's IP).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    #[arg(long, value_name = "SECONDS", default_value = "20", value_parser = cli::seconds, help = lab_common::TIMEOUT_HELP)]
    timeout: std::time::Duration,
}

fn main() -> ExitCode {
    let args = Args::parse();
    cli::init_tracing();
    lab_common::set_step(args.timeout);
    lab_common::set_peer("the client".into());
    match lab_common::run_server(args.device.as_deref(), args.addr, None) {
        Ok(()) => {
            println!("lab server: all checks passed");
            ExitCode::SUCCESS
        }
        Err(e) => cli::fail("lab server", &*e),
    }
}
