//! Inline SEND without an op: the payload is copied into the work request
//! at post time, so the call borrows it only until the WR is posted and
//! returns then, without waiting for the completion (most such sends are
//! unsignaled, like perftest's latency loop). See
//! [`QueuePair::post_send_inline`] for the signaling and error rules.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use verbio_runtime::{QueuePair, SendInline};

use crate::error::Error;

/// The future of [`Verbs::send_inline`](super::Verbs::send_inline) and
/// [`Verbs::send_inline_with_imm`](super::Verbs::send_inline_with_imm):
/// resolves once the SEND is posted.
#[derive(Debug)]
#[must_use = "dropping it before it resolves cancels the send"]
pub struct SendInlineVerb<'a> {
    inner: SendInline<'a>,
    op: &'static str,
}

impl Future for SendInlineVerb<'_> {
    type Output = Result<(), Error>;
    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let op = self.op;
        Pin::new(&mut self.inner)
            .poll(cx)
            .map(|r| r.map_err(|source| Error::Submit { op, source }))
    }
}

/// Posts an inline SEND of `data` (see [`Verbs::send_inline`](super::Verbs::send_inline)).
pub fn send_inline<'a>(qp: &'a QueuePair, data: &'a [u8]) -> SendInlineVerb<'a> {
    SendInlineVerb {
        inner: qp.post_send_inline(data, None),
        op: "send_inline",
    }
}

/// Posts an inline SEND_WITH_IMM of `data`.
pub fn send_inline_with_imm<'a>(qp: &'a QueuePair, data: &'a [u8], imm: u32) -> SendInlineVerb<'a> {
    SendInlineVerb {
        inner: qp.post_send_inline(data, Some(imm)),
        op: "send_inline_with_imm",
    }
}
