//! RECV: a buffer posted to the receive queue, filled by the peer's next
//! SEND (or only consumed, with the immediate, by its WRITE_WITH_IMM).

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf};
use verbio_runtime::provider::{Completion, WcOpcode};
use verbio_runtime::{Completable, QueuePair, ScatterVerb, Submit, SubmitError};

use super::{check, mark_written, refuse};
use crate::error::Error;

const OP: &str = "recv";

/// What a completed RECV reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// Bytes the peer sent (SEND: written at the start of the buffer;
    /// WRITE_WITH_IMM: written into the peer-granted memory, not the buffer).
    pub len: usize,
    /// The immediate data of a SEND_WITH_IMM or WRITE_WITH_IMM.
    pub imm: Option<u32>,
    /// True if the RECV was consumed by an RDMA WRITE_WITH_IMM.
    pub by_write: bool,
}

fn received(c: &Completion) -> Received {
    Received {
        len: c.byte_len as usize,
        imm: c.imm_data,
        by_write: c.opcode == WcOpcode::RecvRdmaWithImm,
    }
}

/// The in-flight RECV: owns the buffer; resolves to [`Received`].
#[derive(Debug)]
pub struct RecvVerb<B> {
    buf: B,
}

impl<B: RegisteredBuf + IoBufMut> ScatterVerb for RecvVerb<B> {
    type Buf = B;
    fn scatter_buf(&mut self) -> &mut B {
        &mut self.buf
    }
    fn scatter_len(&self) -> usize {
        self.buf.bytes_total()
    }
}

impl<B: RegisteredBuf + IoBufMut> Completable for RecvVerb<B> {
    type Output = BufResult<Received, B, Error>;
    fn complete(mut self, c: Completion) -> Self::Output {
        let r = check(OP, &c).map(|()| received(&c));
        if let Ok(r) = &r {
            if !r.by_write {
                mark_written(&mut self.buf, r.len);
            }
        }
        (r, self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Posts a RECV over `buf`'s capacity (see [`Verbs::recv`](super::Verbs::recv)).
#[inline]
pub fn recv<B: RegisteredBuf + IoBufMut>(qp: &QueuePair, buf: B) -> Submit<RecvVerb<B>> {
    if let Err(source) = buf.sge_total() {
        return refuse(Error::Buf { op: OP, source }, buf);
    }
    qp.recv_scatter(RecvVerb { buf })
}

/// The in-flight buffer-less RECV; resolves to [`Received`].
#[derive(Debug)]
pub struct RecvEmptyVerb;

impl Completable for RecvEmptyVerb {
    type Output = Result<Received, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        check("recv_empty", &c).map(|()| received(&c))
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        Err(Error::Submit {
            op: "recv_empty",
            source,
        })
    }
}

/// Posts a RECV with no scatter list (see [`Verbs::recv_empty`](super::Verbs::recv_empty)).
pub fn recv_empty(qp: &QueuePair) -> Submit<RecvEmptyVerb> {
    qp.recv_without_memory(RecvEmptyVerb)
}
