//! Connection management in the style of RDMA CM, asynchronous: resolve an
//! IP address to a device and route, connect or listen and accept, carry
//! private data both ways, disconnect, and learn when the peer does.
//!
//! On libibverbs devices this is librdmacm (the CM event channel's fd is
//! registered with the reactor, so every step is a future) and it speaks
//! the RDMA CM protocol on the wire: the peer may be any RDMA CM program
//! (rdma-core's `rping`, perftest with `-R`, ...). On the software device
//! it is an equivalent exchange over the device's TCP side (same API, same
//! errors; only verbio peers).
//!
//! The queue pair is always the runtime's own [`QueuePair`], created on the
//! given [`Device`] (its CQ and entries) and moved to RTS by the connection
//! manager. It exists before the connection does ([`CmConnector::qp`],
//! [`CmRequest::qp`]), so receives can be posted before the peer's first
//! SEND can arrive.
//!
//! When the peer disconnects, a watcher task answers at once (on RDMA CM
//! `rdma_disconnect`, which sends the DREP the peer's `rdma_disconnect`
//! waits for; on the software device our end of the stream), moves the QP
//! to ERR: pending ops complete with a flush error, later submissions fail
//! as on a closed QP, and [`CmConnection::disconnected`] resolves with
//! [`DisconnectReason::Peer`]. [`CmConnection::disconnect`] is then a
//! no-op success; it is bounded by [`CmOptions::disconnect_timeout`].
//!
//! ```no_run
//! # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
//! use verbio::runtime::cm::{CmConnector, CmError, CmListener, CmOptions};
//! use verbio::runtime::Device;
//!
//! async fn server(device: &Device) -> Result<(), CmError> {
//!     let opts = CmOptions::default();
//!     let listener = CmListener::bind(device, "0.0.0.0:7174".parse().unwrap(), &opts)?;
//!     let request = listener.request().await?;
//!     // ... post receives on request.qp() ...
//!     let conn = request.accept(b"hello").await?;
//!     conn.disconnected().await; // until the client leaves
//!     Ok(())
//! }
//!
//! async fn client(device: &Device) -> Result<(), CmError> {
//!     let opts = CmOptions::default();
//!     let connector = CmConnector::resolve(device, "10.0.0.1:7174".parse().unwrap(), &opts).await?;
//!     let conn = connector.connect(b"hi").await?;
//!     // RDMA CM pads private data with zeros to its field's size.
//!     assert_eq!(&conn.peer_private_data()[..5], b"hello");
//!     conn.disconnect().await
//! }
//! ```

mod backend;
mod conn;
mod error;
#[cfg(feature = "ibverbs")]
mod ibverbs;
pub mod reject;
mod soft;

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

pub use conn::DisconnectReason;
pub use error::CmError;
#[cfg(feature = "fuzzing")]
pub use soft::fuzz_check::{
    check_cm_frame, cm_frame_seeds, CM_FRAME_HEADER_LEN, CM_FRAME_LEN_LOW_BYTE,
};

use crate::device::Device;
use crate::provider::{Pd, QpCaps};
use crate::qp::QueuePair;
use crate::reactor::{timeout, JoinHandle};
use backend::Incoming;
use conn::ConnState;

