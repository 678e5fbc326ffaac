//! Address handles (`ibv_ah`): the route to a remote port, named by UD
//! send work requests.

use std::fmt;
use std::mem::MaybeUninit;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::{errno_err, ret_err, Pd};
use crate::provider::{AhAttr, AhHandle, ProviderError, Result};

struct AhInner {
    ah: *mut sys::ibv_ah,
    // Dropped after the AH is destroyed in Drop.
    _pd: Pd,
}

// SAFETY: an ibv_ah may be used (named by send WRs) and destroyed from any
// thread (libibverbs is thread-safe); the pointer is never mutated.
unsafe impl Send for AhInner {}
// SAFETY: as above; nothing is mutated through a shared reference.
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: the last handle is gone; destroyed once, before the PD.
        let ret = unsafe { sys::ibv_destroy_ah(self.ah) };
        if ret != 0 {
            tracing::warn!(error = %ret_err("ibv_destroy_ah", ret), "destroying AH");
        }
    }
}

/// An address handle; destroyed when the last clone drops. It keeps its
/// protection domain alive.
#[derive(Clone)]
pub struct Ah {
    inner: Arc<AhInner>,
}

impl fmt::Debug for Ah {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ibverbs::Ah")
            .field("raw", &self.inner.ah)
            .finish()
    }
}

/// The `ibv_ah_attr` of `attr`: a GRH (`is_global`) when the destination
/// GID is non-zero, as RoCE requires and `ibv_ud_pingpong` does.
fn raw_attr(attr: &AhAttr) -> sys::ibv_ah_attr {
    // SAFETY: ibv_ah_attr is integers and a GID union of bytes: all-zero is
    // a valid value (what C callers start from).
    let mut a = unsafe { MaybeUninit::<sys::ibv_ah_attr>::zeroed().assume_init() };
    a.dlid = attr.dlid;
    a.sl = attr.sl;
    a.src_path_bits = 0;
    a.port_num = attr.port;
    if !attr.dgid.is_zero() {
        a.is_global = 1;
        a.grh.dgid = sys::ibv_gid { raw: attr.dgid.0 };
        a.grh.sgid_index = attr.sgid_index;
        a.grh.hop_limit = attr.hop_limit.max(1);
    }
    a
}

impl Ah {
    /// `ibv_create_ah` for `attr` on `pd`.
    pub(crate) fn create(pd: &Pd, attr: &AhAttr) -> Result<Ah> {
        if attr.port == 0 {
            return Err(ProviderError::InvalidArgument {
                call: "create_ah",
                what: "port 0 (ports are numbered from 1)".into(),
            });
        }
        let mut raw = raw_attr(attr);
        // SAFETY: valid PD; `raw` is fully initialised and only read.
        let ah = unsafe { sys::ibv_create_ah(pd.inner.pd, &mut raw) };
        if ah.is_null() {
            let err = errno_err("ibv_create_ah");
            // EINVAL: the device refuses this address (e.g. no GID on a
            // RoCE port, a GID index it lacks): say which.
            return Err(match err {
                ProviderError::Verbs { source, .. }
                    if source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    ProviderError::InvalidArgument {
                        call: "ibv_create_ah",
                        what: format!(
                            "address LID {:#x} GID {} (sgid index {}, port {}) on {}: {source}",
                            attr.dlid,
                            attr.dgid,
                            attr.sgid_index,
                            attr.port,
                            pd.context().name()
                        ),
                    }
                }
                other => other,
            });
        }
        Ok(Ah {
            inner: Arc::new(AhInner {
                ah,
                _pd: pd.clone(),
            }),
        })
    }

    /// The handle UD work requests carry: the `ibv_ah` pointer, valid while
    /// a clone of this `Ah` lives.
    pub fn raw(&self) -> AhHandle {
        AhHandle(self.inner.ah as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::Gid;

    #[test]
    fn grh_only_with_a_destination_gid() {
        let mut attr = AhAttr {
            dlid: 7,
            dgid: Gid([0; 16]),
            sgid_index: 1,
            hop_limit: 0,
            sl: 2,
            port: 1,
            addr: crate::provider::ProviderAddr::NONE,
        };
        let a = raw_attr(&attr);
        assert_eq!((a.is_global, a.dlid, a.sl, a.port_num), (0, 7, 2, 1));
        attr.dgid.0[15] = 1;
        let a = raw_attr(&attr);
        assert_eq!(a.is_global, 1);
        assert_eq!(a.grh.sgid_index, 1);
        assert_eq!(a.grh.hop_limit, 1, "hop limit 0 is raised to 1");
        // SAFETY: the union's raw bytes are always initialised.
        assert_eq!(unsafe { a.grh.dgid.raw }, attr.dgid.0);
    }
}
