//! The connection manager on libibverbs devices: librdmacm's identifiers
//! and event channels (`provider::ibverbs::cm`), each channel's fd on the
//! reactor, and the runtime's own queue pair named in the CM exchange and
//! moved to RTS with the CM's attributes.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::rc::Rc;

use super::backend::{self, CmFuture, Resolved};
use super::conn::DisconnectReason;
use super::{CmError, CmOptions};
use crate::device::Device;
use crate::provider::ibverbs::cm::{
    CmEvent, CmEventKind, CmId, CmQpState, ConnParam, EventChannel, MAX_ACCEPT_PRIVATE_DATA,
    MAX_CONNECT_PRIVATE_DATA, MAX_REJECT_PRIVATE_DATA,
};
use crate::provider::{ibverbs, Pd};
use crate::qp::QueuePair;
use crate::reactor::ReadableFd;

/// An event channel and its registration (dropped first: the fd is closed
/// with the channel).
struct Events {
    reg: ReadableFd,
    ch: EventChannel,
}

impl Events {
    fn new() -> Result<Events, CmError> {
        let ch = EventChannel::new().map_err(CmError::provider("creating a CM event channel"))?;
        let reg = ReadableFd::new(ch.fd()).map_err(CmError::io(
            "registering the CM event channel with the reactor",
        ))?;
        Ok(Events { reg, ch })
    }

    async fn next(&self) -> Result<CmEvent, CmError> {
        poll_fn(|cx| self.reg.poll_read(cx, || self.ch.get_event()))
            .await
            .map_err(CmError::provider("reading a CM event"))
    }
}

fn ctx(device: &Device) -> Result<&ibverbs::Context, CmError> {
    device.context().as_ibverbs().ok_or(CmError::Unsupported {
        provider: device.context().kind(),
    })
}

fn ib_qp(qp: &QueuePair) -> &ibverbs::Qp {
    qp.provider()
        .and_then(|q| q.as_ibverbs())
        .expect("a QP created on an ibverbs Device is an ibverbs QP")
}

fn unexpected(step: &'static str, addr: Option<SocketAddr>, ev: &CmEvent) -> CmError {
    if ev.kind == CmEventKind::Rejected {
        return CmError::Rejected {
            addr,
            status: ev.status,
            private_data: ev.private_data.clone(),
        };
    }
    CmError::Event {
        step,
        addr,
        event: ev.kind.to_string(),
        status: ev.status,
    }
}

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

/// Creates the runtime QP on `device` after checking that the CM bound
/// `id` to that device, and moves it to INIT.
fn make_qp(
    device: &Device,
    id: &CmId,
    addr: Option<SocketAddr>,
    opts: &CmOptions,
) -> Result<(QueuePair, Pd), CmError> {
    let ctx = ctx(device)?;
    let cm_device = id.device_name().unwrap_or_default();
    if cm_device != ctx.name() {
        return Err(CmError::OtherDevice {
            addr,
            cm_device,
            device: ctx.name().to_string(),
        });
    }
    let (qp, pd) = super::new_qp(device, opts)?;
    id.modify_qp(ib_qp(&qp), CmQpState::Init, opts.min_rnr_timer)
        .map_err(CmError::provider("moving the queue pair to INIT"))?;
    Ok((qp, pd))
}

/// Moves `qp` through `states` with the CM's attributes.
fn modify(
    id: &CmId,
    qp: &QueuePair,
    states: &[CmQpState],
    min_rnr_timer: u8,
) -> Result<(), CmError> {
    for &s in states {
        id.modify_qp(ib_qp(qp), s, min_rnr_timer)
            .map_err(|source| CmError::Provider {
                step: match s {
                    CmQpState::Init => "moving the queue pair to INIT",
                    CmQpState::Rtr => "moving the queue pair to RTR",
                    CmQpState::Rts => "moving the queue pair to RTS",
                },
                source,
            })?;
    }
    Ok(())
}

fn param(opts: &CmOptions, ctx: &ibverbs::Context) -> ConnParam {
    let dev = ctx.cached_attr();
    let cap = |want: u8, max: u32| {
        if max == 0 {
            want
        } else {
            want.min(u8::try_from(max).unwrap_or(u8::MAX))
        }
    };
    ConnParam {
        responder_resources: cap(opts.responder_resources, dev.max_qp_rd_atom),
        initiator_depth: cap(opts.initiator_depth, dev.max_qp_init_rd_atom),
        retry_count: opts.retry_count,
        rnr_retry_count: opts.rnr_retry_count,
    }
}

