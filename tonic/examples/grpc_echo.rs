//! A gRPC service (a unary and a server-streaming method) over verbio
//! connections, served and called by tonic on tokio's multi-thread
//! runtime: the server's connections come from an
//! [`RdmaIncoming`](verbio_tonic::RdmaIncoming), the client's channel
//! connects through an [`RdmaConnector`](verbio_tonic::RdmaConnector).
//! Both sides live in one process on a [`Pool`] of two runtime threads,
//! each with its own device (`VERBIO_DEVICE`, else a hardware device, else
//! a soft device). Every reply and every streamed byte is checked.
//!
//! `--tcp` runs the same work over tonic's own kernel TCP transport in the
//! same run and prints the ratios (verbio / TCP).
//!
//! ```text
//! cargo run -p verbio-tonic --example grpc_echo
//! cargo run --release -p verbio-tonic --example grpc_echo -- --calls 10000 --stream-mib 100 --tcp
//! ```

mod common;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use common::{stream_checked, unary_calls, EchoClient, EchoServer, EchoService, RunError};
use tonic::transport::{Channel, Endpoint, Server};
use verbio::runtime::{Placement, Pool};
use verbio_tonic::{RdmaConnector, RdmaIncoming};

/// gRPC unary calls and a server stream over verbio (and kernel TCP).
#[derive(Parser, Debug)]
struct Args {
    /// Unary calls in all.
    #[arg(long, default_value_t = 2000)]
    calls: usize,
    /// Bytes of each unary call's payload.
    #[arg(long, default_value_t = 32)]
    payload: usize,
    /// Tasks (tokio::spawn) sharing the calls, each with a clone of the
    /// channel.
    #[arg(long, default_value_t = 16)]
    tasks: usize,
    /// MiB of the server stream.
    #[arg(long, default_value_t = 16)]
    stream_mib: u32,
    /// Bytes per streamed chunk (at most 1 MiB).
    #[arg(long, default_value_t = 65536)]
    chunk: u32,
    /// tokio worker threads.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Also run over tonic's kernel TCP transport and print the ratios.
    #[arg(long)]
    tcp: bool,
    /// Bound of the whole run, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

/// What one transport measured.
#[derive(Debug, Clone, Copy)]
struct Measured {
    calls_per_sec: f64,
    stream_mib_per_sec: f64,
}

/// Runs the calls and the stream over `channel`.
async fn drive(args: &Args, channel: Channel) -> Result<Measured, RunError> {
    let client = EchoClient::new(channel);
    let start = Instant::now();
    let mut tasks = Vec::new();
    let tasks_n = args.tasks.max(1);
    for t in 0..tasks_n {
        let mut client = client.clone();
        let calls = args.calls / tasks_n + usize::from(t < args.calls % tasks_n);
        let payload = args.payload;
        tasks.push(tokio::spawn(async move {
            unary_calls(&mut client, calls, payload, t as u64).await
        }));
    }
    for t in tasks {
        t.await??;
    }
    let unary = start.elapsed();
    let chunk = args.chunk.clamp(1, common::MAX_CHUNK);
    let chunks = ((u64::from(args.stream_mib) << 20) / u64::from(chunk)) as u32;
    let start = Instant::now();
    let bytes = stream_checked(&mut client.clone(), chunks, chunk, 7).await?;
    let stream = start.elapsed();
    Ok(Measured {
        calls_per_sec: args.calls as f64 / unary.as_secs_f64(),
        stream_mib_per_sec: bytes as f64 / f64::from(1 << 20) / stream.as_secs_f64(),
    })
}

fn report(what: &str, m: &Measured) {
    println!(
        "{what:>6}: unary {:>9.0} calls/s   stream {:>8.1} MiB/s",
        m.calls_per_sec, m.stream_mib_per_sec
    );
}

async fn over_verbio(args: &Args, pool: Arc<Pool>) -> Result<Measured, RunError> {
    let incoming = RdmaIncoming::bind(&pool, Placement::Thread(0), "127.0.0.1:0".parse()?).await?;
    let addr = incoming.local_addr();
    let server = tokio::spawn(
        Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve_with_incoming(incoming),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_with_connector(RdmaConnector::new(pool).placement(Placement::Thread(1)))
        .await?;
    let m = drive(args, channel).await;
    server.abort();
    m
}

async fn over_tcp(args: &Args) -> Result<Measured, RunError> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let incoming = tonic::transport::server::TcpIncoming::bind(any)?;
    let addr = incoming.local_addr()?;
    let server = tokio::spawn(
        Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve_with_incoming(incoming),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let m = drive(args, channel).await;
    server.abort();
    m
}

async fn run(args: Args) -> Result<(), RunError> {
    let pool = Arc::new(
        Pool::builder()
            .threads(2)
            .device_per_thread(|_| verbio::provider::open_device(None))
            .build()?,
    );
    println!(
        "{} unary calls of {} B from {} tasks; a {} MiB server stream in chunks of {} B",
        args.calls, args.payload, args.tasks, args.stream_mib, args.chunk
    );
    let verbio = over_verbio(&args, pool.clone()).await?;
    report("verbio", &verbio);
    if args.tcp {
        let tcp = over_tcp(&args).await?;
        report("tcp", &tcp);
        println!(
            "ratio verbio/tcp: unary {:.2}  stream {:.2}",
            verbio.calls_per_sec / tcp.calls_per_sec,
            verbio.stream_mib_per_sec / tcp.stream_mib_per_sec
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("grpc_echo: building the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let limit = Duration::from_secs(args.timeout);
    match rt.block_on(async { tokio::time::timeout(limit, run(args)).await }) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("grpc_echo: {}", verbio::ErrorChain(&*e));
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("grpc_echo: the run did not finish within {limit:?}");
            ExitCode::FAILURE
        }
    }
}
