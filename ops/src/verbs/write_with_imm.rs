//! RDMA WRITE with immediate: a WRITE that also consumes the peer's next
//! RECV, which completes with the immediate and the byte count.

use verbio_runtime::buf::RegisteredBuf;
use verbio_runtime::provider::SendOp;
use verbio_runtime::{QueuePair, Submit};

use super::gather::{post_gather, GatherKind, Gathering, WriteWithImmKind};
use super::RemoteBuf;

/// The in-flight WRITE_WITH_IMM: owns the buffer; resolves to `()`.
pub type WriteWithImmVerb<B> = Gathering<B, WriteWithImmKind>;

/// Writes `buf`'s initialized bytes to the start of `remote` with `imm`
/// (see [`Verbs::write_with_imm`](super::Verbs::write_with_imm)).
#[inline]
pub fn write_with_imm<B: RegisteredBuf>(
    qp: &QueuePair,
    buf: B,
    remote: RemoteBuf,
    imm: u32,
) -> Submit<WriteWithImmVerb<B>> {
    let fits = move |len| remote.check_fits(WriteWithImmKind::OP, len);
    post_gather(qp, buf, fits, move || SendOp::WriteWithImm {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        imm,
    })
}
