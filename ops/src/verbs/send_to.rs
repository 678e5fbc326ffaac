//! SEND of a datagram to a UD peer (`SendOp::SendTo`), with or without
//! immediate data: the UD form of [`send`](super::send).

use verbio_runtime::buf::RegisteredBuf;
use verbio_runtime::provider::{QpType, SendOp};
use verbio_runtime::{QueuePair, Submit, SubmitError, UdPeer};

use super::gather::{post_gather, GatherKind, Gathering, SendToKind};
use super::refuse;
use crate::error::Error;

const OP: &str = SendToKind::OP;

/// The in-flight datagram: owns the buffer (the address handle the WR
/// names lives as long as its queue pair, which caches it); resolves to
/// the bytes sent.
pub type SendToVerb<B> = Gathering<B, SendToKind>;

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
    let fits = |len| {
        qp.check_datagram_len(len)
            .map_err(|source| Error::Submit { op: OP, source })
    };
    post_gather(qp, buf, fits, || SendOp::SendTo {
        dest: peer.dest(),
        imm,
    })
}
