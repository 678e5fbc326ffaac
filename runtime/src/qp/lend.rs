//! The safe submission entries: a verb whose op data owns the buffers its
//! work requests name implements [`GatherVerb`] or [`ScatterVerb`], and the
//! runtime takes each SGE from the data itself, once it owns the data (the
//! model of tokio-uring's `io/read.rs`). Verbs built this way need no
//! `unsafe`: the obligation of [`QueuePair::submit_send`] is met here, once,
//! by the contracts of the unsafe buffer traits ([`RegisteredBuf`]: a stable
//! address and a registration covering it; [`IoBufMut`]: exclusive access).

use super::submit::OneWr;
use super::{QueuePair, SendChain, Submit};
use crate::buf::{IoBufMut, RegisteredBuf};
use crate::op::{Completable, SubmitError};
use crate::provider::{SendFlags, SendOp, Sge};

/// A verb whose op data owns the buffer its one work request gathers from
/// (the device reads it: SEND, WRITE and their `_WITH_IMM` forms).
pub trait GatherVerb: Completable {
    /// The buffer type.
    type Buf: RegisteredBuf;
    /// The buffer whose initialized bytes the WR sends, owned by `self`.
    fn gather_buf(&self) -> &Self::Buf;
}

/// A verb whose op data owns the buffer its one work request scatters into
/// (the device writes it: READ, the atomics, RECV).
pub trait ScatterVerb: Completable {
    /// The buffer type.
    type Buf: RegisteredBuf + IoBufMut;
    /// The buffer the device writes, owned by `self`.
    fn scatter_buf(&mut self) -> &mut Self::Buf;
    /// How many bytes from the buffer's start the device may write.
    fn scatter_len(&self) -> usize;
}

/// A verb whose op data owns one buffer per work request of a chain, each
/// gathered from (WR `i` sends `gather_bufs()[i]`).
pub trait GatherChainVerb: Completable {
    /// The buffer type.
    type Buf: RegisteredBuf;
    /// The buffers, in the chain's order.
    fn gather_bufs(&self) -> &[Self::Buf];
}

/// Opcodes whose SGEs the device only reads.
#[inline(always)]
fn gathers(op: &SendOp) -> bool {
    matches!(
        op,
        SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::SendWithInv { .. }
            | SendOp::SendTo { .. }
            | SendOp::Write { .. }
            | SendOp::WriteWithImm { .. }
    )
}

/// A bind names a window and a region that must outlive it: only
/// [`QueuePair::bind_window`] submits one.
#[inline(always)]
fn binds(op: &SendOp) -> bool {
    matches!(op, SendOp::BindMw { .. })
}

/// `flags` a verb may choose: INLINE, FENCE, SOLICITED (SIGNALED is the
/// runtime's).
#[inline(always)]
fn verb_flags(flags: SendFlags) -> SendFlags {
    flags.intersection(SendFlags::INLINE | SendFlags::FENCE | SendFlags::SOLICITED)
}

#[cold]
fn not_gathering(op: &SendOp) -> SubmitError {
    SubmitError::Invalid {
        what: format!("{op:?} writes local memory: submit it with send_scatter"),
    }
}

#[cold]
fn not_scattering(op: &SendOp) -> SubmitError {
    SubmitError::Invalid {
        what: format!("{op:?} does not write local memory: submit it with send_gather"),
    }
}

impl QueuePair {
    /// Submits one send-queue WR `op` (a SEND or WRITE form) that gathers
    /// the initialized bytes of `data`'s buffer ([`GatherVerb::gather_buf`]),
    /// with `flags` (INLINE, FENCE, SOLICITED). A zero-length buffer posts
    /// no SGE. As [`submit_send_one`](Self::submit_send_one) otherwise.
    #[inline(always)]
    pub fn send_gather<T: GatherVerb>(&self, data: T, op: SendOp, flags: SendFlags) -> Submit<T> {
        if !gathers(&op) {
            return Submit::ready(data.fail(not_gathering(&op)));
        }
        let sge = match data.gather_buf().sge_init() {
            Ok(sge) => sge,
            Err(e) => return Submit::ready(data.fail(SubmitError::from(e))),
        };
        let wr = OneWr {
            op,
            sge: (sge.length > 0).then_some(sge),
            flags: verb_flags(flags),
        };
        // SAFETY: the only SGE is taken from `data`'s own buffer;
        // `RegisteredBuf` guarantees its address survives the move of
        // `data` into the op, and the device only reads it (a gathering
        // opcode, checked), which shared access allows.
        unsafe { self.submit_one(data, wr) }
    }