/// The active side after address and route resolution: the QP exists (in
/// INIT, receives may be posted), the connect request is not sent yet.
pub(crate) struct Connector {
    events: Events,
    id: CmId,
    addr: SocketAddr,
    param: ConnParam,
    min_rnr_timer: u8,
}

impl Connector {
    pub(crate) async fn resolve(
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<(Connector, QueuePair, Pd), CmError> {
        let ctx = ctx(device)?;
        let events = Events::new()?;
        let id = CmId::new(&events.ch).map_err(CmError::provider("creating a CM id"))?;
        let ms = i32::try_from(opts.resolve_timeout.as_millis()).unwrap_or(i32::MAX);
        id.resolve_addr(None, addr, ms)
            .map_err(CmError::provider("resolving the address"))?;
        let ev = events.next().await?;
        if ev.kind != CmEventKind::AddrResolved {
            return Err(unexpected("address resolution", Some(addr), &ev));
        }
        id.resolve_route(ms)
            .map_err(CmError::provider("resolving the route"))?;
        let ev = events.next().await?;
        if ev.kind != CmEventKind::RouteResolved {
            return Err(unexpected("route resolution", Some(addr), &ev));
        }
        let (qp, pd) = make_qp(device, &id, Some(addr), opts)?;
        let param = param(opts, ctx);
        Ok((
            Connector {
                events,
                id,
                addr,
                param,
                min_rnr_timer: opts.min_rnr_timer,
            },
            qp,
            pd,
        ))
    }
}

impl backend::Connecting for Connector {
    type Conn = Conn;

    /// Sends the connect request; on the response moves `qp` to RTS and
    /// establishes. Returns the connection and the peer's private data.
    async fn connect(
        self,
        qp: &QueuePair,
        private_data: &[u8],
    ) -> Result<(Conn, Vec<u8>), CmError> {
        check_len("connect", private_data, MAX_CONNECT_PRIVATE_DATA)?;
        self.id
            .connect(qp.qp_num(), &self.param, private_data)
            .map_err(CmError::provider("sending the connect request"))?;
        let ev = self.events.next().await?;
        if ev.kind != CmEventKind::ConnectResponse {
            return Err(unexpected("connecting", Some(self.addr), &ev));
        }
        // INIT again: access flags (remote READ/WRITE) are known now.
        modify(
            &self.id,
            qp,
            &[CmQpState::Init, CmQpState::Rtr, CmQpState::Rts],
            self.min_rnr_timer,
        )?;
        self.id
            .establish()
            .map_err(CmError::provider("establishing the connection"))?;
        Ok((
            Conn {
                inner: Rc::new(ConnInner {
                    events: self.events,
                    id: self.id,
                }),
            },
            ev.private_data,
        ))
    }
}

/// A listening identifier.
pub(crate) struct Listener {
    events: Events,
    id: CmId,
}

impl Listener {
    pub(crate) fn bind(
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<Listener, CmError> {
        ctx(device)?;
        let events = Events::new()?;
        let id = CmId::new(&events.ch).map_err(CmError::provider("creating a CM id"))?;
        id.listen(addr, opts.backlog)
            .map_err(CmError::provider("listening"))?;
        Ok(Listener { events, id })
    }
}

impl backend::Listening for Listener {
    type Answer = Request;

    fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The next connect request, on its own event channel, with its QP in
    /// RTS (receives may be posted before accepting).
    async fn request(
        &self,
        device: &Device,
        opts: &CmOptions,
    ) -> Result<backend::Request<Request>, CmError> {
        loop {
            let ev = self.events.next().await?;
            match ev.kind {
                CmEventKind::ConnectRequest => {}
                CmEventKind::DeviceRemoval => {
                    return Err(CmError::Disconnected {
                        reason: DisconnectReason::DeviceRemoved,
                    })
                }
                other => {
                    tracing::debug!(event = %other, "RDMA CM listener: ignoring event");
                    continue;
                }
            }
            let Some(mut id) = ev.new_id else { continue };
            let peer = id.peer_addr();
            let events = Events::new()?;
            id.migrate(&events.ch).map_err(CmError::provider(
                "moving a connect request to its own channel",
            ))?;
            let (qp, pd) = match make_qp(device, &id, peer, opts).and_then(|(qp, pd)| {
                modify(
                    &id,
                    &qp,
                    &[CmQpState::Rtr, CmQpState::Rts],
                    opts.min_rnr_timer,
                )?;
                Ok((qp, pd))
            }) {
                Ok(made) => made,
                Err(e) => {
                    if let Err(r) = id.reject(&[]) {
                        tracing::debug!(error = %r, "rejecting a connect request");
                    }
                    return Err(e);
                }
            };
            let ctx = ctx(device)?;
            let mut param = param(opts, ctx);
            // Never more than the requester offers.
            param.responder_resources = param.responder_resources.min(ev.initiator_depth);
            param.initiator_depth = param.initiator_depth.min(ev.responder_resources);
            return Ok((Request { events, id, param }, qp, pd, ev.private_data, peer));
        }
    }
}

/// A connect request not yet answered.
pub(crate) struct Request {
    events: Events,
    id: CmId,
    param: ConnParam,
}

impl backend::Answering for Request {
    type Conn = Conn;

