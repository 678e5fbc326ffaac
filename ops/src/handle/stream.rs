//! [`HandleStream`]: a `Send` byte stream over an [`RdmaHandle`], with the
//! framing of [`RdmaStream`](crate::agent::RdmaStream) (so either end may
//! be either type): each message carries the next bytes, in order; an
//! empty message is the writer's orderly end.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use futures::future::BoxFuture;

use super::{HandleError, RdmaHandle};
use crate::agent::DEFAULT_STREAM_CHUNK;

/// A byte stream over an [`RdmaHandle`], usable from any thread: the
/// `futures::io` traits (`AsyncRead`, `AsyncWrite`) and, with the `tokio`
/// feature, tokio's (`tokio::io::{AsyncRead, AsyncWrite}`, so
/// `tokio_util::codec` and `tokio::io::copy` work on it).
///
/// Writes are gathered into a buffer of up to `chunk` bytes; one message
/// is in flight at a time and the next one takes the writes made
/// meanwhile; a write waits when the buffer is full and the message in
/// flight has not completed. Call `flush` (or `close` / `shutdown`, which
/// also sends the orderly end: the peer then reads EOF) to push out what is
/// buffered. The stream owns the connection's messages: nothing else
/// should `send` or `receive` on it while the stream is in use.
pub struct HandleStream {
    handle: RdmaHandle,
    chunk: usize,
    /// The message being read and how much of it was read.
    current: Vec<u8>,
    pos: usize,
    read_eof: bool,
    receiving: Option<BoxFuture<'static, Result<Vec<u8>, HandleError>>>,
    /// Written bytes not yet sent.
    buffer: Vec<u8>,
    sending: Option<BoxFuture<'static, Result<(), HandleError>>>,
    /// The end was sent.
    closed: bool,
}

impl std::fmt::Debug for HandleStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleStream")
            .field("handle", &self.handle)
            .field("chunk", &self.chunk)
            .field("buffered", &self.buffer.len())
            .field("read_eof", &self.read_eof)
            .finish_non_exhaustive()
    }
}

impl From<HandleError> for io::Error {
    fn from(e: HandleError) -> io::Error {
        match e {
            HandleError::Agent(a) => a.into(),
            HandleError::Pool(p) => io::Error::new(io::ErrorKind::BrokenPipe, p),
            other => io::Error::new(io::ErrorKind::InvalidInput, other),
        }
    }
}

impl HandleStream {
    /// A stream sending messages of up to [`DEFAULT_STREAM_CHUNK`] bytes.
    pub fn new(handle: RdmaHandle) -> HandleStream {
        Self::with_chunk(handle, DEFAULT_STREAM_CHUNK)
    }

    /// A stream sending messages of up to `chunk` bytes (at least 1, at
    /// most the connection's largest message).
    pub fn with_chunk(handle: RdmaHandle, chunk: usize) -> HandleStream {
        let chunk = chunk.clamp(1, handle.max_send_len().max(1));
        HandleStream {
            handle,
            chunk,
            current: Vec::new(),
            pos: 0,
            read_eof: false,
            receiving: None,
            buffer: Vec::new(),
            sending: None,
            closed: false,
        }
    }

    /// The connection.
    pub fn handle(&self) -> &RdmaHandle {
        &self.handle
    }

    fn poll_read_into(&mut self, cx: &mut Context<'_>, out: &mut [u8]) -> Poll<io::Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        while self.pos == self.current.len() {
            if self.read_eof {
                return Poll::Ready(Ok(0));
            }
            let h = self.handle.clone();
            let fut = self
                .receiving
                .get_or_insert_with(|| Box::pin(async move { h.receive().await }));
            let msg = ready!(fut.as_mut().poll(cx));
            self.receiving = None;
            let msg = msg?;
            if msg.is_empty() {
                self.read_eof = true;
            }
            self.current = msg;
            self.pos = 0;
        }
        let n = out.len().min(self.current.len() - self.pos);
        out[..n].copy_from_slice(&self.current[self.pos..self.pos + n]);
        self.pos += n;
        Poll::Ready(Ok(n))
    }

    /// Polls the message in flight, if any.
    fn poll_sending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(s) = &mut self.sending {
            let r = ready!(s.as_mut().poll(cx));
            self.sending = None;
            r?;
        }
        Poll::Ready(Ok(()))
    }

    /// Sends `data` as the message in flight (none may be).
    fn start_send(&mut self, data: Vec<u8>) {
        debug_assert!(self.sending.is_none());
        let h = self.handle.clone();
        self.sending = Some(Box::pin(async move { h.send(data).await }));
    }

    fn poll_write_from(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        if self.closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after the stream was closed",
            )));
        }
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // Idle with bytes buffered (a full buffer that waited for the
        // message in flight): they go first.
        let idle = loop {
            let idle = self.poll_sending(cx)?.is_ready();
            if idle && !self.buffer.is_empty() {
                let full = std::mem::take(&mut self.buffer);
                self.start_send(full);
                continue;
            }
            break idle;
        };
        let room = self.chunk - self.buffer.len();
        if room == 0 {
            // Full, and a message is in flight, polled above: its
            // completion wakes us.
            return Poll::Pending;
        }
        let n = room.min(data.len());
        self.buffer.extend_from_slice(&data[..n]);
        if idle {
            let full = std::mem::take(&mut self.buffer);
            self.start_send(full);
            // Register for its completion.
            let _ = self.poll_sending(cx)?;
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush_all(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.poll_sending(cx))?;
            if self.buffer.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let full = std::mem::take(&mut self.buffer);
            self.start_send(full);
        }
    }

    fn poll_close_stream(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.closed {
            ready!(self.poll_flush_all(cx))?;
            self.closed = true;
            self.start_send(Vec::new());
        }
        self.poll_sending(cx)
    }
}

impl futures::io::AsyncRead for HandleStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_read_into(cx, buf)
    }
}

impl futures::io::AsyncWrite for HandleStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_from(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_flush_all(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_close_stream(cx)
    }
}

#[cfg(feature = "tokio")]
impl tokio::io::AsyncRead for HandleStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = ready!(self.get_mut().poll_read_into(cx, buf.initialize_unfilled()))?;
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

#[cfg(feature = "tokio")]
impl tokio::io::AsyncWrite for HandleStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_from(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_flush_all(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_close_stream(cx)
    }
}
