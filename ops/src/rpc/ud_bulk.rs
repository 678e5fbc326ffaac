//! The large-message path of [`UdTransport`](super::ud::UdTransport): RC
//! queue pairs of the same device (one per session that asks), buffers
//! granted to peers for REMOTE_READ (and REMOTE_WRITE where the peer may
//! write a response into them), READs into buffers registered for the
//! READ's time, WRITEs with immediate from buffers registered for the
//! WRITE's time, and a small receive ring per link whose buffers the
//! peer's WRITEs with immediate consume.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use tracing::debug;
use verbio_runtime::buf::{IoBuf, RegisteredMem, RemoteAccessRegion, Slice};
use verbio_runtime::provider::{AccessFlags, Endpoint, Pd, QpCaps};
use verbio_runtime::{Device, QueuePair, RecvRing, RecvRingConfig};

use super::transport::{Bulk, BulkDone, TransportError};
use crate::connect::handshake::{self, Hello};
use crate::connect::{DeviceQps, QpConfig, QpFactory};
use crate::verbs::RemoteBuf;

/// READs a link has under way at most (its send queue).
const LINK_SEND_DEPTH: u32 = 64;
/// Receives a link keeps posted for the peer's WRITEs with immediate: more
/// than a session's slots, so a WRITE never waits for a repost.
const LINK_RECV_DEPTH: u32 = 16;
/// Bytes of each of those receives (a WRITE with immediate puts nothing in
/// them; a SEND the peer has no business sending lands there and is
/// counted as malformed).
const LINK_RECV_BYTES: usize = 64;

/// Finished READs, filled by their tasks.
#[derive(Default)]
struct Done {
    items: Vec<BulkDone>,
    waker: Option<Waker>,
}

/// The [`Bulk`] of a UD transport's device.
pub(crate) struct UdBulk {
    qps: DeviceQps,
    pd: Pd,
    links: HashMap<u64, (QueuePair, Endpoint)>,
    /// The receive rings of the links whose regions peers may write to,
    /// made on the link's first writable region.
    rings: HashMap<u64, RecvRing>,
    regions: HashMap<u64, RemoteAccessRegion<Slice<Vec<u8>>>>,
    next_region: u64,
    done: Rc<RefCell<Done>>,
}

