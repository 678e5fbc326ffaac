//! A batch: several send-queue WRs posted as one chain (one doorbell), only
//! the last one signaled, completing as one op. The classic use is a few
//! RDMA WRITEs followed by a SEND (or WRITE_WITH_IMM) that tells the peer
//! the data is there: RC executes them in order.

use smallvec::SmallVec;
use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::op::wr_id;
use verbio_runtime::provider::{Completion, SendOp, Sge};
use verbio_runtime::{Completable, GatherChainVerb, QueuePair, SendChain, Submit, SubmitError};

use super::{gather_sge, inline_flag, one_wr, RemoteBuf};
use crate::error::Error;

const OP: &str = "batch";

/// A chain of gathering WRs (send, send_with_imm, write, write_with_imm),
/// each with its own buffer, built with chained calls and posted with
/// [`post`](Batch::post) / [`Verbs::post_batch`](super::Verbs::post_batch).
/// A buffer or bounds error while building is remembered and reported by
/// `post`, which then gives every buffer back without posting anything.
#[derive(Debug)]
pub struct Batch<B> {
    wrs: SendChain,
    kinds: SmallVec<[&'static str; 4]>,
    bufs: Vec<B>,
    error: Option<Error>,
}

impl<B: RegisteredBuf> Default for Batch<B> {
    fn default() -> Self {
        Batch::new()
    }
}

impl<B: RegisteredBuf> Batch<B> {
    /// An empty batch.
    pub fn new() -> Batch<B> {
        Batch::with_capacity(4)
    }

    /// An empty batch with room for `n` WRs.
    pub fn with_capacity(n: usize) -> Batch<B> {
        Batch {
            wrs: SendChain::with_capacity(n),
            kinds: SmallVec::with_capacity(n),
            bufs: Vec::with_capacity(n),
            error: None,
        }
    }

    /// Number of WRs so far.
    pub fn len(&self) -> usize {
        self.bufs.len()
    }

    /// True if no WR was added.
    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    fn push(
        mut self,
        kind: &'static str,
        buf: B,
        remote: Option<RemoteBuf>,
        op: SendOp,
    ) -> Batch<B> {
        if self.error.is_none() {
            let sge: Result<Sge, Error> = gather_sge(kind, &buf).and_then(|s| {
                if let Some(r) = remote {
                    r.check_fits(kind, s.length as usize)?;
                }
                Ok(s)
            });
            match sge {
                Ok(s) => self.wrs.push(one_wr(op, Some(s))),
                Err(e) => self.error = Some(e),
            }
        }
        self.kinds.push(kind);
        self.bufs.push(buf);
        self
    }

    /// Adds an RDMA WRITE of `buf`'s initialized bytes to the start of `remote`.
    pub fn write(self, buf: B, remote: RemoteBuf) -> Batch<B> {
        let op = SendOp::Write {
            remote_addr: remote.addr(),
            rkey: remote.rkey(),
        };
        self.push("write", buf, Some(remote), op)
    }

    /// Adds an RDMA WRITE with immediate.
    pub fn write_with_imm(self, buf: B, remote: RemoteBuf, imm: u32) -> Batch<B> {
        let op = SendOp::WriteWithImm {
            remote_addr: remote.addr(),
            rkey: remote.rkey(),
            imm,
        };
        self.push("write_with_imm", buf, Some(remote), op)
    }

    /// Adds a SEND of `buf`'s initialized bytes.
    pub fn send(self, buf: B) -> Batch<B> {
        self.push("send", buf, None, SendOp::Send)
    }

    /// Adds a SEND with immediate.
    pub fn send_with_imm(self, buf: B, imm: u32) -> Batch<B> {
        self.push("send_with_imm", buf, None, SendOp::SendWithImm { imm })
    }

    /// Posts the chain on `qp` with one doorbell. Resolves when the last WR
    /// completes (or the first failing one does), with every buffer in order.
    pub fn post(self, qp: &QueuePair) -> Submit<BatchVerb<B>> {
        let Batch {
            mut wrs,
            kinds,
            bufs,
            error,
        } = self;
        let error = error.or_else(|| {
            wrs.is_empty().then_some(Error::InvalidBatch {
                what: "empty batch",
            })
        });
        if let Some(e) = error {
            return Submit::ready((Err(e), bufs));
        }
        // Small payloads go INLINE, as for the single verbs.
        for wr in wrs.iter_mut() {
            wr.flags |= inline_flag(qp, &wr.op, wr.sg_list.first());
        }
        // The runtime takes each WR's SGE again from the buffer of the same
        // index once it owns `bufs`.
        qp.send_gather_chain(BatchVerb { bufs, kinds }, wrs)
    }
}

/// The in-flight batch: owns every buffer; resolves to `()`, or to the error
/// of the first WR that failed (named by its kind and index).
#[derive(Debug)]
pub struct BatchVerb<B> {
    bufs: Vec<B>,
    kinds: SmallVec<[&'static str; 4]>,
}

/// Position of a completion's WR in its op's chain (see `verbio_runtime::op`).
fn chain_index(id: u64) -> usize {
    ((id >> (wr_id::KEY_BITS + wr_id::GEN_BITS)) & ((1 << wr_id::INDEX_BITS) - 1)) as usize
}

impl<B: RegisteredBuf> GatherChainVerb for BatchVerb<B> {
    type Buf = B;
    fn gather_bufs(&self) -> &[B] {
        &self.bufs
    }
}

impl<B: RegisteredBuf> Completable for BatchVerb<B> {
    type Output = BufResult<(), Vec<B>, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        if c.status.is_success() {
            return (Ok(()), self.bufs);
        }
        let index = chain_index(c.wr_id);
        let op = self.kinds.get(index).copied().unwrap_or(OP);
        (
            Err(Error::BatchCompletion {
                index,
                op,
                qp_num: c.qp_num,
                wr_id: c.wr_id,
                status: c.status,
            }),
            self.bufs,
        )
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: OP, source }), self.bufs)
    }
}
