//! [`RdmaStream`]: a byte stream (`futures::io::AsyncRead` +
//! `AsyncWrite`) over an [`Rdma`] connection, for codecs and framed
//! protocols. Built on the public `send` / `receive_msg` path: each
//! message carries the next stream bytes, in order; an empty message is the
//! writer's orderly end (the reader sees EOF).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{ready, Context, Poll};

use futures::future::LocalBoxFuture;
use futures::io::{AsyncBufRead, AsyncRead, AsyncWrite};

use super::error::AgentError;
use super::msg::RecvMsg;
use super::rdma::Rdma;
use super::receive::Receive;

/// Default largest message the stream sends at once.
pub const DEFAULT_STREAM_CHUNK: usize = 64 << 10;

type Receiving = Receive;
type Sending = LocalBoxFuture<'static, (Result<(), AgentError>, Vec<u8>)>;

/// A byte stream over an [`Rdma`] connection (`AsyncRead`, `AsyncBufRead`
/// and `AsyncWrite` of `futures::io`; `AsyncReadExt::split` gives two
/// halves).
///
/// Writes are copied into a buffer of up to `chunk` bytes; one message is in
/// flight at a time and the next one gathers the writes made meanwhile, so
/// small writes coalesce under load. A write waits (back-pressure) when the
/// buffer is full and the message in flight has not completed, which in
/// turn waits for the peer's send credits, i.e. for its reader. As with any
/// buffered writer, call `flush` (or `close`) to push out what is buffered.
/// `close` flushes and sends the orderly end: the peer's reads return EOF
/// (0) after the last byte; the other direction stays open.
///
/// The stream owns the connection's messages: the peer must speak the same
/// framing (be an `RdmaStream`), and no other code should call `send` or
/// `receive` on the same connection while the stream is in use. Reading
/// after the peer went away without closing fails with
/// `ConnectionReset` (see `From<AgentError> for io::Error`).
///
/// ```
/// # mod verbio { pub use verbio_ops::*; pub mod ops { pub use verbio_ops::*; } pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use futures::io::{AsyncReadExt, AsyncWriteExt};
/// use verbio::runtime::Runtime;
/// use verbio::{RdmaBuilder, RdmaStream};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?;
/// rt.block_on(async {
///     // Both ends in one runtime, on the software device over loopback.
///     let builder = RdmaBuilder::new().device_name("soft0");
///     let listener = builder.listen("127.0.0.1:0".parse()?)?;
///     let addr = listener.local_addr()?;
///     let (server, client) = futures::join!(listener.accept(), builder.connect(addr));
///     let (mut server, mut client) = (RdmaStream::from(server?), RdmaStream::from(client?));
///     client.write_all(b"hello over RDMA").await?;
///     client.close().await?; // the server reads EOF after the last byte
///     let mut got = String::new();
///     server.read_to_string(&mut got).await?;
///     assert_eq!(got, "hello over RDMA");
///     Ok(())
/// })
/// # }
/// ```
pub struct RdmaStream {
    rdma: Rc<Rdma>,
    chunk: usize,
    receiving: Option<Receiving>,
    current: Option<RecvMsg>,
    pos: usize,
    read_eof: bool,
    out: Vec<u8>,
    spare: Vec<u8>,
    sending: Option<Sending>,
    write: WriteState,
}

/// Where the write half is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteState {
    Open,
    /// The end message is in flight.
    Ending,
    Closed,
}

impl std::fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaStream")
            .field("chunk", &self.chunk)
            .field("buffered_out", &self.out.len())
            .field("sending", &self.sending.is_some())
            .field("read_eof", &self.read_eof)
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

impl RdmaStream {
    /// A stream over `rdma` with messages of up to [`DEFAULT_STREAM_CHUNK`]
    /// bytes (or the connection's `max_send_len`, if smaller).
    pub fn new(rdma: Rc<Rdma>) -> RdmaStream {
        RdmaStream::with_chunk(rdma, DEFAULT_STREAM_CHUNK)
    }

    /// A stream whose messages carry up to `chunk` bytes (at least 1, at
    /// most the connection's `max_send_len`).
    pub fn with_chunk(rdma: Rc<Rdma>, chunk: usize) -> RdmaStream {
        let chunk = chunk.clamp(1, rdma.max_send_len().max(1));
        RdmaStream {
            rdma,
            chunk,
            receiving: None,
            current: None,
            pos: 0,
            read_eof: false,
            out: Vec::with_capacity(chunk),
            spare: Vec::with_capacity(chunk),
            sending: None,
            write: WriteState::Open,
        }
    }

