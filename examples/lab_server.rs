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
//! Set `VERBIO_DEVICE` to use a named device instead of a soft one.

mod lab_common;

use std::process::ExitCode;

/// Default listen address.
const DEFAULT_ADDR: &str = "127.0.0.1:18520";

fn main() -> ExitCode {
    let arg = std::env::args().nth(1);
    let addr = match arg.as_deref().unwrap_or(DEFAULT_ADDR).parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("usage: lab_server [ADDR]: {e}");
            return ExitCode::from(2);
        }
    };
    match lab_common::run_server(addr, None) {
        Ok(()) => {
            println!("lab server: all checks passed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lab server: {e}");
            ExitCode::FAILURE
        }
    }
}
