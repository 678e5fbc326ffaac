//! SEND of a datagram to a UD peer (`SendOp::SendTo`), with or without
//! immediate data: the UD form of [`send`](super::send).

use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::provider::{Completion, QpType, SendOp};
use verbio_runtime::{Completable, GatherVerb, QueuePair, Submit, SubmitError, UdPeer};

use super::{check, gather_sge, refuse, submit_gather};
use crate::error::Error;

const OP: &str = "send_to";

/// The in-flight datagram: owns the buffer (the address handle the WR
/// names lives as long as its queue pair, which caches it); resolves to
/// the bytes sent.
#[derive(Debug)]
pub struct SendToVerb<B> {
    buf: B,
    len: usize,
}

impl<B: RegisteredBuf> GatherVerb for SendToVerb<B> {
    type Buf = B;
    fn gather_buf(&self) -> &B {
        &self.buf
    }
}

impl<B: RegisteredBuf> Completable for SendToVerb<B> {
    type Output = BufResult<usize, B, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (check(OP, &c).map(|()| self.len), self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.buf)
    }
}

/// Sends `buf`'s initialized bytes to `peer` as one datagram, with `imm` if
/// given (see [`Verbs::send_to`](super::Verbs::send_to)).
#[inline]
pub fn send_to<B: RegisteredBuf>(
    qp: &QueuePair,
    peer: &UdPeer,
    buf: B,
    imm: Option<u32>,
) -> Submit<SendToVerb<B>> {
    if qp.qp_type() != QpType::Ud {
        let source = SubmitError::Invalid {
            what: format!("QP {} is not a UD queue pair", qp.qp_num()),
        };
        return refuse(Error::Submit { op: OP, source }, buf);
    }
    let sge = match gather_sge(OP, &buf) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let len = sge.length as usize;
    if let Err(source) = qp.check_datagram_len(len) {
        return refuse(Error::Submit { op: OP, source }, buf);
    }
    let op = SendOp::SendTo {
        dest: peer.dest(),
        imm,
    };
    submit_gather(qp, SendToVerb { buf, len }, op, &sge)
}
