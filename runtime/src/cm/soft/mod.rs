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
//! (consumer reject).

mod wire;

use std::cell::RefCell;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use self::wire::{Frame, Hello, HEADER_LEN};
use super::conn::DisconnectReason;
use super::{CmError, CmOptions};
use crate::device::Device;
use crate::provider::{Endpoint, InitAttr, Pd, RtrAttr, RtsAttr};
use crate::qp::QueuePair;
use crate::reactor::{timeout, Handle, TcpListener, TcpStream};

/// Reject reason when nobody listens (RDMA CM's "invalid service ID").
pub(crate) const REJECT_NO_LISTENER: i32 = 8;
/// Reject reason of an application's reject (RDMA CM's "consumer reject").
pub(crate) const REJECT_CONSUMER: i32 = 28;
/// Private data a request, an accept and a reject carry at most (as on
/// RDMA CM over RoCE).
const MAX_CONNECT_PRIVATE_DATA: usize = 56;
const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
const MAX_REJECT_PRIVATE_DATA: usize = 148;
/// How long a listener waits for a new TCP connection's request.
const REQUEST_WAIT: Duration = Duration::from_secs(10);

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

async fn read_frame(s: &mut TcpStream, peer: Option<SocketAddr>) -> Result<Frame, CmError> {
    let mut header = [0u8; HEADER_LEN];
    s.read_exact(&mut header)
        .await
        .map_err(CmError::io("reading a CM message"))?;
    let protocol = |what| CmError::Protocol { addr: peer, what };
    let n = wire::body_len(&header).map_err(protocol)?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)
        .await
        .map_err(CmError::io("reading a CM message"))?;
    wire::decode(header[4], &body).map_err(protocol)
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

    pub(crate) async fn connect(
        self,
        qp: &QueuePair,
        private_data: &[u8],
    ) -> Result<(Conn, Vec<u8>), CmError> {
        check_len("connect", private_data, MAX_CONNECT_PRIVATE_DATA)?;
        let peer = Some(self.addr);
        let mut s = match TcpStream::connect(self.addr).await {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(CmError::Rejected {
                    addr: peer,
                    status: REJECT_NO_LISTENER,
                    private_data: Vec::new(),
                })
            }
            Err(e) => return Err(CmError::io("connecting to the CM listener")(e)),
        };
        if let Err(e) = s.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on the CM stream");
        }
        let req = Hello {
            responder_resources: self.opts.responder_resources,
            initiator_depth: self.opts.initiator_depth,
            private_data: private_data.to_vec(),
            endpoint: self.local,
        };
        write_frame(&mut s, &Frame::Req(req)).await?;
        match read_frame(&mut s, peer).await? {
            Frame::Rep(rep) => {
                connect_qp(
                    qp,
                    &self.local,
                    &rep.endpoint,
                    self.opts.responder_resources.min(rep.initiator_depth),
                    self.opts.initiator_depth.min(rep.responder_resources),
                    self.opts.min_rnr_timer,
                )?;
                write_frame(&mut s, &Frame::Rtu).await?;
                Ok((Conn::new(s), rep.private_data))
            }
            Frame::Rej(data) => Err(CmError::Rejected {
                addr: peer,
                status: REJECT_CONSUMER,
                private_data: data,
            }),
            other => Err(CmError::Protocol {
                addr: peer,
                what: format!("expected an accept or reject, got {other:?}"),
            }),
        }
    }
}

/// A TCP listener for connect requests.
pub(crate) struct Listener {
    tcp: TcpListener,
}

impl Listener {
    pub(crate) fn bind(addr: SocketAddr) -> Result<Listener, CmError> {
        let tcp = TcpListener::bind(addr).map_err(CmError::io("listening"))?;
        Ok(Listener { tcp })
    }

    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.local_addr().ok()
    }

    /// The next well-formed connect request, its QP in RTS. Connections
    /// that send something else (or nothing for 10 s) are dropped.
    pub(crate) async fn request(
        &self,
        device: &Device,
        opts: &CmOptions,
    ) -> Result<(Request, QueuePair, Pd, Vec<u8>, Option<SocketAddr>), CmError> {
        loop {
            let (mut s, peer) = self
                .tcp
                .accept()
                .await
                .map_err(CmError::io("accepting a CM connection"))?;
            let req = match timeout(REQUEST_WAIT, read_frame(&mut s, Some(peer))).await {
                Ok(Ok(Frame::Req(req))) => req,
                Ok(Ok(other)) => {
                    tracing::debug!(%peer, frame = ?other, "CM listener: expected a connect request");
                    continue;
                }
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %crate::report::ErrorChain(&e), "CM listener: bad connect request");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(%peer, "CM listener: no connect request in time");
                    continue;
                }
            };
            if let Err(e) = s.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY on the CM stream");
            }
            let (qp, pd, local) = make_qp(device, opts)?;
            let responder_resources = opts.responder_resources.min(req.initiator_depth);
            let initiator_depth = opts.initiator_depth.min(req.responder_resources);
            connect_qp(
                &qp,
                &local,
                &req.endpoint,
                responder_resources,
                initiator_depth,
                opts.min_rnr_timer,
            )?;
            let request = Request {
                stream: s,
                peer,
                local,
                responder_resources,
                initiator_depth,
            };
            return Ok((request, qp, pd, req.private_data, Some(peer)));
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
}

impl Request {
    pub(crate) async fn accept(mut self, private_data: &[u8]) -> Result<Conn, CmError> {
        check_len("accept", private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        let rep = Hello {
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            private_data: private_data.to_vec(),
            endpoint: self.local,
        };
        write_frame(&mut self.stream, &Frame::Rep(rep)).await?;
        match read_frame(&mut self.stream, Some(self.peer)).await? {
            Frame::Rtu => Ok(Conn::new(self.stream)),
            other => Err(CmError::Protocol {
                addr: Some(self.peer),
                what: format!("expected ready-to-use, got {other:?}"),
            }),
        }
    }

    pub(crate) fn reject(self, private_data: &[u8]) -> Result<(), CmError> {
        check_len("reject", private_data, MAX_REJECT_PRIVATE_DATA)?;
        let mut s = self.stream;
        let frame = Frame::Rej(private_data.to_vec());
        // A few bytes on a fresh connection: sent by a task so that
        // rejecting does not wait; the stream closes after it. (Without a
        // runtime the stream just closes: the requester sees it end.)
        if let Some(h) = Handle::try_current() {
            h.spawn(async move {
                if let Err(e) = write_frame(&mut s, &frame).await {
                    tracing::debug!(error = %crate::report::ErrorChain(&e), "sending a CM reject");
                }
            });
        }
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

    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    pub(crate) fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Shuts our sending side: the peer reads the end and answers with its own.
    pub(crate) fn disconnect(&self) -> Result<(), CmError> {
        let mut cx = Context::from_waker(Waker::noop());
        // A TCP shutdown does not block: the first poll is final.
        match Pin::new(&mut *self.stream.borrow_mut()).poll_close(&mut cx) {
            Poll::Ready(r) => r.map_err(CmError::io("disconnecting")),
            Poll::Pending => Ok(()),
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
        if let Err(e) = self.disconnect() {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "closing the CM stream");
        }
        DisconnectReason::Peer
    }
}
