//! The connection manager on the software device: the RDMA CM exchange
//! (request, accept or reject, ready-to-use, disconnect) carried over a
//! TCP connection of the reactor (`wire.rs`), with the QPs' endpoints
//! (QPN, PSN, MTU, the engine's address) in the request and the accept.
//! The TCP connection stays open while the RDMA connection lives: its end
//! (FIN, reset, the peer process gone) is the disconnect.
//!
//! Same API and errors as on libibverbs: a refused TCP connect is a
//! [`CmError::Rejected`] with reason 8 (invalid service ID: what RDMA CM
//! reports when nobody listens), an application's reject has reason 28
//! (consumer reject), and the listener rejects requests it cannot take
//! with the InfiniBand CM's reasons (`super::reject`). The listener
//! (`listener.rs`) reads requests concurrently, each within a deadline,
//! under caps on pending connections.

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz_check;
mod listener;
pub(crate) mod wire;

use std::cell::RefCell;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub(crate) use self::listener::Listener;
use self::wire::{DecodeError, Frame, Hello, HEADER_LEN, MAX_BODY};
use super::backend::{self, CmFuture, Resolved};
use super::conn::DisconnectReason;
use super::reject::{REJECT_CONSUMER, REJECT_NO_LISTENER};
use super::{CmError, CmOptions};
use crate::device::Device;
use crate::provider::{Endpoint, InitAttr, Pd, RtrAttr, RtsAttr};
use crate::qp::QueuePair;
use crate::reactor::{timeout, Handle, TcpStream};

/// Private data a request, an accept and a reject carry at most (as on
/// RDMA CM over RoCE).
const MAX_CONNECT_PRIVATE_DATA: usize = 56;
const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
const MAX_REJECT_PRIVATE_DATA: usize = 148;
/// Bound of writing a reject to a peer we give up on (a few bytes on a
/// fresh connection: it never waits unless the peer stopped reading).
const REJECT_WRITE_LIMIT: Duration = Duration::from_secs(1);

fn check_len(step: &'static str, data: &[u8], max: usize) -> Result<(), CmError> {
    if data.len() > max {
        return Err(CmError::PrivateDataTooLong {
            step,
            len: data.len(),
            max,
        });
    }
    Ok(())
}

async fn write_frame(s: &mut TcpStream, f: &Frame) -> Result<(), CmError> {
    s.write_all(&wire::encode(f))
        .await
        .map_err(CmError::io("sending a CM message"))
}

/// Why reading a frame failed.
enum ReadError {
    /// The stream failed or ended.
    Io(std::io::Error),
    /// The bytes are not a valid frame.
    Decode(DecodeError),
}

impl ReadError {
    fn into_cm(self, peer: Option<SocketAddr>) -> CmError {
        match self {
            ReadError::Io(e) => CmError::io("reading a CM message")(e),
            ReadError::Decode(e) => CmError::Protocol {
                addr: peer,
                what: e.what,
            },
        }
    }
}

/// Reads one frame into a buffer of the largest frame's size on the
/// stack: the body length is checked before any of the body is read, and
/// nothing is allocated until the frame decodes (then at most its private
/// data, 255 bytes).
async fn read_frame_raw(s: &mut TcpStream) -> Result<Frame, ReadError> {
    let mut buf = [0u8; HEADER_LEN + MAX_BODY];
    let (header, body) = buf.split_at_mut(HEADER_LEN);
    s.read_exact(header).await.map_err(ReadError::Io)?;
    let header: &[u8; HEADER_LEN] = (&*header).try_into().expect("HEADER_LEN bytes");
    let n = wire::body_len(header).map_err(ReadError::Decode)?;
    let body = &mut body[..n];
    s.read_exact(body).await.map_err(ReadError::Io)?;
    wire::decode(header[4], body).map_err(ReadError::Decode)
}

async fn read_frame(s: &mut TcpStream, peer: Option<SocketAddr>) -> Result<Frame, CmError> {
    read_frame_raw(s).await.map_err(|e| e.into_cm(peer))
}

/// Drops what the peer already sent, without waiting: closing a socket
/// with unread bytes sends a reset, which can destroy a reject frame
/// before the peer reads it.
fn drain_ready(s: &mut TcpStream) {
    let mut cx = Context::from_waker(Waker::noop());
    let mut scratch = [0u8; 512];
    for _ in 0..16 {
        match Pin::new(&mut *s).poll_read(&mut cx, &mut scratch) {
            Poll::Ready(Ok(n)) if n > 0 => continue,
            _ => break,
        }
    }
}

/// Tells the peer no (best effort, within [`REJECT_WRITE_LIMIT`]), then
/// closes the stream.
async fn send_reject(mut s: TcpStream, reason: u16, private_data: Vec<u8>) {
    let frame = Frame::Rej {
        reason,
        private_data,
    };
    drain_ready(&mut s);
    match timeout(REJECT_WRITE_LIMIT, write_frame(&mut s, &frame)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "sending a CM reject")
        }
        Err(_) => tracing::debug!("sending a CM reject: the peer does not read"),
    }
    let _ = s.close().await;
    drain_ready(&mut s);
}

