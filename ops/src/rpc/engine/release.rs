//! What a link, a session or a client slot gives back that its peer could
//! reach: the link closed (and the room granted over it), exposed
//! requests and responses withdrawn, a written request exposed again for
//! its resend, a slot's spare room kept.

use tracing::debug;

use crate::rpc::buf::BufPool;
use crate::rpc::header::BulkDesc;
use crate::rpc::session::{ClientSlot, Session};
use crate::rpc::transport::Bulk;

use super::write_format::{WRITE_TRAILER, WRITTEN_REQUEST_MAX};
use super::Core;

/// Closes the session's link (its READs under way end in error).
pub(crate) fn close_link<P>(bulk: &mut Option<Box<dyn Bulk>>, s: &mut Session<P>) {
    if let (Some(l), Some(bulk)) = (s.link.take(), bulk.as_mut()) {
        bulk.close(l.local);
        // Room granted over it goes with it (`written_requests.rs`).
        release_grants(bulk.as_mut(), s);
    }
}

/// Closes the session's link if it is `link` (an operation over an older
/// link, which the session replaced, failing later leaves the new one).
pub(crate) fn close_link_if<P>(bulk: &mut Option<Box<dyn Bulk>>, s: &mut Session<P>, link: u64) {
    if s.link.as_ref().is_some_and(|l| l.local == link) {
        close_link(bulk, s);
    }
}

/// Gives back what session `s` has exposed and closes its link (it ends,
/// or failed: nothing of it stays reachable by the peer).
pub(crate) fn release_bulk<P>(
    bulk: &mut Option<Box<dyn Bulk>>,
    requests_exposed: &mut usize,
    pool: &BufPool,
    s: &mut Session<P>,
) {
    close_link(bulk, s);
    let Some(bulk) = bulk.as_mut() else {
        return;
    };
    for slot in &mut s.client {
        for token in [slot.req_exposed.take(), slot.offer_exposed.take()]
            .into_iter()
            .flatten()
        {
            *requests_exposed -= 1;
            drop(bulk.unexpose(token));
        }
    }
    for slot in &mut s.server {
        if let Some((token, _, _)) = slot.resp_exposed.take() {
            if let Some(buf) = bulk.unexpose(token) {
                pool.put(buf);
            }
        }
    }
}

impl<P: Clone> Core<P> {
    /// Gives back what session `s` has exposed and closes its link (the
    /// session ends).
    pub(crate) fn release_session(&mut self, s: &mut Session<P>) {
        release_bulk(&mut self.bulk, &mut self.requests_exposed, &self.pool, s);
    }

    /// Gives an exposed response's buffer back to the pool.
    pub(crate) fn release_exposed(&mut self, exposed: Option<(u64, BulkDesc, usize)>) {
        if let (Some((token, _, _)), Some(bulk)) = (exposed, self.bulk.as_mut()) {
            if let Some(buf) = bulk.unexpose(token) {
                self.pool.put(buf);
            }
        }
    }

    /// Client: takes slot `i`'s exposed request buffer back (at its next
    /// call: the last one ended, so the server reads it no more).
    pub(crate) fn take_back_request(&mut self, sid: u32, i: usize) {
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let slot = &mut s.client[i];
        slot.req_desc = None;
        slot.reading = None;
        slot.offered = 0;
        if std::mem::take(&mut slot.req_written) {
            // Written and never exposed (no resend was due): every byte
            // of it went to the server, so it is the slot's spare, as an
            // exposed request below.
            let buf = std::mem::take(&mut slot.req);
            let len = buf.len();
            keep_spare(&self.pool, slot, buf);
            slot.req = self.pool.take_for(len);
        }
        let Some(bulk) = self.bulk.as_mut() else {
            return;
        };
        if let Some(token) = slot.req_exposed.take() {
            self.requests_exposed -= 1;
            if let Some(mut buf) = bulk.unexpose(token) {
                if buf.len() <= WRITTEN_REQUEST_MAX + WRITE_TRAILER {
                    // The server could READ all of its bytes: kept whole
                    // as the room for the slot's next response (offered
                    // with no zeroing, `room_for_response`); the next
                    // request goes into a buffer of the pool (the spare
                    // before it, given back, as a rule).
                    let len = buf.len();
                    keep_spare(&self.pool, slot, buf);
                    slot.req = self.pool.take_for(len);
                } else {
                    // (It spans the offered room; the next request
                    // replaces its bytes.)
                    buf.clear();
                    slot.req = buf;
                }
            }
        }
        if let Some(token) = slot.offer_exposed.take() {
            self.requests_exposed -= 1;
            if let Some(buf) = bulk.unexpose(token) {
                self.pool.put(buf);
            }
        }
    }
}

/// Gives back the room session `s`'s server slots were granted (its link
/// closes) and forgets the grants its client slots hold.
pub(crate) fn release_grants<P>(bulk: &mut dyn Bulk, s: &mut Session<P>) {
    for slot in &mut s.server {
        if let Some((token, _, _)) = slot.granted.take() {
            drop(bulk.unexpose(token));
        }
        slot.grant_charge.release();
    }
    for slot in &mut s.client {
        slot.grant = None;
    }
}

/// Client: exposes slot `slot`'s written request for READ if it is kept
/// unexposed (`ClientSlot::req_written`), so that its resend is a read
/// request (the server answers it as a duplicate, or reads the request if
/// it never took the written one). False if it could not be exposed (no
/// resend then: the server has it, the WRITE completed; the call's
/// retries still run out).
pub(crate) fn expose_written(
    bulk: &mut Option<Box<dyn Bulk>>,
    requests_exposed: &mut usize,
    slot: &mut ClientSlot,
) -> bool {
    if !slot.req_written {
        return true;
    }
    let Some(bulk) = bulk.as_mut() else {
        return false;
    };
    let len = slot.req.len();
    match bulk.expose(std::mem::take(&mut slot.req)) {
        Ok((token, addr, rkey)) => {
            slot.req_written = false;
            slot.req_exposed = Some(token);
            slot.req_desc = Some((BulkDesc { addr, rkey }, len));
            *requests_exposed += 1;
            true
        }
        Err((buf, error)) => {
            debug!(%error, "rpc: a written request not exposed for its resend");
            slot.req = buf;
            false
        }
    }
}

/// Keeps `buf`, whose bytes (all its length) the slot's server received
/// or could READ, as client slot `slot`'s spare: the room offered for
/// its next response, exposed again without zeroing what it holds. The
/// spare it replaces goes back to the pool; a buffer larger than a
/// written request does too (no room that large is kept per slot).
pub(crate) fn keep_spare(pool: &BufPool, slot: &mut ClientSlot, buf: Vec<u8>) {
    if buf.len() > WRITTEN_REQUEST_MAX + WRITE_TRAILER {
        pool.put(buf);
        return;
    }
    pool.put(std::mem::replace(&mut slot.spare, buf));
}
