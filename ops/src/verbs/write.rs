//! RDMA WRITE: copies a buffer's initialized bytes into the peer's memory.

use verbio_runtime::buf::RegisteredBuf;
use verbio_runtime::provider::SendOp;
use verbio_runtime::{QueuePair, Submit};

use super::gather::{post_gather, GatherKind, Gathering, WriteKind};
use super::RemoteBuf;

/// The in-flight WRITE: owns the buffer; resolves to `()`.
pub type WriteVerb<B> = Gathering<B, WriteKind>;

/// Writes `buf`'s initialized bytes to the start of `remote`, which must be
/// at least that long (see [`Verbs::write`](super::Verbs::write)).
#[inline]
pub fn write<B: RegisteredBuf>(qp: &QueuePair, buf: B, remote: RemoteBuf) -> Submit<WriteVerb<B>> {
    let fits = move |len| remote.check_fits(WriteKind::OP, len);
    post_gather(qp, buf, fits, move || SendOp::Write {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
    })
}
