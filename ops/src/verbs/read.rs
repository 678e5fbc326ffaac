//! RDMA READ: copies the peer's memory into a local buffer.

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, QueuePair, ScatterVerb, Submit, SubmitError};

use super::{check, check_scatter, mark_written, refuse, RemoteBuf};
use crate::error::Error;

const OP: &str = "read";

/// The in-flight READ: owns the buffer; resolves to `()` with the first
/// `remote.len()` bytes of the buffer filled (and marked initialized).
#[derive(Debug)]
pub struct ReadVerb<B> {
    buf: B,
    len: usize,
}

impl<B: RegisteredBuf + IoBufMut> ScatterVerb for ReadVerb<B> {
    type Buf = B;
    fn scatter_buf(&mut self) -> &mut B {
        &mut self.buf
    }
    fn scatter_len(&self) -> usize {
        self.len
    }
}

impl<B: RegisteredBuf + IoBufMut> Completable for ReadVerb<B> {
    type Output = BufResult<(), B, Error>;
    fn complete(mut self, c: Completion) -> Self::Output {
        let r = check(OP, &c);
        if r.is_ok() {
            mark_written(&mut self.buf, self.len);
        }
        (r, self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Reads all of `remote` into the start of `buf`, whose capacity must be at
/// least `remote.len()` (see [`Verbs::read`](super::Verbs::read)).
#[inline]
pub fn read<B: RegisteredBuf + IoBufMut>(
    qp: &QueuePair,
    buf: B,
    remote: RemoteBuf,
) -> Submit<ReadVerb<B>> {
    let len = match usize::try_from(remote.len()) {
        Ok(l) => l,
        Err(_) => {
            let have = buf.bytes_total();
            return refuse(
                Error::BufferTooSmall {
                    op: OP,
                    need: usize::MAX,
                    have,
                },
                buf,
            );
        }
    };
    if let Err(e) = check_scatter(OP, &buf, len) {
        return refuse(e, buf);
    }
    let op = SendOp::Read {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
    };
    qp.send_scatter(ReadVerb { buf, len }, op)
}
