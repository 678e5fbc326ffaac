//! Async TCP on mio, for connection setup (endpoint exchange): a
//! [`TcpListener`] and a [`TcpStream`] that implements
//! `futures::io::{AsyncRead, AsyncWrite}`.
//!
//! Sockets are registered edge-triggered. Every operation tries the syscall
//! first; only when it would block does it store the waker, so an edge that
//! arrives after the failed attempt always finds the waker in place.

use std::future::poll_fn;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::io::{AsyncRead, AsyncWrite};
use mio::Interest;

use super::driver::Direction;
use super::Handle;

struct Registration {
    handle: Handle,
    key: usize,
}

impl Registration {
    fn new(source: &mut impl mio::event::Source) -> io::Result<Registration> {
        let handle = Handle::try_current().ok_or_else(|| {
            io::Error::other("no verbio runtime on this thread: create a verbio::Runtime first")
        })?;
        let key = handle
            .driver()
            .register_io(source, Interest::READABLE | Interest::WRITABLE)?;
        Ok(Registration { handle, key })
    }

    /// Takes `source` off the reactor (its owner drops it).
    fn deregister(&self, source: &mut impl mio::event::Source) {
        self.handle.driver().deregister_io(source, self.key);
    }

    /// Runs `op` until it does not block, waiting for readiness in `dir`.
    fn poll_io<R>(
        &self,
        dir: Direction,
        cx: &mut Context<'_>,
        mut op: impl FnMut() -> io::Result<R>,
    ) -> Poll<io::Result<R>> {
        loop {
            match op() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.handle.driver().clear_and_wait(self.key, dir, cx);
                    return Poll::Pending;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                res => return Poll::Ready(res),
            }
        }
    }
}

/// A TCP listener on the reactor.
pub struct TcpListener {
    io: mio::net::TcpListener,
    reg: Registration,
}

/// Connections the kernel completes and queues for a [`TcpListener`]
/// before `accept` takes them (its `listen(2)` backlog; Linux caps it at
/// `net.core.somaxconn`, 4096 by default). The 128 of std and mio drops
/// the SYNs of a burst of clients beyond it, and each such client waits
/// for its SYN's retransmission, a second or more (issue 31).
pub const LISTEN_BACKLOG: i32 = 4096;

impl TcpListener {
    /// Binds a listener (use port 0 for an ephemeral port) with
    /// `SO_REUSEADDR`, as std and mio do, and a backlog of
    /// [`LISTEN_BACKLOG`].
    pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
        use socket2::{Domain, Protocol, Socket, Type};
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(LISTEN_BACKLOG)?;
        socket.set_nonblocking(true)?;
        let mut io = mio::net::TcpListener::from_std(socket.into());
        let reg = Registration::new(&mut io)?;
        Ok(TcpListener { io, reg })
    }

    /// Takes over a listening socket made elsewhere (e.g. with
    /// `SO_REUSEPORT`, so that one runtime per core each accepts on the same
    /// port). It is switched to non-blocking mode.
    pub fn from_std(listener: std::net::TcpListener) -> io::Result<TcpListener> {
        listener.set_nonblocking(true)?;
        let mut io = mio::net::TcpListener::from_std(listener);
        let reg = Registration::new(&mut io)?;
        Ok(TcpListener { io, reg })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }

    /// Waits for the next connection.
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        let (stream, peer) =
            poll_fn(|cx| self.reg.poll_io(Direction::Read, cx, || self.io.accept())).await?;
        Ok((TcpStream::from_mio(stream)?, peer))
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        self.reg.deregister(&mut self.io);
    }
}

impl std::fmt::Debug for TcpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpListener")
            .field("local_addr", &self.io.local_addr().ok())
            .finish()
    }
}

/// A TCP stream on the reactor (`futures::io::AsyncRead` + `AsyncWrite`).
pub struct TcpStream {
    io: mio::net::TcpStream,
    reg: Registration,
}

impl TcpStream {
    fn from_mio(mut io: mio::net::TcpStream) -> io::Result<TcpStream> {
        let reg = Registration::new(&mut io)?;
        Ok(TcpStream { io, reg })
    }

    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
        let stream = TcpStream::from_mio(mio::net::TcpStream::connect(addr)?)?;
        poll_fn(|cx| loop {
            if let Some(e) = stream.io.take_error()? {
                return Poll::Ready(Err(e));
            }
            match stream.io.peer_addr() {
                Ok(_) => return Poll::Ready(Ok(())),
                Err(e)
                    if e.kind() == io::ErrorKind::NotConnected
                        || e.raw_os_error() == Some(libc::EINPROGRESS) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            match stream
                .reg
                .handle
                .driver()
                .poll_ready(stream.reg.key, Direction::Write, cx)
            {
                Poll::Ready(()) => continue,
                Poll::Pending => return Poll::Pending,
            }
        })
        .await?;
        Ok(stream)
    }

    /// Local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }

    /// Peer address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.io.peer_addr()
    }

    /// Sets `TCP_NODELAY`.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.io.set_nodelay(on)
    }
}

impl AsyncRead for TcpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let io = &this.io;
        this.reg.poll_io(Direction::Read, cx, || (&*io).read(buf))
    }
}

impl AsyncWrite for TcpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let io = &this.io;
        this.reg.poll_io(Direction::Write, cx, || (&*io).write(buf))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.io.shutdown(Shutdown::Write) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        self.reg.deregister(&mut self.io);
    }
}

impl std::fmt::Debug for TcpStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStream")
            .field("local_addr", &self.io.local_addr().ok())
            .field("peer_addr", &self.io.peer_addr().ok())
            .finish()
    }
}
