//! Atomic fetch-and-add on a 64-bit word in the peer's memory.

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, QueuePair, ScatterVerb, Submit, SubmitError};

use super::{atomic_result, atomic_target, check, refuse, scatter_sge, RemoteBuf};
use crate::error::Error;

const OP: &str = "fetch_and_add";

/// The in-flight fetch-and-add: owns the 8-byte result buffer; resolves to
/// the word's value before the addition.
#[derive(Debug)]
pub struct FetchAndAddVerb<B> {
    buf: B,
}

impl<B: RegisteredBuf + IoBufMut> ScatterVerb for FetchAndAddVerb<B> {
    type Buf = B;
    fn scatter_buf(&mut self) -> &mut B {
        &mut self.buf
    }
    fn scatter_len(&self) -> usize {
        8
    }
}

impl<B: RegisteredBuf + IoBufMut> Completable for FetchAndAddVerb<B> {
    type Output = BufResult<u64, B, Error>;
    fn complete(mut self, c: Completion) -> Self::Output {
        let r = check(OP, &c).map(|()| atomic_result(&mut self.buf));
        (r, self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Adds `add` (wrapping) to the word at `remote`; returns the original value
/// (see [`Verbs::fetch_and_add`](super::Verbs::fetch_and_add)).
#[inline]
pub fn fetch_and_add<B: RegisteredBuf + IoBufMut>(
    qp: &QueuePair,
    buf: B,
    remote: RemoteBuf,
    add: u64,
) -> Submit<FetchAndAddVerb<B>> {
    let sge = match atomic_target(OP, &remote).and_then(|()| scatter_sge(OP, &buf, 8)) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let op = SendOp::FetchAndAdd {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        add,
    };
    let _ = sge;
    qp.send_scatter(FetchAndAddVerb { buf }, op)
}
