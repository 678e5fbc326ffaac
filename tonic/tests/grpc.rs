//! gRPC over verbio: the example service's unary and server-streaming
//! methods through tonic on tokio's multi-thread runtime (tokio::spawn,
//! no LocalSet), strangers at the server's port, and the ends of the
//! connector and of the incoming stream.

#[path = "../examples/common/mod.rs"]
mod common;
mod support;

use std::future::Future;

use common::{stream_checked, unary_calls, EchoClient, EchoServer, EchoService};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint, Server};
use verbio::runtime::{Placement, Pool};
use verbio::{HandleStream, RdmaHandle};
use verbio_tonic::{AcceptError, ConnectError, RdmaConnection, RdmaConnector, RdmaIncoming};

use support::{any_addr, bounded, pool, WAIT};

/// Compile-time only: what tonic needs is `Send`.
#[allow(dead_code)]
fn connector_and_incoming_are_send(pool: std::sync::Arc<Pool>, incoming: RdmaIncoming) {
    fn send<T: Send>(_: &T) {}
    fn send_sync_clone<T: Send + Sync + Clone>() {}
    send_sync_clone::<RdmaConnector>();
    send_sync_clone::<verbio_tonic::RdmaConnectInfo>();
    fn send_type<T: Send>() {}
    send_type::<RdmaConnection>();
    send(&incoming);
    let mut c = RdmaConnector::new(pool);
    send(&tower_service::Service::call(
        &mut c,
        http::Uri::from_static("http://[::1]:1"),
    ));
}

/// A tonic server of the example service on `pool`'s thread 0, spawned
/// with tokio::spawn; its address and task.
async fn serve(
    pool: &Pool,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    serve_with(pool, verbio_tonic::DEFAULT_HANDSHAKE_TIMEOUT).await
}

/// [`serve`] with a handshake timeout.
async fn serve_with(
    pool: &Pool,
    handshake: std::time::Duration,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    let incoming = bounded(
        "binding the listener",
        RdmaIncoming::bind(pool, Placement::Thread(0), any_addr()),
    )
    .await
    .expect("bind")
    .handshake_timeout(Some(handshake));
    let addr = incoming.local_addr();
    let server = tokio::spawn(
        Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve_with_incoming(incoming),
    );
    (addr, server)
}

/// A channel to `addr` over verbio connections on `pool`'s thread 1.
async fn channel(pool: &std::sync::Arc<Pool>, addr: std::net::SocketAddr) -> Channel {
    let connector = RdmaConnector::new(pool.clone()).placement(Placement::Thread(1));
    bounded(
        "connecting the channel",
        Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector),
    )
    .await
    .expect("channel")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unary_and_server_stream_from_tokio_tasks() {
    let pool = pool(2);
    let (addr, server) = serve(&pool).await;
    let client = EchoClient::new(channel(&pool, addr).await);

    // 16 tasks on 4 workers share one channel (one verbio connection).
    let mut tasks = Vec::new();
    for t in 0..16u64 {
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            unary_calls(&mut client, 40, 32 + 997 * t as usize, t).await
        }));
    }
    for t in tasks {
        bounded("the unary calls", t)
            .await
            .expect("task")
            .expect("unary calls");
    }
    // 8 MiB streamed in chunks of 64 KiB, and one of odd length.
    let bytes = bounded(
        "the server stream",
        stream_checked(&mut client.clone(), 128, 65536, 42),
    )
    .await
    .expect("stream");
    assert_eq!(bytes, 8 << 20);
    let bytes = bounded(
        "the odd server stream",
        stream_checked(&mut client.clone(), 3, 100_001, 43),
    )
    .await
    .expect("odd stream");
    assert_eq!(bytes, 300_003);
    // A request the service refuses fails that call only.
    let refused = client
        .clone()
        .stream_chunks(common::StreamRequest {
            chunks: 1,
            chunk_len: common::MAX_CHUNK + 1,
            seed: 0,
        })
        .await
        .expect_err("an oversized chunk is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    unary_calls(&mut client.clone(), 1, 10, 99)
        .await
        .expect("a call after the refusal");
    assert!(!server.is_finished(), "the server stopped");
    server.abort();
}

