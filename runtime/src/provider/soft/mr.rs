//! Memory registration: the per-context MR table the engine consults (under
//! its lock) every time it touches registered memory, and the [`Mr`] handle
//! whose last drop removes the entry at once.

use std::sync::Arc;

use super::context::Context;
use super::dma::Span;
use super::mw::Windows;
use super::IdMap;
use crate::provider::AccessFlags;

/// One registration, as the engine sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MrEntry {
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
}

impl MrEntry {
    /// Whether `[addr, addr + len)` lies inside the registration.
    fn contains(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.addr.checked_add(self.len)) {
            (Some(end), Some(mr_end)) => addr >= self.addr && end <= mr_end,
            _ => false,
        }
    }
}

/// Why a remote access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AccessError {
    /// Unknown rkey, other PD, out of bounds or missing access flag.
    Denied,
}

/// All registrations of a context, by lkey and by rkey.
///
/// # Invariant
/// While the table's lock is held and an entry is found, the memory of that
/// entry is valid: deregistration removes the entry under the same lock
/// before the owner may free the memory. The table hands out that memory
/// only as [`Span`]s borrowing it (so used under the lock; see `dma.rs`).
#[derive(Default)]
pub(crate) struct MrTable {
    by_lkey: IdMap<MrEntry>,
    by_rkey: IdMap<MrEntry>,
    counter: u32,
    /// The memory windows (`mw.rs`), checked under the same lock.
    pub(crate) windows: Windows,
}

impl MrTable {
    /// A fresh key: a bijective scramble of a counter, so keys look random and
    /// are not reused until 2^32 registrations later.
    fn next_key(&mut self, seed: u32) -> u32 {
        loop {
            self.counter = self.counter.wrapping_add(1);
            let mut x = self.counter ^ seed;
            x = x.wrapping_mul(0x9E37_79B1);
            x ^= x >> 15;
            x = x.wrapping_mul(0x85EB_CA77);
            x ^= x >> 13;
            if x != 0
                && !self.by_lkey.contains_key(&x)
                && !self.by_rkey.contains_key(&x)
                && !self.windows.has_index(x >> 8)
            {
                return x;
            }
        }
    }

    pub fn insert(&mut self, entry: MrEntry, seed: u32) -> (u32, u32) {
        let lkey = self.next_key(seed);
        self.by_lkey.insert(lkey, entry);
        let rkey = self.next_key(seed.rotate_left(16));
        self.by_rkey.insert(rkey, entry);
        (lkey, rkey)
    }

    pub fn remove(&mut self, lkey: u32, rkey: u32) {
        self.by_lkey.remove(&lkey);
        self.by_rkey.remove(&rkey);
    }

    /// Validates a local SGE: key known, same PD, in bounds, and LOCAL_WRITE
    /// when the device must write it.
    pub fn local(&self, lkey: u32, pd: u32, addr: u64, len: u64, write: bool) -> Option<Span<'_>> {
        let e = self.by_lkey.get(&lkey)?;
        if e.pd != pd || (write && !e.access.contains(AccessFlags::LOCAL_WRITE)) {
            return None;
        }
        self.span(e, addr, len)
    }

    /// Validates a remote access arriving on QP `qpn`: rkey known, same PD,
    /// in bounds, and the MR grants `need`; or, for a memory window's rkey,
    /// the window bound over `qpn`, in its bounds, granting `need`, and its
    /// MR still registered.
    pub fn remote(
        &self,
        qpn: u32,
        rkey: u32,
        pd: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<Span<'_>, AccessError> {
        let Some(e) = self.by_rkey.get(&rkey) else {
            return self.remote_window(qpn, rkey, pd, addr, len, need);
        };
        if e.pd != pd || !e.access.contains(need) {
            return Err(AccessError::Denied);
        }
        self.span(e, addr, len).ok_or(AccessError::Denied)
    }

    #[cold]
    fn remote_window(
        &self,
        qpn: u32,
        rkey: u32,
        pd: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<Span<'_>, AccessError> {
        let (w, b) = self.windows.bound(rkey).ok_or(AccessError::Denied)?;
        if w.pd != pd || b.qpn != qpn || !b.access.contains(need) || !b.contains(addr, len) {
            return Err(AccessError::Denied);
        }
        let mr = self.by_lkey.get(&b.mr_lkey).ok_or(AccessError::Denied)?;
        self.span(mr, addr, len).ok_or(AccessError::Denied)
    }

    /// The region an lkey names: (pd, start, length, access).
    pub fn region(&self, lkey: u32) -> Option<(u32, u64, u64, AccessFlags)> {
        self.by_lkey
            .get(&lkey)
            .map(|e| (e.pd, e.addr, e.len, e.access))
    }

    /// A fresh window index: not a window's, and no MR rkey in its range.
    pub fn next_window_index(&mut self, seed: u32) -> u32 {
        loop {
            let x = self.next_key(seed.rotate_left(8)) >> 8;
            if x != 0 && !self.windows.has_index(x) && !self.by_rkey.keys().any(|k| k >> 8 == x) {
                return x;
            }
        }
    }

    /// `[addr, addr + len)` of `e` (an entry of this table), if inside it.
    fn span(&self, e: &MrEntry, addr: u64, len: u64) -> Option<Span<'_>> {
        let n = usize::try_from(len).ok()?;
        if !e.contains(addr, len) {
            return None;
        }
        // SAFETY: inside a registration of this table, borrowed for the span.
        Some(unsafe { Span::new(addr as usize as *mut u8, n) })
    }
}

pub(crate) struct MrInner {
    pub ctx: Context,
    pub lkey: u32,
    pub rkey: u32,
    pub entry: MrEntry,
}

impl Drop for MrInner {
    fn drop(&mut self) {
        // Removing the entry under the table lock: the engine holds that lock
        // while it touches memory, so after this the memory is never touched.
        self.ctx.shared().mrs().remove(self.lkey, self.rkey);
    }
}

/// A registered memory region of the soft device.
#[derive(Clone)]
pub struct Mr(pub(crate) Arc<MrInner>);

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.0.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.0.rkey
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.0.entry.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.entry.len as usize
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.0.entry.len == 0
    }
    /// Access flags.
    pub fn access(&self) -> AccessFlags {
        self.0.entry.access
    }
    /// The handle bind WRs carry (the lkey).
    pub fn raw(&self) -> u64 {
        u64::from(self.0.lkey)
    }
    /// Runs `f` under the MR-table lock, which every device access to
    /// registered memory holds (see `dma.rs`): what `f` does to the memory
    /// is ordered with the device's accesses.
    pub(crate) fn with_memory<R>(&self, f: impl FnOnce() -> R) -> R {
        let _table = self.0.ctx.shared().mrs();
        f()
    }
}
