//! [`SendMsg`]: the future of `Rdma::send` and `Rdma::send_with_imm`.
//!
//! The usual message fits one piece and goes out INLINE the moment it is
//! polled ([`Shared::try_send_whole`]): that first poll needs none of the
//! state of the general path (`Rdma::send_inner`: splitting, waiting for
//! credits or a reassembly slot, aborts), which is polled only if the
//! message cannot go out at once.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use pin_project::pin_project;

use super::error::AgentError;
use super::rdma::Shared;

/// Sends one message: INLINE at the first poll if it can go out at once,
/// else through `rest` (the general path, which tries that again first).
/// Cancel-safe as `rest` is: dropped before its first poll it sent nothing.
#[pin_project]
pub(crate) struct SendMsg<'a, S> {
    shared: &'a Rc<Shared>,
    data: &'a [u8],
    imm: Option<u32>,
    /// The fast path was tried (it is, once, at the first poll).
    tried: bool,
    #[pin]
    rest: S,
}

impl<'a, S> SendMsg<'a, S> {
    /// `data` (with `imm`) on `shared`'s connection; `rest` sends it the
    /// general way.
    pub(crate) fn new(shared: &'a Rc<Shared>, data: &'a [u8], imm: Option<u32>, rest: S) -> Self {
        SendMsg {
            shared,
            data,
            imm,
            tried: false,
            rest,
        }
    }
}

impl<S: Future<Output = Result<(), AgentError>>> Future for SendMsg<'_, S> {
    type Output = Result<(), AgentError>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if !*this.tried {
            *this.tried = true;
            if let Some(r) = this.shared.try_send_whole(this.data, *this.imm) {
                return Poll::Ready(r);
            }
        }
        this.rest.poll(cx)
    }
}