/// Sends a reject from a task of its own, so that the caller does not
/// wait. (Without a runtime the stream just closes: the peer sees it end.)
fn spawn_reject(s: TcpStream, reason: u16, private_data: Vec<u8>) {
    if let Some(h) = Handle::try_current() {
        h.spawn(send_reject(s, reason, private_data));
    }
}

/// Creates the connection's QP in INIT and returns it with its endpoint.
fn make_qp(device: &Device, opts: &CmOptions) -> Result<(QueuePair, Pd, Endpoint), CmError> {
    let (qp, pd) = super::new_qp(device, opts)?;
    let init = InitAttr::default();
    qp.modify_to_init(&init)
        .map_err(CmError::provider("moving the queue pair to INIT"))?;
    let ep = qp
        .endpoint(0)
        .map_err(CmError::provider("querying the queue pair's endpoint"))?;
    Ok((qp, pd, ep))
}

/// RTR towards `remote`, then RTS, with the negotiated READ depths.
fn connect_qp(
    qp: &QueuePair,
    local: &Endpoint,
    remote: &Endpoint,
    responder_resources: u8,
    initiator_depth: u8,
    min_rnr_timer: u8,
) -> Result<(), CmError> {
    qp.modify_to_rtr(&RtrAttr {
        remote: *remote,
        path_mtu: local.mtu.min(remote.mtu),
        min_rnr_timer,
        max_dest_rd_atomic: responder_resources,
        sgid_index: 0,
        hop_limit: 64,
    })
    .map_err(CmError::provider("moving the queue pair to RTR"))?;
    qp.modify_to_rts(&RtsAttr {
        max_rd_atomic: initiator_depth,
        ..RtsAttr::default()
    })
    .map_err(CmError::provider("moving the queue pair to RTS"))
}

/// The active side before its request: the QP is in INIT.
pub(crate) struct Connector {
    addr: SocketAddr,
    local: Endpoint,
    opts: CmOptions,
}

impl Connector {
    pub(crate) fn resolve(
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<(Connector, QueuePair, Pd), CmError> {
        let (qp, pd, local) = make_qp(device, opts)?;
        Ok((
            Connector {
                addr,
                local,
                opts: *opts,
            },
            qp,
            pd,
        ))
    }
}

impl backend::Connecting for Connector {
    type Conn = Conn;

    /// Connects, within `CmOptions::connect_timeout` (TCP connect,
    /// request, the listener's answer): a listener that never answers fails
    /// it as RDMA CM reports a peer that does not answer, with an
    /// `UNREACHABLE` event and `-ETIMEDOUT`.
    async fn connect(
        self,
        qp: &QueuePair,
        private_data: &[u8],
    ) -> Result<(Conn, Vec<u8>), CmError> {
        check_len("connect", private_data, MAX_CONNECT_PRIVATE_DATA)?;
        let (addr, limit) = (self.addr, self.opts.connect_timeout);
        match timeout(limit, self.connect_unbounded(qp, private_data)).await {
            Ok(r) => r,
            Err(_) => Err(CmError::Event {
                step: "connecting (no answer within CmOptions::connect_timeout)",
                addr: Some(addr),
                event: "UNREACHABLE".into(),
                status: -libc::ETIMEDOUT,
            }),
        }
    }
}

impl Connector {
    async fn connect_unbounded(
        self,
        qp: &QueuePair,
        private_data: &[u8],
    ) -> Result<(Conn, Vec<u8>), CmError> {
        let peer = Some(self.addr);
        let mut s = match TcpStream::connect(self.addr).await {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(CmError::Rejected {
                    addr: peer,
                    status: i32::from(REJECT_NO_LISTENER),
                    private_data: Vec::new(),
                })
            }
            Err(e) => return Err(CmError::io("connecting to the CM listener")(e)),
        };
        if let Err(e) = s.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on the CM stream");
        }
        // (An engine on the unspecified address is announced at the IP
        // this host reaches the peer from.)
        let local = s
            .local_addr()
            .map_or(self.local, |l| self.local.announced_over(l));
        let req = Hello {
            responder_resources: self.opts.responder_resources,
            initiator_depth: self.opts.initiator_depth,
            private_data: private_data.to_vec(),
            endpoint: local,
        };
        write_frame(&mut s, &Frame::Req(req)).await?;
        match read_frame(&mut s, peer).await? {
            Frame::Rep(rep) => {
                connect_qp(
                    qp,
                    &local,
                    &rep.endpoint,
                    self.opts.responder_resources.min(rep.initiator_depth),
                    self.opts.initiator_depth.min(rep.responder_resources),
                    self.opts.min_rnr_timer,
                )?;
                write_frame(&mut s, &Frame::Rtu).await?;
                Ok((Conn::new(s), rep.private_data))
            }
            Frame::Rej {
                reason,
                private_data,
            } => Err(CmError::Rejected {
                addr: peer,
                status: i32::from(reason),
                private_data,
            }),
            other => Err(CmError::Protocol {
                addr: peer,
                what: format!("expected an accept or reject, got {other:?}"),
            }),
        }
    }
}

