//! Memory windows (type 2B), with rxe's rules (`rxe_mw.c`).
//!
//! A window is allocated unbound (FREE) with an rkey `index << 8 | key`.
//! A BIND_MW work request, executed by the requester in send-queue order,
//! binds it to a range of a memory region (which must allow `MW_BIND`, and
//! `LOCAL_WRITE` for a writable window), with remote access flags, over the
//! QP that posted it, and gives it the WR's rkey (same index, new key
//! byte). Only a FREE window can be bound. LOCAL_INV or a peer's
//! SEND_WITH_INV naming its current rkey makes it FREE again. A remote
//! access through a window must name its current rkey, arrive on the QP
//! that bound it, stay inside the window and need only the window's access;
//! it then reaches the region's memory, looked up by lkey under the same
//! MR-table lock, so a window over a deregistered region reaches nothing.
//!
//! The table lives inside the MR table (`mr.rs`): windows are changed and
//! checked under the lock every device access to registered memory holds.

use std::sync::Arc;

use super::context::Context;
use super::mr::MrTable;
use super::IdMap;
use crate::provider::{AccessFlags, SendOp, WcStatus};

/// Remote access flags a window may grant.
const WINDOW_ACCESS: AccessFlags = AccessFlags::from_bits_truncate(
    AccessFlags::REMOTE_READ.bits()
        | AccessFlags::REMOTE_WRITE.bits()
        | AccessFlags::REMOTE_ATOMIC.bits(),
);

/// The binding of a VALID window.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Binding {
    /// The QP that bound it: the only one remote accesses may use.
    pub qpn: u32,
    /// The region's lkey.
    pub mr_lkey: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
}

/// One window, as the engine sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MwEntry {
    pub pd: u32,
    /// Current rkey (the index in the high 24 bits).
    pub rkey: u32,
    /// The rkey the last posted bind gives it (what [`Mw::rkey`] reports).
    pub posted_rkey: u32,
    /// `None` while FREE.
    pub bound: Option<Binding>,
}

/// Why a bind or an invalidation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Refused(pub &'static str);

/// What a bind asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BindArgs {
    pub qpn: u32,
    pub pd: u32,
    pub index: u32,
    pub mr_lkey: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
    pub rkey: u32,
}

/// The windows of a context, by index (`rkey >> 8`).
#[derive(Default)]
pub(crate) struct Windows {
    by_index: IdMap<MwEntry>,
}

impl Windows {
    /// True if some window has `index` (an MR key must not collide with one).
    pub fn has_index(&self, index: u32) -> bool {
        self.by_index.contains_key(&index)
    }

    /// Adds an unbound window with index `index` and key byte `key`.
    pub fn insert(&mut self, pd: u32, index: u32, key: u8) -> u32 {
        let rkey = (index << 8) | u32::from(key);
        self.by_index.insert(
            index,
            MwEntry {
                pd,
                rkey,
                posted_rkey: rkey,
                bound: None,
            },
        );
        rkey
    }

    pub fn remove(&mut self, index: u32) {
        self.by_index.remove(&index);
    }

    pub fn get(&self, index: u32) -> Option<&MwEntry> {
        self.by_index.get(&index)
    }

    /// Notes the rkey a posted bind will give window `index`.
    pub fn note_posted(&mut self, index: u32, rkey: u32) {
        if let Some(w) = self.by_index.get_mut(&index) {
            w.posted_rkey = rkey;
        }
    }

    /// The binding `rkey` names, if it is a window's current rkey and the
    /// window is bound.
    pub fn bound(&self, rkey: u32) -> Option<(&MwEntry, Binding)> {
        let w = self.by_index.get(&(rkey >> 8))?;
        if w.rkey != rkey {
            return None;
        }
        Some((w, w.bound?))
    }

    /// Executes a BIND_MW (`rxe_bind_mw`'s checks; `mr` is the region the
    /// lkey names, if any: pd, start, length, access).
    pub fn bind(
        &mut self,
        a: &BindArgs,
        mr: Option<(u32, u64, u64, AccessFlags)>,
    ) -> Result<(), Refused> {
        let w = self
            .by_index
            .get_mut(&a.index)
            .ok_or(Refused("no such window"))?;
        if a.rkey >> 8 != a.index {
            return Err(Refused("new rkey changes more than the key byte"));
        }
        if w.bound.is_some() {
            return Err(Refused("a type 2 window must be free to bind"));
        }
        if w.pd != a.pd {
            return Err(Refused("window and QP in different PDs"));
        }
        if a.len == 0 {
            return Err(Refused("zero-length bind"));
        }
        let (mr_pd, mr_addr, mr_len, mr_access) = mr.ok_or(Refused("no such MR"))?;
        if mr_pd != a.pd {
            return Err(Refused("MR in another PD"));
        }
        if !WINDOW_ACCESS.contains(a.access) {
            return Err(Refused("window access beyond remote read/write/atomic"));
        }
        if !mr_access.contains(AccessFlags::MW_BIND) {
            return Err(Refused("MR without MW_BIND access"));
        }
        let writable = a.access.contains(AccessFlags::REMOTE_WRITE)
            || a.access.contains(AccessFlags::REMOTE_ATOMIC);
        if writable && !mr_access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Refused("writable window over an MR without LOCAL_WRITE"));
        }
        let inside = match (a.addr.checked_add(a.len), mr_addr.checked_add(mr_len)) {
            (Some(end), Some(mr_end)) => a.addr >= mr_addr && end <= mr_end,
            _ => false,
        };
        if !inside {
            return Err(Refused("window outside the MR"));
        }
        w.rkey = a.rkey;
        w.bound = Some(Binding {
            qpn: a.qpn,
            mr_lkey: a.mr_lkey,
            addr: a.addr,
            len: a.len,
            access: a.access,
        });
        Ok(())
    }

    /// Executes an invalidation (LOCAL_INV, or a SEND_WITH_INV at the
    /// responder): `rkey` must be a bound window's current rkey.
    pub fn invalidate(&mut self, rkey: u32) -> Result<(), Refused> {
        let w = self
            .by_index
            .get_mut(&(rkey >> 8))
            .ok_or(Refused("no such window"))?;
        if w.rkey != rkey {
            return Err(Refused("stale rkey"));
        }
        if w.bound.take().is_none() {
            return Err(Refused("window not bound"));
        }
        Ok(())
    }
}