/// The queue pair and connection parameters of a connection.
#[derive(Clone, Copy, Debug)]
pub struct CmOptions {
    /// Queue sizes of the connection's QP.
    pub caps: QpCaps,
    /// RDMA READs / atomics the peer may have in flight towards us
    /// (capped by the device, and on accept by what the requester offers).
    pub responder_resources: u8,
    /// RDMA READs / atomics we may have in flight towards the peer.
    pub initiator_depth: u8,
    /// Transport retries (at most 7).
    pub retry_count: u8,
    /// Receiver-not-ready retries (7 = retry forever).
    pub rnr_retry_count: u8,
    /// How long a peer whose SEND finds no receive posted waits before
    /// retrying (verbs encoding, 0..=31; 12 = 0.64 ms; RDMA CM's own
    /// choice, 0, is 655 ms).
    pub min_rnr_timer: u8,
    /// Bound of address and route resolution, each.
    pub resolve_timeout: Duration,
    /// Connect requests a listener queues (valid requests not yet taken by
    /// [`CmListener::request`]; on the software device, more are rejected
    /// with [`reject::REJECT_NO_RESOURCES`]).
    pub backlog: i32,
    /// Software device: how long a listener waits for a new connection's
    /// request, and [`CmRequest::accept`] for the requester's
    /// ready-to-use, before closing the connection. (librdmacm has its
    /// own CM timeouts.)
    pub request_timeout: Duration,
    /// Software device: bound of [`CmConnector::connect`] (the TCP
    /// connect, the request and the listener's answer); when it passes,
    /// the connect fails with an `UNREACHABLE` [`CmError::Event`]
    /// (`-ETIMEDOUT`), as librdmacm reports a peer that does not answer
    /// after its retries (about a minute, the default here too).
    pub connect_timeout: Duration,
    /// Software device: connections a listener reads requests from at
    /// once; when that many are pending it stops accepting until one is
    /// done (new ones wait in the kernel's backlog).
    pub max_pending: usize,
    /// Software device: of those, how many may come from one IP address;
    /// more are rejected at once ([`reject::REJECT_NO_RESOURCES`]).
    pub max_pending_per_source: usize,
    /// Each connection's QP in a protection domain of its own (a fresh
    /// [`Device::alloc_pd`]), so that memory registered for one connection
    /// cannot be reached through another; else the device's PD.
    pub own_pd: bool,
    /// Bound of [`CmConnection::disconnect`]: the wait for the connection
    /// manager to report the connection down (on RDMA CM the DISCONNECTED
    /// event, i.e. the peer's DREP; on the software device the peer's end
    /// of the stream) and for the QP's flushes. When it passes, the
    /// connection is down on this side all the same and `disconnect` fails
    /// with a `TimedOut` [`CmError::Io`] naming the wait. (The kernel CM
    /// itself gives up on an unanswered DREQ after about a minute.)
    pub disconnect_timeout: Duration,
}

impl Default for CmOptions {
    fn default() -> CmOptions {
        CmOptions {
            caps: QpCaps {
                max_send_wr: 128,
                max_recv_wr: 128,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            responder_resources: 16,
            initiator_depth: 16,
            retry_count: 7,
            rnr_retry_count: 7,
            min_rnr_timer: 12,
            resolve_timeout: Duration::from_secs(2),
            backlog: 64,
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(64),
            max_pending: 128,
            max_pending_per_source: 32,
            own_pd: false,
            disconnect_timeout: Duration::from_secs(10),
        }
    }
}

/// The connection's QP on `device`, in a fresh PD if `opts.own_pd`.
fn new_qp(device: &Device, opts: &CmOptions) -> Result<(QueuePair, Pd), CmError> {
    let pd = if opts.own_pd {
        device.alloc_pd().map_err(CmError::provider(
            "allocating the connection's protection domain",
        ))?
    } else {
        device.pd().clone()
    };
    let qp = device
        .create_qp_in(&pd, opts.caps)
        .map_err(CmError::provider("creating the connection's queue pair"))?;
    Ok((qp, pd))
}

/// The active side after address and route resolution: its QP exists (in
/// INIT: receives may be posted); [`connect`](Self::connect) sends the
/// request.
pub struct CmConnector {
    qp: QueuePair,
    pd: Pd,
    addr: SocketAddr,
    disconnect_timeout: Duration,
    imp: Box<dyn backend::Connect>,
}

impl std::fmt::Debug for CmConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmConnector")
            .field("addr", &self.addr)
            .field("qp", &self.qp)
            .finish()
    }
}

impl CmConnector {
    /// Resolves `addr` (the peer's IP address and CM port) to a device and
    /// route, checks that it is `device`, and creates the QP there.
    pub async fn resolve(
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<CmConnector, CmError> {
        let r = backend::for_device(device)
            .resolve(device, addr, opts)
            .await?;
        Ok(CmConnector {
            qp: r.qp,
            pd: r.pd,
            addr,
            disconnect_timeout: opts.disconnect_timeout,
            imp: r.connector,
        })
    }

    /// The connection's queue pair (in INIT until connected).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The protection domain of its QP.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// Sends the connect request with `private_data` (at most 56 bytes on
    /// RDMA CM) and resolves once the connection is established.
    pub async fn connect(self, private_data: &[u8]) -> Result<CmConnection, CmError> {
        let (conn, peer) = self.imp.connect(&self.qp, private_data).await?;
        Ok(CmConnection::new(
            self.qp,
            self.pd,
            conn,
            peer,
            self.disconnect_timeout,
        ))
    }
}

/// Resolves `addr` and connects to it: [`CmConnector::resolve`] then
/// [`CmConnector::connect`].
pub async fn connect(
    device: &Device,
    addr: SocketAddr,
    opts: &CmOptions,
    private_data: &[u8],
) -> Result<CmConnection, CmError> {
    CmConnector::resolve(device, addr, opts)
        .await?
        .connect(private_data)
        .await
}

/// A listening connection manager endpoint.
pub struct CmListener {
    device: Device,
    opts: CmOptions,
    imp: Box<dyn backend::Listen>,
}

impl std::fmt::Debug for CmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmListener")
            .field("local_addr", &self.local_addr())
            .finish()
    }
}