/// A connect request not yet answered.
pub(crate) struct Request {
    stream: TcpStream,
    peer: SocketAddr,
    local: Endpoint,
    responder_resources: u8,
    initiator_depth: u8,
    /// Bound of the wait for the requester's ready-to-use.
    rtu_wait: Duration,
}

impl backend::Answering for Request {
    type Conn = Conn;

    /// Sends the accept and waits (at most `rtu_wait`) for the
    /// requester's ready-to-use: a peer that never confirms fails this
    /// request only. The QP is already in RTS (the listener moved it).
    async fn accept(mut self, _qp: &QueuePair, private_data: &[u8]) -> Result<Conn, CmError> {
        check_len("accept", private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        let rep = Hello {
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            private_data: private_data.to_vec(),
            endpoint: self.local,
        };
        let peer = Some(self.peer);
        let confirmed = timeout(self.rtu_wait, async {
            write_frame(&mut self.stream, &Frame::Rep(rep)).await?;
            read_frame(&mut self.stream, peer).await
        })
        .await;
        match confirmed {
            Ok(Ok(Frame::Rtu)) => Ok(Conn::new(self.stream)),
            Ok(Ok(other)) => Err(CmError::Protocol {
                addr: peer,
                what: format!("expected ready-to-use, got {other:?}"),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(CmError::Io {
                step: "waiting for the requester's ready-to-use",
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "none within {:?} (CmOptions::request_timeout)",
                        self.rtu_wait
                    ),
                ),
            }),
        }
    }

    fn reject(self, private_data: &[u8]) -> Result<(), CmError> {
        check_len("reject", private_data, MAX_REJECT_PRIVATE_DATA)?;
        // A few bytes on a fresh connection: sent by a task so that
        // rejecting does not wait; the stream closes after it.
        spawn_reject(self.stream, REJECT_CONSUMER, private_data.to_vec());
        Ok(())
    }
}

/// An established connection's TCP stream.
#[derive(Clone)]
pub(crate) struct Conn {
    stream: Rc<RefCell<TcpStream>>,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

impl Conn {
    fn new(stream: TcpStream) -> Conn {
        Conn {
            local: stream.local_addr().ok(),
            peer: stream.peer_addr().ok(),
            stream: Rc::new(RefCell::new(stream)),
        }
    }

    /// Resolves when the peer's side of the stream ends.
    pub(crate) async fn down(self) -> DisconnectReason {
        let mut buf = [0u8; 64];
        loop {
            let r = poll_fn(|cx| Pin::new(&mut *self.stream.borrow_mut()).poll_read(cx, &mut buf))
                .await;
            match r {
                Ok(0) => break,
                Ok(n) => {
                    tracing::debug!(
                        peer = ?self.peer,
                        bytes = n,
                        "CM stream: ignoring bytes after set-up"
                    );
                }
                Err(e) => {
                    tracing::debug!(peer = ?self.peer, error = %e, "CM stream failed");
                    break;
                }
            }
        }
        // Answer the peer's end with ours (no-op if we started).
        if let Err(e) = backend::Conn::disconnect(&self) {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "closing the CM stream");
        }
        DisconnectReason::Peer
    }
}

/// The software device's connection manager ([`backend::CmBackend`]).
pub(crate) struct Backend;

impl backend::CmBackend for Backend {
    fn resolve<'a>(
        &self,
        device: &'a Device,
        addr: SocketAddr,
        opts: &'a CmOptions,
    ) -> CmFuture<'a, Resolved> {
        let resolved = Connector::resolve(device, addr, opts).map(|(c, qp, pd)| Resolved {
            connector: Box::new(c),
            qp,
            pd,
        });
        Box::pin(std::future::ready(resolved))
    }

    fn bind(
        &self,
        _device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<Box<dyn backend::Listen>, CmError> {
        Ok(Box::new(Listener::bind(addr, opts)?))
    }
}

impl backend::Conn for Conn {
    fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Shuts our sending side: the peer reads the end and answers with its own.
    fn disconnect(&self) -> Result<(), CmError> {
        let mut cx = Context::from_waker(Waker::noop());
        // A TCP shutdown does not block: the first poll is final.
        match Pin::new(&mut *self.stream.borrow_mut()).poll_close(&mut cx) {
            Poll::Ready(r) => r.map_err(CmError::io("disconnecting")),
            Poll::Pending => Ok(()),
        }
    }

    fn down(&self) -> Pin<Box<dyn std::future::Future<Output = DisconnectReason>>> {
        Box::pin(self.clone().down())
    }

    fn down_event(&self) -> &'static str {
        "disconnecting: waiting for the peer to close its end of the CM stream"
    }
}
