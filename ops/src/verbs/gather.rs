//! The one in-flight type of the single-buffer gathering verbs (SEND, SEND
//! to a UD peer, SEND with immediate or invalidate, WRITE, WRITE with
//! immediate): it owns the buffer the device reads and resolves to what
//! the verb returns. The verbs differ only in their work request, their
//! checks before the post and their name, so each is a [`GatherKind`]
//! marker and its in-flight type a [`Gathering`] alias ([`SendVerb`],
//! [`WriteVerb`], ...).
//!
//! [`SendVerb`]: super::SendVerb
//! [`WriteVerb`]: super::WriteVerb

use std::fmt;
use std::marker::PhantomData;

use verbio_runtime::buf::{BufResult, RegisteredBuf};
use verbio_runtime::provider::{Completion, SendOp};
use verbio_runtime::{Completable, GatherVerb, QueuePair, Submit, SubmitError};

use super::{check, gather_sge, refuse, submit_gather};
use crate::error::Error;

mod sealed {
    pub trait Sealed {}
}

/// What tells the gathering verbs apart once posted: the name errors carry
/// and what a successful one resolves to. Implemented by this module's
/// markers only.
pub trait GatherKind: sealed::Sealed + 'static {
    /// The verb's name in its errors.
    const OP: &'static str;
    /// What the verb resolves to: the bytes sent for the SENDs, `()` for
    /// the WRITEs.
    type Out: fmt::Debug;
    /// The output of the verb that gathers `len` bytes.
    fn out(len: usize) -> Self::Out;
    /// The verb's result from its checked completion.
    #[inline(always)]
    fn output(checked: Result<(), Error>, out: Self::Out) -> Result<Self::Out, Error> {
        checked.map(|()| out)
    }
}

/// An in-flight gathering verb of kind `K`: owns the buffer; resolves to
/// `K::Out` with the buffer.
pub struct Gathering<B, K: GatherKind> {
    buf: B,
    out: K::Out,
    kind: PhantomData<K>,
}

impl<B: fmt::Debug, K: GatherKind> fmt::Debug for Gathering<B, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gathering")
            .field("op", &K::OP)
            .field("buf", &self.buf)
            .field("out", &self.out)
            .finish()
    }
}

impl<B: RegisteredBuf, K: GatherKind> GatherVerb for Gathering<B, K> {
    type Buf = B;
    fn gather_buf(&self) -> &B {
        &self.buf
    }
}

impl<B: RegisteredBuf, K: GatherKind> Completable for Gathering<B, K> {
    type Output = BufResult<K::Out, B, Error>;
    fn complete(self, c: Completion) -> Self::Output {
        (K::output(check(K::OP, &c), self.out), self.buf)
    }
    fn fail(self, source: SubmitError) -> Self::Output {
        (Err(Error::Submit { op: K::OP, source }), self.buf)
    }
}

/// Submits the gathering verb `K` of `buf`'s initialized bytes as the WR
/// `op` makes, once `fits` accepts their length; a buffer without an SGE
/// or a length `fits` refuses comes back at once with the error.
#[inline(always)]
pub(crate) fn post_gather<K: GatherKind, B: RegisteredBuf>(
    qp: &QueuePair,
    buf: B,
    fits: impl FnOnce(usize) -> Result<(), Error>,
    op: impl FnOnce() -> SendOp,
) -> Submit<Gathering<B, K>> {
    let sge = match gather_sge(K::OP, &buf).and_then(|s| {
        fits(s.length as usize)?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => return refuse(e, buf),
    };
    let data = Gathering {
        buf,
        out: K::out(sge.length as usize),
        kind: PhantomData,
    };
    submit_gather(qp, data, op(), &sge)
}

/// Declares the marker of one gathering verb: a SEND resolves to the
/// bytes sent, a WRITE to `()`.
macro_rules! kind {
    ($(#[$doc:meta])* $name:ident, $op:literal) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub enum $name {}
        impl sealed::Sealed for $name {}
    };
    ($(#[$doc:meta])* $name:ident, $op:literal, sends) => {
        kind!($(#[$doc])* $name, $op);
        impl GatherKind for $name {
            const OP: &'static str = $op;
            type Out = usize;
            #[inline(always)]
            fn out(len: usize) -> usize {
                len
            }
        }
    };
    ($(#[$doc:meta])* $name:ident, $op:literal, writes) => {
        kind!($(#[$doc])* $name, $op);
        impl GatherKind for $name {
            const OP: &'static str = $op;
            type Out = ();
            #[inline(always)]
            fn out(_: usize) {}
            #[inline(always)]
            fn output(checked: Result<(), Error>, (): ()) -> Result<(), Error> {
                checked
            }
        }
    };
}

kind!(
    /// SEND ([`send`](super::send::send)): resolves to the bytes sent.
    SendKind, "send", sends
);
kind!(
    /// SEND to a UD peer ([`send_to`](super::send_to::send_to)): resolves
    /// to the bytes sent.
    SendToKind, "send_to", sends
);
kind!(
    /// SEND with immediate ([`send_with_imm`](super::send_with_imm::send_with_imm)):
    /// resolves to the bytes sent.
    SendWithImmKind, "send_with_imm", sends
);
kind!(
    /// SEND with invalidate ([`send_with_inv`](super::mw::send_with_inv)):
    /// resolves to the bytes sent.
    SendWithInvKind, "send_with_inv", sends
);
kind!(
    /// RDMA WRITE ([`write`](super::write::write)): resolves to `()`.
    WriteKind, "write", writes
);
kind!(
    /// RDMA WRITE with immediate ([`write_with_imm`](super::write_with_imm::write_with_imm)):
    /// resolves to `()`.
    WriteWithImmKind, "write_with_imm", writes
);
