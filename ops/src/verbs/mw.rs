//! Memory windows (type 2): bind a [`Window`] over a sub-range of a
//! bindable region and get the [`RemoteBuf`] a peer uses; revoke it with
//! one LOCAL_INV; or let the peer revoke it with SEND_WITH_INV.
//!
//! ```no_run
//! # async fn demo(qp: &verbio_runtime::QueuePair, pd: &verbio_runtime::provider::Pd)
//! #     -> verbio_ops::Result<()> {
//! use std::rc::Rc;
//! use verbio_ops::verbs::Verbs;
//! use verbio_runtime::buf::{RemoteAccessRegion, Window};
//! use verbio_runtime::provider::AccessFlags;
//! let region = Rc::new(RemoteAccessRegion::bindable(pd, vec![0u8; 1 << 20]).expect("register"));
//! let window = Window::alloc(pd).expect("alloc_mw");
//! let (granted, window) = qp
//!     .bind_mw(window, region.clone(), 4096..8192, AccessFlags::REMOTE_READ)
//!     .await;
//! let remote = granted?; // send it to the peer
//! # let _ = remote;
//! let (revoked, _window) = qp.local_inv(window).await;
//! revoked?; // the rkey fails from here on
//! # Ok(()) }
//! ```

use std::ops::Range;
use std::rc::Rc;

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf, RemoteAccessRegion, Window};
use verbio_runtime::provider::{AccessFlags, Completion, SendOp};
use verbio_runtime::{Bind, Completable, Invalidate, QueuePair, Submit, SubmitError, WindowVerb};

use super::gather::{post_gather, Gathering, SendWithInvKind};
use super::{check, RemoteBuf};
use crate::error::Error;

/// The in-flight bind: owns the window; resolves to what the peer uses.
#[derive(Debug)]
pub struct BindMwVerb<R> {
    window: Window<R>,
}

impl<R: IoBufMut> WindowVerb for BindMwVerb<R> {
    type Region = R;
    fn window(&mut self) -> &mut Window<R> {
        &mut self.window
    }
}

impl<R: IoBufMut> Completable for BindMwVerb<R> {
    type Output = BufResult<RemoteBuf, Window<R>, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        let r = check("bind_mw", &c).and_then(|()| {
            let (addr, len, rkey) = self.window.remote().ok_or_else(|| Error::Submit {
                op: "bind_mw",
                source: SubmitError::Invalid {
                    what: "window unbound after its bind".into(),
                },
            })?;
            Ok(RemoteBuf::new(addr, len, rkey))
        });
        (r, self.window)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (
            Err(Error::Submit {
                op: "bind_mw",
                source,
            }),
            self.window,
        )
    }
}

/// Binds `window` over `range` of `region` with `access` (see
/// [`Verbs::bind_mw`](super::Verbs::bind_mw)).
pub fn bind_mw<R: IoBufMut>(
    qp: &QueuePair,
    window: Window<R>,
    region: Rc<RemoteAccessRegion<R>>,
    range: Range<usize>,
    access: AccessFlags,
) -> Submit<Bind<BindMwVerb<R>>> {
    qp.bind_window(BindMwVerb { window }, region, range, access)
}

/// The in-flight LOCAL_INV: owns the window; resolves once it is revoked.
#[derive(Debug)]
pub struct LocalInvVerb<R> {
    window: Window<R>,
}

impl<R: IoBufMut> WindowVerb for LocalInvVerb<R> {
    type Region = R;
    fn window(&mut self) -> &mut Window<R> {
        &mut self.window
    }
}

impl<R: IoBufMut> Completable for LocalInvVerb<R> {
    type Output = BufResult<(), Window<R>, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (check("local_inv", &c), self.window)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (
            Err(Error::Submit {
                op: "local_inv",
                source,
            }),
            self.window,
        )
    }
}

/// Invalidates `window` (see [`Verbs::local_inv`](super::Verbs::local_inv)).
pub fn local_inv<R: IoBufMut>(
    qp: &QueuePair,
    window: Window<R>,
) -> Submit<Invalidate<LocalInvVerb<R>>> {
    qp.invalidate_window(LocalInvVerb { window })
}

/// The in-flight SEND_WITH_INV: owns the buffer; resolves to the bytes sent.
pub type SendWithInvVerb<B> = Gathering<B, SendWithInvKind>;

/// SEND of `buf`'s initialized bytes that invalidates the peer's window
/// `rkey` (see [`Verbs::send_with_inv`](super::Verbs::send_with_inv)).
pub fn send_with_inv<B: RegisteredBuf>(
    qp: &QueuePair,
    buf: B,
    rkey: u32,
) -> Submit<SendWithInvVerb<B>> {
    post_gather(qp, buf, |_| Ok(()), || SendOp::SendWithInv { rkey })
}
