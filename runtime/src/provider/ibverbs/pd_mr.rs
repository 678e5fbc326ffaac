//! Protection domains and memory regions.

use std::fmt;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::device::Context;
use super::errno_err;
use super::qp::Qp;
use super::ret_err;
use super::{Ah, Cq};
use crate::provider::{AccessFlags, AhAttr, ProviderError, QpCaps, QpType, Result};

pub(crate) struct PdInner {
    pub(crate) pd: *mut sys::ibv_pd,
    pub(crate) ctx: Context,
}

// SAFETY: an ibv_pd may be used from any thread (libibverbs is thread-safe);
// the pointer is never mutated after creation.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds a Pd clone, so none is left;
        // deallocated exactly once, before `ctx` (a field) closes the device.
        let ret = unsafe { sys::ibv_dealloc_pd(self.pd) };
        if ret != 0 {
            tracing::warn!(error = %ret_err("ibv_dealloc_pd", ret), "deallocating PD");
        }
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for Pd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ibverbs::Pd")
            .field("device", &self.inner.ctx.name())
            .finish()
    }
}

impl Pd {
    pub(crate) fn alloc(ctx: &Context) -> Result<Pd> {
        // SAFETY: valid open context.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.raw()) };
        if pd.is_null() {
            return Err(errno_err("ibv_alloc_pd"));
        }
        Ok(Pd {
            inner: Arc::new(PdInner {
                pd,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The context the PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Registers `[addr, addr + len)` (`ibv_reg_mr`).
    ///
    /// # Safety
    ///
    /// The memory must stay valid (allocated, not moved) until the returned
    /// [`Mr`] and all its clones are dropped; while registered, the device may
    /// read it (and write it, per `access`) at any time.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        // SAFETY: valid PD; the memory contract is the caller's. The access bits
        // have the verbs values.
        let mr = unsafe {
            sys::ibv_reg_mr(
                self.inner.pd,
                addr.cast(),
                len,
                access.bits() as libc::c_int,
            )
        };
        if mr.is_null() {
            // ENOMEM here is the locked-memory limit in nearly every case:
            // the error names the limit and how to raise it.
            return Err(match errno_err("ibv_reg_mr") {
                ProviderError::Verbs { call, source } => {
                    ProviderError::registration(call, len, source)
                }
                other => other,
            });
        }
        // SAFETY: a valid MR just returned.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr {
            inner: Arc::new(MrInner {
                mr,
                lkey,
                rkey,
                addr: addr as u64,
                len,
                access,
                _pd: self.clone(),
            }),
        })
    }

    /// Creates an RC QP in RESET state.
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        Qp::create(self, send_cq, recv_cq, caps, QpType::Rc, None)
    }

    /// Creates a shared receive queue (`ibv_create_srq`).
    pub fn create_srq(&self, attr: &crate::provider::SrqAttr) -> Result<super::Srq> {
        super::Srq::create(self, attr)
    }

    /// Creates an RC QP in RESET state whose receives come from `srq`.
    pub fn create_qp_with_srq(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        srq: &super::Srq,
    ) -> Result<Qp> {
        Qp::create(self, send_cq, recv_cq, caps, QpType::Rc, Some(srq))
    }

    /// Creates a UD QP in RESET state; [`Qp::modify_ud_to_rts`] makes it
    /// ready.
    pub fn create_ud_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        Qp::create(self, send_cq, recv_cq, caps, QpType::Ud, None)
    }

    /// Creates an address handle (`ibv_create_ah`).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<Ah> {
        Ah::create(self, attr)
    }

    /// Allocates a type 2 memory window (`ibv_alloc_mw`).
    pub fn alloc_mw(&self) -> Result<super::Mw> {
        super::Mw::alloc(self)
    }
}

struct MrInner {
    mr: *mut sys::ibv_mr,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    access: AccessFlags,
    _pd: Pd,
}

// SAFETY: an ibv_mr handle may be used and deregistered from any thread; the
// other fields are plain values.
unsafe impl Send for MrInner {}
// SAFETY: as above; nothing is mutated through a shared reference.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: deregistered exactly once, before the PD (a field) is released.
        let ret = unsafe { sys::ibv_dereg_mr(self.mr) };
        if ret != 0 {
            tracing::warn!(error = %ret_err("ibv_dereg_mr", ret), "deregistering MR");
        }
    }
}

/// A registered memory region; deregistered when the last clone drops.
#[derive(Clone)]
pub struct Mr {
    inner: Arc<MrInner>,
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }
    /// Length in bytes.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Access flags it was registered with.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }
    /// The handle bind WRs carry: the `ibv_mr` pointer.
    pub fn raw(&self) -> u64 {
        self.inner.mr as u64
    }
}
