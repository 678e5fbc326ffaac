//! hyper's own HTTP/2 (no tonic) through the same verbio connections: a
//! hyper server on an [`RdmaIncoming`]'s connections, a hyper client on an
//! [`RdmaConnector`]'s, concurrent requests multiplexed on one connection,
//! every byte checked.

mod support;

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use verbio::runtime::Placement;
use verbio_tonic::{RdmaConnector, RdmaIncoming};

use support::{any_addr, bounded, pool};

/// Largest body the server takes.
const MAX_BODY: usize = 4 << 20;

/// Answers `POST /echo` with its body reversed (and the pool thread the
/// connection lives on); anything else is 404.
async fn handle(
    thread: usize,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    if req.uri().path() != "/echo" {
        let mut r = Response::new(Full::new(Bytes::from_static(b"no such path")));
        *r.status_mut() = StatusCode::NOT_FOUND;
        return Ok(r);
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            let mut r = Response::new(Full::new(Bytes::from(e.to_string())));
            *r.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
            return Ok(r);
        }
    };
    let mut reversed = body.to_vec();
    reversed.reverse();
    let mut r = Response::new(Full::new(Bytes::from(reversed)));
    r.headers_mut()
        .insert("x-verbio-thread", thread.to_string().parse().unwrap());
    Ok(r)
}

fn body_bytes(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (j * 31 + i * 7 + j / 251) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hyper_http2_client_and_server_over_verbio() {
    let pool = pool(2);
    let incoming = bounded(
        "binding",
        RdmaIncoming::bind(&pool, Placement::Thread(0), any_addr()),
    )
    .await
    .expect("bind");
    let addr = incoming.local_addr();
    let server = tokio::spawn(async move {
        let mut incoming = incoming;
        while let Some(conn) = incoming.next().await {
            let Ok(conn) = conn else { continue };
            let thread = conn.info().thread;
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new()).serve_connection(
                    TokioIo::new(conn),
                    hyper::service::service_fn(move |req| handle(thread, req)),
                ),
            );
        }
    });

    let connector = RdmaConnector::new(pool.clone()).placement(Placement::Thread(1));
    let io = bounded(
        "connecting",
        connector.connect_uri(format!("http://{addr}").parse().unwrap()),
    )
    .await
    .expect("connect");
    assert_eq!(io.info().listener_addr, addr);
    let (sender, conn) = bounded(
        "the HTTP/2 handshake",
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)),
    )
    .await
    .expect("handshake");
    let driver = tokio::spawn(conn);

    // Requests side by side on the one connection, from tasks on any
    // worker: bodies from empty to 1 MiB.
    let mut tasks = Vec::new();
    for (i, len) in [0usize, 1, 1000, 65_535, 300_001, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let mut sender = sender.clone();
        tasks.push(tokio::spawn(async move {
            let sent = body_bytes(i, len);
            let req = Request::post(format!("http://{addr}/echo"))
                .body(Full::new(Bytes::from(sent.clone())))
                .unwrap();
            let resp = sender.send_request(req).await.expect("request");
            assert_eq!(resp.status(), StatusCode::OK);
            assert_eq!(resp.headers()["x-verbio-thread"], "0");
            let got = resp.into_body().collect().await.expect("body").to_bytes();
            let mut want = sent;
            want.reverse();
            assert!(
                got[..] == want[..],
                "request {i} ({len} B): the body differs"
            );
        }));
    }
    for t in tasks {
        bounded("the requests", t).await.expect("request task");
    }
    // A request the server refuses is answered, and the connection goes on.
    let mut sender2 = sender.clone();
    let resp = bounded(
        "a 404",
        sender2.send_request(
            Request::get(format!("http://{addr}/nothing"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        ),
    )
    .await
    .expect("request");
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let too_big = Request::post(format!("http://{addr}/echo"))
        .body(Full::new(Bytes::from(vec![0u8; MAX_BODY + 1])))
        .unwrap();
    let resp = bounded("an oversized body", sender2.send_request(too_big))
        .await
        .expect("request");
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let again = Request::post(format!("http://{addr}/echo"))
        .body(Full::new(Bytes::from_static(b"abc")))
        .unwrap();
    let resp = bounded("after the refusals", sender2.send_request(again))
        .await
        .expect("request");
    let got = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&got[..], b"cba");

    // The client goes: the connection ends cleanly on both sides.
    drop((sender, sender2));
    bounded("the client connection's end", driver)
        .await
        .expect("task")
        .expect("the client connection ends without error");
    server.abort();
}
