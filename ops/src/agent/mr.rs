//! Memory regions of the high-level API: [`LocalMr`] (own registered
//! memory, local access only) and [`RemoteMr`] (a peer's grant, by token).

use std::ops::{Bound, Deref, DerefMut, RangeBounds};
use std::rc::{Rc, Weak};
use tracing::Instrument;

use verbio_runtime::buf::LocalBuf;
use verbio_runtime::provider::AccessFlags;
use verbio_runtime::Handle;

use super::rdma::Shared;
use super::wire::{Message, MrToken};
use crate::verbs::RemoteBuf;

/// Own registered memory for local use (RDMA READ/WRITE source and target,
/// SEND payload); never accessible to a peer while it is a `LocalMr`. Owned
/// by value through every operation.
///
/// Its [`access`](LocalMr::access) is what a peer gets when the region is
/// handed over with [`Rdma::send_local_mr`](super::Rdma::send_local_mr)
/// (the grant is registered with exactly that access, capped by the
/// builder's `max_access`).
#[derive(Debug)]
pub struct LocalMr {
    pub(crate) buf: LocalBuf,
    pub(crate) access: AccessFlags,
}

impl LocalMr {
    /// The remote access a peer gets if this region is handed over.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// True if empty.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The bytes in `range`, `None` if out of bounds.
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<&[u8]> {
        let (s, e) = bounds(range, self.len())?;
        self.buf.get(s..e)
    }

    /// The bytes in `range`, writable; `None` if out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<&mut [u8]> {
        let (s, e) = bounds(range, self.len())?;
        self.buf.get_mut(s..e)
    }

    /// The underlying pool buffer.
    pub fn into_buf(self) -> LocalBuf {
        self.buf
    }
}

impl Deref for LocalMr {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for LocalMr {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

/// `[start, end)` of `range` within `len`, `None` if out of bounds.
pub(crate) fn bounds(range: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let s = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let e = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (s <= e && e <= len).then_some((s, e))
}

/// What the holder of a peer's grant must do when it lets go of it.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) token: MrToken,
    pub(crate) conn: Weak<Shared>,
    /// Set when the grant was handed back or released explicitly.
    pub(crate) done: std::cell::Cell<bool>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.done.get() {
            return;
        }
        // Dropped without hand-back: tell the owner to revoke it.
        let (Some(shared), Some(h)) = (self.conn.upgrade(), Handle::try_current()) else {
            return;
        };
        if shared.is_down() {
            return;
        }
        let id = self.token.token_id;
        let span = shared.span.clone();
        h.spawn(
            async move {
                let _ = shared
                    .send_message(&Message::Release { token_id: id }, true)
                    .await;
            }
            .instrument(span),
        );
    }
}

/// A region of the peer's memory this side may access, by token; views made
/// with [`RemoteMr::get`] share the grant. When the last view is dropped the
/// owner is told to revoke it (or use [`Rdma::release`](super::Rdma::release)
/// / [`Rdma::send_remote_mr`](super::Rdma::send_remote_mr)).
#[derive(Debug, Clone)]
pub struct RemoteMr {
    pub(crate) held: Rc<Held>,
    pub(crate) off: u64,
    pub(crate) len: u64,
}

impl RemoteMr {
    pub(crate) fn new(token: MrToken, conn: Weak<Shared>) -> RemoteMr {
        RemoteMr {
            off: 0,
            len: token.len,
            held: Rc::new(Held {
                token,
                conn,
                done: std::cell::Cell::new(false),
            }),
        }
    }

    /// The whole grant's token.
    pub fn token(&self) -> &MrToken {
        &self.held.token
    }

    /// Length of this view in bytes: a `usize`, as [`LocalMr::len`],
    /// [`Rdma::alloc_local_mr`](super::Rdma::alloc_local_mr) and
    /// [`get`](RemoteMr::get) count (the verbs descriptor,
    /// [`remote_buf`](RemoteMr::remote_buf), carries it as the wire's
    /// `u64`).
    pub fn len(&self) -> usize {
        // The peer's grant is memory of a 64-bit Linux host: it fits.
        usize::try_from(self.len).unwrap_or(usize::MAX)
    }

    /// True if the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Access the owner granted.
    pub fn access(&self) -> AccessFlags {
        AccessFlags::from_bits_truncate(self.held.token.access)
    }

    /// A view of `range` (relative to this view); `None` if out of bounds.
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<RemoteMr> {
        let (s, e) = bounds(range, usize::try_from(self.len).ok()?)?;
        Some(RemoteMr {
            held: self.held.clone(),
            off: self.off + s as u64,
            len: (e - s) as u64,
        })
    }

    /// The verbs descriptor of this view.
    pub fn remote_buf(&self) -> RemoteBuf {
        // Decoded tokens cannot wrap (the codec refuses them); a token from
        // the test hook may, and the device refuses the wrapped address.
        RemoteBuf::new(
            self.held.token.addr.wrapping_add(self.off),
            self.len,
            self.held.token.rkey,
        )
    }
}