impl CmListener {
    /// Listens on `addr` (an IP address of the device's network interface,
    /// or the unspecified address; port 0 picks one). Connections get QPs
    /// made with `opts`.
    pub fn bind(
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<CmListener, CmError> {
        Ok(CmListener {
            device: device.clone(),
            opts: *opts,
            imp: backend::for_device(device).bind(device, addr, opts)?,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.imp.local_addr()
    }

    /// The next connect request. Its QP is ready (receives may be posted);
    /// answer it with [`CmRequest::accept`] or [`CmRequest::reject`].
    ///
    /// A requester's own failure never fails this call: on the software
    /// device, a request that is malformed or cannot be taken (address
    /// family 0, a QPN of 2^24 or more, no queue pair for it, ...) is
    /// rejected with the InfiniBand CM's reason ([`reject`]), logged
    /// (`tracing`, debug), and skipped; a connection that sends nothing
    /// within [`CmOptions::request_timeout`] is closed. It fails only when
    /// the listener itself does (its socket, or on libibverbs its event
    /// channel).
    pub async fn request(&self) -> Result<CmRequest, CmError> {
        let Incoming {
            answer,
            qp,
            pd,
            private_data,
            peer,
        } = self.imp.request(&self.device, &self.opts).await?;
        Ok(CmRequest {
            qp,
            pd,
            private_data,
            peer,
            disconnect_timeout: self.opts.disconnect_timeout,
            imp: answer,
        })
    }

    /// The next connect request, accepted with `private_data`. Unlike
    /// [`request`](Self::request), this fails for that requester's own
    /// failure too (for example one that never confirms, on the software
    /// device): a server that goes on listening should then call it again.
    pub async fn accept(&self, private_data: &[u8]) -> Result<CmConnection, CmError> {
        self.request().await?.accept(private_data).await
    }
}

/// A connect request not yet answered.
pub struct CmRequest {
    qp: QueuePair,
    pd: Pd,
    private_data: Vec<u8>,
    peer: Option<SocketAddr>,
    disconnect_timeout: Duration,
    imp: Box<dyn backend::Answer>,
}

impl std::fmt::Debug for CmRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmRequest")
            .field("peer", &self.peer)
            .field("private_data_len", &self.private_data.len())
            .finish()
    }
}

impl CmRequest {
    /// The requester's private data.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The requester's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// The queue pair the connection will use (receives may be posted now).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The protection domain of its QP.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// Accepts with `private_data` (at most 196 bytes on RDMA CM);
    /// resolves once the connection is established.
    pub async fn accept(self, private_data: &[u8]) -> Result<CmConnection, CmError> {
        let peer = self.private_data;
        let conn = self.imp.accept(&self.qp, private_data).await?;
        Ok(CmConnection::new(
            self.qp,
            self.pd,
            conn,
            peer,
            self.disconnect_timeout,
        ))
    }

    /// Refuses the connection; the requester's connect fails with
    /// [`CmError::Rejected`] carrying `private_data` (at most 148 bytes).
    pub fn reject(self, private_data: &[u8]) -> Result<(), CmError> {
        self.imp.reject(private_data)
    }
}

/// An established connection: its queue pair (in RTS), the peer's private
/// data, and its disconnect.
///
/// Dropping it without [`disconnect`](Self::disconnect) (or in the middle
/// of one) tears the connection down (the peer sees a disconnect) and
/// drops this handle of the QP.
pub struct CmConnection {
    qp: QueuePair,
    pd: Pd,
    peer_private: Vec<u8>,
    disconnect_timeout: Duration,
    state: Rc<ConnState>,
    watcher: Option<JoinHandle<()>>,
    imp: Box<dyn backend::Conn>,
}

impl std::fmt::Debug for CmConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmConnection")
            .field("qp", &self.qp)
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .field("down", &self.state.reason())
            .finish()
    }
}

