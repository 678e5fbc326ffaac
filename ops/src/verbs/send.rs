//! SEND: transmits a buffer's initialized bytes into the peer's next RECV.

use verbio_runtime::buf::RegisteredBuf;
use verbio_runtime::provider::SendOp;
use verbio_runtime::{QueuePair, Submit};

use super::gather::{post_gather, Gathering, SendKind};

/// The in-flight SEND: owns the buffer; resolves to the bytes sent.
pub type SendVerb<B> = Gathering<B, SendKind>;

/// Sends `buf`'s initialized bytes (see [`Verbs::send`](super::Verbs::send)).
#[inline]
pub fn send<B: RegisteredBuf>(qp: &QueuePair, buf: B) -> Submit<SendVerb<B>> {
    post_gather(qp, buf, |_| Ok(()), || SendOp::Send)
}
