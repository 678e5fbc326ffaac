//! [`RdmaConnection`]: one verbio connection as an HTTP/2 transport, with
//! the information a tonic server hands its handlers ([`RdmaConnectInfo`]).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use verbio::{HandleStream, RdmaHandle};

/// A byte stream over one verbio connection ([`HandleStream`]):
/// `tokio::io::{AsyncRead, AsyncWrite}`, `Send`, and tonic's
/// [`Connected`], so a tonic or hyper server serves it like a TCP stream.
/// Wrap it in [`hyper_util::rt::TokioIo`] for hyper's own I/O traits (the
/// [`RdmaConnector`](crate::RdmaConnector) hands out that wrapping).
#[derive(Debug)]
pub struct RdmaConnection {
    stream: HandleStream,
    info: RdmaConnectInfo,
}

/// What a server knows of a connection, in each request's extensions
/// (`request.extensions().get::<RdmaConnectInfo>()`, or tonic's
/// `Request::extensions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaConnectInfo {
    /// The verbio listener's address (server side) or the address dialled
    /// (client side).
    pub listener_addr: SocketAddr,
    /// The index of the pool thread the connection lives on.
    pub thread: usize,
}

impl RdmaConnection {
    /// A connection over `handle`, messages of up to `chunk` bytes (see
    /// [`HandleStream::with_chunk`]); `listener_addr` is the listener's
    /// address, as reported in [`RdmaConnectInfo`].
    pub fn new(handle: RdmaHandle, chunk: usize, listener_addr: SocketAddr) -> RdmaConnection {
        let info = RdmaConnectInfo {
            listener_addr,
            thread: handle.thread().index(),
        };
        RdmaConnection {
            stream: HandleStream::with_chunk(handle, chunk),
            info,
        }
    }

    /// The connection's handle.
    pub fn handle(&self) -> &RdmaHandle {
        self.stream.handle()
    }

    /// What a server knows of the connection.
    pub fn info(&self) -> RdmaConnectInfo {
        self.info
    }
}

impl Connected for RdmaConnection {
    type ConnectInfo = RdmaConnectInfo;

    fn connect_info(&self) -> RdmaConnectInfo {
        self.info
    }
}

impl AsyncRead for RdmaConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for RdmaConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.stream), cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.stream), cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