    /// The connection.
    pub fn rdma(&self) -> &Rc<Rdma> {
        &self.rdma
    }

    /// Bytes per message at most.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Drives the message in flight; `Ready(Ok)` once none is.
    fn poll_sending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(f) = self.sending.as_mut() {
            let (res, mut buf) = ready!(f.as_mut().poll(cx));
            self.sending = None;
            buf.clear();
            self.spare = buf;
            res?;
        }
        Poll::Ready(Ok(()))
    }

    /// Starts sending what is buffered (or the end marker if empty) and
    /// polls it once, which posts its first piece.
    fn start_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let data = std::mem::replace(&mut self.out, std::mem::take(&mut self.spare));
        let rdma = self.rdma.clone();
        self.sending = Some(Box::pin(async move {
            let r = rdma.send(&data).await;
            (r, data)
        }));
        self.poll_sending(cx)
    }

    fn copy_out(&mut self, buf: &mut [u8]) -> Option<usize> {
        let msg = self.current.as_ref()?;
        let rest = &msg[self.pos..];
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.pos += n;
        if self.pos == msg.len() {
            self.current = None;
            self.pos = 0;
        }
        Some(n)
    }
}

impl RdmaStream {
    /// Receives the next message into `current`, or notes the orderly end
    /// (an empty message) in `read_eof`.
    fn poll_next_message(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let rdma = &self.rdma;
        let f = self
            .receiving
            .get_or_insert_with(|| Receive::new(&rdma.shared));
        let res = ready!(Pin::new(f).poll(cx));
        self.receiving = None;
        let msg = res?;
        if msg.is_empty() {
            self.read_eof = true;
        } else {
            self.current = Some(msg);
            self.pos = 0;
        }
        Poll::Ready(Ok(()))
    }
}

impl From<Rdma> for RdmaStream {
    fn from(rdma: Rdma) -> RdmaStream {
        RdmaStream::new(Rc::new(rdma))
    }
}

impl AsyncRead for RdmaStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            if let Some(n) = this.copy_out(buf) {
                return Poll::Ready(Ok(n));
            }
            if this.read_eof {
                return Poll::Ready(Ok(0));
            }
            ready!(this.poll_next_message(cx))?;
        }
    }
}

/// Reads without a copy out of the received message (`fill_buf` gives the
/// rest of the current message).
impl AsyncBufRead for RdmaStream {
    fn poll_fill_buf(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        let this = self.get_mut();
        while this.current.is_none() && !this.read_eof {
            ready!(this.poll_next_message(cx))?;
        }
        match &this.current {
            Some(m) => Poll::Ready(Ok(&m[this.pos..])),
            None => Poll::Ready(Ok(&[])),
        }
    }

    fn consume(self: Pin<&mut Self>, amt: usize) {
        let this = self.get_mut();
        if let Some(m) = &this.current {
            this.pos = (this.pos + amt).min(m.len());
            if this.pos == m.len() {
                this.current = None;
                this.pos = 0;
            }
        }
    }
}

impl AsyncWrite for RdmaStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write != WriteState::Open {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after close on an RdmaStream",
            )));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if let Poll::Ready(r) = this.poll_sending(cx) {
            r?;
        }
        if this.sending.is_none() && !this.out.is_empty() {
            if let Poll::Ready(Err(e)) = this.start_send(cx) {
                return Poll::Ready(Err(e));
            }
        }
        let room = this.chunk - this.out.len();
        if room == 0 {
            // Full while a message is in flight (polled above with this
            // context, so its completion wakes this task).
            return Poll::Pending;
        }
        let n = room.min(buf.len());
        this.out.extend_from_slice(&buf[..n]);
        if this.sending.is_none() {
            if let Poll::Ready(Err(e)) = this.start_send(cx) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.poll_sending(cx))?;
            if this.out.is_empty() {
                return Poll::Ready(Ok(()));
            }
            ready!(this.start_send(cx))?;
        }
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write == WriteState::Open {
            ready!(self.as_mut().poll_flush(cx))?;
            let this = self.as_mut().get_mut();
            this.write = WriteState::Ending;
            // `out` is empty: this sends the end marker.
            let r = ready!(this.start_send(cx));
            this.write = WriteState::Closed;
            return Poll::Ready(r);
        }
        let this = self.as_mut().get_mut();
        if this.write == WriteState::Ending {
            let r = ready!(this.poll_sending(cx));
            this.write = WriteState::Closed;
            return Poll::Ready(r);
        }
        Poll::Ready(Ok(()))
    }
}