impl CmConnection {
    fn new(
        qp: QueuePair,
        pd: Pd,
        imp: Box<dyn backend::Conn>,
        peer_private: Vec<u8>,
        disconnect_timeout: Duration,
    ) -> CmConnection {
        let state = ConnState::new();
        let watcher = conn::watch(&state, &qp, imp.down());
        CmConnection {
            qp,
            pd,
            peer_private,
            disconnect_timeout,
            state,
            watcher: Some(watcher),
            imp,
        }
    }

    /// The connection's queue pair.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The protection domain of its QP (register the connection's memory
    /// there; see [`CmOptions::own_pd`]).
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// The private data the peer sent with its request or accept (empty if
    /// none; RDMA CM may pad it with zeros to its field's size).
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_private
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.imp.local_addr()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.imp.peer_addr()
    }

    /// Why the connection is down, or `None` while it is up.
    pub fn down_reason(&self) -> Option<DisconnectReason> {
        self.state.reason()
    }

    /// `Ready` with the reason once the connection is down; else keeps
    /// `cx`'s waker for then.
    pub fn poll_disconnected(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<DisconnectReason> {
        self.state.poll_down(cx)
    }

    /// Resolves once the connection is down (the QP is then in ERR), with
    /// who ended it.
    pub fn disconnected(&self) -> impl std::future::Future<Output = DisconnectReason> + 'static {
        self.state.down()
    }

    /// Fails with [`CmError::Disconnected`] if the connection is down.
    pub fn check(&self) -> Result<(), CmError> {
        match self.state.reason() {
            Some(reason) => Err(CmError::Disconnected { reason }),
            None => Ok(()),
        }
    }

    /// Disconnects: the QP moves to ERR (pending ops are flushed), the
    /// peer is told, and this resolves once the connection manager reports
    /// the connection down (on RDMA CM the DISCONNECTED event: the peer's
    /// DREP, or its own DREQ when both disconnect at once; on the software
    /// device the peer's end of the stream) and every WR of the QP has
    /// completed.
    ///
    /// - Already down (the peer disconnected first, which this side has
    ///   answered already; or a disconnect finished): a no-op success,
    ///   after the QP's flushes. [`down_reason`](Self::down_reason) still
    ///   says who ended it.
    /// - Called again while a disconnect is under way (concurrently, or
    ///   after a dropped `disconnect` future): waits for the same end.
    /// - Bounded by [`CmOptions::disconnect_timeout`]: when it passes, the
    ///   connection is down on this side
    ///   ([`DisconnectReason::Local`], the QP in ERR) and this fails with a
    ///   `TimedOut` [`CmError::Io`] naming what it waited for.
    pub async fn disconnect(&self) -> Result<(), CmError> {
        let limit = self.disconnect_timeout;
        let started = Instant::now();
        if self.state.start_disconnect() {
            drop(self.qp.close());
            if let Err(e) = self.imp.disconnect() {
                // The peer could not be told: down on this side anyway.
                self.state.finish(DisconnectReason::Local, &self.qp);
                return Err(e);
            }
        }
        if timeout(limit, self.state.down()).await.is_err() {
            self.state.finish(DisconnectReason::Local, &self.qp);
            return Err(disconnect_timed_out(self.imp.down_event(), limit));
        }
        let rest = limit.saturating_sub(started.elapsed());
        match timeout(rest, self.qp.close()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                tracing::debug!(error = %crate::report::ErrorChain(&e), "closing a disconnected QP");
                Ok(())
            }
            Err(_) => Err(disconnect_timed_out(
                "disconnecting: waiting for the queue pair's work requests to complete (flushed)",
                limit,
            )),
        }
    }
}

fn disconnect_timed_out(step: &'static str, limit: Duration) -> CmError {
    CmError::Io {
        step,
        source: std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "not within {limit:?} (CmOptions::disconnect_timeout); the connection is down on this side"
            ),
        ),
    }
}

impl Drop for CmConnection {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}
