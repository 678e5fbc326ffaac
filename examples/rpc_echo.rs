//! Echo over the RPC engine (`verbio::rpc`) on a UD queue pair, with the
//! rate and the latency percentiles; by default also the engine alone
//! (both sides on one thread over the in-memory network: its CPU cost per
//! call, in thread CPU time), RC SEND/RECV ping-pong, the `Rdma`
//! connection's send/receive and a plain TCP request/response loop in the
//! same run, side by side, with ratios.
//!
//! Both sides in this process (two threads, loopback), then TCP:
//!
//! ```text
//! cargo run --release --example rpc_echo [-- --calls 20000 --size 32]
//! ```
//!
//! or in two terminals / on two hosts (the client gets the server's RPC
//! address over TCP at ADDR):
//!
//! ```text
//! cargo run --release --example rpc_echo -- --server 0.0.0.0:7100
//! cargo run --release --example rpc_echo -- --client 127.0.0.1:7100 [--concurrency 8]
//! ```

mod cli;
mod rpc_echo_common;

use std::io::{BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::channel::oneshot;
use verbio::rpc::mem::MemNetwork;
use verbio::rpc::ud::{UdConfig, UdTransport};
use verbio::rpc::{Request, Rpc, RpcAddr, RpcConfig, RpcError, Transport};
use verbio::runtime::{Device, Runtime};

const ECHO: u8 = 1;

/// What the server writes first on its TCP port, before the RPC address:
/// a client pointed at anything else says so instead of waiting.
const HELLO: &[u8; 16] = b"verbio-rpc-echo\n";

use cli::thread_cpu;
use rpc_echo_common::{rc_loop, rdma_loop, tcp_loop, BoxError, Figures};
use verbio::ErrorChain;

/// RPC echo over UD; without --server/--client both sides run in this
/// process, followed by a TCP request/response loop for comparison.
#[derive(Parser)]
struct Args {
    /// Serve on ADDR (the RPC address is handed out over TCP there).
    #[arg(long, value_name = "ADDR", conflicts_with = "client")]
    server: Option<SocketAddr>,
    /// Call the server whose TCP address is ADDR.
    #[arg(long, value_name = "ADDR")]
    client: Option<SocketAddr>,
    /// Calls measured (after a tenth as many for warm-up).
    #[arg(long, default_value_t = 20_000, value_parser = cli::at_least_one)]
    calls: usize,
    /// Request (and response) size in bytes.
    #[arg(long, default_value_t = 32)]
    size: usize,
    /// Calls under way at once (client mode; the in-process run measures
    /// 1 and 8).
    #[arg(long, default_value_t = 1, value_parser = cli::at_least_one)]
    concurrency: usize,
    /// RDMA device (e.g. rxe0; default: a software device).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    /// Session credits: packets of a session unanswered at once
    /// (`RpcConfig::session_credits`; default: the engine's).
    #[arg(long)]
    credits: Option<usize>,
    /// Server: response packets sent unasked
    /// (`RpcConfig::response_window`; default: the engine's).
    #[arg(long)]
    response_window: Option<usize>,
    /// Skips the `Rdma` send/receive loop (slow for large messages).
    #[arg(long)]
    no_rdma: bool,
    /// Runs only the engine alone (both sides on this thread over the
    /// in-memory network) and prints its CPU time per call: for profiling
    /// the engine (e.g. instructions per call under callgrind).
    #[arg(long, conflicts_with_all = ["server", "client"])]
    engine_only: bool,
    /// With --engine-only: only the warm-up and the calls timed as one
    /// batch (no timestamp per call, no latency percentiles): what
    /// callgrind counts per call for the engine row.
    #[arg(long, requires = "engine_only")]
    no_latency: bool,
    /// Serves the echo with `Rpc::register_inline` (run by the
    /// dispatcher, no handler task) instead of `Rpc::register`.
    #[arg(long)]
    inline_handler: bool,
    /// Seconds the client waits on the server: for the TCP connect, its
    /// RPC address, and opening the RPC session.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = cli::seconds)]
    timeout: Duration,
}

/// The endpoints' settings: messages up to 16 MiB (or `size`), the
/// credits and response window asked for.
fn rpc_config(args: &Args) -> RpcConfig {
    let defaults = RpcConfig::default();
    RpcConfig {
        max_msg_len: args.size.max(16 << 20),
        session_credits: args.credits.unwrap_or(defaults.session_credits),
        response_window: args.response_window.unwrap_or(defaults.response_window),
        ..defaults
    }
}

fn rpc_endpoint(
    device: Option<&str>,
    ip: IpAddr,
    config: RpcConfig,
) -> Result<Rpc<UdTransport>, BoxError> {
    let dev = Device::open(cli::open_device_or_soft(device, ip)?)?;
    let transport = UdTransport::new(&dev, &UdConfig::default())?;
    Ok(Rpc::new(transport, config))
}

fn register_echo<T: Transport>(rpc: &Rpc<T>, inline: bool) -> Result<(), RpcError> {
    let echo = |req: Request| {
        let mut resp = req.response_with_capacity(req.data().len());
        resp.extend_from_slice(req.data());
        resp
    };
    if inline {
        rpc.register_inline(ECHO, echo)
    } else {
        rpc.register(ECHO, move |req: Request| std::future::ready(echo(req)))
    }
}

/// `concurrency` tasks calling until `calls` are done; the latency of
/// each (unsorted: the caller measuring CPU time stops before the sort)
/// and the time they took.
async fn call_loop<T: Transport>(
    rpc: &Rc<Rpc<T>>,
    addr: &[u8],
    calls: usize,
    size: usize,
    concurrency: usize,
    server: &cli::Peer,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let s = server
        .within("opening an RPC session", rpc.connect(addr))
        .await?;
    let run = |n: usize| {
        let handles: Vec<_> = (0..concurrency)
            .map(|_| {
                let rpc = rpc.clone();
                verbio::runtime::spawn(async move {
                    let req = vec![0x5a; size];
                    let mut lat = Vec::with_capacity(n / concurrency);
                    for _ in 0..n / concurrency {
                        let t0 = Instant::now();
                        let resp = rpc
                            .call(s, ECHO, &req)
                            .await
                            .map_err(|e| ErrorChain(&e).to_string())?;
                        lat.push(t0.elapsed());
                        if resp.len() != size {
                            return Err(format!("echo of {} bytes, sent {size}", resp.len()));
                        }
                    }
                    Ok(lat)
                })
            })
            .collect();
        handles
    };
    for h in run((calls / 10).max(concurrency)) {
        h.await?;
    }
    let t0 = Instant::now();
    let mut lat = Vec::with_capacity(calls);
    for h in run(calls) {
        lat.extend(h.await?);
    }
    let elapsed = t0.elapsed();
    tracing::debug!(rpc = ?rpc.stats(), "client counters");
    Ok((lat, elapsed))
}

/// Serves RPC echo; hands the RPC address (its text form, after
/// [`HELLO`]) to whoever connects to `tcp`.
fn serve(
    tcp: SocketAddr,
    device: Option<&str>,
    config: RpcConfig,
    inline: bool,
) -> Result<(), BoxError> {
    let rt = Runtime::new()?;
    rt.block_on(async {
        let rpc = rpc_endpoint(device, tcp.ip(), config)?;
        register_echo(&rpc, inline)?;
        let addr = rpc.local_addr();
        let listener = TcpListener::bind(tcp)
            .map_err(|e| format!("binding the address server to {tcp}: {}", ErrorChain(&e)))?;
        println!(
            "serving RPC echo at {addr}; the address over TCP at {}",
            listener.local_addr()?
        );
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let _ = conn
                    .write_all(HELLO)
                    .and_then(|()| writeln!(conn, "{addr}"));
            }
        });
        rpc.serve_until(std::future::pending::<()>()).await;
        Ok(())
    })
}

