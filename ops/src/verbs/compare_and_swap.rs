//! Atomic compare-and-swap on a 64-bit word in the peer's memory.

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, QueuePair, ScatterVerb, Submit, SubmitError};

use super::{atomic_result, atomic_target, check, refuse, scatter_sge, RemoteBuf};
use crate::error::Error;

const OP: &str = "compare_and_swap";

/// The in-flight compare-and-swap: owns the 8-byte result buffer; resolves
/// to the word's original value (the swap happened iff it equals `compare`).
#[derive(Debug)]
pub struct CompareAndSwapVerb<B> {
    buf: B,
}

impl<B: RegisteredBuf + IoBufMut> ScatterVerb for CompareAndSwapVerb<B> {
    type Buf = B;
    fn scatter_buf(&mut self) -> &mut B {
        &mut self.buf
    }
    fn scatter_len(&self) -> usize {
        8
    }
}

impl<B: RegisteredBuf + IoBufMut> Completable for CompareAndSwapVerb<B> {
    type Output = BufResult<u64, B, Error>;
    fn complete(mut self, c: Completion) -> Self::Output {
        let r = check(OP, &c).map(|()| atomic_result(&mut self.buf));
        (r, self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// If the word at `remote` equals `compare`, stores `swap`; returns the
/// original value (see [`Verbs::compare_and_swap`](super::Verbs::compare_and_swap)).
#[inline]
pub fn compare_and_swap<B: RegisteredBuf + IoBufMut>(
    qp: &QueuePair,
    buf: B,
    remote: RemoteBuf,
    compare: u64,
    swap: u64,
) -> Submit<CompareAndSwapVerb<B>> {
    let sge = match atomic_target(OP, &remote).and_then(|()| scatter_sge(OP, &buf, 8)) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let op = SendOp::CompareAndSwap {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        compare,
        swap,
    };
    let _ = sge;
    qp.send_scatter(CompareAndSwapVerb { buf }, op)
}
