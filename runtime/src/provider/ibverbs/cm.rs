//! librdmacm (RDMA connection manager) objects, through rdma-mummy-sys
//! (which `dlopen`s `librdmacm.so.1`): an event channel whose fd is
//! non-blocking ([`EventChannel`]), connection identifiers ([`CmId`]) and
//! their events copied out and acknowledged at once ([`CmEvent`]).
//!
//! Queue pairs are not created through the CM: the caller creates its own
//! QP (on its own device context, CQs and PD), names it by number in
//! [`CmId::connect`] / [`CmId::accept`], and moves it through INIT, RTR and
//! RTS with [`CmId::modify_qp`], which asks `rdma_init_qp_attr` (what rping does
//! with `-q`). The QP must be on the device the CM bound the identifier to
//! ([`CmId::device_name`]).
//!
//! These are single-thread objects (`!Send`): the runtime that owns them
//! polls the channel's fd and calls them from its thread.

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr;
use std::rc::Rc;

use rdma_mummy_sys as sys;
use sys::rdma_cm_event_type as E;

use super::{errno_err, Qp};
use crate::provider::{ProviderError, Result};

/// Most private data a connect request carries on RoCE/IB (the CM's
/// 92-byte REQ field less the 36-byte header rdma_cm puts in it).
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Most private data an accept (REP) or reject carries (196 and 148 bytes).
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Most private data a reject carries.
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;

/// What a connection-manager event reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmEventKind {
    /// `rdma_resolve_addr` finished.
    AddrResolved,
    /// `rdma_resolve_addr` failed.
    AddrError,
    /// `rdma_resolve_route` finished.
    RouteResolved,
    /// `rdma_resolve_route` failed.
    RouteError,
    /// A peer asks to connect (on a listening identifier).
    ConnectRequest,
    /// The passive side accepted (the QP is ours to move to RTR/RTS).
    ConnectResponse,
    /// The connection failed while being set up.
    ConnectError,
    /// The peer did not answer.
    Unreachable,
    /// The peer refused the connection.
    Rejected,
    /// The connection is up.
    Established,
    /// The connection is down (either side disconnected).
    Disconnected,
    /// The device went away.
    DeviceRemoval,
    /// Any other event (multicast, address change, time-wait exit).
    Other(u32),
}

impl CmEventKind {
    fn from_raw(raw: u32) -> CmEventKind {
        match raw {
            E::RDMA_CM_EVENT_ADDR_RESOLVED => CmEventKind::AddrResolved,
            E::RDMA_CM_EVENT_ADDR_ERROR => CmEventKind::AddrError,
            E::RDMA_CM_EVENT_ROUTE_RESOLVED => CmEventKind::RouteResolved,
            E::RDMA_CM_EVENT_ROUTE_ERROR => CmEventKind::RouteError,
            E::RDMA_CM_EVENT_CONNECT_REQUEST => CmEventKind::ConnectRequest,
            E::RDMA_CM_EVENT_CONNECT_RESPONSE => CmEventKind::ConnectResponse,
            E::RDMA_CM_EVENT_CONNECT_ERROR => CmEventKind::ConnectError,
            E::RDMA_CM_EVENT_UNREACHABLE => CmEventKind::Unreachable,
            E::RDMA_CM_EVENT_REJECTED => CmEventKind::Rejected,
            E::RDMA_CM_EVENT_ESTABLISHED => CmEventKind::Established,
            E::RDMA_CM_EVENT_DISCONNECTED => CmEventKind::Disconnected,
            E::RDMA_CM_EVENT_DEVICE_REMOVAL => CmEventKind::DeviceRemoval,
            other => CmEventKind::Other(other),
        }
    }
}

