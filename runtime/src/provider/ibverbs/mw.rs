//! Memory windows, type 2 (`ibv_alloc_mw`, bound by `IBV_WR_BIND_MW` work
//! requests).
//!
//! libibverbs providers read the window's current rkey from `ibv_mw.rkey`
//! when a bind is posted (rxe checks it against its own), and leave it to
//! the application to store the new one: [`note_posted`] does so once the
//! post succeeded, as rxe's own `ibv_bind_mw` does.

use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::pd_mr::Pd;
use super::{errno_err, ret_err};
use crate::provider::{Result, SendOp, SendWr};

struct MwInner {
    mw: *mut sys::ibv_mw,
    _pd: Pd,
}

// SAFETY: an ibv_mw may be used and deallocated from any thread; its `rkey`
// field is only accessed atomically here, and by the provider during a
// post whose bind WR names it (never concurrently with a store: the
// contract of `Qp::post_send`).
unsafe impl Send for MwInner {}
// SAFETY: as above.
unsafe impl Sync for MwInner {}

impl Drop for MwInner {
    fn drop(&mut self) {
        // SAFETY: deallocated exactly once, before the PD (a field) goes.
        let ret = unsafe { sys::ibv_dealloc_mw(self.mw) };
        if ret != 0 {
            tracing::warn!(error = %ret_err("ibv_dealloc_mw", ret), "deallocating MW");
        }
    }
}

/// A type 2 memory window; deallocated when the last clone drops.
#[derive(Clone)]
pub struct Mw {
    inner: Arc<MwInner>,
}

impl Mw {
    pub(crate) fn alloc(pd: &Pd) -> Result<Mw> {
        // SAFETY: valid PD.
        let mw = unsafe { sys::ibv_alloc_mw(pd.inner.pd, sys::ibv_mw_type::IBV_MW_TYPE_2) };
        if mw.is_null() {
            return Err(errno_err("ibv_alloc_mw"));
        }
        Ok(Mw {
            inner: Arc::new(MwInner {
                mw,
                _pd: pd.clone(),
            }),
        })
    }

    /// The rkey the last posted bind gave the window (the allocated one
    /// before any).
    pub fn rkey(&self) -> u32 {
        // SAFETY: the window is alive (we hold it); the field is aligned and
        // accessed atomically (see `MwInner`).
        unsafe { rkey_cell(self.inner.mw) }.load(Ordering::Acquire)
    }

    /// The handle bind WRs carry: the `ibv_mw` pointer.
    pub fn raw(&self) -> u64 {
        self.inner.mw as u64
    }
}

/// The `rkey` field of `mw` as an atomic.
///
/// # Safety
///
/// `mw` points at a live `ibv_mw`.
unsafe fn rkey_cell<'a>(mw: *mut sys::ibv_mw) -> &'a AtomicU32 {
    // SAFETY: a live, aligned u32 field (caller); every Rust access to it
    // goes through this atomic view.
    unsafe { AtomicU32::from_ptr(addr_of_mut!((*mw).rkey)) }
}

/// Stores the new rkey of every window bound by `posted` (WRs the device
/// accepted) in its `ibv_mw`, where the next bind's post reads it.
///
/// # Safety
///
/// The `mw` of every bind WR in `posted` names a live window (the contract
/// of `Qp::post_send`).
#[cold]
pub(crate) unsafe fn note_posted(posted: &[SendWr]) {
    for wr in posted {
        if let SendOp::BindMw { mw, rkey, .. } = wr.op {
            // SAFETY: a live window (caller).
            unsafe { rkey_cell(mw.0 as *mut sys::ibv_mw) }.store(rkey, Ordering::Release);
        }
    }
}
