//! Shared by the `lab_server` and `lab_client` examples: the device, bounded
//! waits, the test patterns and the whole server side of the lab.

use std::error::Error;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

use verbio::runtime::{timeout, Device, Runtime};
use verbio::ErrorChain;
use verbio::{Rdma, RdmaBuilder};

/// Result of a lab step: any error ends the run with a non-zero exit.
pub type Res<T> = Result<T, Box<dyn Error>>;

/// Default bound of every single wait (`--timeout`'s default).
pub const STEP: Duration = Duration::from_secs(20);

/// `--timeout` help shared by both lab examples.
pub const TIMEOUT_HELP: &str =
    "Seconds to wait on the peer: for the connection and for each step's message";

/// The bound in force, in seconds ([`set_step`]).
static STEP_SECS: AtomicU64 = AtomicU64::new(STEP.as_secs());

/// Who the waits are on, for the expiry message ([`set_peer`]).
static PEER: OnceLock<String> = OnceLock::new();

/// Sets the bound of every single wait (the `--timeout` flag).
pub fn set_step(limit: Duration) {
    STEP_SECS.store(limit.as_secs().max(1), Ordering::Relaxed);
}

/// The bound of every single wait.
pub fn step() -> Duration {
    Duration::from_secs(STEP_SECS.load(Ordering::Relaxed))
}

/// Names the peer the waits are on ("the server at 10.0.0.1:18520").
pub fn set_peer(peer: String) {
    let _ = PEER.set(peer);
}

/// Size of the memory regions of steps 3-5.
pub const MR_LEN: usize = 64 * 1024;

/// Where step 5's write ends (sent as the immediate).
pub const BOUNDARY: usize = 20_000;

/// What the server stamps on the client's lent memory after reading it.
pub const STAMP: &[u8] = b"server read this";

/// Deterministic test data.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Fails with `msg` unless `ok`.
pub fn check(ok: bool, msg: &str) -> Res<()> {
    if ok {
        println!("  ok: {msg}");
        Ok(())
    } else {
        Err(format!("check failed: {msg}").into())
    }
}

/// Awaits `f`, failing after [`step`] with what it waited for.
pub async fn within<T, E: Into<Box<dyn Error>>>(
    what: &str,
    f: impl Future<Output = Result<T, E>>,
) -> Res<T> {
    let limit = step();
    match timeout(limit, f).await {
        // The cause chain kept as text: "connect: connection setup: …".
        Ok(r) => r.map_err(|e| format!("{what}: {}", ErrorChain(&*e.into())).into()),
        Err(_) => {
            let peer = PEER.get().map_or("the peer", String::as_str);
            Err(crate::cli::no_answer(peer, limit, what).into())
        }
    }
}

/// The device of one side: `device` if given, else a soft device whose
/// engine listens on `ip` (so two hosts can reach each other).
pub fn open(device: Option<&str>, ip: IpAddr) -> Res<Device> {
    Ok(Device::open(crate::cli::open_device_or_soft(device, ip)?)?)
}

/// Runs the server: listens on `addr`, reports the bound address on `ready`
/// (or prints it), serves one client through the lab and returns its verdict.
pub fn run_server(
    device: Option<&str>,
    addr: SocketAddr,
    ready: Option<mpsc::Sender<SocketAddr>>,
) -> Res<()> {
    let rt = Runtime::new()?;
    let dev = open(device, addr.ip())?;
    rt.block_on(async {
        let listener = RdmaBuilder::new().device(dev).listen(addr)?;
        let local = listener.local_addr()?;
        match ready {
            Some(tx) => tx.send(local)?,
            None => println!("lab server listening on {local}"),
        }
        let r = within("accept", listener.accept()).await?;
        let verdict = server_steps(&r).await;
        match &verdict {
            Ok(()) => {
                within("final message", r.send(b"lab passed")).await?;
                // The client closes; wait for it so the last message lands.
                let _ = timeout(step(), r.receive()).await;
            }
            Err(e) => {
                let _ = timeout(step(), r.send(format!("lab failed: {e}").as_bytes())).await;
            }
        }
        verdict
    })
}

/// The server half of the five steps.
async fn server_steps(r: &Rdma) -> Res<()> {
    println!("server 1: send/receive");
    let got = within("receive", r.receive()).await?;
    check(
        got == b"hello server",
        "server received the client's message",
    )?;
    within("send", r.send(b"hello client")).await?;

    println!("server 2: send/receive with imm");
    let (got, imm) = within("receive_with_imm", r.receive_with_imm()).await?;
    check(
        got == b"with imm" && imm == Some(0x1ab),
        "server received data with imm 0x1ab",
    )?;
    within("send_with_imm", r.send_with_imm(b"imm back", 0x2cd)).await?;

    println!("server 3: RDMA READ of memory the client lent (send_local_mr)");
    // Hand-overs carry a tag naming their purpose: here the lab step.
    let lent = within("receive_remote_mr", r.receive_remote_mr_with_tag(3)).await?;
    check(lent.len() == MR_LEN, "lent region has the agreed size")?;
    let (res, local) = within("read", async {
        Ok::<_, Box<dyn Error>>(r.read(r.alloc_local_mr(MR_LEN)?, &lent).await)
    })
    .await?;
    res?;
    check(
        local[..] == pattern(MR_LEN, 3)[..],
        "READ returned the client's bytes",
    )?;
    let mut stamp = r.alloc_local_mr(STAMP.len())?;
    stamp.copy_from_slice(STAMP);
    let (res, _) = within("write stamp", async {
        Ok::<_, Box<dyn Error>>(r.write(stamp, &lent).await)
    })
    .await?;
    res?;
    within(
        "send_remote_mr (hand back)",
        r.send_remote_mr_with_tag(lent, 3),
    )
    .await?;

    println!("server 4: the client writes the second half of requested memory");
    let mem = within("receive_local_mr", r.receive_local_mr_with_tag(4)).await?;
    check(
        mem.len() == MR_LEN,
        "handed-back region has the requested size",
    )?;
    check(
        mem[..MR_LEN / 2].iter().all(|&b| b == 0),
        "first half untouched (zero)",
    )?;
    check(
        mem[MR_LEN / 2..] == pattern(MR_LEN / 2, 4)[..],
        "second half holds the client's bytes",
    )?;

    println!("server 5: write_with_imm, the immediate marks the boundary");
    let imm = within("receive_write_imm", r.receive_write_imm()).await?;
    let boundary = imm as usize;
    check(boundary == BOUNDARY, "immediate is the agreed boundary")?;
    let mem = within("receive_local_mr", r.receive_local_mr_with_tag(5)).await?;
    check(
        mem.len() == MR_LEN,
        "handed-back region has the requested size",
    )?;
    check(
        mem[..boundary] == pattern(boundary, 5)[..],
        "bytes before the boundary are the client's",
    )?;
    check(
        mem[boundary..].iter().all(|&b| b == 0),
        "bytes after the boundary untouched",
    )?;
    Ok(())
}
