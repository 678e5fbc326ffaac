//! [`RdmaConnection`]: one verbio connection as an HTTP/2 transport, with
//! the information a tonic server hands its handlers ([`RdmaConnectInfo`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

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
    /// Until the peer's first bytes have come: when they must have.
    handshake: Option<Handshake>,
}

/// The bytes a client sends first: HTTP/2's connection preface.
const PREFACE_LEN: usize = 24;

/// The bound on a server connection's first bytes.
#[derive(Debug)]
struct Handshake {
    limit: Duration,
    /// Armed at the first read (inside the tokio runtime).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes still due.
    left: usize,
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
            handshake: None,
        }
    }

    /// Fails the connection's reads (`TimedOut`, so hyper and tonic drop
    /// it) unless the peer's first 24 bytes (HTTP/2's connection preface)
    /// have come within `limit` of the first read: a peer that connects
    /// and stalls holds nothing for long. [`RdmaIncoming`](crate::RdmaIncoming)
    /// sets it on every connection it accepts.
    pub fn with_handshake_timeout(mut self, limit: Duration) -> RdmaConnection {
        self.handshake = Some(Handshake {
            limit,
            deadline: None,
            left: PREFACE_LEN,
        });
        self
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
        let this = &mut *self;
        let Some(h) = &mut this.handshake else {
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        };
        let limit = h.limit;
        let deadline = h
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if deadline.as_mut().poll(cx).is_ready() {
            let got = PREFACE_LEN - h.left;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the peer sent {got} of its first {PREFACE_LEN} bytes within {limit:?}"),
            )));
        }
        let (before, room) = (buf.filled().len(), buf.remaining());
        ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
        let n = buf.filled().len() - before;
        h.left = h.left.saturating_sub(n);
        if h.left == 0 || (n == 0 && room > 0) {
            // All came (or the peer ended: the reader sees the end).
            this.handshake = None;
        }
        Poll::Ready(Ok(()))
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
