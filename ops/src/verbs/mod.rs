//! Every verb as an owned-buffer op on a [`QueuePair`] (DESIGN sections 4 and 6).
//!
//! Each verb takes its local buffer **by value** and hands it back with the
//! outcome, as a [`BufResult`]: while the work request is in flight the
//! device may read or write the memory, so nothing else may hold it. The
//! returned future is the runtime's [`Submit`]: it waits for send/receive
//! queue and CQ credits if the queues are full (it never overruns them),
//! then for the completion. Dropping it after the post parks the buffer in
//! the reactor until the device is done with it (completion or flush).
//!
//! ```no_run
//! # async fn demo(qp: &verbio_runtime::QueuePair, pool: &verbio_runtime::buf::MrPool,
//! #               remote: verbio_ops::verbs::RemoteBuf) -> verbio_ops::Result<()> {
//! use verbio_ops::verbs::Verbs;
//! let buf = pool.alloc_from(b"hello").expect("pool");
//! let (res, buf) = qp.write(buf, remote.slice(0..5)?).await;
//! res?;
//! let (res, _buf) = qp.send(buf).await;
//! assert_eq!(res?, 5);
//! # Ok(()) }
//! ```
//!
//! Local buffers are any [`RegisteredBuf`] (a pool [`LocalBuf`](verbio_runtime::buf::LocalBuf),
//! [`RegisteredMem`](verbio_runtime::buf::RegisteredMem), or a [`Slice`](verbio_runtime::buf::Slice)
//! of one); remote targets are [`RemoteBuf`] descriptors with bounds-checked sub-ranges.
//! Gathering verbs (send, write) transmit the buffer's initialized bytes;
//! scattering verbs (recv, read, atomics) fill from the start of its capacity
//! and mark what the device wrote as initialized.

pub mod atomic;
pub mod batch;
pub mod gather;
pub mod mw;
pub mod read;
pub mod recv;
mod remote;
pub mod send;
pub mod send_inline;
pub mod send_to;
pub mod send_with_imm;
pub mod write;
pub mod write_with_imm;

pub use atomic::AtomicVerb;
pub use batch::{Batch, BatchVerb};
pub use gather::{GatherKind, Gathering};
pub use mw::{BindMwVerb, LocalInvVerb, SendWithInvVerb};
pub use read::ReadVerb;
pub use recv::{Received, RecvEmptyVerb, RecvVerb};
pub use remote::RemoteBuf;
pub use send::SendVerb;
pub use send_inline::SendInlineVerb;
pub use send_to::SendToVerb;
pub use send_with_imm::SendWithImmVerb;
pub use write::WriteVerb;
pub use write_with_imm::WriteWithImmVerb;

use std::ops::Range;
use std::rc::Rc;

use verbio_runtime::buf::{BufResult, IoBufMut, RegisteredBuf, RemoteAccessRegion, Window};
use verbio_runtime::provider::{AccessFlags, Completion, SendFlags, SendOp, SendWr, SgList, Sge};
use verbio_runtime::{Bind, Completable, GatherVerb, Invalidate, QueuePair, Submit, UdPeer};

use crate::error::Error;

