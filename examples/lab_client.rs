//! The client of the classic RDMA lab on the high-level [`verbio::Rdma`]
//! API (see `lab_server.rs` for the five steps). Every step is checked on
//! both sides; any failed check or expired wait exits non-zero.
//!
//! ```text
//! cargo run --example lab_server -- [ADDR]     # terminal 1
//! cargo run --example lab_client -- ADDR       # terminal 2
//! cargo run --example lab_client               # both sides, one process
//! ```
//!
//! Without ADDR the server runs on a thread of this process (its own
//! runtime and soft device) on 127.0.0.1:0, so one command demonstrates
//! and checks everything.

mod cli;
mod lab_common;

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::mpsc;

use clap::Parser;
use lab_common::{check, open, pattern, within, Res, BOUNDARY, MR_LEN, STAMP};
use verbio::runtime::Runtime;
use verbio::ErrorChain;
use verbio::{Rdma, RdmaBuilder};

/// The client of the RDMA lab; without ADDR the server runs in this process too.
#[derive(Parser)]
struct Args {
    /// The lab_server's address.
    addr: Option<SocketAddr>,
    /// RDMA device (default: a software device, on loopback for a server
    /// on loopback, else on the unspecified address).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    #[arg(long, value_name = "SECONDS", default_value = "20", value_parser = cli::seconds, help = lab_common::TIMEOUT_HELP)]
    timeout: std::time::Duration,
}

fn main() -> ExitCode {
    let args = Args::parse();
    cli::init_tracing();
    lab_common::set_step(args.timeout);
    let (addr, server) = match args.addr {
        Some(addr) => {
            lab_common::set_peer(format!("the server at {addr}"));
            (addr, None)
        }
        None => {
            let (tx, rx) = mpsc::channel();
            let device = args.device.clone();
            let th = std::thread::spawn(move || {
                let any = SocketAddr::from(([127, 0, 0, 1], 0));
                lab_common::run_server(device.as_deref(), any, Some(tx))
                    .map_err(|e| cli::chain(&*e))
            });
            match rx.recv_timeout(args.timeout) {
                Ok(addr) => (addr, Some(th)),
                Err(_) => {
                    let why = match th.join() {
                        Ok(Err(e)) => e,
                        _ => "did not start".into(),
                    };
                    eprintln!("lab server thread: {why}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    let client = run_client(args.device.as_deref(), addr);
    let server = server.map(|th| match th.join() {
        Ok(r) => r,
        Err(_) => Err("server thread panicked".into()),
    });
    let mut ok = true;
    match client {
        Ok(()) => println!("lab client: all checks passed"),
        Err(e) => {
            eprintln!("lab client: {}", cli::chain(&*e));
            ok = false;
        }
    }
    match server {
        Some(Ok(())) => println!("lab server (thread): all checks passed"),
        Some(Err(e)) => {
            eprintln!("lab server (thread): {e}");
            ok = false;
        }
        None => {}
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run_client(device: Option<&str>, addr: SocketAddr) -> Res<()> {
    let rt = Runtime::new()?;
    // A server on this host: the soft engine on loopback too; on another
    // host: on the unspecified address (it announces the one the server
    // reaches it at), not the server's, which is not this host's.
    let local_ip = if addr.ip().is_loopback() {
        addr.ip()
    } else {
        std::net::IpAddr::from([0, 0, 0, 0])
    };
    let dev = open(device, local_ip)?;
    rt.block_on(async {
        let r = within("connecting", RdmaBuilder::new().device(dev).connect(addr)).await?;
        client_steps(&r).await?;
        let last = within("final message", r.receive()).await?;
        let last = String::from_utf8_lossy(&last).into_owned();
        check(last == "lab passed", &format!("server says {last:?}"))?;
        within("close", r.close()).await
    })
}

/// Runs a verb returning `(result, buffer)` under the step bound.
async fn verb<T>(
    what: &str,
    f: impl std::future::Future<Output = (Result<(), verbio::AgentError>, T)>,
) -> Res<T> {
    let (res, buf) = within(what, async { Ok::<_, Box<dyn Error>>(f.await) }).await?;
    res.map_err(|e| format!("{what}: {}", ErrorChain(&e)))?;
    Ok(buf)
}

async fn client_steps(r: &Rdma) -> Res<()> {
    println!("client 1: send/receive");
    within("send", r.send(b"hello server")).await?;
    let got = within("receive", r.receive()).await?;
    check(got == b"hello client", "client received the server's reply")?;

    println!("client 2: send/receive with imm");
    within("send_with_imm", r.send_with_imm(b"with imm", 0x1ab)).await?;
    let (got, imm) = within("receive_with_imm", r.receive_with_imm()).await?;
    check(
        got == b"imm back" && imm == Some(0x2cd),
        "client received data with imm 0x2cd",
    )?;

    println!("client 3: lend memory (send_local_mr) for the server to READ");
    // Hand-overs carry a tag naming their purpose: here the lab step.
    let token = within(
        "send_local_mr",
        r.send_local_mr_with_tag(pattern(MR_LEN, 3), 3),
    )
    .await?;
    check(token.len == MR_LEN as u64, "grant token covers the memory")?;
    let back = within("receive_local_mr", r.receive_local_mr_with_tag(3)).await?;
    check(back.len() == MR_LEN, "memory came back whole")?;
    check(
        back[..STAMP.len()] == *STAMP,
        "server stamped it after reading",
    )?;
    check(
        back[STAMP.len()..] == pattern(MR_LEN, 3)[STAMP.len()..],
        "rest of the lent memory unchanged",
    )?;

    println!("client 4: request remote memory, write its second half, hand it back");
    let remote = within("request_remote_mr", r.request_remote_mr(MR_LEN)).await?;
    check(remote.len() == MR_LEN, "granted the requested size")?;
    let half = remote
        .get(MR_LEN / 2..)
        .ok_or("second half of the grant out of range")?;
    let mut local = r.alloc_local_mr(MR_LEN / 2)?;
    local.copy_from_slice(&pattern(MR_LEN / 2, 4));
    verb("write", r.write(local, &half)).await?;
    let check_back = verb("read back", r.read(r.alloc_local_mr(MR_LEN / 2)?, &half)).await?;
    check(
        check_back[..] == pattern(MR_LEN / 2, 4)[..],
        "READ of the written half matches",
    )?;
    drop(half);
    within("send_remote_mr", r.send_remote_mr_with_tag(remote, 4)).await?;

    println!("client 5: write_with_imm, the immediate marks the boundary");
    let remote = within("request_remote_mr", r.request_remote_mr(MR_LEN)).await?;
    let mut local = r.alloc_local_mr(BOUNDARY)?;
    local.copy_from_slice(&pattern(BOUNDARY, 5));
    verb(
        "write_with_imm",
        r.write_with_imm(local, &remote, BOUNDARY as u32),
    )
    .await?;
    within("send_remote_mr", r.send_remote_mr_with_tag(remote, 5)).await?;
    Ok(())
}
