//! Grants through memory windows (`RdmaBuilder::grant_windows`): instead of
//! registering fresh memory per grant, the owner binds a type 2 window over
//! exactly the granted range of one bindable region per connection, with
//! the minimal access asked for; revoking a grant is one LOCAL_INV, after
//! which the rkey fails, and the range and the window are reused.
//!
//! The grant table's rules hold: exact bounds and minimal access (the
//! window's), refusal after release, hand-back or deadline (the
//! invalidation completes first), unknown ids refused. Window grant ids
//! have [`WINDOW_ID`] set, so they never meet the registration table's.
//! Bounds are as exact as the device enforces a window's range: the soft
//! device does, rxe on Linux 6.1 checks only the region's (measured).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use verbio_runtime::buf::{RemoteAccessRegion, Window};
use verbio_runtime::provider::AccessFlags;

use super::rdma::Shared;
use super::wire::{MrToken, RefuseCode};
use crate::verbs::Verbs;

/// The id bit of window grants.
pub(crate) const WINDOW_ID: u64 = 1 << 63;

/// Granted ranges are aligned to this.
const ALIGN: usize = 8;

type Region = Rc<RemoteAccessRegion<Vec<u8>>>;

/// One live window grant.
struct Live {
    window: Window<Vec<u8>>,
    off: usize,
    len: usize,
    deadline: Instant,
}

/// First-fit allocator of the region's ranges.
#[derive(Default)]
struct Ranges {
    /// Free `(offset, length)`, sorted by offset, never adjacent.
    free: Vec<(usize, usize)>,
}

impl Ranges {
    fn new(size: usize) -> Ranges {
        Ranges {
            free: vec![(0, size)],
        }
    }

    fn alloc(&mut self, len: usize) -> Option<usize> {
        let need = len.checked_add(ALIGN - 1)? / ALIGN * ALIGN;
        let i = self.free.iter().position(|&(_, l)| l >= need)?;
        let (off, l) = self.free[i];
        if l == need {
            self.free.remove(i);
        } else {
            self.free[i] = (off + need, l - need);
        }
        Some(off)
    }

    fn release(&mut self, off: usize, len: usize) {
        let len = len.div_ceil(ALIGN) * ALIGN;
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, len));
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// The window grants of one connection.
pub(crate) struct WindowGrants {
    size: usize,
    region: RefCell<Option<Region>>,
    ranges: RefCell<Ranges>,
    /// Unbound windows, for the next grants.
    idle: RefCell<Vec<Window<Vec<u8>>>>,
    live: RefCell<HashMap<u64, Live>>,
    /// Bytes of the grants revoked because the connection went down, kept
    /// for a hand-back the peer sent before that.
    revoked: RefCell<HashMap<u64, (MrToken, Vec<u8>)>>,
    next_id: Cell<u64>,
    bytes: Cell<u64>,
}