/// The verbs as methods of [`QueuePair`]. Every method returns at once with
/// a future; the WR is posted before it returns when the queues have room,
/// or, for the single-WR verbs called from a task (or the `block_on`
/// future), at the end of the runtime's poll phase, with the other WRs the
/// phase's tasks submitted in one post list (see
/// [`QueuePair::submit_send_one`]).
///
/// # Example
///
/// Two RC queue pairs connected over the TCP handshake on a software
/// device: the client WRITEs into memory the server granted, then SENDs
/// to say so. Each verb takes its buffer and hands it back with the result.
///
/// ```
/// # mod verbio { pub use verbio_ops::*; pub mod ops { pub use verbio_ops::*; } pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use std::time::Duration;
/// use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
/// use verbio::ops::verbs::{RemoteBuf, Verbs};
/// use verbio::provider::{AccessFlags, Context, SoftConfig};
/// use verbio::runtime::buf::{MrPool, RemoteAccessRegion};
/// use verbio::runtime::{Device, Runtime};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?;
/// let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
/// let qps = DeviceQps::new(dev.clone(), QpConfig::default());
/// let wait = Duration::from_secs(10); // each handshake is bounded
/// rt.block_on(async {
///     let listener = Listener::bind("127.0.0.1:0".parse()?, qps.clone(), wait)?;
///     let addr = listener.local_addr()?;
///     let (server, client) = futures::join!(listener.accept(), connect(addr, &qps, wait));
///     let (server, client) = (server?.qp, client?.qp);
///     let pool = MrPool::new(dev.pd());
///
///     // The server grants 4 KiB for remote WRITE; a real server sends
///     // this descriptor (address, length, rkey) to its peer.
///     let region = RemoteAccessRegion::grant(dev.pd(), vec![0u8; 4096], AccessFlags::REMOTE_WRITE)
///         .map_err(|rejected| rejected.error)?;
///     let target = RemoteBuf::from(&region);
///     let inbox = server.recv(pool.alloc(64)?); // posted before the SEND
///
///     let (res, _buf) = client.write(pool.alloc_from(b"written")?, target.slice(0..7)?).await;
///     res?;
///     let (res, _buf) = client.send(pool.alloc_from(b"done")?).await;
///     assert_eq!(res?, 4); // bytes sent
///
///     let (res, buf) = inbox.await;
///     assert_eq!(&buf[..res?.len], b"done");
///     assert_eq!(&region.to_vec()[..7], b"written"); // RC delivers in order
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok(())
/// # }
/// ```
pub trait Verbs {
    /// SEND of `buf`'s initialized bytes; resolves to the number of bytes sent.
    fn send<B: RegisteredBuf>(&self, buf: B) -> Submit<SendVerb<B>>;
    /// SEND with 32-bit immediate data; resolves to the number of bytes sent.
    fn send_with_imm<B: RegisteredBuf>(&self, buf: B, imm: u32) -> Submit<SendWithImmVerb<B>>;
    /// SEND of `data` (at most the QP's `max_inline_data` bytes), copied
    /// INLINE when posted: resolves once posted, not when complete, and
    /// mostly unsignaled (see [`QueuePair::post_send_inline`]). An error
    /// completion of it is reported by the QP's later submissions.
    fn send_inline<'a>(&'a self, data: &'a [u8]) -> SendInlineVerb<'a>;
    /// [`send_inline`](Self::send_inline) with 32-bit immediate data.
    fn send_inline_with_imm<'a>(&'a self, data: &'a [u8], imm: u32) -> SendInlineVerb<'a>;
    /// UD: sends `buf`'s initialized bytes to `peer` as one datagram (at
    /// most the path MTU); resolves to the number of bytes sent once the
    /// datagram has left (UD neither acknowledges nor retries).
    fn send_to<B: RegisteredBuf>(&self, peer: &UdPeer, buf: B) -> Submit<SendToVerb<B>>;
    /// [`send_to`](Self::send_to) with 32-bit immediate data.
    fn send_to_with_imm<B: RegisteredBuf>(
        &self,
        peer: &UdPeer,
        buf: B,
        imm: u32,
    ) -> Submit<SendToVerb<B>>;
    /// Posts a RECV over `buf`'s whole capacity; resolves to what arrived.
    /// On UD the first [`GRH_LEN`](verbio_runtime::provider::GRH_LEN)
    /// bytes receive the GRH (a [`RecvRing`](verbio_runtime::RecvRing)
    /// separates it from the payload).
    fn recv<B: RegisteredBuf + IoBufMut>(&self, buf: B) -> Submit<RecvVerb<B>>;
    /// Posts a RECV without a buffer: for WRITE_WITH_IMM notifications and
    /// zero-length SENDs (a SEND with payload fails with `LOC_LEN_ERR`).
    fn recv_empty(&self) -> Submit<RecvEmptyVerb>;
    /// RDMA WRITE of `buf`'s initialized bytes to the start of `remote`.
    fn write<B: RegisteredBuf>(&self, buf: B, remote: RemoteBuf) -> Submit<WriteVerb<B>>;
    /// RDMA WRITE with immediate: consumes a RECV at the peer, which gets `imm`.
    fn write_with_imm<B: RegisteredBuf>(
        &self,
        buf: B,
        remote: RemoteBuf,
        imm: u32,
    ) -> Submit<WriteWithImmVerb<B>>;
    /// RDMA READ of all of `remote` into the start of `buf`.
    fn read<B: RegisteredBuf + IoBufMut>(&self, buf: B, remote: RemoteBuf) -> Submit<ReadVerb<B>>;
    /// 64-bit compare-and-swap on `remote` (8 bytes, 8-byte aligned); the
    /// original value lands in `buf[..8]` and is the result.
    fn compare_and_swap<B: RegisteredBuf + IoBufMut>(
        &self,
        buf: B,
        remote: RemoteBuf,
        compare: u64,
        swap: u64,
    ) -> Submit<AtomicVerb<B>>;
    /// 64-bit fetch-and-add on `remote` (8 bytes, 8-byte aligned); the
    /// original value lands in `buf[..8]` and is the result.
    fn fetch_and_add<B: RegisteredBuf + IoBufMut>(
        &self,
        buf: B,
        remote: RemoteBuf,
        add: u64,
    ) -> Submit<AtomicVerb<B>>;
    /// Posts `batch` as one chain (one doorbell, only the last WR signaled).
    fn post_batch<B: RegisteredBuf>(&self, batch: Batch<B>) -> Submit<BatchVerb<B>>;
    /// Binds `window` (unbound) over `range` of `region` (a
    /// [`RemoteAccessRegion::bindable`](verbio_runtime::buf::RemoteAccessRegion::bindable)
    /// one) with `access`; resolves to the [`RemoteBuf`] this QP's peer
    /// uses, and the window (which holds the region until invalidated).
    /// See [`QueuePair::bind_window`].
    fn bind_mw<R: IoBufMut>(
        &self,
        window: Window<R>,
        region: Rc<RemoteAccessRegion<R>>,
        range: Range<usize>,
        access: AccessFlags,
    ) -> Submit<Bind<BindMwVerb<R>>>;
    /// Invalidates `window`'s binding (LOCAL_INV): once resolved, its rkey
    /// fails and the window is unbound. See [`QueuePair::invalidate_window`].
    fn local_inv<R: IoBufMut>(&self, window: Window<R>) -> Submit<Invalidate<LocalInvVerb<R>>>;
    /// SEND of `buf`'s initialized bytes that also invalidates the peer's
    /// window `rkey` before the peer's receive completes; resolves to the
    /// number of bytes sent.
    fn send_with_inv<B: RegisteredBuf>(&self, buf: B, rkey: u32) -> Submit<SendWithInvVerb<B>>;
}

