//! The large-message path of [`MemTransport`](super::MemTransport):
//! links, exposed buffers, READs and WRITEs with immediate between
//! endpoints of one [`MemNetwork`], with READs and
//! WRITEs that can be held (to test what happens while one is under way).

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Waker};

use crate::rpc::header::HEADER_LEN;
use crate::rpc::transport::{Bulk, BulkDone, LinkPacket, TransportError};
use crate::rpc::waker::keep_waker;

use super::MemNetwork;

/// The largest packet a link carries in memory (as on UD: a header and
/// 32 KiB); a larger one breaks the receiver's link, as a SEND larger
/// than the receive buffer does.
pub(crate) const MEM_LINK_PACKET: usize = HEADER_LEN + (32 << 10);

/// Packets sent over links waiting for their endpoint's dispatcher, and
/// the links whose sends failed.
#[derive(Default)]
struct LinkInbox {
    packets: Vec<(u64, Vec<u8>)>,
    broken: Vec<u64>,
}

/// A WRITE with immediate that landed: the link and the immediate.
type Written = (u64, u32);

/// A buffer exposed to READ (and to WRITE, if `writable`).
struct Region {
    owner: u32,
    addr: u64,
    bytes: Vec<u8>,
    writable: bool,
}

/// A READ or WRITE with immediate not carried out yet (the network holds
/// them).
struct PendingRead {
    reader: u32,
    link: u64,
    addr: u64,
    rkey: u32,
    len: usize,
    /// The READ's target, or the WRITE's source.
    into: Vec<u8>,
    token: u64,
    /// A WRITE with this immediate (else a READ).
    write_imm: Option<u32>,
}

/// The network's bulk state.
#[derive(Default)]
pub(crate) struct BulkNet {
    /// Exposed buffers by rkey.
    regions: HashMap<u32, Region>,
    next_rkey: u32,
    /// Links by (endpoint, link): the peer endpoint and its link number
    /// once connected.
    links: HashMap<(u32, u64), Option<(u32, u64)>>,
    pending: VecDeque<PendingRead>,
    /// READs wait until released.
    pub(crate) hold: bool,
    /// WRITEs with immediate wait until released.
    pub(crate) hold_writes: bool,
    /// Finished READs per endpoint (by id), and the waker of its
    /// dispatcher.
    done: Vec<(Vec<BulkDone>, Option<Waker>)>,
    /// WRITEs with immediate that landed, per endpoint (by id): (link,
    /// immediate), and the waker of its dispatcher.
    written: Vec<(Vec<Written>, Option<Waker>)>,
    /// READs carried out (tests).
    pub(crate) reads: u64,
    /// WRITEs with immediate carried out (tests).
    pub(crate) writes: u64,
    /// Packets sent over links, per endpoint (by id), woken by the waker
    /// of `written`.
    inboxes: Vec<LinkInbox>,
    /// Packets sent over links (tests).
    pub(crate) link_packets: u64,
    /// Bytes zeroed to expose buffers for WRITE, as a device's
    /// registration zeroes what a buffer does not hold yet (tests).
    pub(crate) zeroed: u64,
    /// Bytes copied out of exposed buffers by their owners
    /// ([`Bulk::copy_out`]; tests).
    pub(crate) copied_out: u64,
    /// Memory registrations a device would make, per endpoint (by id):
    /// a buffer exposed (for READ, or READ and WRITE), a READ's
    /// destination, a WRITE's source (tests).
    registrations: Vec<u64>,
}

impl BulkNet {
    /// Carries out `r`: the bytes of the peer's exposed buffer copied (a
    /// READ) or written with the immediate delivered (a WRITE), or an
    /// error as a device gives one (a bad key, address or length, a region
    /// not writable, or a link that is closed).
    fn execute(&mut self, mut r: PendingRead) {
        let peer = self.links.get(&(r.reader, r.link)).copied().flatten();
        let mut landed = None;
        let result = match (peer, self.regions.get_mut(&r.rkey)) {
            (None, _) => Err("the link is closed"),
            (Some((peer, peer_link)), Some(region)) if region.owner == peer => {
                let off = r.addr.checked_sub(region.addr);
                match off.and_then(|o| usize::try_from(o).ok()) {
                    Some(o)
                        if o.checked_add(r.len)
                            .is_some_and(|e| e <= region.bytes.len()) =>
                    {
                        match r.write_imm {
                            None => {
                                r.into.clear();
                                r.into.extend_from_slice(&region.bytes[o..o + r.len]);
                                Ok(())
                            }
                            Some(imm) if region.writable => {
                                region.bytes[o..o + r.len].copy_from_slice(&r.into);
                                landed = Some((peer, peer_link, imm));
                                Ok(())
                            }
                            Some(_) => Err("remote access error: the region is not writable"),
                        }
                    }
                    _ => Err("remote access error: out of the region"),
                }
            }
            _ => Err("remote access error: no such key at the peer"),
        };
        let op = if r.write_imm.is_some() {
            self.writes += 1;
            "writing by RDMA WRITE with immediate"
        } else {
            self.reads += 1;
            "reading by RDMA READ"
        };
        if let Some((peer, peer_link, imm)) = landed {
            let (items, waker) = self.written_of(peer);
            items.push((peer_link, imm));
            if let Some(w) = waker.take() {
                w.wake();
            }
        }
        let result = result.map_err(|reason| TransportError::Failed {
            op,
            source: reason.into(),
        });
        let (items, waker) = self.done_of(r.reader);
        items.push((r.token, r.into, result));
        if let Some(w) = waker.take() {
            w.wake();
        }
    }