    /// Submits one send-queue WR `op` (a READ or an atomic) that scatters
    /// into the first [`scatter_len`](ScatterVerb::scatter_len) bytes of
    /// `data`'s buffer.
    #[inline(always)]
    pub fn send_scatter<T: ScatterVerb>(&self, data: T, op: SendOp) -> Submit<T> {
        let mut data = data;
        if gathers(&op) || binds(&op) {
            return Submit::ready(data.fail(not_scattering(&op)));
        }
        let len = data.scatter_len();
        let sge = match data.scatter_buf().sge(..len) {
            Ok(sge) => sge,
            Err(e) => return Submit::ready(data.fail(SubmitError::from(e))),
        };
        let wr = OneWr {
            op,
            sge: (sge.length > 0).then_some(sge),
            flags: SendFlags::NONE,
        };
        // SAFETY: the only SGE is taken from `data`'s own buffer, which
        // `IoBufMut` gives `data` exclusive access to, at an address that
        // survives the move of `data` into the op.
        unsafe { self.submit_one(data, wr) }
    }

    /// Submits one receive WR over the first
    /// [`scatter_len`](ScatterVerb::scatter_len) bytes of `data`'s buffer.
    #[inline(always)]
    pub fn recv_scatter<T: ScatterVerb>(&self, data: T) -> Submit<T> {
        // SAFETY: as for `send_scatter`: an exclusively owned buffer of
        // `data`, at an address that survives the move.
        unsafe {
            self.submit_recv(data, |data, sg_list| {
                let len = data.scatter_len();
                let sge = data.scatter_buf().sge(..len).map_err(SubmitError::from)?;
                if sge.length > 0 {
                    sg_list.push(sge);
                }
                Ok(())
            })
        }
    }

    /// Submits one send-queue WR `op` that names no local memory (e.g. a
    /// zero-length WRITE_WITH_IMM, a LOCAL_INV); a window bind is refused
    /// (see [`bind_window`](Self::bind_window)).
    pub fn send_without_memory<T: Completable>(&self, data: T, op: SendOp) -> Submit<T> {
        // SAFETY: the WR has no SGE: it lends no memory to the device.
        unsafe {
            self.submit_send_one(data, move |_, wr| {
                if binds(&op) {
                    return Err(SubmitError::Invalid {
                        what: "a window bind: submit it with bind_window".into(),
                    });
                }
                wr.op = op;
                Ok(())
            })
        }
    }

    /// Submits one receive WR with no scatter list.
    pub fn recv_without_memory<T: Completable>(&self, data: T) -> Submit<T> {
        // SAFETY: no scatter list: the device writes no local memory.
        unsafe { self.submit_recv(data, |_, _| Ok(())) }
    }

    /// Submits `wrs` as one chain (one doorbell): each WR (a SEND or WRITE
    /// form) gathers the buffer of the same index in
    /// [`gather_bufs`](GatherChainVerb::gather_bufs); the runtime sets
    /// every SGE, wr_id and the SIGNALED flag.
    pub fn send_gather_chain<T: GatherChainVerb>(&self, data: T, wrs: SendChain) -> Submit<T> {
        // SAFETY: every SGE is taken from one of `data`'s own buffers inside
        // the build closure (stable addresses by `RegisteredBuf`), for
        // gathering opcodes only (checked): the device only reads them.
        unsafe {
            self.submit_send(data, move |data, chain| {
                let bufs = data.gather_bufs();
                if bufs.len() != wrs.len() {
                    return Err(SubmitError::Invalid {
                        what: format!("a chain of {} WRs over {} buffers", wrs.len(), bufs.len()),
                    });
                }
                *chain = wrs;
                for (wr, buf) in chain.iter_mut().zip(bufs) {
                    if !gathers(&wr.op) {
                        return Err(not_gathering(&wr.op));
                    }
                    let sge: Sge = buf.sge_init().map_err(SubmitError::from)?;
                    wr.sg_list.clear();
                    if sge.length > 0 {
                        wr.sg_list.push(sge);
                    }
                    wr.flags = verb_flags(wr.flags);
                }
                Ok(())
            })
        }
    }
}
