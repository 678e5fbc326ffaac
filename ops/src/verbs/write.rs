//! RDMA WRITE: copies a buffer's initialized bytes into the peer's memory.

use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, GatherVerb, QueuePair, Submit, SubmitError};

use super::{check, gather_sge, refuse, submit_gather, RemoteBuf};
use crate::error::Error;

const OP: &str = "write";

/// The in-flight WRITE: owns the buffer; resolves to `()`.
#[derive(Debug)]
pub struct WriteVerb<B> {
    buf: B,
}

impl<B: RegisteredBuf> GatherVerb for WriteVerb<B> {
    type Buf = B;
    fn gather_buf(&self) -> &B {
        &self.buf
    }
}

impl<B: RegisteredBuf> Completable for WriteVerb<B> {
    type Output = BufResult<(), B, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (check(OP, &c), self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Writes `buf`'s initialized bytes to the start of `remote`, which must be
/// at least that long (see [`Verbs::write`](super::Verbs::write)).
#[inline]
pub fn write<B: RegisteredBuf>(qp: &QueuePair, buf: B, remote: RemoteBuf) -> Submit<WriteVerb<B>> {
    let sge = match gather_sge(OP, &buf).and_then(|s| {
        remote.check_fits(OP, s.length as usize)?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let op = SendOp::Write {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
    };
    submit_gather(qp, WriteVerb { buf }, op, &sge)
}