impl std::fmt::Display for CmEventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            CmEventKind::AddrResolved => "ADDR_RESOLVED",
            CmEventKind::AddrError => "ADDR_ERROR",
            CmEventKind::RouteResolved => "ROUTE_RESOLVED",
            CmEventKind::RouteError => "ROUTE_ERROR",
            CmEventKind::ConnectRequest => "CONNECT_REQUEST",
            CmEventKind::ConnectResponse => "CONNECT_RESPONSE",
            CmEventKind::ConnectError => "CONNECT_ERROR",
            CmEventKind::Unreachable => "UNREACHABLE",
            CmEventKind::Rejected => "REJECTED",
            CmEventKind::Established => "ESTABLISHED",
            CmEventKind::Disconnected => "DISCONNECTED",
            CmEventKind::DeviceRemoval => "DEVICE_REMOVAL",
            CmEventKind::Other(n) => return write!(f, "event {n}"),
        };
        f.write_str(s)
    }
}

struct ChannelInner {
    ch: *mut sys::rdma_event_channel,
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: created by rdma_create_event_channel; every identifier
        // on it holds an `Rc` of this inner and is destroyed first.
        unsafe { sys::rdma_destroy_event_channel(self.ch) };
    }
}

/// An `rdma_event_channel` with a non-blocking fd. Cheap to clone (`Rc`);
/// destroyed when the last handle and the last [`CmId`] on it are gone.
#[derive(Clone)]
pub struct EventChannel {
    inner: Rc<ChannelInner>,
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

impl EventChannel {
    /// `rdma_create_event_channel`, its fd switched to non-blocking mode.
    pub fn new() -> Result<EventChannel> {
        // SAFETY: no arguments; NULL on failure (errno set).
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(errno_err("rdma_create_event_channel"));
        }
        let inner = Rc::new(ChannelInner { ch });
        // SAFETY: valid channel; `fd` is a plain field.
        let fd = unsafe { (*ch).fd };
        // SAFETY: fcntl on the channel's own open fd.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(errno_err("fcntl(O_NONBLOCK) on the CM event channel"));
        }
        Ok(EventChannel { inner })
    }

    /// The fd to poll for readability.
    pub fn fd(&self) -> RawFd {
        // SAFETY: valid channel while `inner` lives; plain field.
        unsafe { (*self.inner.ch).fd }
    }

    /// `rdma_get_cm_event` without blocking, the event copied out and
    /// acknowledged: `None` when the channel has none.
    pub fn get_event(&self) -> Result<Option<CmEvent>> {
        let mut ev: *mut sys::rdma_cm_event = ptr::null_mut();
        // SAFETY: valid channel; `ev` receives an event we ack below.
        let ret = unsafe { sys::rdma_get_cm_event(self.inner.ch, &mut ev) };
        if ret != 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(ProviderError::Verbs {
                    call: "rdma_get_cm_event",
                    source: e,
                }),
            };
        }
        // SAFETY: a valid event until acked; every field read here is plain
        // data or the private data (`len` bytes at `private_data`, owned by
        // the event).
        let out = unsafe {
            let e = &*ev;
            let kind = CmEventKind::from_raw(e.event);
            let conn = &e.param.conn;
            let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
                .to_vec()
            };
            let new_id = if kind == CmEventKind::ConnectRequest && !e.id.is_null() {
                Some(CmId {
                    id: e.id,
                    channel: self.clone(),
                })
            } else {
                None
            };
            CmEvent {
                kind,
                status: e.status,
                private_data,
                qp_num: conn.qp_num,
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
                new_id,
            }
        };
        // SAFETY: the event from rdma_get_cm_event above, acked once; a new
        // identifier of a connect request stays valid after the ack.
        let ret = unsafe { sys::rdma_ack_cm_event(ev) };
        if ret != 0 {
            tracing::warn!(error = %errno_err("rdma_ack_cm_event"), "acknowledging a CM event");
        }
        Ok(Some(out))
    }
}

/// One connection-manager event, copied out of librdmacm (and acked).
#[derive(Debug)]
pub struct CmEvent {
    /// What happened.
    pub kind: CmEventKind,
    /// The event's status (0, a negative errno, or for `Rejected` the
    /// CM's reject reason).
    pub status: i32,
    /// The peer's private data (connect request, response, reject,
    /// established on the passive side).
    pub private_data: Vec<u8>,
    /// The peer's QP number (connect request and response).
    pub qp_num: u32,
    /// RDMA READ / atomic operations the peer accepts in flight.
    pub responder_resources: u8,
    /// RDMA READ / atomic operations the peer issues in flight.
    pub initiator_depth: u8,
    /// A connect request's new identifier (on the listener's channel).
    pub new_id: Option<CmId>,
}