/// A verbio connection to `addr` from a stranger (no HTTP/2 client).
async fn stranger(pool: &Pool, addr: std::net::SocketAddr) -> HandleStream {
    let h = bounded(
        "the stranger's connection",
        RdmaHandle::connect(pool, Placement::Thread(1), addr),
    )
    .await
    .expect("stranger connects");
    HandleStream::new(h)
}

/// Reads until the server ends the connection (EOF or an error), within
/// [`WAIT`]; the bytes it sent before.
async fn until_closed(s: &mut HandleStream, what: &str) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    bounded(&format!("the server closing {what}"), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    got
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// HTTP/2's GOAWAY frame type and its FRAME_SIZE_ERROR code.
const GOAWAY: u8 = 7;
const FRAME_SIZE_ERROR: u32 = 6;

/// The HTTP/2 frames in `bytes` (type, payload), up to the first one cut
/// short.
fn frames(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        if bytes.len() < 9 + len {
            break;
        }
        out.push((bytes[3], bytes[9..9 + len].to_vec()));
        bytes = &bytes[9 + len..];
    }
    out
}

async fn write_all(s: &mut HandleStream, data: &[u8]) {
    bounded("the stranger's write", async {
        s.write_all(data).await.expect("write");
        s.flush().await.expect("flush");
    })
    .await;
}

