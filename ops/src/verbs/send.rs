//! SEND: transmits a buffer's initialized bytes into the peer's next RECV.

use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, GatherVerb, QueuePair, Submit, SubmitError};

use super::{check, gather_sge, refuse, submit_gather};
use crate::error::Error;

const OP: &str = "send";

/// The in-flight SEND: owns the buffer; resolves to the bytes sent.
#[derive(Debug)]
pub struct SendVerb<B> {
    buf: B,
    len: usize,
}

impl<B: RegisteredBuf> GatherVerb for SendVerb<B> {
    type Buf = B;
    fn gather_buf(&self) -> &B {
        &self.buf
    }
}

impl<B: RegisteredBuf> Completable for SendVerb<B> {
    type Output = BufResult<usize, B, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (check(OP, &c).map(|()| self.len), self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Sends `buf`'s initialized bytes (see [`Verbs::send`](super::Verbs::send)).
#[inline]
pub fn send<B: RegisteredBuf>(qp: &QueuePair, buf: B) -> Submit<SendVerb<B>> {
    let sge = match gather_sge(OP, &buf) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let len = sge.length as usize;
    submit_gather(qp, SendVerb { buf, len }, SendOp::Send, &sge)
}