/// Executes a BIND_MW or LOCAL_INV posted on QP `qpn` of PD `pd`: the
/// status it fails with (`MW_BIND_ERR`, `LOC_QP_OP_ERR`, as rxe) and why.
pub(crate) fn execute_local(
    op: &SendOp,
    qpn: u32,
    pd: u32,
    mrs: &mut MrTable,
) -> Result<(), (WcStatus, Refused)> {
    match *op {
        SendOp::BindMw {
            mw,
            mr,
            addr,
            len,
            access,
            rkey,
        } => {
            let args = BindArgs {
                qpn,
                pd,
                index: mw.0 as u32,
                mr_lkey: mr.0 as u32,
                addr,
                len,
                access,
                rkey,
            };
            let region = mrs.region(args.mr_lkey);
            mrs.windows
                .bind(&args, region)
                .map_err(|r| (WcStatus::MwBindErr, r))
        }
        SendOp::LocalInv { rkey } => mrs
            .windows
            .invalidate(rkey)
            .map_err(|r| (WcStatus::LocQpOpErr, r)),
        _ => Ok(()),
    }
}

impl Binding {
    /// Whether `[addr, addr + len)` lies inside the window.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.addr.checked_add(self.len)) {
            (Some(end), Some(w_end)) => addr >= self.addr && end <= w_end,
            _ => false,
        }
    }
}

pub(crate) struct MwInner {
    pub ctx: Context,
    pub index: u32,
}

impl Drop for MwInner {
    fn drop(&mut self) {
        self.ctx.shared().mrs().windows.remove(self.index);
    }
}

/// A memory window (type 2) of the soft device; deallocated when the last
/// clone drops, which ends every access through it.
#[derive(Clone)]
pub struct Mw(pub(crate) Arc<MwInner>);

impl Mw {
    /// The rkey the window has, or will have once the last posted bind
    /// executes.
    pub fn rkey(&self) -> u32 {
        let mrs = self.0.ctx.shared().mrs();
        mrs.windows
            .get(self.0.index)
            .map_or(self.0.index << 8, |w| w.posted_rkey)
    }

    /// The handle bind WRs carry.
    pub fn raw(&self) -> u64 {
        u64::from(self.0.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(index: u32, rkey: u32) -> BindArgs {
        BindArgs {
            qpn: 7,
            pd: 1,
            index,
            mr_lkey: 99,
            addr: 0x1000,
            len: 64,
            access: AccessFlags::REMOTE_READ,
            rkey,
        }
    }

    const MR: Option<(u32, u64, u64, AccessFlags)> =
        Some((1, 0x1000, 4096, AccessFlags::from_bits_truncate(0b1_0100)));

    #[test]
    fn binds_only_free_windows_and_invalidates_only_the_current_rkey() {
        let mut t = Windows::default();
        let r0 = t.insert(1, 5, 0x10);
        assert_eq!(r0, 0x510);
        let r1 = crate::provider::inc_rkey(r0);
        t.bind(&args(5, r1), MR).expect("bind");
        assert_eq!(t.bound(r1).map(|(_, b)| b.len), Some(64));
        assert!(t.bound(r0).is_none(), "the old rkey reaches nothing");
        assert_eq!(
            t.bind(&args(5, crate::provider::inc_rkey(r1)), MR),
            Err(Refused("a type 2 window must be free to bind"))
        );
        assert_eq!(t.invalidate(r0), Err(Refused("stale rkey")));
        t.invalidate(r1).expect("invalidate");
        assert!(t.bound(r1).is_none());
        assert_eq!(t.invalidate(r1), Err(Refused("window not bound")));
    }

    #[test]
    fn bind_checks_follow_rxe() {
        let mut t = Windows::default();
        let r = crate::provider::inc_rkey(t.insert(1, 5, 0));
        let no_bind = Some((1, 0x1000, 4096, AccessFlags::ALL));
        assert!(t.bind(&args(5, r), no_bind).is_err(), "MR lacks MW_BIND");
        let mut w = args(5, r);
        w.access = AccessFlags::REMOTE_WRITE;
        assert!(t.bind(&w, MR).is_err(), "writable window needs LOCAL_WRITE");
        let mut out = args(5, r);
        out.addr = 0x1000 + 4096 - 8;
        assert!(t.bind(&out, MR).is_err(), "outside the MR");
        let mut zero = args(5, r);
        zero.len = 0;
        assert!(t.bind(&zero, MR).is_err(), "zero length");
        assert!(t.bind(&args(5, r ^ 0x100), MR).is_err(), "other index");
        assert!(t.bind(&args(5, r), None).is_err(), "no MR");
        t.bind(&args(5, r), MR).expect("valid bind");
    }
}
