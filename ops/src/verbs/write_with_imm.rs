//! RDMA WRITE with immediate: a WRITE that also consumes the peer's next
//! RECV, which completes with the immediate and the byte count.

use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, GatherVerb, QueuePair, Submit, SubmitError};

use super::{check, gather_sge, refuse, submit_gather, RemoteBuf};
use crate::error::Error;

const OP: &str = "write_with_imm";

/// The in-flight WRITE_WITH_IMM: owns the buffer; resolves to `()`.
#[derive(Debug)]
pub struct WriteWithImmVerb<B> {
    buf: B,
}

impl<B: RegisteredBuf> GatherVerb for WriteWithImmVerb<B> {
    type Buf = B;
    fn gather_buf(&self) -> &B {
        &self.buf
    }
}

impl<B: RegisteredBuf> Completable for WriteWithImmVerb<B> {
    type Output = BufResult<(), B, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (check(OP, &c), self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Writes `buf`'s initialized bytes to the start of `remote` with `imm`
/// (see [`Verbs::write_with_imm`](super::Verbs::write_with_imm)).
#[inline]
pub fn write_with_imm<B: RegisteredBuf>(
    qp: &QueuePair,
    buf: B,
    remote: RemoteBuf,
    imm: u32,
) -> Submit<WriteWithImmVerb<B>> {
    let sge = match gather_sge(OP, &buf).and_then(|s| {
        remote.check_fits(OP, s.length as usize)?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let op = SendOp::WriteWithImm {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        imm,
    };
    submit_gather(qp, WriteWithImmVerb { buf }, op, &sge)
}
