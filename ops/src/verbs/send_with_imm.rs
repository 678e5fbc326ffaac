//! SEND with immediate: a SEND whose receive completion also carries 32 bits.

use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, GatherVerb, QueuePair, Submit, SubmitError};

use super::{check, gather_sge, refuse, submit_gather};
use crate::error::Error;

const OP: &str = "send_with_imm";

/// The in-flight SEND with immediate: owns the buffer; resolves to the bytes sent.
#[derive(Debug)]
pub struct SendWithImmVerb<B> {
    buf: B,
    len: usize,
}

impl<B: RegisteredBuf> GatherVerb for SendWithImmVerb<B> {
    type Buf = B;
    fn gather_buf(&self) -> &B {
        &self.buf
    }
}

impl<B: RegisteredBuf> Completable for SendWithImmVerb<B> {
    type Output = BufResult<usize, B, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (check(OP, &c).map(|()| self.len), self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Sends `buf`'s initialized bytes with `imm` (see [`Verbs::send_with_imm`](super::Verbs::send_with_imm)).
#[inline]
pub fn send_with_imm<B: RegisteredBuf>(
    qp: &QueuePair,
    buf: B,
    imm: u32,
) -> Submit<SendWithImmVerb<B>> {
    let sge = match gather_sge(OP, &buf) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let len = sge.length as usize;
    submit_gather(
        qp,
        SendWithImmVerb { buf, len },
        SendOp::SendWithImm { imm },
        &sge,
    )
}
