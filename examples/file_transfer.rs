//! Moves a file from a client to a server with RDMA WRITE into memory the
//! client requests from the server, on the high-level [`verbio::Rdma`] API.
//!
//! Per chunk the client asks for a region (`request_remote_mr`), writes the
//! chunk into it with `write_with_imm` (the immediate is the chunk's index,
//! the server's notification), and hands the region back (`send_remote_mr`);
//! the server takes the bytes (`receive_local_mr`) and appends them to the
//! output file. The client streams the input (one chunk in memory at a
//! time). Integrity is checked outside the timed transfer: the client
//! computes the CRC-32 of the input before it starts, the server that of
//! the output file once it is written, and compares them; either side
//! exits non-zero on a mismatch, an error or an expired wait.
//!
//! ```text
//! cargo run --release --example file_transfer -- --server ADDR OUT [--chunk BYTES]
//! cargo run --release --example file_transfer -- --client ADDR IN  [--chunk BYTES]
//! cargo run --release --example file_transfer -- IN OUT            # one process
//! ```
//!
//! The server handles one transfer and exits. Chunks default to 1 MiB (at
//! most 64 MiB, the server's largest grant). `-d DEVICE` uses a named
//! device instead of a soft one.

use std::error::Error;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use verbio::runtime::{timeout, Device, Runtime};
use verbio::ErrorChain;
use verbio::{Rdma, RdmaBuilder};

mod cli;

type Res<T> = Result<T, Box<dyn Error>>;

/// Largest chunk: the server's default `max_message_len`, its grant limit.
const MAX_CHUNK: usize = 64 << 20;

/// Moves a file over RDMA WRITEs into memory requested from the server.
#[derive(Parser)]
struct Args {
    /// Receive into the file as the server, listening on ADDR.
    #[arg(long, value_name = "ADDR", conflicts_with = "client")]
    server: Option<SocketAddr>,
    /// Send the file to the server at ADDR.
    #[arg(long, value_name = "ADDR")]
    client: Option<SocketAddr>,
    /// IN OUT (both sides in this process), OUT (--server) or IN (--client).
    #[arg(required = true, num_args = 1..=2, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Chunk size in bytes (1..=64 MiB).
    #[arg(long, default_value_t = 1 << 20)]
    chunk: usize,
    /// RDMA device (default: a software device bound to the address's IP).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    /// Seconds to wait on the peer: for the connection and for each
    /// message of the transfer.
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = cli::seconds)]
    timeout: Duration,
}

enum Mode {
    Server(SocketAddr, PathBuf),
    Client(SocketAddr, PathBuf),
    Both(PathBuf, PathBuf),
}

fn mode(args: &Args) -> Res<Mode> {
    if args.chunk == 0 || args.chunk > MAX_CHUNK {
        return Err(format!("--chunk must be 1..={MAX_CHUNK}").into());
    }
    let mode = match (args.server, args.client, args.files.as_slice()) {
        (Some(addr), None, [out]) => Mode::Server(addr, out.clone()),
        (None, Some(addr), [inp]) => Mode::Client(addr, inp.clone()),
        (None, None, [inp, out]) => Mode::Both(inp.clone(), out.clone()),
        _ => return Err("give IN OUT, --server ADDR OUT or --client ADDR IN".into()),
    };
    // Before anything is set up: a missing input fails now, not after the
    // server has waited for a client that never comes.
    if let Mode::Client(_, inp) | Mode::Both(inp, _) = &mode {
        check_input(inp)?;
    }
    Ok(mode)
}

/// Fails unless `path` is a regular file this process can open.
fn check_input(path: &Path) -> Res<()> {
    let f = File::open(path).map_err(|e| format!("input {path:?}: {}", ErrorChain(&e)))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("input {path:?}: {}", ErrorChain(&e)))?;
    if !meta.is_file() {
        return Err(format!("input {path:?}: not a regular file").into());
    }
    Ok(())
}