    async fn accept(self, qp: &QueuePair, private_data: &[u8]) -> Result<Conn, CmError> {
        check_len("accept", private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        self.id
            .accept(qp.qp_num(), &self.param, private_data)
            .map_err(CmError::provider("accepting"))?;
        let ev = self.events.next().await?;
        if ev.kind != CmEventKind::Established {
            return Err(unexpected("accepting", self.id.peer_addr(), &ev));
        }
        Ok(Conn {
            inner: Rc::new(ConnInner {
                events: self.events,
                id: self.id,
            }),
        })
    }

    fn reject(self, private_data: &[u8]) -> Result<(), CmError> {
        check_len("reject", private_data, MAX_REJECT_PRIVATE_DATA)?;
        self.id
            .reject(private_data)
            .map_err(CmError::provider("rejecting"))
    }
}

struct ConnInner {
    events: Events,
    id: CmId,
}

/// An established connection's identifier and channel.
#[derive(Clone)]
pub(crate) struct Conn {
    inner: Rc<ConnInner>,
}

impl Conn {
    /// Resolves when the CM reports the connection down. A DISCONNECTED
    /// event is answered at once with `rdma_disconnect`: after the peer's
    /// DREQ it sends the DREP the peer's own `rdma_disconnect` waits for
    /// (without it the kernel answers only when the id is destroyed, or the
    /// peer gives up after about a minute); after ours it does nothing.
    pub(crate) async fn down(self) -> DisconnectReason {
        loop {
            match self.inner.events.next().await {
                Ok(ev) => match ev.kind {
                    CmEventKind::Disconnected => {
                        if let Err(e) = self.inner.id.disconnect() {
                            tracing::debug!(error = %e, "RDMA CM connection: answering the peer's disconnect");
                        }
                        return DisconnectReason::Peer;
                    }
                    CmEventKind::DeviceRemoval => return DisconnectReason::DeviceRemoved,
                    other => tracing::debug!(event = %other, "RDMA CM connection: event"),
                },
                Err(e) => {
                    tracing::warn!(error = %crate::report::ErrorChain(&e), "RDMA CM connection: reading events failed");
                    return DisconnectReason::EventsFailed;
                }
            }
        }
    }
}

/// RDMA CM through librdmacm ([`backend::CmBackend`]).
pub(crate) struct Backend;

impl backend::CmBackend for Backend {
    fn resolve<'a>(
        &self,
        device: &'a Device,
        addr: SocketAddr,
        opts: &'a CmOptions,
    ) -> CmFuture<'a, Resolved> {
        Box::pin(async move {
            let (c, qp, pd) = Connector::resolve(device, addr, opts).await?;
            Ok(Resolved {
                connector: Box::new(c),
                qp,
                pd,
            })
        })
    }

    fn bind(
        &self,
        device: &Device,
        addr: SocketAddr,
        opts: &CmOptions,
    ) -> Result<Box<dyn backend::Listen>, CmError> {
        Ok(Box::new(Listener::bind(device, addr, opts)?))
    }
}

impl backend::Conn for Conn {
    fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.id.local_addr()
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        self.inner.id.peer_addr()
    }

    fn disconnect(&self) -> Result<(), CmError> {
        self.inner
            .id
            .disconnect()
            .map_err(CmError::provider("disconnecting"))
    }

    fn down(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = DisconnectReason>>> {
        Box::pin(self.clone().down())
    }

    fn down_event(&self) -> &'static str {
        "disconnecting: waiting for the RDMA CM DISCONNECTED event (the peer's DREP)"
    }
}
