//! The large-message path of [`MemTransport`](super::mem::MemTransport):
//! links, exposed buffers and READs between endpoints of one
//! [`MemNetwork`](super::mem::MemNetwork), with READs that can be held
//! (to test what happens while one is under way).

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Waker};

use super::mem::MemNetwork;
use super::transport::{Bulk, BulkDone, TransportError};

/// A buffer exposed to READ.
struct Region {
    owner: u32,
    addr: u64,
    bytes: Vec<u8>,
}

/// A READ not carried out yet (the network holds READs).
struct PendingRead {
    reader: u32,
    link: u64,
    addr: u64,
    rkey: u32,
    len: usize,
    into: Vec<u8>,
    token: u64,
}

/// The network's bulk state.
#[derive(Default)]
pub(crate) struct BulkNet {
    /// Exposed buffers by rkey.
    regions: HashMap<u32, Region>,
    next_rkey: u32,
    /// Links by (endpoint, link): the peer endpoint once connected.
    links: HashMap<(u32, u64), Option<u32>>,
    pending: VecDeque<PendingRead>,
    /// READs wait until released.
    pub(crate) hold: bool,
    /// Finished READs per endpoint (by id), and the waker of its
    /// dispatcher.
    done: Vec<(Vec<BulkDone>, Option<Waker>)>,
    /// READs carried out (tests).
    pub(crate) reads: u64,
}

impl BulkNet {
    /// Carries out `r`: the bytes of the peer's exposed buffer, or an
    /// error as a device gives one (a bad key, address or length, or a
    /// link that is closed).
    fn execute(&mut self, mut r: PendingRead) {
        let peer = self.links.get(&(r.reader, r.link)).copied().flatten();
        let result = match (peer, self.regions.get(&r.rkey)) {
            (None, _) => Err("the link is closed"),
            (Some(peer), Some(region)) if region.owner == peer => {
                let off = r.addr.checked_sub(region.addr);
                match off.and_then(|o| usize::try_from(o).ok()) {
                    Some(o)
                        if o.checked_add(r.len)
                            .is_some_and(|e| e <= region.bytes.len()) =>
                    {
                        r.into.clear();
                        r.into.extend_from_slice(&region.bytes[o..o + r.len]);
                        Ok(())
                    }
                    _ => Err("remote access error: out of the region"),
                }
            }
            _ => Err("remote access error: no such key at the peer"),
        };
        self.reads += 1;
        let result = result.map_err(|reason| TransportError::Failed {
            op: "reading by RDMA READ",
            source: reason.into(),
        });
        let (items, waker) = self.done_of(r.reader);
        items.push((r.token, r.into, result));
        if let Some(w) = waker.take() {
            w.wake();
        }
    }

    /// Endpoint `id`'s finished READs.
    fn done_of(&mut self, id: u32) -> &mut (Vec<BulkDone>, Option<Waker>) {
        let i = id as usize;
        if self.done.len() <= i {
            self.done.resize_with(i + 1, Default::default);
        }
        &mut self.done[i]
    }

    /// Carries out the READs held.
    pub(crate) fn release(&mut self) {
        while let Some(r) = self.pending.pop_front() {
            self.execute(r);
        }
    }

    /// Buffers exposed by endpoint `id`.
    pub(crate) fn exposed_by(&self, id: u32) -> usize {
        self.regions.values().filter(|r| r.owner == id).count()
    }

    /// READs held.
    pub(crate) fn held(&self) -> usize {
        self.pending.len()
    }
}

/// The [`Bulk`] of a memory endpoint.
pub(crate) struct MemBulk {
    pub(crate) net: MemNetwork,
    pub(crate) id: u32,
}

impl Drop for MemBulk {
    fn drop(&mut self) {
        // The endpoint is gone: its buffers and links with it.
        let mut net = self.net.0.borrow_mut();
        let b = &mut net.bulk;
        b.regions.retain(|_, r| r.owner != self.id);
        b.links.retain(|(owner, _), _| *owner != self.id);
        if let Some(d) = b.done.get_mut(self.id as usize) {
            *d = Default::default();
        }
    }
}

impl Bulk for MemBulk {
    fn open(&mut self, link: u64) -> Result<Vec<u8>, TransportError> {
        self.net
            .0
            .borrow_mut()
            .bulk
            .links
            .insert((self.id, link), None);
        let mut addr = self.id.to_le_bytes().to_vec();
        addr.extend_from_slice(&link.to_le_bytes());
        Ok(addr)
    }

    fn connect(&mut self, link: u64, remote: &[u8]) -> Result<(), TransportError> {
        let bad = |reason| TransportError::BadAddress {
            len: remote.len(),
            reason,
        };
        let Some((peer, rest)) = remote.split_first_chunk::<4>() else {
            return Err(bad("not a link address"));
        };
        if rest.len() != 8 {
            return Err(bad("not a link address"));
        }
        let peer = u32::from_le_bytes(*peer);
        let mut net = self.net.0.borrow_mut();
        if peer as usize >= net.inboxes.len() {
            return Err(bad("no such endpoint"));
        }
        match net.bulk.links.get_mut(&(self.id, link)) {
            Some(end) => {
                *end = Some(peer);
                Ok(())
            }
            None => Err(bad("no such link")),
        }
    }

    fn close(&mut self, link: u64) {
        self.net.0.borrow_mut().bulk.links.remove(&(self.id, link));
    }

    fn expose(&mut self, buf: Vec<u8>) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        let mut net = self.net.0.borrow_mut();
        let b = &mut net.bulk;
        b.next_rkey = b.next_rkey.wrapping_add(1);
        let rkey = b.next_rkey;
        let addr = (u64::from(rkey) << 32) | 0x40;
        b.regions.insert(
            rkey,
            Region {
                owner: self.id,
                addr,
                bytes: buf,
            },
        );
        Ok((u64::from(rkey), addr, rkey))
    }

    fn unexpose(&mut self, token: u64) -> Option<Vec<u8>> {
        let rkey = u32::try_from(token).ok()?;
        let mut net = self.net.0.borrow_mut();
        match net.bulk.regions.get(&rkey) {
            Some(r) if r.owner == self.id => net.bulk.regions.remove(&rkey).map(|r| r.bytes),
            _ => None,
        }
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
        let mut net = self.net.0.borrow_mut();
        let b = &mut net.bulk;
        if !b.links.contains_key(&(self.id, link)) {
            let e = TransportError::BadAddress {
                len: 0,
                reason: "no such link",
            };
            return Err((into, e));
        }
        let r = PendingRead {
            reader: self.id,
            link,
            addr,
            rkey,
            len,
            into,
            token,
        };
        if b.hold {
            b.pending.push_back(r);
        } else {
            b.execute(r);
        }
        Ok(())
    }

    fn poll_done(&mut self, cx: &mut Context<'_>, out: &mut Vec<BulkDone>) {
        let mut net = self.net.0.borrow_mut();
        let (items, waker) = net.bulk.done_of(self.id);
        if items.is_empty() {
            match waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                w => *w = Some(cx.waker().clone()),
            }
            return;
        }
        out.append(items);
    }
}
