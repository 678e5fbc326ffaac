//! gRPC (tonic) and HTTP/2 (hyper) over verbio's RDMA connections.
//!
//! verbio's connections live on the threads of a
//! [`Pool`](verbio::runtime::Pool) and are used from anywhere through
//! `Send` handles; their byte stream ([`HandleStream`](verbio::HandleStream))
//! implements tokio's I/O traits. This crate plugs that stream into the
//! two places tonic takes a transport:
//!
//! * client: [`RdmaConnector`], a `tower::Service<Uri>` for
//!   `Endpoint::connect_with_connector` (the `Uri`'s host and port name the
//!   verbio listener);
//! * server: [`RdmaIncoming`], a `Stream` of [`RdmaConnection`]s (tokio
//!   `AsyncRead + AsyncWrite` and tonic's `Connected`) for
//!   `Server::serve_with_incoming`.
//!
//! Everything runs on tokio's multi-thread runtime with `tokio::spawn`; no
//! `LocalSet`. The same connections carry plain hyper HTTP/2 (wrap an
//! [`RdmaConnection`] in [`hyper_util::rt::TokioIo`], or take the
//! connector's response as is).
//!
//! A whole program: an HTTP/2 echo over verbio, hyper on both ends (the
//! same lines with tonic are in the comments, and in `examples/grpc_echo.rs`).
//!
//! ```
//! use std::sync::Arc;
//!
//! use bytes::Bytes;
//! use futures::StreamExt;
//! use http_body_util::{BodyExt, Full, Limited};
//! use hyper_util::rt::{TokioExecutor, TokioIo};
//! use verbio::runtime::{Placement, Pool};
//! use verbio_tonic::{RdmaConnector, RdmaIncoming};
//!
//! type Error = Box<dyn std::error::Error + Send + Sync>;
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Error> {
//!     // Runtime threads, each with a device (VERBIO_DEVICE, else hardware,
//!     // else a soft device).
//!     let pool = Arc::new(
//!         Pool::builder()
//!             .threads(2)
//!             .device_per_thread(|_| verbio::provider::open_device(None))
//!             .build()?,
//!     );
//!     // Server: hyper's HTTP/2 on each connection the listener accepts
//!     // (tonic: `Server::builder().add_service(..).serve_with_incoming(incoming)`).
//!     let mut incoming =
//!         RdmaIncoming::bind(&pool, Placement::Thread(0), "127.0.0.1:0".parse()?).await?;
//!     let addr = incoming.local_addr();
//!     tokio::spawn(async move {
//!         while let Some(conn) = incoming.next().await {
//!             let Ok(conn) = conn else { continue }; // a client that failed its handshake
//!             let echo = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async {
//!                 let body = Limited::new(req.into_body(), 1 << 20).collect().await?;
//!                 Ok::<_, Error>(http::Response::new(Full::new(body.to_bytes())))
//!             });
//!             let http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
//!             tokio::spawn(http2.serve_connection(TokioIo::new(conn), echo));
//!         }
//!     });
//!     // Client: one verbio connection, HTTP/2 over it (tonic:
//!     // `Endpoint::connect_with_connector(RdmaConnector::new(pool))`).
//!     let connector = RdmaConnector::new(pool.clone()).placement(Placement::Thread(1));
//!     let io = connector.connect_uri(format!("http://{addr}").parse()?).await?;
//!     let (mut sender, conn) =
//!         hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)).await?;
//!     tokio::spawn(conn);
//!     let request = http::Request::post(format!("http://{addr}/echo"))
//!         .body(Full::new(Bytes::from_static(b"hello over RDMA")))?;
//!     let response = sender.send_request(request).await?;
//!     let body = response.into_body().collect().await?.to_bytes();
//!     assert_eq!(body, "hello over RDMA");
//!     Ok(())
//! }
//! ```
//!
//! The crate's `examples/grpc_echo.rs` is a whole service (a unary and a
//! server-streaming method) run this way; its repository's
//! `docs/tokio.md` says what the handles cost.
#![warn(missing_docs)]

mod connection;
mod connector;
mod error;
mod incoming;

pub use connection::{RdmaConnectInfo, RdmaConnection};
pub use connector::RdmaConnector;
pub use error::{AcceptError, ConnectError};
pub use incoming::{RdmaIncoming, DEFAULT_HANDSHAKE_TIMEOUT};
