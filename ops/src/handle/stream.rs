//! [`HandleStream`]: a `Send` byte stream over an [`RdmaHandle`], with the
//! framing of [`RdmaStream`](crate::agent::RdmaStream) (so either end may
//! be either type): each message carries the next bytes, in order; an
//! empty message is the writer's orderly end.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use verbio_runtime::pool::{Answer, Waiting};

use super::serve::{Reply, Request};
use super::{HandleError, RdmaHandle};
use crate::agent::DEFAULT_STREAM_CHUNK;

/// A byte stream over an [`RdmaHandle`], usable from any thread: the
/// `futures::io` traits (`AsyncRead`, `AsyncWrite`) and, with the `tokio`
/// feature, tokio's (`tokio::io::{AsyncRead, AsyncWrite}`, so
/// `tokio_util::codec` and `tokio::io::copy` work on it).
///
/// Writes pipeline: a write hands its bytes (as one message of up to
/// `chunk` bytes) to the runtime thread and returns while fewer than
/// [`WRITE_WINDOW`](Self::WRITE_WINDOW) messages are in flight; past that, writes are gathered
/// into a buffer of up to `chunk` bytes, and a write waits once that is
/// full. The runtime thread sends the stream's messages one at a time in
/// order, each even if the stream is dropped meanwhile. A failed send
/// surfaces on a later `write`, `flush` or `close` (and every call after
/// it fails too). `flush` sends what is buffered and waits for every
/// message in flight; `close` / `shutdown` also sends the orderly end
/// (the peer then reads EOF).
///
/// Reads take the messages the runtime thread received ahead for the
/// connection (see [`RdmaHandle::receive`]): a read that finds one never
/// waits for that thread. The stream owns the connection's messages:
/// nothing else should `send` or `receive` on it while the stream is in
/// use.
pub struct HandleStream {
    handle: RdmaHandle,
    chunk: usize,
    /// The message being read and how much of it was read.
    current: Vec<u8>,
    pos: usize,
    read_eof: bool,
    /// The reader's place in line for the next message.
    waiting: Waiting,
    /// Written bytes not yet sent.
    buffer: Vec<u8>,
    /// A message waiting for room in the runtime thread's mailbox (at most
    /// one, so that messages enter it in order).
    queued: Option<Request>,
    /// The answers of the messages handed over, oldest first.
    in_flight: VecDeque<Answer<Reply>>,
    /// The first failure of a send: every write after it fails.
    failed: Option<(io::ErrorKind, String)>,
    /// The end was sent.
    closed: bool,
}

impl std::fmt::Debug for HandleStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleStream")
            .field("handle", &self.handle)
            .field("chunk", &self.chunk)
            .field("buffered", &self.buffer.len())
            .field("in_flight", &self.in_flight.len())
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
    /// Messages a stream hands to its runtime thread before it waits for
    /// the oldest to complete: the write window (with the buffer being
    /// gathered, at most `(WRITE_WINDOW + 1) * chunk` bytes are written and
    /// not yet sent).
    pub const WRITE_WINDOW: usize = 4;

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
            waiting: Waiting::default(),
            buffer: Vec::new(),
            queued: None,
            in_flight: VecDeque::new(),
            failed: None,
            closed: false,
        }
    }

    /// The connection.
    pub fn handle(&self) -> &RdmaHandle {
        &self.handle
    }

    /// Messages handed to the runtime thread whose sends this stream has
    /// not seen complete (at most [`WRITE_WINDOW`](Self::WRITE_WINDOW)).
    pub fn sends_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The next message of the connection's read-ahead queue.
    fn poll_receive(&mut self, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>, HandleError>> {
        self.handle
            .poll_arrived(cx, &mut self.waiting)
            .map(|r| r.map(|(m, _imm)| m))
    }

    fn poll_read_into(&mut self, cx: &mut Context<'_>, out: &mut [u8]) -> Poll<io::Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        while self.pos == self.current.len() {
            if self.read_eof {
                return Poll::Ready(Ok(0));
            }
            let msg = ready!(self.poll_receive(cx))?;
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

    /// The failure recorded, as an error for this call.
    fn check_failed(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, msg)) => Err(io::Error::new(*kind, msg.clone())),
            None => Ok(()),
        }
    }

    /// Records a failed send (the first one) and returns it.
    fn fail(&mut self, e: HandleError) -> io::Error {
        let e = io::Error::from(e);
        let msg = format!("a stream message handed to the runtime thread was not sent: {e}");
        self.failed.get_or_insert((e.kind(), msg));
        self.check_failed().unwrap_err()
    }

    /// Moves the sends along: the queued message into the mailbox, and the
    /// completed answers off the front. `Ready` once no message waits for
    /// room; the first failure is returned (and kept).
    fn poll_progress(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check_failed()?;
        while let Some(a) = self.in_flight.front_mut() {
            let Poll::Ready(r) = Pin::new(a).poll(cx) else {
                break;
            };
            let a = self.in_flight.pop_front().expect("polled above");
            self.handle.conn.slots.give_back(a);
            if let Err(e) = self.handle.answered(r) {
                return Poll::Ready(Err(self.fail(e)));
            }
        }
        if self.queued.is_some() {
            if let Err(_refused) = ready!(self.handle.conn.tx.poll_send(cx, &mut self.queued)) {
                let e = self.handle.refused_error();
                return Poll::Ready(Err(self.fail(e)));
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Whether another message can be handed over now.
    fn has_room(&self) -> bool {
        self.queued.is_none() && self.in_flight.len() < Self::WRITE_WINDOW
    }

    /// Hands `data` over as the next message (there is room).
    fn start_send(&mut self, cx: &mut Context<'_>, data: Vec<u8>) -> io::Result<()> {
        debug_assert!(self.has_room());
        let (done, answer) = self.handle.conn.slots.pair();
        self.queued = Some(Request::SendInOrder {
            data,
            imm: None,
            done: Some(done),
        });
        self.in_flight.push_back(answer);
        // Into the mailbox now if it has room; either way, registered to
        // be woken.
        match self.poll_progress(cx) {
            Poll::Ready(Err(e)) => Err(e),
            _ => Ok(()),
        }
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
        let _ = self.poll_progress(cx)?;
        // Bytes gathered while the window was full go first.
        if !self.buffer.is_empty() && self.has_room() {
            let full = std::mem::take(&mut self.buffer);
            self.start_send(cx, full)?;
        }
        let room = self.chunk - self.buffer.len();
        if room == 0 {
            // Full, and the window too: a completion (or mailbox room),
            // registered above, wakes us.
            return Poll::Pending;
        }
        let n = room.min(data.len());
        if self.buffer.is_empty() && self.has_room() {
            self.start_send(cx, data[..n].to_vec())?;
        } else {
            self.buffer.extend_from_slice(&data[..n]);
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush_all(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.poll_progress(cx))?;
            if !self.buffer.is_empty() && self.has_room() {
                let full = std::mem::take(&mut self.buffer);
                self.start_send(cx, full)?;
                continue;
            }
            if self.buffer.is_empty() && self.in_flight.is_empty() {
                return Poll::Ready(Ok(()));
            }
            // Waiting for a completion, registered by `poll_progress`.
            return Poll::Pending;
        }
    }

    fn poll_close_stream(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.closed {
            ready!(self.poll_flush_all(cx))?;
            self.closed = true;
            self.start_send(cx, Vec::new())?;
        }
        self.poll_flush_all(cx)
    }
}

impl Drop for HandleStream {
    fn drop(&mut self) {
        // Its place in line for a message goes (a wake it got goes on).
        self.handle.conn.arrived.cancel(&mut self.waiting);
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
