//! Calls into a connection from outside its tasks, for a caller that
//! holds the connection's runtime without being one of its tasks (a
//! handle on a runtime hosted on tokio, `crate::handle`): what it can do
//! at once, or `None` when the usual (awaited) call is needed.

use super::error::AgentError;
use super::rdma::Rdma;

impl Rdma {
    /// Sends `data` (with `imm`) now if it goes as one INLINE piece with a
    /// credit at hand and nothing queued ahead of it (done when posted:
    /// the bytes are copied into the work request); `None` (nothing done)
    /// otherwise, for [`Rdma::send`].
    #[inline]
    pub(crate) fn try_send_now(
        &self,
        data: &[u8],
        imm: Option<u32>,
    ) -> Option<Result<(), AgentError>> {
        self.shared.try_send_whole(data, imm)
    }
}