    /// Endpoint `id`'s WRITEs with immediate received.
    fn written_of(&mut self, id: u32) -> &mut (Vec<Written>, Option<Waker>) {
        of_endpoint(&mut self.written, id)
    }

    /// Breaks endpoint `id`'s link ends.
    pub(crate) fn break_links(&mut self, id: u32) {
        self.links.retain(|(owner, _), _| *owner != id);
    }

    /// Endpoint `id`'s packets over links.
    fn inbox_of(&mut self, id: u32) -> &mut LinkInbox {
        of_endpoint(&mut self.inboxes, id)
    }

    /// Wakes endpoint `id`'s dispatcher for its link packets.
    fn wake(&mut self, id: u32) {
        if let Some(w) = self.written_of(id).1.take() {
            w.wake();
        }
    }

    /// Endpoint `id`'s finished READs.
    fn done_of(&mut self, id: u32) -> &mut (Vec<BulkDone>, Option<Waker>) {
        of_endpoint(&mut self.done, id)
    }

    /// Carries out the READs held (`writes`: the WRITEs).
    pub(crate) fn release(&mut self, writes: bool) {
        let (go, stay) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|r| r.write_imm.is_some() == writes);
        self.pending = stay;
        for r in go {
            self.execute(r);
        }
    }

    /// Starts `r`, a READ or a WRITE with immediate over its reader's
    /// link (its buffer's registration counted): held while its kind is
    /// held, else carried out now.
    fn start(&mut self, r: PendingRead) -> Result<(), (Vec<u8>, TransportError)> {
        if !self.links.contains_key(&(r.reader, r.link)) {
            return Err((r.into, TransportError::no_such_link()));
        }
        self.registered(r.reader);
        let hold = if r.write_imm.is_some() {
            self.hold_writes
        } else {
            self.hold
        };
        if hold {
            self.pending.push_back(r);
        } else {
            self.execute(r);
        }
        Ok(())
    }

    /// Counts one registration of endpoint `id`.
    fn registered(&mut self, id: u32) {
        let i = id as usize;
        if self.registrations.len() <= i {
            self.registrations.resize(i + 1, 0);
        }
        self.registrations[i] += 1;
    }

    /// Registrations endpoint `id` made so far (see `registrations`).
    pub(crate) fn registrations_of(&self, id: u32) -> u64 {
        self.registrations.get(id as usize).copied().unwrap_or(0)
    }

    /// Buffers exposed by endpoint `id`.
    pub(crate) fn exposed_by(&self, id: u32) -> usize {
        self.regions.values().filter(|r| r.owner == id).count()
    }

    /// Withdraws every buffer endpoint `id` exposes.
    pub(crate) fn withdraw(&mut self, id: u32) {
        self.regions.retain(|_, r| r.owner != id);
    }

    /// READs held (`writes`: WRITEs).
    pub(crate) fn held(&self, writes: bool) -> usize {
        (self.pending.iter())
            .filter(|r| r.write_imm.is_some() == writes)
            .count()
    }
}

