//! SEND with immediate: a SEND whose receive completion also carries 32 bits.

use verbio_runtime::buf::RegisteredBuf;
use verbio_runtime::provider::SendOp;
use verbio_runtime::{QueuePair, Submit};

use super::gather::{post_gather, Gathering, SendWithImmKind};

/// The in-flight SEND with immediate: owns the buffer; resolves to the bytes sent.
pub type SendWithImmVerb<B> = Gathering<B, SendWithImmKind>;

/// Sends `buf`'s initialized bytes with `imm` (see [`Verbs::send_with_imm`](super::Verbs::send_with_imm)).
#[inline]
pub fn send_with_imm<B: RegisteredBuf>(
    qp: &QueuePair,
    buf: B,
    imm: u32,
) -> Submit<SendWithImmVerb<B>> {
    post_gather(qp, buf, |_| Ok(()), || SendOp::SendWithImm { imm })
}
