//! Shared receive queues (`ibv_create_srq`, `ibv_post_srq_recv`,
//! `ibv_modify_srq`, `ibv_query_srq`, `ibv_destroy_srq`).

use std::fmt;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::pd_mr::Pd;
use super::{errno_err, ret_err};
use crate::provider::{PostError, ProviderError, RecvWr, Result, Sge, SrqAttr};

/// Receive WRs built on the stack per post; longer lists are posted in
/// chunks of this many (one `ibv_post_srq_recv` each).
const STACK_WRS: usize = 16;

struct SrqInner {
    srq: *mut sys::ibv_srq,
    handle: u32,
    max_sge: u32,
    // Dropped after the SRQ is destroyed in Drop.
    _pd: Pd,
}

// SAFETY: libibverbs SRQ verbs (post, modify, query) are thread-safe; the
// pointer is never mutated after creation.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: the last handle is gone, and every QP created on the SRQ
        // holds a handle, so none is left; destroyed once, before the PD.
        let ret = unsafe { sys::ibv_destroy_srq(self.srq) };
        if ret != 0 {
            tracing::warn!(srq = self.handle, error = %ret_err("ibv_destroy_srq", ret), "destroying SRQ");
        }
    }
}

/// A shared receive queue.
#[derive(Clone)]
pub struct Srq {
    inner: Arc<SrqInner>,
}

impl fmt::Debug for Srq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ibverbs::Srq")
            .field("handle", &self.inner.handle)
            .finish()
    }
}

impl Srq {
    /// `ibv_create_srq` in `pd`.
    pub(crate) fn create(pd: &Pd, attr: &SrqAttr) -> Result<Srq> {
        let mut init = sys::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: sys::ibv_srq_attr {
                max_wr: attr.max_wr,
                max_sge: attr.max_sge,
                srq_limit: attr.srq_limit,
            },
        };
        // SAFETY: valid PD; `init` is fully set and only written back.
        let srq = unsafe { sys::ibv_create_srq(pd.inner.pd, &mut init) };
        if srq.is_null() {
            return Err(match errno_err("ibv_create_srq") {
                ProviderError::Verbs { call, source }
                    if source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    ProviderError::InvalidArgument {
                        call,
                        what: format!("{attr:?} refused by {}: {source}", pd.context().name()),
                    }
                }
                other => other,
            });
        }
        // SAFETY: valid SRQ just created; a plain field.
        let handle = unsafe { (*srq).handle };
        tracing::debug!(
            srq = handle,
            max_wr = init.attr.max_wr,
            max_sge = init.attr.max_sge,
            "created SRQ"
        );
        Ok(Srq {
            inner: Arc::new(SrqInner {
                srq,
                handle,
                max_sge: if init.attr.max_sge == 0 {
                    attr.max_sge
                } else {
                    init.attr.max_sge
                },
                _pd: pd.clone(),
            }),
        })
    }

    pub(crate) fn raw(&self) -> *mut sys::ibv_srq {
        self.inner.srq
    }

    /// The handle its async events name.
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// `ibv_query_srq`.
    pub fn attr(&self) -> Result<SrqAttr> {
        let mut a = sys::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: 0,
        };
        // SAFETY: valid SRQ and out-struct.
        let ret = unsafe { sys::ibv_query_srq(self.inner.srq, &mut a) };
        if ret != 0 {
            return Err(ret_err("ibv_query_srq", ret));
        }
        Ok(SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: a.srq_limit,
        })
    }

    /// `ibv_modify_srq` with `IBV_SRQ_LIMIT`.
    pub fn modify_limit(&self, limit: u32) -> Result<()> {
        let mut a = sys::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        let mask = sys::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as libc::c_int;
        // SAFETY: valid SRQ; only `srq_limit` is read (the mask).
        let ret = unsafe { sys::ibv_modify_srq(self.inner.srq, &mut a, mask) };
        if ret != 0 {
            return Err(match ret_err("ibv_modify_srq", ret) {
                ProviderError::Verbs { call, source }
                    if source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    ProviderError::InvalidArgument {
                        call,
                        what: format!("srq_limit {limit}: {source}"),
                    }
                }
                other => other,
            });
        }
        Ok(())
    }

    /// Posts receive WRs, 16 per `ibv_post_srq_recv` call.
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Srq::post_recv`].
    pub unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let mut done = 0;
        for chunk in wrs.chunks(STACK_WRS) {
            // SAFETY: the caller's contract is ours.
            if let Err(e) = unsafe { self.post_chunk(chunk) } {
                return Err(PostError {
                    posted: done + e.posted,
                    error: e.error,
                });
            }
            done += chunk.len();
        }
        Ok(())
    }

    /// One `ibv_post_srq_recv` of at most [`STACK_WRS`] WRs.
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Srq::post_recv`]; `wrs.len() <= STACK_WRS`.
    unsafe fn post_chunk(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let mut raw = [MaybeUninit::<sys::ibv_recv_wr>::uninit(); STACK_WRS];
        let base = raw.as_mut_ptr().cast::<sys::ibv_recv_wr>();
        let max_sge = self.inner.max_sge as usize;
        let mut n = 0;
        for wr in wrs.iter().take(STACK_WRS) {
            let sgl: &[Sge] = wr.sg_list.as_slice();
            if sgl.len() > max_sge {
                break;
            }
            let sg_list = if sgl.is_empty() {
                ptr::null_mut()
            } else {
                sgl.as_ptr().cast::<sys::ibv_sge>().cast_mut()
            };
            // SAFETY: n < STACK_WRS: in bounds; `next` is one past at most.
            // `Sge` has `ibv_sge`'s layout (checked in qp.rs).
            unsafe {
                base.add(n).write(sys::ibv_recv_wr {
                    wr_id: wr.wr_id,
                    next: base.add(n + 1),
                    sg_list,
                    num_sge: sgl.len() as libc::c_int,
                })
            };
            n += 1;
        }
        if n > 0 {
            // SAFETY: entries 0..n are written; terminate the list.
            unsafe { (*base.add(n - 1)).next = ptr::null_mut() };
            let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
            // SAFETY: valid SRQ; a well-formed list of n WRs whose SGE lists
            // the provider only reads during the call. The memory they name
            // is lent to the device under this function's contract.
            let ret = unsafe { sys::ibv_post_srq_recv(self.inner.srq, base, &mut bad) };
            if ret != 0 {
                let posted = if bad.is_null() || (bad as usize) < (base as usize) {
                    0
                } else {
                    ((bad as usize - base as usize) / std::mem::size_of::<sys::ibv_recv_wr>())
                        .min(n)
                };
                let error = match ret_err("ibv_post_srq_recv", ret) {
                    ProviderError::Verbs { source, .. }
                        if source.raw_os_error() == Some(libc::ENOMEM) =>
                    {
                        ProviderError::QueueFull {
                            qp_num: 0,
                            queue: "shared receive",
                            depth: self.attr().map_or(0, |a| a.max_wr),
                        }
                    }
                    other => other,
                };
                return Err(PostError { posted, error });
            }
        }
        if n < wrs.len() {
            return Err(PostError {
                posted: n,
                error: ProviderError::InvalidArgument {
                    call: "post_srq_recv",
                    what: format!(
                        "{} SGEs in one WR, the SRQ takes at most {max_sge}",
                        wrs[n].sg_list.len()
                    ),
                },
            });
        }
        Ok(())
    }
}
