//! The large-message path of [`UdTransport`](super::ud::UdTransport): RC
//! queue pairs of the same device (one per session that asks), buffers
//! granted to peers for REMOTE_READ only, and READs into buffers
//! registered for the READ's time.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::task::{Context, Waker};

use tracing::debug;
use verbio_runtime::buf::{IoBuf, RegisteredMem, RemoteAccessRegion, Slice};
use verbio_runtime::provider::{AccessFlags, Endpoint, Pd, QpCaps};
use verbio_runtime::{Device, QueuePair};

use super::transport::{Bulk, BulkDone, TransportError};
use crate::connect::handshake::{self, Hello};
use crate::connect::{DeviceQps, QpConfig, QpFactory};
use crate::verbs::RemoteBuf;

/// READs a link has under way at most (its send queue).
const LINK_SEND_DEPTH: u32 = 64;

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
                max_recv_wr: 1,
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
        // Dropping the queue pair destroys it; READs under way end
        // flushed (their tasks report them).
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
            let e = TransportError::BadAddress {
                len: 0,
                reason: "no such link",
            };
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
        let done = self.done.clone();
        // The READ is submitted now; its task only waits for it (the
        // runtime keeps the buffer until the completion).
        verbio_runtime::spawn(async move {
            let (result, mem) = op.await;
            let buf = mem.into_inner();
            let result = result.map_err(|e| {
                debug!(error = %e, "rpc/ud: READ failed");
                failed("reading by RDMA READ", e)
            });
            let mut d = done.borrow_mut();
            d.items.push((token, buf, result));
            if let Some(w) = d.waker.take() {
                w.wake();
            }
        });
        Ok(())
    }

    fn poll_done(&mut self, cx: &mut Context<'_>, out: &mut Vec<BulkDone>) {
        let mut d = self.done.borrow_mut();
        if d.items.is_empty() {
            match &mut d.waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                w => *w = Some(cx.waker().clone()),
            }
            return;
        }
        out.append(&mut d.items);
    }
}
