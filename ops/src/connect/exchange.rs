//! The two roles of the handshake over any `futures::io` byte stream.

use std::cell::Cell;
use std::future::Future;
use std::io::ErrorKind;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{self, Either};
use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use verbio_runtime::provider::{Endpoint, ProviderKind};

use super::error::HandshakeError;
use super::handshake::{
    self, decode_frame, encode_ready, encode_reject, parse_header, Frame, Hello, HEADER_LEN, MAGIC,
    MAX_BODY_LEN,
};

/// A time limit for a whole handshake: `timer` completes when it is over
/// (for example the reactor's `sleep(after)`); `after` is reported in
/// [`HandshakeError::Timeout`].
#[derive(Debug)]
pub struct Deadline<T> {
    /// Completes when the time is up.
    pub timer: T,
    /// The limit it stands for.
    pub after: Duration,
}

/// Where a handshake is, for timeout and I/O errors.
struct Stage(Cell<&'static str>);

impl Stage {
    fn set(&self, s: &'static str) -> &'static str {
        self.0.set(s);
        s
    }
}

async fn bounded<F, T, R>(
    work: F,
    deadline: Deadline<T>,
    stage: &Stage,
) -> Result<R, HandshakeError>
where
    F: Future<Output = Result<R, HandshakeError>>,
    T: Future<Output = ()>,
{
    let timer = deadline.timer;
    futures::pin_mut!(work, timer);
    match future::select(work, timer).await {
        Either::Left((r, _)) => r,
        Either::Right(((), _)) => Err(HandshakeError::Timeout {
            stage: stage.0.get(),
            after: deadline.after,
        }),
    }
}

/// Client role: sends `local`, waits for the server's hello, lets `connect`
/// bring the local QP to RTS with the server's endpoint, then confirms with
/// `ready`. Returns the server's endpoint. If the server's hello is refused
/// (malformed, other provider) or `connect` fails, a `reject` frame tells the
/// server why (best effort) and the error is returned.
pub async fn connect_exchange<S, F, T>(
    stream: &mut S,
    local: &Endpoint,
    connect: F,
    deadline: Deadline<T>,
) -> Result<Endpoint, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(&Endpoint) -> Result<(), HandshakeError>,
    T: Future<Output = ()>,
{
    let stage = Stage(Cell::new("starting"));
    bounded(client(stream, local, connect, &stage), deadline, &stage).await
}

/// Server role: waits for the client's hello, checks it (and that it comes
/// from the same provider, `local_provider`), lets `setup` create and connect
/// the local QP (to RTS) and return its endpoint plus anything the caller
/// wants back (the QP), sends that endpoint and waits for the client's
/// `ready`. Returns the client's endpoint and `setup`'s value. A refused
/// hello is answered with a `reject` frame (best effort).
pub async fn accept_exchange<S, F, R, T>(
    stream: &mut S,
    local_provider: ProviderKind,
    setup: F,
    deadline: Deadline<T>,
) -> Result<(Endpoint, R), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(&Endpoint) -> Result<(Endpoint, R), HandshakeError>,
    T: Future<Output = ()>,
{
    let stage = Stage(Cell::new("starting"));
    bounded(
        server(stream, local_provider, setup, &stage),
        deadline,
        &stage,
    )
    .await
}

async fn client<S, F>(
    s: &mut S,
    local: &Endpoint,
    connect: F,
    stage: &Stage,
) -> Result<Endpoint, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(&Endpoint) -> Result<(), HandshakeError>,
{
    let hello = handshake::encode(&Hello::new(*local))?;
    write_frame(s, &hello, stage.set("sending hello")).await?;
    let remote = match read_hello(s, stage.set("reading the server's hello")).await {
        Ok(h) => h.endpoint,
        Err(e) => return Err(refuse(s, e).await),
    };
    if let Err(e) = same_provider(local.provider, remote.provider) {
        return Err(refuse(s, e).await);
    }
    stage.set("connecting the local QP");
    if let Err(e) = connect(&remote) {
        return Err(refuse(s, e).await);
    }
    write_frame(s, &encode_ready(), stage.set("sending ready")).await?;
    Ok(remote)
}

async fn server<S, F, R>(
    s: &mut S,
    local_provider: ProviderKind,
    setup: F,
    stage: &Stage,
) -> Result<(Endpoint, R), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(&Endpoint) -> Result<(Endpoint, R), HandshakeError>,
{
    let remote = match read_hello(s, stage.set("reading the client's hello")).await {
        Ok(h) => h.endpoint,
        Err(e) => return Err(refuse(s, e).await),
    };
    if let Err(e) = same_provider(local_provider, remote.provider) {
        return Err(refuse(s, e).await);
    }
    stage.set("setting up the local QP");
    let (local, value) = match setup(&remote).and_then(|(ep, v)| {
        same_provider(local_provider, ep.provider)?;
        Ok((handshake::encode(&Hello::new(ep))?, v))
    }) {
        Ok(x) => x,
        Err(e) => return Err(refuse(s, e).await),
    };
    write_frame(s, &local, stage.set("sending hello")).await?;
    match read_frame(s, stage.set("waiting for the client's ready")).await {
        Ok(Frame::Ready) => Ok((remote, value)),
        Ok(Frame::Reject(reason)) => Err(HandshakeError::RejectedByPeer { reason }),
        // A hello sent twice, a malformed frame: the client is told why.
        Ok(other) => Err(refuse(
            s,
            HandshakeError::UnexpectedFrame {
                expected: "ready",
                got: other.kind_name(),
            },
        )
        .await),
        Err(e) => Err(refuse(s, e).await),
    }
}

fn same_provider(local: ProviderKind, remote: ProviderKind) -> Result<(), HandshakeError> {
    if local == remote {
        Ok(())
    } else {
        Err(HandshakeError::ProviderMismatch { local, remote })
    }
}

/// Tells the peer why we give up (best effort: it may be gone or not a
/// verbio peer at all), then hands back the error. A peer that rejected us
/// gets no reject back.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, e: HandshakeError) -> HandshakeError {
    if !matches!(
        e,
        HandshakeError::RejectedByPeer { .. } | HandshakeError::Io { .. }
    ) {
        let frame = encode_reject(&crate::error::ErrorChain(&e).to_string());
        let _ = s.write_all(&frame).await;
        let _ = s.flush().await;
        let _ = s.close().await;
    }
    drain_ready(s);
    tracing::debug!(error = %crate::error::ErrorChain(&e), "handshake refused");
    e
}

/// Reads (and discards) what the peer already sent, without waiting: closing a
/// TCP socket with unread received bytes sends a reset, which can destroy the
/// reject frame before the peer reads it.
fn drain_ready<S: AsyncRead + Unpin>(s: &mut S) {
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    let mut scratch = [0u8; 1024];
    for _ in 0..64 {
        match Pin::new(&mut *s).poll_read(&mut cx, &mut scratch) {
            Poll::Ready(Ok(n)) if n > 0 => continue,
            _ => break,
        }
    }
}

async fn read_hello<S: AsyncRead + Unpin>(
    s: &mut S,
    stage: &'static str,
) -> Result<Hello, HandshakeError> {
    match read_frame(s, stage).await? {
        Frame::Hello(h) => Ok(h),
        Frame::Reject(reason) => Err(HandshakeError::RejectedByPeer { reason }),
        other => Err(HandshakeError::UnexpectedFrame {
            expected: "hello",
            got: other.kind_name(),
        }),
    }
}

async fn write_frame<S: AsyncWrite + Unpin>(
    s: &mut S,
    frame: &[u8],
    stage: &'static str,
) -> Result<(), HandshakeError> {
    let io = |source| HandshakeError::Io { stage, source };
    s.write_all(frame).await.map_err(io)?;
    s.flush().await.map_err(io)
}

/// Reads one frame. The magic is checked as soon as bytes arrive, so a
/// foreign client is refused without waiting for a whole header; the body
/// length is bounded by `MAX_BODY_LEN` before anything is read.
async fn read_frame<S: AsyncRead + Unpin>(
    s: &mut S,
    stage: &'static str,
) -> Result<Frame, HandshakeError> {
    let mut buf = [0u8; HEADER_LEN + MAX_BODY_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = read_some(s, &mut buf[got..HEADER_LEN], stage).await?;
        if n == 0 {
            return Err(HandshakeError::Truncated {
                needed: HEADER_LEN,
                got,
            });
        }
        got += n;
        let m = got.min(MAGIC.len());
        if buf[..m] != MAGIC[..m] {
            return Err(HandshakeError::BadMagic {
                expected: MAGIC,
                got: buf[..m].to_vec(),
            });
        }
    }
    let total = HEADER_LEN + parse_header(&buf[..HEADER_LEN])?;
    while got < total {
        let n = read_some(s, &mut buf[got..total], stage).await?;
        if n == 0 {
            return Err(HandshakeError::Truncated { needed: total, got });
        }
        got += n;
    }
    decode_frame(&buf[..total])
}

async fn read_some<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut [u8],
    stage: &'static str,
) -> Result<usize, HandshakeError> {
    loop {
        match s.read(buf).await {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(source) => return Err(HandshakeError::Io { stage, source }),
            Ok(n) => return Ok(n),
        }
    }
}

#[cfg(test)]
mod tests;
