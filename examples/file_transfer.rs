//! Moves a file from a client to a server with RDMA WRITE into memory the
//! client requests from the server, on the high-level [`verbio::Rdma`] API.
//!
//! Per chunk the client asks for a region (`request_remote_mr`), writes the
//! chunk into it with `write_with_imm` (the immediate is the chunk's index,
//! the server's notification), and hands the region back (`send_remote_mr`);
//! the server takes the bytes (`receive_local_mr`) and appends them to the
//! output file. Both sides print an FNV-1a 64 checksum of the bytes; the
//! server compares it with the client's and either side exits non-zero on a
//! mismatch, an error or an expired wait.
//!
//! ```text
//! cargo run --release --example file_transfer -- --server ADDR OUT [--chunk BYTES]
//! cargo run --release --example file_transfer -- --client ADDR IN  [--chunk BYTES]
//! cargo run --release --example file_transfer -- IN OUT            # one process
//! ```
//!
//! The server handles one transfer and exits. Chunks default to 1 MiB (at
//! most 64 MiB, the server's largest grant). Set `VERBIO_DEVICE` to use a
//! named device instead of a soft one.

use std::error::Error;
use std::fs::File;
use std::future::Future;
use std::io::{BufWriter, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use verbio::provider::{open_device, Context, SoftConfig};
use verbio::runtime::{timeout, Device, Runtime};
use verbio::{Rdma, RdmaBuilder};

type Res<T> = Result<T, Box<dyn Error>>;

/// Bound of every single wait.
const STEP: Duration = Duration::from_secs(30);

/// Largest chunk: the server's default `max_message_len`, its grant limit.
const MAX_CHUNK: usize = 64 << 20;

/// FNV-1a, 64 bits, fed incrementally.
#[derive(Clone, Copy)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

enum Mode {
    Server(SocketAddr, PathBuf),
    Client(SocketAddr, PathBuf),
    Both(PathBuf, PathBuf),
}

const USAGE: &str =
    "usage: file_transfer (--server ADDR OUT | --client ADDR IN | IN OUT) [--chunk BYTES]";

fn parse_args() -> Res<(Mode, usize)> {
    let mut chunk = 1 << 20;
    let mut pos = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--chunk" => chunk = it.next().ok_or("--chunk needs a value")?.parse()?,
            "-h" | "--help" => return Err(USAGE.into()),
            _ => pos.push(a),
        }
    }
    if chunk == 0 || chunk > MAX_CHUNK {
        return Err(format!("--chunk must be 1..={MAX_CHUNK}").into());
    }
    let mode = match pos.as_slice() {
        [flag, addr, out] if flag == "--server" => Mode::Server(addr.parse()?, out.into()),
        [flag, addr, inp] if flag == "--client" => Mode::Client(addr.parse()?, inp.into()),
        [inp, out] if !inp.starts_with("--") => Mode::Both(inp.into(), out.into()),
        _ => return Err(USAGE.into()),
    };
    Ok((mode, chunk))
}

/// Awaits `f`, failing after [`STEP`].
async fn within<T, E: Into<Box<dyn Error>>>(
    what: &str,
    f: impl Future<Output = Result<T, E>>,
) -> Res<T> {
    match timeout(STEP, f).await {
        Ok(r) => r.map_err(|e| format!("{what}: {}", e.into()).into()),
        Err(_) => Err(format!("{what}: timed out after {STEP:?}").into()),
    }
}

/// The device of one side: `VERBIO_DEVICE` if set, else a soft device whose
/// engine listens on `ip`.
fn open(ip: IpAddr) -> Res<Device> {
    let ctx = match std::env::var("VERBIO_DEVICE") {
        Ok(name) if !name.trim().is_empty() => open_device(Some(name.trim()))?,
        _ => Context::open_soft(SoftConfig {
            bind: SocketAddr::new(ip, 0),
            ..SoftConfig::default()
        })?,
    };
    Ok(Device::open(ctx)?)
}

fn u64_at(msg: &[u8], at: usize) -> Res<u64> {
    let b = msg.get(at..at + 8).ok_or("short message from the client")?;
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    Ok(u64::from_le_bytes(w))
}

/// Receives one file into `out`; reports the bound address on `ready` or
/// prints it.
fn server(addr: SocketAddr, out: PathBuf, ready: Option<mpsc::Sender<SocketAddr>>) -> Res<()> {
    let rt = Runtime::new()?;
    let dev = open(addr.ip())?;
    rt.block_on(async {
        let listener = RdmaBuilder::new().device(dev).listen(addr)?;
        let local = listener.local_addr()?;
        match ready {
            Some(tx) => tx.send(local)?,
            None => println!("server listening on {local}"),
        }
        let r = within("accept", listener.accept()).await?;
        let verdict = receive_file(&r, &out).await;
        let answer = match &verdict {
            Ok(sum) => format!("ok {sum:016x}"),
            Err(e) => format!("failed: {e}"),
        };
        let _ = within("answer", r.send(answer.as_bytes())).await;
        // The client closes after the answer.
        let _ = timeout(STEP, r.receive()).await;
        verdict.map(|_| ())
    })
}