/// The CRC-32 and length of a file, read in 1 MiB pieces.
fn crc_of(path: &Path) -> Res<(u32, u64)> {
    let mut f = File::open(path).map_err(|e| format!("{path:?}: {}", ErrorChain(&e)))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("{path:?}: {}", ErrorChain(&e)))?;
        if n == 0 {
            return Ok((h.finalize(), len));
        }
        h.update(&buf[..n]);
        len += n as u64;
    }
}

/// The device of one side: `device` if given, else a soft device whose
/// engine listens on `ip`.
fn open(device: Option<&str>, ip: IpAddr) -> Res<Device> {
    Ok(Device::open(cli::open_device_or_soft(device, ip)?)?)
}

fn u64_at(msg: &[u8], at: usize) -> Res<u64> {
    let b = msg.get(at..at + 8).ok_or("short message from the client")?;
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    Ok(u64::from_le_bytes(w))
}

/// Receives one file into `out`; reports the bound address on `ready` or
/// prints it.
fn server(
    device: Option<&str>,
    addr: SocketAddr,
    out: PathBuf,
    ready: Option<mpsc::Sender<SocketAddr>>,
    limit: Duration,
) -> Res<()> {
    let rt = Runtime::new()?;
    let dev = open(device, addr.ip())?;
    rt.block_on(async {
        let listener = RdmaBuilder::new().device(dev).listen(addr)?;
        let local = listener.local_addr()?;
        match ready {
            Some(tx) => tx.send(local)?,
            None => println!("server listening on {local}"),
        }
        let peer = cli::Peer {
            name: "a client".into(),
            limit,
        };
        let r = peer
            .within("waiting for a client", listener.accept())
            .await?;
        let peer = cli::Peer {
            name: "the client".into(),
            limit,
        };
        let verdict = receive_file(&r, &out, &peer).await;
        let answer = match &verdict {
            Ok(sum) => format!("ok {sum:08x}"),
            Err(e) => format!("failed: {}", ErrorChain(&**e)),
        };
        let _ = peer.within("answer", r.send(answer.as_bytes())).await;
        // The client closes after the answer.
        let _ = timeout(limit, r.receive()).await;
        verdict.map(|_| ())
    })
}

/// Receives the file into `out`; returns its CRC-32, read back from the
/// written file once the transfer is done, after comparing it with the
/// client's.
async fn receive_file(r: &Rdma, out: &PathBuf, peer: &cli::Peer) -> Res<u32> {
    let header = peer.within("header", r.receive()).await?;
    let size = u64_at(&header, 0)?;
    let chunk = u64_at(&header, 8)?;
    if chunk == 0 || chunk > MAX_CHUNK as u64 {
        return Err(format!("bad chunk size {chunk} from the client").into());
    }
    let chunks = size.div_ceil(chunk);
    println!("server: receiving {size} bytes in {chunks} chunks of {chunk} into {out:?}");
    let mut file = BufWriter::new(File::create(out)?);
    let mut got = 0u64;
    for i in 0..chunks {
        let imm = peer
            .within("receive_write_imm", r.receive_write_imm())
            .await?;
        if u64::from(imm) != i {
            return Err(format!("chunk {i}: notified as chunk {imm}").into());
        }
        let mem = peer
            .within("receive_local_mr", r.receive_local_mr())
            .await?;
        let want = chunk.min(size - got);
        if mem.len() as u64 != want {
            return Err(format!("chunk {i}: {} bytes, expected {want}", mem.len()).into());
        }
        file.write_all(&mem)?;
        got += want;
    }
    file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    let theirs = u64_at(&peer.within("checksum", r.receive()).await?, 0)?;
    let (crc, len) = crc_of(out)?;
    println!("server: wrote {len} bytes, CRC-32 {crc:08x}");
    if theirs != u64::from(crc) || len != size {
        return Err(format!(
            "integrity check failed: client sent {size} bytes with CRC-32 {theirs:08x}, \
             the output has {len} bytes with {crc:08x}"
        )
        .into());
    }
    println!("server: CRC-32 matches the client's");
    Ok(crc)
}