/// Fetches the server's RPC address from `tcp`, each wait bounded by `limit`;
/// fails, saying what was expected, if `tcp` is not an `rpc_echo --server`.
/// Also returns this host's address towards the server.
fn fetch_addr(tcp: SocketAddr, limit: Duration) -> Result<(RpcAddr, IpAddr), BoxError> {
    let not_ours = |what: String| -> BoxError {
        format!(
            "{tcp}: {what}; expected an `rpc_echo --server` to send its RPC address \
             (\"verbio-rpc-echo\" and a line \"rpc:…\") within {} s (--timeout sets the bound)",
            limit.as_secs()
        )
        .into()
    };
    let why = |e: std::io::Error, what: &str| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("no {what} arrived")
        }
        std::io::ErrorKind::UnexpectedEof => format!("closed before the {what}"),
        _ => format!("reading the {what}: {}", ErrorChain(&e)),
    };
    let conn = TcpStream::connect_timeout(&tcp, limit)
        .map_err(|e| format!("connecting to the server at {tcp}: {}", ErrorChain(&e)))?;
    conn.set_read_timeout(Some(limit))?;
    let local_ip = conn.local_addr()?.ip();
    let mut conn = BufReader::new(conn);
    let mut hello = [0u8; HELLO.len()];
    conn.read_exact(&mut hello)
        .map_err(|e| not_ours(why(e, "greeting")))?;
    if &hello != HELLO {
        return Err(not_ours(format!(
            "it greeted with {:?}",
            String::from_utf8_lossy(&hello)
        )));
    }
    let addr = RpcAddr::read_from(conn).map_err(|e| not_ours(why(e, "address")))?;
    Ok((addr, local_ip))
}