impl Verbs for QueuePair {
    #[inline]
    fn send<B: RegisteredBuf>(&self, buf: B) -> Submit<SendVerb<B>> {
        send::send(self, buf)
    }
    #[inline]
    fn send_with_imm<B: RegisteredBuf>(&self, buf: B, imm: u32) -> Submit<SendWithImmVerb<B>> {
        send_with_imm::send_with_imm(self, buf, imm)
    }
    #[inline]
    fn send_inline<'a>(&'a self, data: &'a [u8]) -> SendInlineVerb<'a> {
        send_inline::send_inline(self, data)
    }
    #[inline]
    fn send_inline_with_imm<'a>(&'a self, data: &'a [u8], imm: u32) -> SendInlineVerb<'a> {
        send_inline::send_inline_with_imm(self, data, imm)
    }
    #[inline]
    fn send_to<B: RegisteredBuf>(&self, peer: &UdPeer, buf: B) -> Submit<SendToVerb<B>> {
        send_to::send_to(self, peer, buf, None)
    }
    #[inline]
    fn send_to_with_imm<B: RegisteredBuf>(
        &self,
        peer: &UdPeer,
        buf: B,
        imm: u32,
    ) -> Submit<SendToVerb<B>> {
        send_to::send_to(self, peer, buf, Some(imm))
    }
    #[inline]
    fn recv<B: RegisteredBuf + IoBufMut>(&self, buf: B) -> Submit<RecvVerb<B>> {
        recv::recv(self, buf)
    }
    #[inline]
    fn recv_empty(&self) -> Submit<RecvEmptyVerb> {
        recv::recv_empty(self)
    }
    #[inline]
    fn write<B: RegisteredBuf>(&self, buf: B, remote: RemoteBuf) -> Submit<WriteVerb<B>> {
        write::write(self, buf, remote)
    }
    #[inline]
    fn write_with_imm<B: RegisteredBuf>(
        &self,
        buf: B,
        remote: RemoteBuf,
        imm: u32,
    ) -> Submit<WriteWithImmVerb<B>> {
        write_with_imm::write_with_imm(self, buf, remote, imm)
    }
    #[inline]
    fn read<B: RegisteredBuf + IoBufMut>(&self, buf: B, remote: RemoteBuf) -> Submit<ReadVerb<B>> {
        read::read(self, buf, remote)
    }
    #[inline]
    fn compare_and_swap<B: RegisteredBuf + IoBufMut>(
        &self,
        buf: B,
        remote: RemoteBuf,
        compare: u64,
        swap: u64,
    ) -> Submit<AtomicVerb<B>> {
        atomic::compare_and_swap(self, buf, remote, compare, swap)
    }
    #[inline]
    fn fetch_and_add<B: RegisteredBuf + IoBufMut>(
        &self,
        buf: B,
        remote: RemoteBuf,
        add: u64,
    ) -> Submit<AtomicVerb<B>> {
        atomic::fetch_and_add(self, buf, remote, add)
    }
    #[inline]
    fn post_batch<B: RegisteredBuf>(&self, batch: Batch<B>) -> Submit<BatchVerb<B>> {
        batch.post(self)
    }
    #[inline]
    fn bind_mw<R: IoBufMut>(
        &self,
        window: Window<R>,
        region: Rc<RemoteAccessRegion<R>>,
        range: Range<usize>,
        access: AccessFlags,
    ) -> Submit<Bind<BindMwVerb<R>>> {
        mw::bind_mw(self, window, region, range, access)
    }
    #[inline]
    fn local_inv<R: IoBufMut>(&self, window: Window<R>) -> Submit<Invalidate<LocalInvVerb<R>>> {
        mw::local_inv(self, window)
    }
    #[inline]
    fn send_with_inv<B: RegisteredBuf>(&self, buf: B, rkey: u32) -> Submit<SendWithInvVerb<B>> {
        mw::send_with_inv(self, buf, rkey)
    }
}