/// The `rdma_conn_param` fields a caller chooses (`qp_num` and the private
/// data are separate arguments).
#[derive(Clone, Copy, Debug)]
pub struct ConnParam {
    /// RDMA READs / atomics the peer may have in flight towards us.
    pub responder_resources: u8,
    /// RDMA READs / atomics we may have in flight towards the peer.
    pub initiator_depth: u8,
    /// Transport retries (0..=7).
    pub retry_count: u8,
    /// RNR retries (0..=7, 7 = forever).
    pub rnr_retry_count: u8,
}

/// An `rdma_cm_id` (port space TCP, RC), destroyed on drop.
pub struct CmId {
    id: *mut sys::rdma_cm_id,
    channel: EventChannel,
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .finish()
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: created by rdma_create_id (or a connect request) and
        // destroyed once; its events are acked as they are read, so the
        // call does not wait for any.
        let ret = unsafe { sys::rdma_destroy_id(self.id) };
        if ret != 0 {
            tracing::debug!(error = %errno_err("rdma_destroy_id"), "destroying a CM id");
        }
    }
}

fn check(call: &'static str, ret: libc::c_int) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(errno_err(call))
    }
}

impl CmId {
    /// `rdma_create_id` on `channel` (port space TCP: reliable connected).
    pub fn new(channel: &EventChannel) -> Result<CmId> {
        let mut id: *mut sys::rdma_cm_id = ptr::null_mut();
        // SAFETY: valid channel; `id` receives the new identifier.
        let ret = unsafe {
            sys::rdma_create_id(
                channel.inner.ch,
                &mut id,
                ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        };
        check("rdma_create_id", ret)?;
        Ok(CmId {
            id,
            channel: channel.clone(),
        })
    }

    /// The channel its events arrive on.
    pub fn channel(&self) -> &EventChannel {
        &self.channel
    }

    /// `rdma_migrate_id`: its later events arrive on `channel`. Every event
    /// of it read so far is acked already, so this does not block.
    pub fn migrate(&mut self, channel: &EventChannel) -> Result<()> {
        // SAFETY: valid identifier and channel.
        let ret = unsafe { sys::rdma_migrate_id(self.id, channel.inner.ch) };
        check("rdma_migrate_id", ret)?;
        self.channel = channel.clone();
        Ok(())
    }

    /// `rdma_resolve_addr` to `dst` (from `src`, if given); the result is
    /// an `AddrResolved` or `AddrError` event.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: i32,
    ) -> Result<()> {
        let mut d = SockAddr::from(dst);
        let mut s = src.map(SockAddr::from);
        let sp = s
            .as_mut()
            .map_or(ptr::null_mut(), |s| s.as_mut_ptr().cast::<libc::sockaddr>());
        // SAFETY: valid identifier; the addresses live for the call.
        let ret = unsafe {
            sys::rdma_resolve_addr(
                self.id,
                sp,
                d.as_mut_ptr().cast::<libc::sockaddr>(),
                timeout_ms,
            )
        };
        check("rdma_resolve_addr", ret)
    }

    /// `rdma_resolve_route`; the result is a `RouteResolved` or
    /// `RouteError` event.
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<()> {
        // SAFETY: valid identifier.
        let ret = unsafe { sys::rdma_resolve_route(self.id, timeout_ms) };
        check("rdma_resolve_route", ret)
    }

    /// `rdma_bind_addr` then `rdma_listen`.
    pub fn listen(&self, addr: SocketAddr, backlog: i32) -> Result<()> {
        let mut a = SockAddr::from(addr);
        // SAFETY: valid identifier; the address lives for the call.
        let ret = unsafe { sys::rdma_bind_addr(self.id, a.as_mut_ptr().cast::<libc::sockaddr>()) };
        check("rdma_bind_addr", ret)?;
        // SAFETY: valid, bound identifier.
        let ret = unsafe { sys::rdma_listen(self.id, backlog) };
        check("rdma_listen", ret)
    }