async fn receive_file(r: &Rdma, out: &PathBuf) -> Res<u64> {
    let header = within("header", r.receive()).await?;
    let size = u64_at(&header, 0)?;
    let chunk = u64_at(&header, 8)?;
    if chunk == 0 || chunk > MAX_CHUNK as u64 {
        return Err(format!("bad chunk size {chunk} from the client").into());
    }
    let chunks = size.div_ceil(chunk);
    println!("server: receiving {size} bytes in {chunks} chunks of {chunk} into {out:?}");
    let mut file = BufWriter::new(File::create(out)?);
    let mut sum = Fnv::new();
    let mut got = 0u64;
    for i in 0..chunks {
        let imm = within("receive_write_imm", r.receive_write_imm()).await?;
        if u64::from(imm) != i {
            return Err(format!("chunk {i}: notified as chunk {imm}").into());
        }
        let mem = within("receive_local_mr", r.receive_local_mr()).await?;
        let want = chunk.min(size - got);
        if mem.len() as u64 != want {
            return Err(format!("chunk {i}: {} bytes, expected {want}", mem.len()).into());
        }
        sum.update(&mem);
        file.write_all(&mem)?;
        got += want;
    }
    file.flush()?;
    let theirs = u64_at(&within("checksum", r.receive()).await?, 0)?;
    println!("server: wrote {got} bytes, checksum {:016x}", sum.0);
    if theirs != sum.0 {
        return Err(format!(
            "checksum mismatch: client {theirs:016x}, server {:016x}",
            sum.0
        )
        .into());
    }
    println!("server: checksum matches the client's");
    Ok(sum.0)
}

/// Reads the input file.
fn read_input(inp: &PathBuf) -> Res<Vec<u8>> {
    Ok(std::fs::read(inp).map_err(|e| format!("{inp:?}: {e}"))?)
}

/// Sends `data` to the server at `addr`.
fn client(addr: SocketAddr, data: Vec<u8>, chunk: usize) -> Res<()> {
    let rt = Runtime::new()?;
    let dev = open(addr.ip())?;
    rt.block_on(async {
        let r = within("connect", RdmaBuilder::new().device(dev).connect(addr)).await?;
        let mut header = Vec::with_capacity(16);
        header.extend_from_slice(&(data.len() as u64).to_le_bytes());
        header.extend_from_slice(&(chunk as u64).to_le_bytes());
        within("header", r.send(&header)).await?;
        let start = Instant::now();
        let mut sum = Fnv::new();
        let mut buf = r.alloc_local_mr(chunk.min(data.len()).max(1))?;
        for (i, piece) in data.chunks(chunk).enumerate() {
            if buf.len() != piece.len() {
                buf = r.alloc_local_mr(piece.len())?; // the last, shorter chunk
            }
            buf.copy_from_slice(piece);
            sum.update(piece);
            let remote = within("request_remote_mr", r.request_remote_mr(piece.len())).await?;
            let imm = u32::try_from(i).map_err(|_| "too many chunks")?;
            let (res, back) = within("write_with_imm", async {
                Ok::<_, Box<dyn Error>>(r.write_with_imm(buf, &remote, imm).await)
            })
            .await?;
            res.map_err(|e| format!("chunk {i}: write_with_imm: {e}"))?;
            buf = back;
            within("send_remote_mr", r.send_remote_mr(remote)).await?;
        }
        within("checksum", r.send(&sum.0.to_le_bytes())).await?;
        let answer = within("answer", r.receive()).await?;
        let secs = start.elapsed().as_secs_f64();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        println!(
            "client: sent {} bytes in {secs:.3} s ({:.1} MB/s), checksum {:016x}",
            data.len(),
            data.len() as f64 / secs / 1e6,
            sum.0
        );
        let _ = within("close", r.close()).await;
        if answer != format!("ok {:016x}", sum.0) {
            return Err(format!("server answered {answer:?}").into());
        }
        println!("client: server confirmed the checksum");
        Ok(())
    })
}

fn run() -> Res<()> {
    let (mode, chunk) = parse_args()?;
    match mode {
        Mode::Server(addr, out) => server(addr, out, None),
        Mode::Client(addr, inp) => client(addr, read_input(&inp)?, chunk),
        Mode::Both(inp, out) => {
            let data = read_input(&inp)?;
            let (tx, rx) = mpsc::channel();
            let th = std::thread::spawn(move || {
                server(SocketAddr::from(([127, 0, 0, 1], 0)), out, Some(tx))
                    .map_err(|e| e.to_string())
            });
            let addr = match rx.recv_timeout(STEP) {
                Ok(a) => a,
                Err(_) => {
                    return Err(match th.join() {
                        Ok(Err(e)) => format!("server: {e}").into(),
                        _ => "server did not start".into(),
                    })
                }
            };
            let sent = client(addr, data, chunk);
            let served = th.join().map_err(|_| "server thread panicked")?;
            sent?;
            served.map_err(|e| format!("server: {e}").into())
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("file_transfer: {e}");
            ExitCode::FAILURE
        }
    }
}
