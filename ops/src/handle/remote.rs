//! [`RemoteMrHandle`]: a peer's grant, kept on the connection's runtime
//! thread and named from any thread.

use std::sync::Arc;

use super::rdma::ConnShared;
use super::serve::Request;

/// A region of the peer's memory this side may READ and WRITE through
/// [`RdmaHandle::read`](super::RdmaHandle::read) /
/// [`write`](super::RdmaHandle::write) of the connection that requested
/// it. `Send + Sync + Clone`; when its last clone (and the last request
/// using it) is gone, the grant is released (the owner is told to revoke
/// it).
#[derive(Clone)]
pub struct RemoteMrHandle {
    pub(super) entry: Arc<RemoteEntry>,
}

impl std::fmt::Debug for RemoteMrHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteMrHandle")
            .field("len", &self.entry.len)
            .finish_non_exhaustive()
    }
}

impl RemoteMrHandle {
    /// Length of the region in bytes (a `usize`, as
    /// [`RemoteMr::len`](crate::agent::RemoteMr::len)).
    pub fn len(&self) -> usize {
        usize::try_from(self.entry.len).unwrap_or(usize::MAX)
    }

    /// True if the region is empty.
    pub fn is_empty(&self) -> bool {
        self.entry.len == 0
    }
}

/// The grant's entry in its connection's table (`id`, never reused: a
/// late release of a grant handed back cannot hit another), released when
/// the last holder goes.
pub(super) struct RemoteEntry {
    pub(super) conn: Arc<ConnShared>,
    pub(super) id: u64,
    pub(super) len: u64,
}

impl Drop for RemoteEntry {
    fn drop(&mut self) {
        // A full queue keeps the grant until the connection ends (bounded
        // by the connection's life).
        if self
            .conn
            .tx
            .try_send(Request::Release { id: self.id })
            .is_err()
        {
            tracing::debug!(
                id = self.id,
                "remote MR handle dropped: its release could not be queued; the grant lives until the connection ends"
            );
        }
    }
}
