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
//! cargo run --release -p verbio-tonic --example grpc_echo -- --tcp --payloads 64,1024,16384,262144 --chunks 4096,65536,1048576
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
    /// Bytes of each unary call's payload (a row per size).
    #[arg(long, value_delimiter = ',', default_values_t = vec![32])]
    payloads: Vec<usize>,
    /// Tasks (tokio::spawn) sharing the calls, each with a clone of the
    /// channel.
    #[arg(long, default_value_t = 16)]
    tasks: usize,
    /// MiB of the server stream.
    #[arg(long, default_value_t = 16)]
    stream_mib: u32,
    /// Bytes per streamed chunk, at most 1 MiB (a row per size).
    #[arg(long, value_delimiter = ',', default_values_t = vec![65536])]
    chunks: Vec<u32>,
    /// Largest message of each connection's byte stream, in bytes (the
    /// HTTP/2 bytes go in messages of up to this size).
    #[arg(long, default_value_t = verbio::ops::agent::DEFAULT_STREAM_CHUNK)]
    conn_chunk: usize,
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

/// A channel to each transport's server (the servers run as tokio tasks).
struct Transports {
    verbio: Channel,
    tcp: Option<Channel>,
}

/// A tonic server of the example service over verbio, and a channel to it.
async fn over_verbio(args: &Args, pool: Arc<Pool>) -> Result<Channel, RunError> {
    let incoming = RdmaIncoming::bind(&pool, Placement::Thread(0), "127.0.0.1:0".parse()?)
        .await?
        .chunk(args.conn_chunk);
    let addr = incoming.local_addr();
    tokio::spawn(
        Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve_with_incoming(incoming),
    );
    let connector = RdmaConnector::new(pool)
        .placement(Placement::Thread(1))
        .chunk(args.conn_chunk);
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_with_connector(connector)
        .await?)
}

/// The same over tonic's kernel TCP transport.
async fn over_tcp() -> Result<Channel, RunError> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let incoming = tonic::transport::server::TcpIncoming::bind(any)?;
    let addr = incoming.local_addr()?;
    tokio::spawn(
        Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve_with_incoming(incoming),
    );
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?)
}

/// `calls` unary calls of `payload` bytes shared by `tasks` tasks; calls
/// per second.
async fn unary_rate(
    channel: &Channel,
    calls: usize,
    payload: usize,
    tasks: usize,
) -> Result<f64, RunError> {
    let client = EchoClient::new(channel.clone());
    let start = Instant::now();
    let mut running = Vec::new();
    for t in 0..tasks {
        let mut client = client.clone();
        let n = calls / tasks + usize::from(t < calls % tasks);
        running.push(tokio::spawn(async move {
            unary_calls(&mut client, n, payload, t as u64).await
        }));
    }
    for t in running {
        t.await??;
    }
    Ok(calls as f64 / start.elapsed().as_secs_f64())
}

/// A server stream of `mib` MiB in chunks of `chunk` bytes; MiB/s.
async fn stream_rate(channel: &Channel, mib: u32, chunk: u32) -> Result<f64, RunError> {
    let chunk = chunk.clamp(1, common::MAX_CHUNK);
    let chunks = ((u64::from(mib) << 20) / u64::from(chunk)).max(1) as u32;
    let start = Instant::now();
    let bytes = stream_checked(&mut EchoClient::new(channel.clone()), chunks, chunk, 7).await?;
    Ok(bytes as f64 / f64::from(1 << 20) / start.elapsed().as_secs_f64())
}

/// Measures `what` on verbio and, if there, TCP (alternating which goes
/// first by `row`), and prints one row.
async fn row<F, Fut>(
    t: &Transports,
    row: usize,
    label: &str,
    unit: &str,
    what: F,
) -> Result<(), RunError>
where
    F: Fn(Channel) -> Fut,
    Fut: std::future::Future<Output = Result<f64, RunError>>,
{
    let (v, tcp) = match &t.tcp {
        None => (what(t.verbio.clone()).await?, None),
        Some(tcp) if row % 2 == 0 => {
            let v = what(t.verbio.clone()).await?;
            (v, Some(what(tcp.clone()).await?))
        }
        Some(tcp) => {
            let k = what(tcp.clone()).await?;
            (what(t.verbio.clone()).await?, Some(k))
        }
    };
    match tcp {
        None => println!("{label:<22} verbio {v:>10.1} {unit}"),
        Some(k) => println!(
            "{label:<22} verbio {v:>10.1} {unit}   tcp {k:>10.1} {unit}   verbio/tcp {:.2}",
            v / k
        ),
    }
    Ok(())
}

async fn run(args: Args) -> Result<(), RunError> {
    let pool = Arc::new(
        Pool::builder()
            .threads(2)
            .device_per_thread(|_| verbio::provider::open_device(None))
            .build()?,
    );
    let verbio = over_verbio(&args, pool.clone()).await?;
    let tcp = if args.tcp {
        Some(over_tcp().await?)
    } else {
        None
    };
    let t = Transports { verbio, tcp };
    let tasks = args.tasks.max(1);
    println!(
        "{} unary calls from {tasks} tasks per payload; a {} MiB server stream per chunk size",
        args.calls, args.stream_mib
    );
    let mut n = 0;
    for &payload in &args.payloads {
        let label = format!("unary {payload} B");
        row(&t, n, &label, "calls/s", |c| async move {
            unary_rate(&c, args.calls, payload, tasks).await
        })
        .await?;
        n += 1;
    }
    for &chunk in &args.chunks {
        let label = format!("stream, chunks {chunk} B");
        row(&t, n, &label, "MiB/s", |c| async move {
            stream_rate(&c, args.stream_mib, chunk).await
        })
        .await?;
        n += 1;
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