    fn conn_param(param: &ConnParam, qp_num: u32, private_data: &[u8]) -> sys::rdma_conn_param {
        sys::rdma_conn_param {
            private_data: if private_data.is_empty() {
                ptr::null()
            } else {
                private_data.as_ptr().cast()
            },
            private_data_len: private_data.len() as u8,
            responder_resources: param.responder_resources,
            initiator_depth: param.initiator_depth,
            flow_control: 1,
            retry_count: param.retry_count.min(7),
            rnr_retry_count: param.rnr_retry_count.min(7),
            srq: 0,
            qp_num,
        }
    }

    fn check_private(call: &'static str, data: &[u8], max: usize) -> Result<()> {
        if data.len() > max {
            return Err(ProviderError::InvalidArgument {
                call,
                what: format!("{} bytes of private data, at most {max}", data.len()),
            });
        }
        Ok(())
    }

    /// `rdma_connect` naming our QP `qp_num`; the result is a
    /// `ConnectResponse` (then move the QP to RTR and RTS and call
    /// [`establish`](Self::establish)), `Rejected`, `Unreachable` or
    /// `ConnectError` event.
    pub fn connect(&self, qp_num: u32, param: &ConnParam, private_data: &[u8]) -> Result<()> {
        Self::check_private("rdma_connect", private_data, MAX_CONNECT_PRIVATE_DATA)?;
        let mut p = Self::conn_param(param, qp_num, private_data);
        // SAFETY: valid, route-resolved identifier; `p` and the private
        // data it points to live for the call (librdmacm copies them).
        let ret = unsafe { sys::rdma_connect(self.id, &mut p) };
        check("rdma_connect", ret)
    }

    /// `rdma_establish`: after `ConnectResponse` and the QP's move to RTS.
    pub fn establish(&self) -> Result<()> {
        // SAFETY: valid identifier.
        let ret = unsafe { sys::rdma_establish(self.id) };
        check("rdma_establish", ret)
    }

    /// `rdma_accept` of a connect request, naming our QP `qp_num` (already
    /// in RTS); the result is an `Established` event.
    pub fn accept(&self, qp_num: u32, param: &ConnParam, private_data: &[u8]) -> Result<()> {
        Self::check_private("rdma_accept", private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        let mut p = Self::conn_param(param, qp_num, private_data);
        // SAFETY: valid identifier of a connect request; `p` and its
        // private data live for the call.
        let ret = unsafe { sys::rdma_accept(self.id, &mut p) };
        check("rdma_accept", ret)
    }

    /// `rdma_reject` of a connect request.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        Self::check_private("rdma_reject", private_data, MAX_REJECT_PRIVATE_DATA)?;
        let p = if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        // SAFETY: valid identifier; the data lives for the call.
        let ret = unsafe { sys::rdma_reject(self.id, p, private_data.len() as u8) };
        check("rdma_reject", ret)
    }

