//! The safe entries for memory windows: binding a [`Window`] over a
//! bindable region and invalidating it. The op data owns the window (and
//! through it, once bound, the region), so the window and the region's
//! memory and registration outlive the work request and every access
//! through the window; the runtime, not the verb, records the binding and
//! lets the region go once an invalidation completed.

use std::ops::Range;
use std::rc::Rc;

use super::{QueuePair, Submit};
use crate::buf::{IoBufMut, RemoteAccessRegion, Window};
use crate::op::{Completable, SubmitError};
use crate::provider::{AccessFlags, Completion, SendOp};

/// A verb whose op data owns the [`Window`] its work request binds or
/// invalidates.
pub trait WindowVerb: Completable {
    /// The memory of the regions the window is bound over.
    type Region: IoBufMut;
    /// The window, owned by `self`.
    fn window(&mut self) -> &mut Window<Self::Region>;
}

/// Remote access flags a window may grant.
const WINDOW_ACCESS: AccessFlags = AccessFlags::from_bits_truncate(
    AccessFlags::REMOTE_READ.bits()
        | AccessFlags::REMOTE_WRITE.bits()
        | AccessFlags::REMOTE_ATOMIC.bits(),
);

fn invalid(what: String) -> SubmitError {
    SubmitError::Invalid { what }
}

/// The op data of [`QueuePair::invalidate_window`]: on a successful
/// completion the window is unbound (it lets its region go) before the
/// verb completes.
#[derive(Debug)]
pub struct Invalidate<T>(T);

impl<T: WindowVerb> Completable for Invalidate<T> {
    type Output = T::Output;
    fn complete(mut self, c: Completion) -> T::Output {
        if c.status.is_success() {
            self.0.window().bound = None;
        }
        self.0.complete(c)
    }
    fn fail(self, error: SubmitError) -> T::Output {
        self.0.fail(error)
    }
}

/// The op data of [`QueuePair::bind_window`]: if the bind fails (refused
/// once the binding was recorded, or completed with an error such as a
/// flush), the window is unbound again (it lets its region go) before the
/// verb completes: a failed bind bound nothing on the device.
#[derive(Debug)]
pub struct Bind<T> {
    data: T,
    /// This bind recorded its binding in the window (a refusal of a bound
    /// window keeps that window's binding).
    recorded: bool,
}

impl<T: WindowVerb> Bind<T> {
    fn unrecord(&mut self) {
        if std::mem::take(&mut self.recorded) {
            self.data.window().bound = None;
        }
    }
}

impl<T: WindowVerb> Completable for Bind<T> {
    type Output = T::Output;
    fn complete(mut self, c: Completion) -> T::Output {
        if !c.status.is_success() {
            self.unrecord();
        }
        self.data.complete(c)
    }
    fn fail(mut self, error: SubmitError) -> T::Output {
        self.unrecord();
        self.data.fail(error)
    }
}

impl QueuePair {
    /// Binds `data`'s window (unbound) over `range` of `region` (a
    /// [`RemoteAccessRegion::bindable`] one of this QP's PD) with `access`
    /// (remote read, write, atomic): one BIND_MW work request. From its
    /// completion on, the peer of this QP reaches exactly that range with
    /// that access through the window's new rkey
    /// ([`Window::remote`]); the window holds `region` until it is
    /// invalidated. Refused (before posting) for a bound window, an empty
    /// or out-of-bounds range, a region without `MW_BIND`, or access beyond
    /// the remote flags. Devices that check only the region's bounds (rxe
    /// on Linux 6.1) let the peer reach the rest of the region. A bind
    /// that fails leaves the window unbound.
    pub fn bind_window<T: WindowVerb>(
        &self,
        data: T,
        region: Rc<RemoteAccessRegion<T::Region>>,
        range: Range<usize>,
        access: AccessFlags,
    ) -> Submit<Bind<T>> {
        // SAFETY: the WR has no SGE (lends no local memory). The window it
        // names is owned by `data` (alive until the WR is done); the region
        // it names is held by the window from here until an invalidation
        // completed or the window is deallocated (window first), so it
        // stays registered while the window is bound.
        unsafe {
            let data = Bind {
                data,
                recorded: false,
            };
            self.submit_send_one(data, move |bind, wr| {
                let w = bind.data.window();
                if w.bound.is_some() {
                    return Err(invalid(
                        "binding a bound window: invalidate it first".into(),
                    ));
                }
                if range.is_empty() || range.end > region.len() {
                    return Err(invalid(format!(
                        "window range {range:?} outside a region of {} bytes",
                        region.len()
                    )));
                }
                if !region.access().contains(AccessFlags::MW_BIND) {
                    return Err(invalid(
                        "region not bindable: register it with RemoteAccessRegion::bindable".into(),
                    ));
                }
                if access.is_empty() || !WINDOW_ACCESS.contains(access) {
                    return Err(invalid(format!(
                        "window access {access:?}: remote read, write, atomic only"
                    )));
                }
                let mr = region
                    .mr_handle()
                    .ok_or_else(|| invalid("region of a test double".into()))?;
                let addr = region.addr() + range.start as u64;
                let len = range.len() as u64;
                let rkey = w.mw.next_rkey();
                wr.op = SendOp::BindMw {
                    mw: w.mw.raw(),
                    mr,
                    addr,
                    len,
                    access,
                    rkey,
                };
                w.bound = Some(crate::buf::window_binding(region, addr, len, rkey, access));
                bind.recorded = true;
                Ok(())
            })
        }
    }

    /// Invalidates `data`'s bound window: one LOCAL_INV work request; from
    /// its completion on, the window's rkey fails and the window has let
    /// its region go (the output of `data` sees it unbound). Refused for an
    /// unbound window (which rxe on Linux 6.1 cannot take: it panics).
    pub fn invalidate_window<T: WindowVerb>(&self, data: T) -> Submit<Invalidate<T>> {
        // SAFETY: the WR names no local memory and no object but an rkey.
        unsafe {
            self.submit_send_one(Invalidate(data), |data, wr| {
                let Some((_, _, rkey)) = data.0.window().remote() else {
                    return Err(invalid("invalidating an unbound window".into()));
                };
                wr.op = SendOp::LocalInv { rkey };
                Ok(())
            })
        }
    }
}