/// [`write_all`] of bytes the server may stop reading part-way: it closes
/// the connection on the bad bytes it has seen, so the rest of the write
/// may fail (the stream's QP gone at the other end). Either way, within
/// [`WAIT`].
async fn write_all_or_closed(s: &mut HandleStream, data: &[u8]) {
    bounded(
        "the stranger's write (may meet the server's close)",
        async {
            if s.write_all(data).await.is_ok() {
                let _ = s.flush().await;
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_peers_fail_only_their_connection() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let pool = pool(2);
    let (addr, server) = serve(&pool).await;
    // A good client before the strangers, kept across them.
    let mut before = EchoClient::new(channel(&pool, addr).await);
    unary_calls(&mut before, 5, 64, 1).await.expect("before");

    // Garbage instead of the preface.
    let mut garbage = stranger(&pool, addr).await;
    let junk: Vec<u8> = common::chunk_bytes(9, 0, 64 << 10);
    write_all_or_closed(&mut garbage, &junk).await;
    until_closed(&mut garbage, "a connection sending garbage").await;

    // The preface, then a frame header cut short, then the orderly end.
    let mut truncated = stranger(&pool, addr).await;
    write_all(&mut truncated, PREFACE).await;
    write_all(&mut truncated, &[0, 0, 6, 4]).await;
    bounded("the stranger's shutdown", truncated.shutdown())
        .await
        .expect("shutdown");
    until_closed(&mut truncated, "a truncated frame").await;

    // The preface, then a SETTINGS frame claiming 16 MiB - 1 of payload
    // (over HTTP/2's default largest frame): a GOAWAY, then the end.
    let mut oversized = stranger(&pool, addr).await;
    write_all(&mut oversized, PREFACE).await;
    write_all_or_closed(&mut oversized, &[0xff, 0xff, 0xff, 4, 0, 0, 0, 0, 0]).await;
    write_all_or_closed(&mut oversized, &junk[..4096]).await;
    let got = until_closed(&mut oversized, "an oversized frame").await;
    let goaway = frames(&got)
        .into_iter()
        .find(|(kind, _)| *kind == GOAWAY)
        .unwrap_or_else(|| panic!("no GOAWAY before the end: {got:?}"));
    assert_eq!(
        goaway.1.get(4..8),
        Some(&FRAME_SIZE_ERROR.to_be_bytes()[..]),
        "GOAWAY's error code"
    );

    // Half a preface, then silence: left open while others are served.
    let mut stalled = stranger(&pool, addr).await;
    write_all(&mut stalled, &PREFACE[..10]).await;

    // Strangers at the listener's TCP port itself (the verbio handshake):
    // garbage, and a connection that never speaks.
    let tcp_garbage = tokio::spawn(async move {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(&[0xAB; 4096]).await?;
        let mut buf = [0u8; 64];
        // The listener drops it: EOF or a reset.
        let _ = tokio::time::timeout(WAIT, s.read(&mut buf)).await;
        Ok::<_, std::io::Error>(())
    });
    let tcp_silent = tokio::net::TcpStream::connect(addr).await.expect("tcp");

    // The server still serves: the old client and a new one, both methods.
    unary_calls(&mut before, 20, 64, 2)
        .await
        .expect("after, old client");
    let mut after = EchoClient::new(channel(&pool, addr).await);
    bounded("calls after the strangers", async {
        unary_calls(&mut after, 20, 1000, 3)
            .await
            .expect("after, new client");
        let n = stream_checked(&mut after, 16, 65536, 5)
            .await
            .expect("stream after");
        assert_eq!(n, 1 << 20);
    })
    .await;
    bounded("the TCP stranger", tcp_garbage)
        .await
        .expect("task")
        .expect("tcp stranger");
    assert!(!server.is_finished(), "a stranger stopped the server");
    drop((stalled, tcp_silent));
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_silent_past_the_handshake_timeout_is_dropped() {
    let pool = pool(2);
    let limit = std::time::Duration::from_millis(300);
    let (addr, server) = serve_with(&pool, limit).await;
    let mut good = EchoClient::new(channel(&pool, addr).await);
    unary_calls(&mut good, 2, 64, 1).await.expect("first calls");
    // Half a preface, then silence: the server drops it.
    let mut stalled = stranger(&pool, addr).await;
    write_all(&mut stalled, &PREFACE[..10]).await;
    until_closed(&mut stalled, "a client silent past the handshake timeout").await;
    // Nothing at all: dropped too.
    let mut silent = stranger(&pool, addr).await;
    until_closed(&mut silent, "a client that never speaks").await;
    // A client that sent its preface long ago is not bound by it: idle
    // past the limit, it is still served.
    tokio::time::sleep(limit * 2).await;
    unary_calls(&mut good, 2, 64, 2)
        .await
        .expect("calls after idling");
    assert!(!server.is_finished(), "the server stopped");
    server.abort();
}

/// Runs `f` on a connector to `addr` and returns its error.
async fn connect_error<F, Fut>(f: F) -> ConnectError
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<RdmaConnection, ConnectError>>,
{
    bounded("a connect that fails", f())
        .await
        .expect_err("the connect must fail")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connector_names_what_is_wrong_with_the_address() {
    let pool = pool(1);
    let c = RdmaConnector::new(pool.clone());
    let e = connect_error(|| c.connect_uri(http::Uri::from_static("http://127.0.0.1"))).await;
    assert!(matches!(e, ConnectError::NoPort { .. }), "{e:?}");
    let e = connect_error(|| c.connect_uri(http::Uri::from_static("/path/only"))).await;
    assert!(matches!(e, ConnectError::NoHost { .. }), "{e:?}");
    // Nothing listens there: the verbio connect fails, naming the address.
    let closed = std::net::TcpListener::bind(any_addr()).unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let e = connect_error(|| c.connect_uri(format!("http://{addr}").parse().unwrap())).await;
    match e {
        ConnectError::Connect { addr: a, .. } => assert_eq!(a, addr),
        other => panic!("expected Connect, got {other:?}"),
    }
    // A host name (resolved from /etc/hosts, no DNS): its addresses are
    // tried, and the error names the last one.
    let e = connect_error(|| {
        c.connect_uri(format!("http://localhost:{}", addr.port()).parse().unwrap())
    })
    .await;
    assert!(matches!(e, ConnectError::Connect { .. }), "{e:?}");
    // Through tonic: the channel's connect fails with the same cause.
    let err = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector(c.clone())
        .await
        .expect_err("a channel to nothing");
    let chain = verbio::ErrorChain(&err).to_string();
    assert!(chain.contains(&addr.to_string()), "{chain}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incoming_ends_when_its_pool_shuts_down() {
    let pool = pool(1);
    let mut incoming = RdmaIncoming::bind(&pool, Placement::Thread(0), any_addr())
        .await
        .expect("bind");
    let next = tokio::spawn(async move {
        let first = incoming.next().await;
        let second = incoming.next().await;
        (first.map(|r| r.err()), second.is_none())
    });
    pool.shutdown();
    let (first, ended) = bounded("the incoming stream's end", next)
        .await
        .expect("task");
    match first {
        Some(Some(AcceptError::Listener { .. })) => {}
        other => panic!("expected AcceptError::Listener, got {other:?}"),
    }
    assert!(ended, "the stream goes on after the listener is gone");
}