/// `Ok` for a successful completion, else the error naming `op`, QP, WR and status.
pub(crate) fn check(op: &'static str, c: &Completion) -> Result<(), Error> {
    if c.status.is_success() {
        Ok(())
    } else {
        Err(Error::Completion {
            op,
            qp_num: c.qp_num,
            wr_id: c.wr_id,
            status: c.status,
            vendor_err: c.vendor_err,
        })
    }
}

/// One send-queue WR with at most one SGE (none for an empty gather).
pub(crate) fn one_wr(op: SendOp, sge: Option<Sge>) -> SendWr {
    let mut sg_list = SgList::new();
    if let Some(s) = sge.filter(|s| s.length > 0) {
        sg_list.push(s);
    }
    SendWr {
        wr_id: 0, // set by the runtime
        sg_list,
        op,
        flags: SendFlags::NONE, // the runtime signals the last WR of a chain
    }
}

/// [`SendFlags::INLINE`] if `op` gathers its payload from `sge` (SEND and
/// WRITE, with or without immediate) and that payload is non-empty and fits
/// the QP's `max_inline_data`: the device then copies it at post time, which
/// saves it a DMA read of the buffer (latency of small messages, as
/// perftest's inline sends). Else no flag.
pub(crate) fn inline_flag(qp: &QueuePair, op: &SendOp, sge: Option<&Sge>) -> SendFlags {
    let gathers = matches!(
        op,
        SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::SendTo { .. }
            | SendOp::Write { .. }
            | SendOp::WriteWithImm { .. }
    );
    match sge {
        Some(s) if gathers && s.length > 0 && s.length <= qp.caps().max_inline_data => {
            SendFlags::INLINE
        }
        _ => SendFlags::NONE,
    }
}

/// Submits a single-WR gathering op (SEND, WRITE) whose data owns the
/// buffer `sge` was validated from; the runtime takes the SGE from that
/// buffer again once it owns the data. A small payload goes INLINE (see
/// [`inline_flag`]).
#[inline(always)]
pub(crate) fn submit_gather<T: GatherVerb>(
    qp: &QueuePair,
    data: T,
    op: SendOp,
    sge: &Sge,
) -> Submit<T> {
    let flags = inline_flag(qp, &op, Some(sge));
    qp.send_gather(data, op, flags)
}

/// A submission that failed validation: the buffer comes back at once.
pub(crate) fn refuse<T, R, B>(error: Error, buf: B) -> Submit<T>
where
    T: Completable<Output = BufResult<R, B, Error>>,
{
    Submit::ready((Err(error), buf))
}

/// The SGE of `buf`'s initialized bytes (what a gathering verb transmits).
pub(crate) fn gather_sge<B: RegisteredBuf>(op: &'static str, buf: &B) -> Result<Sge, Error> {
    buf.sge_init().map_err(|source| Error::Buf { op, source })
}

/// Checks that `buf[..len]` (where a scattering verb writes) fits the
/// buffer and makes an SGE, so that a bad buffer fails with the verb's name
/// before the submission takes it.
pub(crate) fn check_scatter<B: RegisteredBuf>(
    op: &'static str,
    buf: &B,
    len: usize,
) -> Result<(), Error> {
    let have = buf.bytes_total();
    if have < len {
        return Err(Error::BufferTooSmall {
            op,
            need: len,
            have,
        });
    }
    buf.sge(0..len)
        .map(drop)
        .map_err(|source| Error::Buf { op, source })
}

/// Marks `buf[..len]` initialized after the device wrote it (clamped to capacity).
pub(crate) fn mark_written<B: IoBufMut>(buf: &mut B, len: usize) {
    let len = len.min(buf.bytes_total());
    // SAFETY: the completion reports that the device wrote the first `len`
    // bytes (clamped to the capacity it was given), so they are initialized.
    unsafe { buf.set_init(len) };
}

#[cfg(test)]
mod tests;