/// Streams the file at `inp` to the server at `addr`, one chunk in memory
/// at a time.
fn client(
    device: Option<&str>,
    addr: SocketAddr,
    inp: &Path,
    chunk: usize,
    limit: Duration,
) -> Res<()> {
    // Outside the timed transfer: the checksum of what is sent.
    let (crc, size) = crc_of(inp)?;
    let mut file =
        BufReader::new(File::open(inp).map_err(|e| format!("{inp:?}: {}", ErrorChain(&e)))?);
    let rt = Runtime::new()?;
    let local_ip = if addr.ip().is_loopback() {
        addr.ip()
    } else {
        IpAddr::from([0, 0, 0, 0])
    };
    let dev = open(device, local_ip)?;
    let peer = cli::Peer {
        name: format!("the server at {addr}"),
        limit,
    };
    rt.block_on(async {
        let r = peer
            .within("connecting", RdmaBuilder::new().device(dev).connect(addr))
            .await?;
        let mut header = Vec::with_capacity(16);
        header.extend_from_slice(&size.to_le_bytes());
        header.extend_from_slice(&(chunk as u64).to_le_bytes());
        peer.within("header", r.send(&header)).await?;
        let start = Instant::now();
        let first = usize::try_from(size)
            .unwrap_or(usize::MAX)
            .min(chunk)
            .max(1);
        let mut buf = r.alloc_local_mr(first)?;
        let mut sent = 0u64;
        let mut i = 0u32;
        while sent < size {
            let len = (size - sent).min(chunk as u64) as usize;
            if buf.len() != len {
                buf = r.alloc_local_mr(len)?; // the last, shorter chunk
            }
            file.read_exact(&mut buf)
                .map_err(|e| format!("{inp:?} at byte {sent}: {}", ErrorChain(&e)))?;
            let remote = peer
                .within("request_remote_mr", r.request_remote_mr(len))
                .await?;
            let (res, back) = peer
                .within("write_with_imm", async {
                    Ok::<_, Box<dyn Error>>(r.write_with_imm(buf, &remote, i).await)
                })
                .await?;
            res.map_err(|e| format!("chunk {i}: write_with_imm: {}", ErrorChain(&e)))?;
            buf = back;
            peer.within("send_remote_mr", r.send_remote_mr(remote))
                .await?;
            sent += len as u64;
            i = i.checked_add(1).ok_or("too many chunks")?;
        }
        peer.within("checksum", r.send(&u64::from(crc).to_le_bytes()))
            .await?;
        let answer = peer.within("answer", r.receive()).await?;
        let secs = start.elapsed().as_secs_f64();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        println!(
            "client: sent {size} bytes in {secs:.3} s ({:.1} MB/s), CRC-32 {crc:08x}",
            size as f64 / secs / 1e6,
        );
        let _ = peer.within("close", r.close()).await;
        if answer != format!("ok {crc:08x}") {
            return Err(format!("server answered {answer:?}").into());
        }
        println!("client: server confirmed the CRC-32");
        Ok(())
    })
}

fn run(args: &Args) -> Res<()> {
    let chunk = args.chunk;
    let limit = args.timeout;
    let device = args.device.as_deref();
    match mode(args)? {
        Mode::Server(addr, out) => server(device, addr, out, None, limit),
        Mode::Client(addr, inp) => client(device, addr, &inp, chunk, limit),
        Mode::Both(inp, out) => {
            let (tx, rx) = mpsc::channel();
            let dev_name = args.device.clone();
            let th = std::thread::spawn(move || {
                let any = SocketAddr::from(([127, 0, 0, 1], 0));
                server(dev_name.as_deref(), any, out, Some(tx), limit).map_err(|e| cli::chain(&*e))
            });
            let addr = match rx.recv_timeout(limit) {
                Ok(a) => a,
                Err(_) => {
                    return Err(match th.join() {
                        Ok(Err(e)) => format!("server: {e}").into(),
                        _ => "server did not start".into(),
                    })
                }
            };
            let sent = client(device, addr, &inp, chunk, limit);
            let served = th.join().map_err(|_| "server thread panicked")?;
            sent?;
            served.map_err(|e| format!("server: {e}").into())
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    cli::init_tracing();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("file_transfer", &*e),
    }
}