impl UdBulk {
    /// RC links on `device`.
    pub(crate) fn new(device: &Device) -> UdBulk {
        let config = QpConfig {
            caps: QpCaps {
                max_send_wr: LINK_SEND_DEPTH,
                max_recv_wr: LINK_RECV_DEPTH,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..QpConfig::default()
        };
        UdBulk {
            qps: DeviceQps::new(device.clone(), config),
            pd: device.pd().clone(),
            links: HashMap::new(),
            rings: HashMap::new(),
            regions: HashMap::new(),
            next_region: 1,
            done: Rc::default(),
        }
    }
}

fn failed(op: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> TransportError {
    TransportError::Failed {
        op,
        source: Box::new(e),
    }
}

/// Waits in a task for `op`, a READ or WRITE submitted already (the
/// runtime keeps its buffer until the completion), then records its
/// buffer and result under `token` in `done` and wakes the engine.
fn record_when_done<T, E>(
    done: &Rc<RefCell<Done>>,
    token: u64,
    what: &'static str,
    op: impl std::future::Future<Output = (Result<T, E>, RegisteredMem<Vec<u8>>)> + 'static,
) where
    E: std::error::Error + Send + Sync + 'static,
{
    let done = done.clone();
    verbio_runtime::spawn(async move {
        let (result, mem) = op.await;
        let buf = mem.into_inner();
        let result = result.map(drop).map_err(|e| {
            debug!(error = %e, what, "rpc/ud: bulk operation failed");
            failed(what, e)
        });
        let mut d = done.borrow_mut();
        d.items.push((token, buf, result));
        if let Some(w) = d.waker.take() {
            w.wake();
        }
    });
}

impl Bulk for UdBulk {
    fn open(&mut self, link: u64) -> Result<Vec<u8>, TransportError> {
        let (qp, ep) = self
            .qps
            .create()
            .map_err(|e| failed("creating an RC queue pair", e))?;
        let hello = handshake::encode(&Hello::new(ep))
            .map_err(|e| failed("encoding the RC endpoint", e))?;
        self.links.insert(link, (qp, ep));
        Ok(hello.to_vec())
    }

    fn connect(&mut self, link: u64, remote: &[u8]) -> Result<(), TransportError> {
        let Some((qp, local)) = self.links.get(&link) else {
            return Err(TransportError::BadAddress {
                len: remote.len(),
                reason: "no such link",
            });
        };
        let hello = handshake::decode(remote).map_err(|_| TransportError::BadAddress {
            len: remote.len(),
            reason: "not a handshake hello",
        })?;
        self.qps
            .connect(qp, local, &hello.endpoint)
            .map_err(|e| failed("connecting the RC queue pair", e))
    }

    fn close(&mut self, link: u64) {
        // Dropping the queue pair destroys it; READs and WRITEs under way
        // end flushed (their tasks report them), and so do the ring's
        // receives (the ring's memory is freed once they are polled).
        self.rings.remove(&link);
        self.links.remove(&link);
    }

    fn expose(&mut self, buf: Vec<u8>) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        // Exactly the message: the peer reaches nothing past it (and the
        // pool buffer's spare capacity is neither registered nor zeroed).
        let len = buf.len();
        let buf = match buf.slice(..len) {
            Ok(slice) => slice,
            Err(rejected) => {
                let error = failed("exposing a buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        match RemoteAccessRegion::grant(&self.pd, buf, AccessFlags::REMOTE_READ) {
            Ok(region) => {
                let token = self.next_region;
                self.next_region += 1;
                let (addr, rkey) = (region.addr(), region.rkey());
                self.regions.insert(token, region);
                Ok((token, addr, rkey))
            }
            Err(rejected) => {
                let error = failed("granting a buffer for READ", rejected.error);
                Err((rejected.buf.into_inner(), error))
            }
        }
    }

    fn unexpose(&mut self, token: u64) -> Option<Vec<u8>> {
        // Deregistered first: no READ reaches it afterwards.
        self.regions
            .remove(&token)
            .map(|region| region.revoke().into_inner())
    }

    fn read(
        &mut self,
        link: u64,
        addr: u64,
        rkey: u32,
        len: usize,
        into: Vec<u8>,
        token: u64,
    ) -> Result<(), (Vec<u8>, TransportError)> {
        let Some((qp, _)) = self.links.get(&link) else {
            let e = TransportError::no_such_link();
            return Err((into, e));
        };
        let mem = match RegisteredMem::register(&self.pd, into, AccessFlags::LOCAL_WRITE) {
            Ok(mem) => mem,
            Err(rejected) => {
                let error = failed("registering the READ's buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        let op = crate::verbs::read::read(qp, mem, RemoteBuf::new(addr, len as u64, rkey));
        record_when_done(&self.done, token, "reading by RDMA READ", op);
        Ok(())
    }

    fn expose_writable(
        &mut self,
        link: u64,
        mut buf: Vec<u8>,
        cap: usize,
    ) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        if !self.rings.contains_key(&link) {
            let Some((qp, _)) = self.links.get(&link) else {
                let e = TransportError::no_such_link();
                return Err((buf, e));
            };
            let config = RecvRingConfig::new(LINK_RECV_DEPTH, LINK_RECV_BYTES);
            match RecvRing::new(qp, &self.pd, config) {
                Ok(ring) => {
                    self.rings.insert(link, ring);
                }
                Err(e) => return Err((buf, failed("posting the link's receives", e))),
            }
        }
        let cap = cap.max(buf.len());
        buf.reserve_exact(cap - buf.len());
        // Exactly `cap` bytes: the peer reaches nothing past them.
        let buf = match buf.slice(..cap) {
            Ok(slice) => slice,
            Err(rejected) => {
                let error = failed("exposing a buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        match RemoteAccessRegion::grant(&self.pd, buf, access) {
            Ok(region) => {
                let token = self.next_region;
                self.next_region += 1;
                let (addr, rkey) = (region.addr(), region.rkey());
                self.regions.insert(token, region);
                Ok((token, addr, rkey))
            }
            Err(rejected) => {
                let error = failed("granting a buffer for READ and WRITE", rejected.error);
                Err((rejected.buf.into_inner(), error))
            }
        }
    }

    fn write_imm(
        &mut self,
        link: u64,
        buf: Vec<u8>,
        addr: u64,
        rkey: u32,
        imm: u32,
        token: u64,
    ) -> Result<(), (Vec<u8>, TransportError)> {
        let Some((qp, _)) = self.links.get(&link) else {
            let e = TransportError::no_such_link();
            return Err((buf, e));
        };
        let len = buf.len() as u64;
        let mem = match RegisteredMem::register(&self.pd, buf, AccessFlags::from_bits_truncate(0)) {
            Ok(mem) => mem,
            Err(rejected) => {
                let error = failed("registering the WRITE's buffer", rejected.error);
                return Err((rejected.buf, error));
            }
        };
        let op = crate::verbs::write_with_imm::write_with_imm(
            qp,
            mem,
            RemoteBuf::new(addr, len, rkey),
            imm,
        );
        record_when_done(
            &self.done,
            token,
            "writing by RDMA WRITE with immediate",
            op,
        );
        Ok(())
    }

    fn poll_written(&mut self, cx: &mut Context<'_>, out: &mut Vec<(u64, u32)>) {
        for (&link, ring) in &self.rings {
            loop {
                match ring.poll_next(cx) {
                    Poll::Ready(Some(Ok(msg))) => match (msg.by_write(), msg.imm()) {
                        (true, Some(imm)) => out.push((link, imm)),
                        _ => debug!(link, "rpc/ud: a message on a link that takes only WRITEs with immediate; ignored"),
                    },
                    Poll::Ready(Some(Err(error))) => {
                        debug!(%error, link, "rpc/ud: a link's receive completed in error");
                    }
                    Poll::Ready(None) | Poll::Pending => break,
                }
            }
        }
    }

    fn poll_done(&mut self, cx: &mut Context<'_>, out: &mut Vec<BulkDone>) {
        let mut d = self.done.borrow_mut();
        // Registered whether or not some are here: the dispatcher does not
        // ask again before it sleeps.
        match &mut d.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        out.append(&mut d.items);
    }
}