fn client(tcp: SocketAddr, args: &Args) -> Result<(), BoxError> {
    let (addr, local_ip) = fetch_addr(tcp, args.timeout)?;
    let server = cli::Peer {
        name: format!("the server at {tcp} ({addr})"),
        limit: args.timeout,
    };
    let rt = Runtime::new()?;
    rt.block_on(async {
        let config = rpc_config(args);
        let rpc = Rc::new(rpc_endpoint(args.device.as_deref(), local_ip, config)?);
        let (lat, elapsed) = call_loop(
            &rpc,
            &addr,
            args.calls,
            args.size,
            args.concurrency,
            &server,
        )
        .await?;
        let f = Figures::new(lat, elapsed);
        f.print(&format!("rpc/ud, {} in flight", args.concurrency));
        Ok(())
    })
}

/// `calls` calls on `session`, one at a time from a task of their own (as
/// `call_loop` makes them), with no timestamp per call: the thread CPU
/// time they took (the calls timed as one batch).
async fn batch_cpu<T: Transport>(
    rpc: &Rc<Rpc<T>>,
    session: verbio::rpc::SessionId,
    calls: usize,
    size: usize,
) -> Result<Duration, BoxError> {
    let rpc = rpc.clone();
    let task = verbio::runtime::spawn(async move {
        let req = vec![0x5a; size];
        let cpu0 = thread_cpu();
        for _ in 0..calls {
            let resp = rpc
                .call(session, ECHO, &req)
                .await
                .map_err(|e| ErrorChain(&e).to_string())?;
            if resp.len() != size {
                return Err(format!("echo of {} bytes, sent {size}", resp.len()));
            }
        }
        Ok(thread_cpu() - cpu0)
    });
    Ok(task.await?)
}

/// The engine row's thread CPU per call, two ways.
struct EngineCpu {
    /// With a timestamp before and after each call (for the latency
    /// percentiles; on this VM's clock a pair costs tens of ns), the
    /// warm-up and the session's set-up included.
    timed: Option<Duration>,
    /// The calls timed as one batch (a second session, after its own
    /// warm-up): the engine, the handler and the call loop, no clock.
    batch: Duration,
}

/// Both sides on this thread over the in-memory network: the engine's own
/// cost (client, server and handler task) without a device. With
/// `latency`, first the calls with a timestamp each (the figures); then,
/// always, as many timed as one batch.
fn in_memory(args: &Args, latency: bool) -> Result<(Option<Figures>, EngineCpu), BoxError> {
    let rt = Runtime::new()?;
    rt.block_on(async {
        let net = MemNetwork::new(1, 4096);
        let config = rpc_config(args);
        let srv = Rpc::new(net.endpoint(), config.clone());
        register_echo(&srv, args.inline_handler)?;
        let cli = Rc::new(Rpc::new(net.endpoint(), config));
        let calls = args.calls + (args.calls / 10).max(1);
        let server = cli::Peer {
            name: "the in-memory server".into(),
            limit: args.timeout,
        };
        let (figures, timed) = if latency {
            let cpu0 = thread_cpu();
            let (lat, elapsed) =
                call_loop(&cli, &srv.local_addr(), args.calls, args.size, 1, &server).await?;
            // The latencies' sort is not the engine's: after the CPU time.
            let cpu = (thread_cpu() - cpu0) / calls as u32;
            (Some(Figures::new(lat, elapsed)), Some(cpu))
        } else {
            (None, None)
        };
        let s = server
            .within("opening an RPC session", cli.connect(&srv.local_addr()))
            .await?;
        batch_cpu(&cli, s, (args.calls / 10).max(1), args.size).await?;
        let batch = batch_cpu(&cli, s, args.calls, args.size).await? / args.calls as u32;
        Ok((figures, EngineCpu { timed, batch }))
    })
}

/// The engine alone: its rate, latency and CPU time per call.
fn engine_only(args: &Args) -> Result<(), BoxError> {
    let (mem, cpu) = in_memory(args, !args.no_latency)?;
    println!("{} calls of {} bytes:", args.calls, args.size);
    if let Some(mem) = mem {
        mem.print("rpc/in-memory, 1 thread");
    }
    if let Some(timed) = cpu.timed {
        println!(
            "  (engine CPU per call, client + server + handler task: {:.0} ns of thread CPU time)",
            timed.as_secs_f64() * 1e9
        );
    }
    println!(
        "  (the same, the calls timed as one batch, no timestamp per call: {:.0} ns of batch thread CPU time)",
        cpu.batch.as_secs_f64() * 1e9
    );
    Ok(())
}