/// Endpoint `id`'s entry of `v`, which grows to hold it.
fn of_endpoint<T: Default>(v: &mut Vec<T>, id: u32) -> &mut T {
    let i = id as usize;
    if v.len() <= i {
        v.resize_with(i + 1, Default::default);
    }
    &mut v[i]
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
        if let Some(d) = b.written.get_mut(self.id as usize) {
            *d = Default::default();
        }
        if let Some(d) = b.inboxes.get_mut(self.id as usize) {
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
        let bad = |reason| TransportError::bad_address(remote.len(), reason);
        let Some((peer, rest)) = remote.split_first_chunk::<4>() else {
            return Err(bad("not a link address"));
        };
        if rest.len() != 8 {
            return Err(bad("not a link address"));
        }
        let peer = u32::from_le_bytes(*peer);
        let mut peer_link = [0u8; 8];
        peer_link.copy_from_slice(rest);
        let peer_link = u64::from_le_bytes(peer_link);
        let mut net = self.net.0.borrow_mut();
        if peer as usize >= net.inboxes.len() {
            return Err(bad("no such endpoint"));
        }
        match net.bulk.links.get_mut(&(self.id, link)) {
            Some(end) => {
                *end = Some((peer, peer_link));
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
        b.registered(self.id);
        b.next_rkey = b.next_rkey.wrapping_add(1);
        let rkey = b.next_rkey;
        let addr = (u64::from(rkey) << 32) | 0x40;
        b.regions.insert(
            rkey,
            Region {
                owner: self.id,
                addr,
                bytes: buf,
                writable: false,
            },
        );
        Ok((u64::from(rkey), addr, rkey))
    }

    fn copy_out(&mut self, token: u64, off: usize, n: usize, dst: &mut Vec<u8>) -> bool {
        let Ok(rkey) = u32::try_from(token) else {
            return false;
        };
        let mut net = self.net.0.borrow_mut();
        let span = off.checked_add(n);
        match (net.bulk.regions.get(&rkey), span) {
            (Some(r), Some(end)) if r.owner == self.id && end <= r.bytes.len() => {
                dst.extend_from_slice(&r.bytes[off..end]);
                net.bulk.copied_out += n as u64;
                true
            }
            _ => false,
        }
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
        self.net.0.borrow_mut().bulk.start(PendingRead {
            reader: self.id,
            link,
            addr,
            rkey,
            len,
            into,
            token,
            write_imm: None,
        })
    }

    fn expose_writable(
        &mut self,
        link: u64,
        mut buf: Vec<u8>,
        cap: usize,
    ) -> Result<(u64, u64, u32), (Vec<u8>, TransportError)> {
        if !self
            .net
            .0
            .borrow()
            .bulk
            .links
            .contains_key(&(self.id, link))
        {
            let e = TransportError::no_such_link();
            return Err((buf, e));
        }
        let cap = cap.max(buf.len());
        self.net.0.borrow_mut().bulk.zeroed += (cap - buf.len()) as u64;
        buf.resize(cap, 0);
        let (token, addr, rkey) = self.expose(buf)?;
        let mut net = self.net.0.borrow_mut();
        if let Some(r) = net.bulk.regions.get_mut(&rkey) {
            r.writable = true;
        }
        Ok((token, addr, rkey))
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
        self.net.0.borrow_mut().bulk.start(PendingRead {
            reader: self.id,
            link,
            addr,
            rkey,
            len: buf.len(),
            into: buf,
            token,
            write_imm: Some(imm),
        })
    }

    fn poll_written(&mut self, cx: &mut Context<'_>, out: &mut Vec<(u64, u32)>) {
        let mut net = self.net.0.borrow_mut();
        let (items, waker) = net.bulk.written_of(self.id);
        // Registered whether or not some are here (as a receive ring
        // registers once drained): the engine does not ask again.
        keep_waker(waker, cx);
        out.append(items);
    }

    fn max_link_packet(&self) -> usize {
        MEM_LINK_PACKET
    }

    fn send_packet(
        &mut self,
        link: u64,
        head: &[u8; HEADER_LEN],
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let mut net = self.net.0.borrow_mut();
        let b = &mut net.bulk;
        let Some(Some((peer, peer_link))) = b.links.get(&(self.id, link)).copied() else {
            return Err(TransportError::no_such_link());
        };
        b.link_packets += 1;
        if !b.links.contains_key(&(peer, peer_link)) {
            // The peer's end is gone: the SEND fails later.
            b.inbox_of(self.id).broken.push(link);
            b.wake(self.id);
            return Ok(());
        }
        if HEADER_LEN + payload.len() > MEM_LINK_PACKET {
            // Longer than the receive buffer: the receiver's end breaks
            // (its QP in error), and so does the SEND.
            b.links.remove(&(peer, peer_link));
            b.inbox_of(self.id).broken.push(link);
            b.wake(self.id);
            return Ok(());
        }
        let mut packet = Vec::with_capacity(HEADER_LEN + payload.len());
        packet.extend_from_slice(head);
        packet.extend_from_slice(payload);
        b.inbox_of(peer).packets.push((peer_link, packet));
        b.wake(peer);
        Ok(())
    }

    fn poll_received(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut Vec<(u64, LinkPacket)>,
        broken: &mut Vec<u64>,
    ) {
        let mut net = self.net.0.borrow_mut();
        keep_waker(&mut net.bulk.written_of(self.id).1, cx);
        let inbox = net.bulk.inbox_of(self.id);
        out.extend(
            inbox
                .packets
                .drain(..)
                .map(|(link, p)| (link, LinkPacket::Owned(p))),
        );
        broken.append(&mut inbox.broken);
    }

    fn poll_done(&mut self, cx: &mut Context<'_>, out: &mut Vec<BulkDone>) {
        let mut net = self.net.0.borrow_mut();
        let (items, waker) = net.bulk.done_of(self.id);
        // Registered whether or not some are here (as the UD one).
        keep_waker(waker, cx);
        out.append(items);
    }
}
