//! [`SideChannel`]: what tells an agent connection that its peer is gone:
//! the TCP stream of the endpoint handshake (its end), or the connection
//! manager's connection (its disconnect). Dropping it tells the peer.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::io::AsyncRead;
use verbio_runtime::cm::CmConnection;
use verbio_runtime::TcpStream;

/// The connection's liveness channel.
#[derive(Debug)]
pub(crate) enum SideChannel {
    /// The TCP stream the endpoints and settings were exchanged on.
    Tcp(TcpStream),
    /// An RDMA CM (or the soft device's equivalent) connection.
    Cm(CmConnection),
}

impl SideChannel {
    /// `Ready` once the peer is gone (stream ended or failed, connection
    /// disconnected), else keeps `cx`'s waker.
    pub(crate) fn poll_gone(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            SideChannel::Tcp(st) => {
                let mut scratch = [0u8; 64];
                loop {
                    match Pin::new(&mut *st).poll_read(cx, &mut scratch) {
                        Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(()),
                        Poll::Ready(Ok(_)) => continue, // the peer sends nothing; ignore
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }
            SideChannel::Cm(c) => c.poll_disconnected(cx).map(|_| ()),
        }
    }
}
