//! Calls a handle makes itself, on the asking thread, when its connection
//! lives on a runtime hosted on tokio
//! ([`PoolBuilder::host_on_tokio`](verbio_runtime::pool::PoolBuilder::host_on_tokio))
//! that the asking thread may hold at the moment
//! ([`ThreadRef::run_hosted`]): no request in the mailbox, no task of the
//! runtime and no completion slot between the asker and the connection.
//! Only calls that finish at once go this way (a small send with a credit
//! at hand); the others, and every call that finds the runtime held
//! elsewhere, take the usual way.

use std::sync::atomic::{AtomicBool, Ordering};

use verbio_runtime::pool::ThreadRef;

use super::serve::Server;

/// The connection's server, reached from the handles while they hold its
/// runtime.
pub(super) struct DirectServer {
    /// The server, while `alive`.
    server: *const Server,
    /// Cleared by the server's drop (on its runtime, which the clearing
    /// thread holds).
    alive: AtomicBool,
}

// SAFETY: `server` is dereferenced only in `run`, inside
// `ThreadRef::run_hosted` (the runtime it lives on held by the calling
// thread and entered there, as for its own tasks) and only while `alive`,
// which the server's drop clears on that runtime, under the same hold: the
// holds are ordered (the runtime's lock), so a thread that finds `alive`
// set reaches a live server and nothing else touches it meanwhile. The
// rest is an atomic.
unsafe impl Send for DirectServer {}
// SAFETY: as for `Send`: shared references only read `alive` outside a
// hold.
unsafe impl Sync for DirectServer {}

impl DirectServer {
    /// For the server at `server` (an `Rc`'s pointer; the server clears
    /// [`gone`](Self::gone) when dropped).
    pub(super) fn new(server: *const Server) -> DirectServer {
        DirectServer {
            server,
            alive: AtomicBool::new(true),
        }
    }

    /// The server is dropped: no more direct calls.
    pub(super) fn gone(&self) {
        self.alive.store(false, Ordering::Relaxed);
    }

    /// Runs `f` with the server on the calling thread if the runtime can
    /// be held here (see [`ThreadRef::run_hosted`]) and the server lives;
    /// `None` otherwise.
    pub(super) fn run<R: Send>(
        &self,
        thread: &ThreadRef,
        f: impl FnOnce(&Server) -> R + Send,
    ) -> Option<R> {
        thread
            .run_hosted(|| {
                // (The hold orders this load after the server's drop.)
                if !self.alive.load(Ordering::Relaxed) {
                    return None;
                }
                // SAFETY: the runtime the server lives on is held by this
                // thread and `alive` says the server is not dropped (see
                // the `Send` impl); the reference does not leave `f`.
                let server = unsafe { &*self.server };
                Some(f(server))
            })
            .flatten()
    }
}