    /// `rdma_disconnect`; a `Disconnected` event follows on both sides.
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: valid identifier.
        let ret = unsafe { sys::rdma_disconnect(self.id) };
        check("rdma_disconnect", ret)
    }

    /// Moves `qp` to `state` (INIT, RTR or RTS) with the attributes the
    /// CM gives for this connection (`rdma_init_qp_attr` + `ibv_modify_qp`).
    /// On RTR, `min_rnr_timer` (verbs encoding) replaces the kernel CM's 0,
    /// which makes a peer that finds no receive posted wait 655 ms.
    pub fn modify_qp(&self, qp: &Qp, state: CmQpState, min_rnr_timer: u8) -> Result<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr (integers and plain structs).
        let mut attr: sys::ibv_qp_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.qp_state = match state {
            CmQpState::Init => sys::ibv_qp_state::IBV_QPS_INIT,
            CmQpState::Rtr => sys::ibv_qp_state::IBV_QPS_RTR,
            CmQpState::Rts => sys::ibv_qp_state::IBV_QPS_RTS,
        };
        let mut mask: libc::c_int = 0;
        // SAFETY: valid identifier; `attr` and `mask` are out-parameters.
        let ret = unsafe { sys::rdma_init_qp_attr(self.id, &mut attr, &mut mask) };
        check("rdma_init_qp_attr", ret)?;
        if state == CmQpState::Rtr
            && mask & (sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as libc::c_int) != 0
        {
            attr.min_rnr_timer = min_rnr_timer.min(31);
        }
        qp.modify_with(&mut attr, mask)
    }

    /// The device the CM bound this identifier to (after address
    /// resolution, or on a connect request), if any.
    pub fn device_name(&self) -> Option<String> {
        // SAFETY: valid identifier; `verbs` is NULL or a context librdmacm
        // keeps open, whose device name is a NUL-terminated string.
        unsafe {
            let verbs = (*self.id).verbs;
            if verbs.is_null() || (*verbs).device.is_null() {
                return None;
            }
            let name = sys::ibv_get_device_name((*verbs).device);
            if name.is_null() {
                return None;
            }
            Some(CStr::from_ptr(name).to_string_lossy().into_owned())
        }
    }

    /// The port the CM bound this identifier to.
    pub fn port_num(&self) -> u8 {
        // SAFETY: valid identifier; plain field.
        unsafe { (*self.id).port_num }
    }

    /// The local address (after binding or resolution).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: valid identifier; the source-address union is a
        // sockaddr_storage-sized field of plain data, read through a raw
        // pointer to the whole union.
        unsafe {
            let p = ptr::addr_of!((*self.id).route.addr.src_addr_union);
            sockaddr_to_std(p.cast::<libc::sockaddr_storage>())
        }
    }

    /// The peer's address (after resolution, or on a connect request).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above, for the destination-address union.
        unsafe {
            let p = ptr::addr_of!((*self.id).route.addr.dst_addr_union);
            sockaddr_to_std(p.cast::<libc::sockaddr_storage>())
        }
    }
}

/// The QP states [`CmId::modify_qp`] moves a QP to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmQpState {
    /// INIT: port, P_Key index, access flags.
    Init,
    /// RTR: the peer's address, QPN, PSN, path MTU, READ depth.
    Rtr,
    /// RTS: our PSN, timeouts and retries, READ depth.
    Rts,
}

/// A socket address in C layout (`sockaddr_in` or `sockaddr_in6` in a
/// `sockaddr_storage`).
struct SockAddr(libc::sockaddr_storage);

impl SockAddr {
    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr_storage {
        &mut self.0
    }
}

impl From<SocketAddr> for SockAddr {
    fn from(addr: SocketAddr) -> SockAddr {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut st: libc::sockaddr_storage = unsafe { MaybeUninit::zeroed().assume_init() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_in fits in (and is aligned for) sockaddr_storage.
                unsafe { ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin) };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above for sockaddr_in6.
                unsafe { ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin6) };
            }
        }
        SockAddr(st)
    }
}

/// The address at `sa`, if it is IPv4 or IPv6.
///
/// # Safety
///
/// `sa` points to a readable `sockaddr_storage` (rdma_cm's address unions
/// have that size), initialised as far as its family says.
unsafe fn sockaddr_to_std(sa: *const libc::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the family is the first field of every socket address
    // (contract: readable).
    let family = unsafe { ptr::read_unaligned(ptr::addr_of!((*sa).ss_family)) };
    match i32::from(family) {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in, which fits in
            // the storage (contract).
            let sin = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above for sockaddr_in6.
            let sin6 = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip() {
        for a in ["10.77.0.1:7174", "[fe80::1%2]:18515", "0.0.0.0:0"] {
            let addr: SocketAddr = a.parse().unwrap();
            let c = SockAddr::from(addr);
            // SAFETY: a sockaddr_storage holding the address just written.
            let back = unsafe { sockaddr_to_std(&c.0) };
            assert_eq!(back, Some(addr), "{a}");
        }
    }

    #[test]
    fn event_kinds_have_rdma_cm_names() {
        assert_eq!(
            CmEventKind::from_raw(E::RDMA_CM_EVENT_DISCONNECTED),
            CmEventKind::Disconnected
        );
        assert_eq!(CmEventKind::Rejected.to_string(), "REJECTED");
        assert_eq!(CmEventKind::from_raw(99).to_string(), "event 99");
    }
}