/// Both RPC sides in this process, then TCP; prints both and the ratios.
fn side_by_side(args: &Args) -> Result<(), BoxError> {
    let (mem, cpu) = in_memory(args, true)?;
    let (Some(mem), Some(cpu_per_call)) = (mem, cpu.timed) else {
        return Err("the in-memory run gave no latency figures".into());
    };
    let device = args.device.clone();
    let inline = args.inline_handler;
    let config = rpc_config(args);
    let server_config = config.clone();
    let (addr_tx, addr_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = std::thread::spawn(move || -> Result<(), String> {
        let rt = Runtime::new().map_err(|e| ErrorChain(&e).to_string())?;
        rt.block_on(async {
            let rpc = rpc_endpoint(device.as_deref(), Ipv4Addr::LOCALHOST.into(), server_config)
                .map_err(|e| ErrorChain(&*e).to_string())?;
            register_echo(&rpc, inline).map_err(|e| ErrorChain(&e).to_string())?;
            addr_tx
                .send(rpc.local_addr())
                .map_err(|e| ErrorChain(&e).to_string())?;
            // Ends when the client side sends or drops its stop.
            let _ = rpc.serve_until(stop_rx).await;
            tracing::debug!(
                rpc = ?rpc.stats(),
                ud = ?rpc.with_transport(|t| t.stats()),
                "server counters"
            );
            Ok(())
        })
    });
    let addr = addr_rx.recv()?;
    let rt = Runtime::new()?;
    let (one, eight) = rt.block_on(async {
        let rpc = Rc::new(rpc_endpoint(
            args.device.as_deref(),
            Ipv4Addr::LOCALHOST.into(),
            config,
        )?);
        let server = cli::Peer {
            name: "the server thread".into(),
            limit: args.timeout,
        };
        let (lat, elapsed) = call_loop(&rpc, &addr, args.calls, args.size, 1, &server).await?;
        let one = Figures::new(lat, elapsed);
        let (lat, elapsed) = call_loop(&rpc, &addr, args.calls, args.size, 8, &server).await?;
        let eight = Figures::new(lat, elapsed);
        tracing::debug!(ud = ?rpc.with_transport(|t| t.stats()), "client UD counters");
        Ok::<_, BoxError>((one, eight))
    })?;
    drop(rt);
    let _ = stop_tx.send(()); // A server gone already: its join says why.
    server.join().map_err(|_| "RPC server panicked")??;
    let rc = rc_loop(args.device.as_deref(), args.calls, args.size)?;
    let rdma = if args.no_rdma {
        None
    } else {
        Some(rdma_loop(args.device.as_deref(), args.calls, args.size)?)
    };
    let tcp = tcp_loop(args.calls, args.size)?;
    println!("{} calls of {} bytes:", args.calls, args.size);
    mem.print("rpc/in-memory, 1 thread");
    println!(
        "  (engine CPU per call, client + server + handler task: {:.2} µs of thread CPU time)",
        cpu_per_call.as_secs_f64() * 1e6
    );
    println!(
        "  (the same, the calls timed as one batch, no timestamp per call: {:.2} µs)",
        cpu.batch.as_secs_f64() * 1e6
    );
    one.print("rpc/ud, 1 in flight");
    eight.print("rpc/ud, 8 in flight");
    rc.print("rc send/recv, 1 in flight");
    if let Some(rdma) = &rdma {
        rdma.print("Rdma send/receive, 1");
    }
    tcp.print("tcp loopback, 1 in flight");
    one.print_ratio("rpc/ud ÷ rc send/recv (1 in flight):", &rc);
    if let Some(rdma) = &rdma {
        one.print_ratio("rpc/ud ÷ Rdma send/receive (1):", rdma);
    }
    one.print_ratio("rpc/ud ÷ tcp (1 in flight):", &tcp);
    println!(
        "rpc/ud with 8 in flight ÷ tcp with 1: rate {:.2}x",
        eight.rate / tcp.rate
    );
    Ok(())
}

fn main() -> ExitCode {
    cli::init_tracing();
    let args = Args::parse();
    let res = match (args.server, args.client) {
        _ if args.engine_only => engine_only(&args),
        (Some(at), _) => serve(
            at,
            args.device.as_deref(),
            rpc_config(&args),
            args.inline_handler,
        ),
        (None, Some(at)) => client(at, &args),
        (None, None) => side_by_side(&args),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("rpc_echo", &*e),
    }
}
