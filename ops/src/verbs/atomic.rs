//! The two atomics on a 64-bit word in the peer's memory: compare-and-swap
//! and fetch-and-add. Both return the word's original value in an 8-byte
//! local buffer, so they share one in-flight type, [`AtomicVerb`].

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, QueuePair, ScatterVerb, Submit, SubmitError};

use super::{check, check_scatter, mark_written, refuse, RemoteBuf};
use crate::error::Error;

const CAS: &str = "compare_and_swap";
const FAA: &str = "fetch_and_add";

/// An in-flight atomic: owns the 8-byte result buffer; resolves to the
/// word's original value (for compare-and-swap, the swap happened iff it
/// equals `compare`).
#[derive(Debug)]
pub struct AtomicVerb<B> {
    buf: B,
    /// The verb's name, for errors.
    op: &'static str,
}

impl<B: RegisteredBuf + IoBufMut> ScatterVerb for AtomicVerb<B> {
    type Buf = B;
    fn scatter_buf(&mut self) -> &mut B {
        &mut self.buf
    }
    fn scatter_len(&self) -> usize {
        8
    }
}

impl<B: RegisteredBuf + IoBufMut> Completable for AtomicVerb<B> {
    type Output = BufResult<u64, B, Error>;
    fn complete(mut self, c: Completion) -> Self::Output {
        let r = check(self.op, &c).map(|()| result(&mut self.buf));
        (r, self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        let op = self.op;
        (Err(Error::Submit { op, source }), self.buf)
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
) -> Submit<AtomicVerb<B>> {
    let op = SendOp::CompareAndSwap {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        compare,
        swap,
    };
    submit(qp, CAS, buf, &remote, op)
}

/// Adds `add` (wrapping) to the word at `remote`; returns the original value
/// (see [`Verbs::fetch_and_add`](super::Verbs::fetch_and_add)).
#[inline]
pub fn fetch_and_add<B: RegisteredBuf + IoBufMut>(
    qp: &QueuePair,
    buf: B,
    remote: RemoteBuf,
    add: u64,
) -> Submit<AtomicVerb<B>> {
    let op = SendOp::FetchAndAdd {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        add,
    };
    submit(qp, FAA, buf, &remote, op)
}

/// Checks the target and the buffer, then posts `op` into `buf[..8]`.
#[inline]
fn submit<B: RegisteredBuf + IoBufMut>(
    qp: &QueuePair,
    name: &'static str,
    buf: B,
    remote: &RemoteBuf,
    op: SendOp,
) -> Submit<AtomicVerb<B>> {
    if let Err(e) = target(name, remote).and_then(|()| check_scatter(name, &buf, 8)) {
        return refuse(e, buf);
    }
    qp.send_scatter(AtomicVerb { buf, op: name }, op)
}

/// The 8-byte value an atomic left in `buf[..8]` (native byte order, like
/// rxe and the soft device), after marking it initialized.
fn result<B: IoBufMut>(buf: &mut B) -> u64 {
    mark_written(buf, 8);
    // SAFETY: the atomic's scatter list was `buf[..8]` (checked at submit:
    // capacity >= 8) and the successful completion says the device wrote it;
    // we own `buf`, so no one else writes it now. Unaligned read: the local
    // buffer needs no alignment.
    unsafe { std::ptr::read_unaligned(buf.stable_ptr() as *const u64) }
}

/// Checks an atomic's remote target: exactly 8 bytes, 8-byte aligned (rxe
/// refuses a misaligned atomic at post time; catch it with a clear error).
fn target(op: &'static str, remote: &RemoteBuf) -> Result<(), Error> {
    if remote.len() != 8 || remote.addr() & 7 != 0 {
        return Err(Error::BadAtomicTarget {
            op,
            addr: remote.addr(),
            len: remote.len(),
        });
    }
    Ok(())
}
