//! The software RDMA device (placeholder signatures; the engine is being built).
#![allow(
    missing_docs,
    unused_variables,
    clippy::missing_safety_doc,
    clippy::len_without_is_empty
)]

use std::os::fd::RawFd;

use super::*;

pub(crate) fn device_info() -> DeviceInfo {
    DeviceInfo {
        name: "soft0".into(),
        kind: ProviderKind::Soft,
        guid: 0,
    }
}

#[derive(Clone)]
pub struct Context;
#[derive(Clone)]
pub struct Pd;
#[derive(Clone)]
pub struct Mr;
#[derive(Clone)]
pub struct CompChannel;
#[derive(Clone)]
pub struct Cq;
#[derive(Clone)]
pub struct Qp;

impl Context {
    pub fn open(config: SoftConfig) -> Result<Context> {
        todo!()
    }
    pub fn name(&self) -> &str {
        todo!()
    }
    pub fn query_device(&self) -> Result<DeviceAttr> {
        todo!()
    }
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        todo!()
    }
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        todo!()
    }
    pub fn alloc_pd(&self) -> Result<Pd> {
        todo!()
    }
    pub fn create_comp_channel(&self) -> Result<CompChannel> {
        todo!()
    }
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompChannel>) -> Result<Cq> {
        todo!()
    }
    pub fn async_fd(&self) -> RawFd {
        todo!()
    }
    pub fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
        todo!()
    }
    pub fn local_addr(&self) -> std::net::SocketAddr {
        todo!()
    }
}
impl Pd {
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        todo!()
    }
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        todo!()
    }
}
impl Mr {
    pub fn lkey(&self) -> u32 {
        todo!()
    }
    pub fn rkey(&self) -> u32 {
        todo!()
    }
    pub fn addr(&self) -> u64 {
        todo!()
    }
    pub fn len(&self) -> usize {
        todo!()
    }
    pub fn access(&self) -> AccessFlags {
        todo!()
    }
}
impl CompChannel {
    pub fn fd(&self) -> RawFd {
        todo!()
    }
    pub fn get_event(&self) -> Result<Option<u32>> {
        todo!()
    }
}
impl Cq {
    pub fn handle(&self) -> u32 {
        todo!()
    }
    pub fn capacity(&self) -> u32 {
        todo!()
    }
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        todo!()
    }
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        todo!()
    }
    pub fn ack_events(&self, n: u32) {
        todo!()
    }
}
impl Qp {
    pub fn qp_num(&self) -> u32 {
        todo!()
    }
    pub fn state(&self) -> QpState {
        todo!()
    }
    pub fn caps(&self) -> QpCaps {
        todo!()
    }
    pub fn endpoint(&self, gid_index: u8) -> Result<Endpoint> {
        todo!()
    }
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
        todo!()
    }
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
        todo!()
    }
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
        todo!()
    }
    pub fn modify_to_err(&self) -> Result<()> {
        todo!()
    }
    pub fn modify_to_reset(&self) -> Result<()> {
        todo!()
    }
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        todo!()
    }
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        todo!()
    }
}