impl std::fmt::Debug for WindowGrants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowGrants")
            .field("size", &self.size)
            .field("live", &self.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

fn epoch_ms(deadline: Instant) -> u64 {
    let at = SystemTime::now() + deadline.saturating_duration_since(Instant::now());
    at.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl WindowGrants {
    /// Grants through windows over one region of `size` bytes.
    pub(crate) fn new(size: usize) -> WindowGrants {
        WindowGrants {
            size,
            region: RefCell::new(None),
            ranges: RefCell::new(Ranges::new(size)),
            idle: RefCell::new(Vec::new()),
            live: RefCell::new(HashMap::new()),
            revoked: RefCell::new(HashMap::new()),
            next_id: Cell::new(0),
            bytes: Cell::new(0),
        }
    }

    /// Live grants.
    pub(crate) fn len(&self) -> usize {
        self.live.borrow().len()
    }

    /// Bytes of the live grants.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.get()
    }

    fn region(&self, shared: &Shared) -> Result<Region, RefuseCode> {
        if let Some(r) = &*self.region.borrow() {
            return Ok(r.clone());
        }
        let r = RemoteAccessRegion::bindable(&shared.pd.0, vec![0u8; self.size]).map_err(|r| {
            tracing::warn!(error = %r.error, "registering the window region failed");
            RefuseCode::NoMemory
        })?;
        let r = Rc::new(r);
        *self.region.borrow_mut() = Some(r.clone());
        Ok(r)
    }

    /// Grants `len` zeroed bytes with `access` until `lifetime` passes: a
    /// window bound over a free range of the region (one BIND_MW).
    pub(crate) async fn grant(
        &self,
        shared: &Shared,
        len: usize,
        access: AccessFlags,
        lifetime: Duration,
    ) -> Result<(MrToken, Instant), RefuseCode> {
        let region = self.region(shared)?;
        let off = self.ranges.borrow_mut().alloc(len).ok_or_else(|| {
            tracing::debug!(len, "window region full: memory request refused");
            RefuseCode::NoMemory
        })?;
        let give_back = |w: Option<Window<Vec<u8>>>| {
            self.ranges.borrow_mut().release(off, len);
            if let Some(w) = w.filter(|w| !w.is_bound()) {
                self.idle.borrow_mut().push(w);
            }
        };
        // The range is the peer's until revoked: it starts zeroed.
        if region.write_from(off, &vec![0u8; len]).is_err() {
            give_back(None);
            return Err(RefuseCode::NoMemory);
        }
        let window = match self.idle.borrow_mut().pop() {
            Some(w) => w,
            None => match Window::alloc(&shared.pd.0) {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %crate::error::ErrorChain(&e), "allocating a memory window failed");
                    give_back(None);
                    return Err(RefuseCode::NoMemory);
                }
            },
        };
        let (bound, window) = shared
            .qp
            .bind_mw(window, region, off..off + len, access)
            .await;
        let remote = match bound {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "binding a memory window failed");
                give_back(Some(window));
                return Err(RefuseCode::NoMemory);
            }
        };
        let id = WINDOW_ID | (self.next_id.get() + 1);
        self.next_id.set(self.next_id.get() + 1);
        let deadline = Instant::now() + lifetime;
        let token = MrToken {
            token_id: id,
            addr: remote.addr(),
            len: remote.len(),
            rkey: remote.rkey(),
            access: access.bits(),
            deadline_ms: epoch_ms(deadline),
            flags: 0,
        };
        self.bytes.set(self.bytes.get() + len as u64);
        self.live.borrow_mut().insert(
            id,
            Live {
                window,
                off,
                len,
                deadline,
            },
        );
        Ok((token, deadline))
    }

    /// Revokes grant `id` if `token` (when given) matches it, once its
    /// window is invalidated (one LOCAL_INV); the granted bytes come back.
    /// With `due`, only if its deadline has passed. `None` for an unknown,
    /// released, expired or forged one.
    pub(crate) async fn revoke(
        &self,
        shared: &Shared,
        id: u64,
        token: Option<&MrToken>,
        due: bool,
    ) -> Option<Vec<u8>> {
        let live = {
            let mut live = self.live.borrow_mut();
            let Some(g) = live.get(&id) else {
                drop(live);
                return self.take_revoked(id, token?);
            };
            if let Some(t) = token {
                if Some((t.addr, t.len, t.rkey)) != g.window.remote() {
                    return None;
                }
            }
            if due && g.deadline > Instant::now() {
                return None;
            }
            live.remove(&id)?
        };
        self.bytes.set(self.bytes.get() - live.len as u64);
        let (res, window) = shared.qp.local_inv(live.window).await;
        if let Err(e) = &res {
            // The QP failed: deallocating the window ends its access.
            tracing::debug!(error = %crate::error::ErrorChain(e), "invalidating a memory window failed");
        }
        let mem = self.take_bytes(live.off, live.len);
        self.ranges.borrow_mut().release(live.off, live.len);
        if res.is_ok() {
            self.idle.borrow_mut().push(window);
        }
        mem
    }

    fn take_bytes(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        let region = self.region.borrow().clone()?;
        let mut mem = vec![0u8; len];
        region.read_into(off, &mut mem).ok()?;
        Some(mem)
    }

    fn take_revoked(&self, id: u64, token: &MrToken) -> Option<Vec<u8>> {
        let mut revoked = self.revoked.borrow_mut();
        let (t, _) = revoked.get(&id)?;
        if (t.addr, t.len, t.rkey) != (token.addr, token.len, token.rkey) {
            return None;
        }
        revoked.remove(&id).map(|(_, mem)| mem)
    }

    /// Revokes everything (connection down: the QP cannot invalidate any
    /// more): each window is deallocated, which ends its access; the bytes
    /// are kept for hand-backs until [`WindowGrants::forget_revoked`].
    pub(crate) fn clear(&self) {
        let all: Vec<(u64, Live)> = self.live.borrow_mut().drain().collect();
        self.bytes.set(0);
        for (id, g) in all {
            let Some((addr, len, rkey)) = g.window.remote() else {
                continue;
            };
            drop(g.window);
            let mem = self.take_bytes(g.off, g.len).unwrap_or_default();
            let token = MrToken {
                token_id: id,
                addr,
                len,
                rkey,
                access: 0,
                deadline_ms: 0,
                flags: 0,
            };
            self.revoked.borrow_mut().insert(id, (token, mem));
        }
        self.idle.borrow_mut().clear();
    }

    /// Drops what [`WindowGrants::clear`] kept (the agent stopped).
    pub(crate) fn forget_revoked(&self) {
        self.revoked.borrow_mut().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_aligned_reused_and_merged() {
        let mut r = Ranges::new(64);
        let a = r.alloc(5).unwrap();
        let b = r.alloc(8).unwrap();
        let c = r.alloc(40).unwrap();
        assert_eq!((a, b, c), (0, 8, 16));
        assert_eq!(r.alloc(16), None, "8 bytes left");
        r.release(b, 8);
        assert_eq!(r.alloc(3), Some(8));
        r.release(8, 3);
        r.release(a, 5);
        r.release(c, 40);
        assert_eq!(r.free, vec![(0, 64)], "merged back into one range");
        assert_eq!(r.alloc(64), Some(0));
    }
}
