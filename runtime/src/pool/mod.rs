//! [`Pool`]: verbio from any thread. A pool of runtime threads, each
//! running one [`Runtime`](crate::Runtime) as a thread-per-core program
//! would, and `Send` ways in: [`Pool::spawn`] runs a (possibly `!Send`)
//! future on a chosen thread and gives back a `Send` [`PoolJoinHandle`].
//! Higher layers (`verbio-ops`'s `RdmaHandle`) build `Send + Sync + Clone`
//! handles on the same two pieces:
//!
//! - [`mailbox()`]: a bounded queue per runtime thread (and per object
//!   living there), lock-free, woken through the reactor's own wake path
//!   (the executor's cross-thread queue and `mio::Waker`) once per burst of
//!   sends, not once per message;
//! - [`slot()`] / [`SlotCache`]: the completion slot an answer comes back
//!   in, with no lock and, recycled, no allocation per request;
//! - [`inbox()`]: the other way, a bounded queue a runtime thread fills
//!   ahead of demand (a connection's arriving messages) and any thread
//!   takes from without asking: a taker that finds an item never crosses
//!   to the runtime thread, one that waits is woken once.
//!
//! The runtimes may also be hosted on tokio's multi-thread runtime
//! instead of threads of their own (`PoolBuilder::host_on_tokio`, feature `tokio`): each
//! turned by a tokio task on whichever worker polls it, so that a handle's
//! request and answer stay on the asking worker.
//!
//! Placement is round-robin, by a key of the caller's, or on a named thread
//! ([`Placement`]). Shutdown ([`Pool::shutdown`], or dropping the pool) is
//! graceful: the threads stop taking work, run what was queued, give their
//! tasks a grace period to end, then drop their runtimes (which let posted
//! sends reach the peer and drain in-flight work). A runtime thread that
//! panics (see [`Pool::spawn`] for which panics end a thread) fails every
//! later call of its handles with [`PoolError::ThreadGone`], and every
//! request it held with an error: nothing waits forever.

mod builder;
#[cfg(feature = "tokio")]
mod hosted;
pub mod inbox;
mod join;
pub mod mailbox;
pub mod relay;
mod reply_wakes;
pub mod slot;
mod thread;

pub use builder::PoolBuilder;
pub use inbox::{inbox, Feeder, Inbox, InboxEnd, Waiting};
pub use join::PoolJoinHandle;
pub use mailbox::{mailbox, MailReceiver, MailSender, SendError};
pub use slot::{slot, Answer, Completer, Lost, SlotCache};
pub use thread::{ShutdownSignal, ThreadContext, ThreadRef};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread::JoinHandle as StdJoinHandle;

/// Which runtime thread of a [`Pool`] gets a task or an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The next thread in turn.
    RoundRobin,
    /// A thread chosen by hashing the key: equal keys share a thread.
    Key(u64),
    /// Thread number `n` (from 0).
    Thread(usize),
}

/// How a runtime thread ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadEnd {
    /// The pool was shut down.
    ShutDown,
    /// The thread panicked.
    Panicked,
}

impl std::fmt::Display for ThreadEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ThreadEnd::ShutDown => "the pool was shut down",
            ThreadEnd::Panicked => "the thread panicked",
        })
    }
}

/// Errors of a [`Pool`] and of the requests it carries.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The runtime thread is gone; nothing placed on it works any more.
    #[error("verbio pool thread {index} is gone: {end}")]
    ThreadGone {
        /// The thread's number.
        index: usize,
        /// How it ended.
        end: ThreadEnd,
    },
    /// The task running the request ended without an answer (it panicked;
    /// the panic is logged by the runtime thread, which goes on).
    #[error("the task on verbio pool thread {index} ended without an answer (it panicked)")]
    TaskFailed {
        /// The thread's number.
        index: usize,
    },
    /// [`Placement::Thread`] named a thread the pool does not have.
    #[error("the pool has no thread {index} (it has {threads})")]
    NoSuchThread {
        /// The number asked for.
        index: usize,
        /// How many threads the pool has.
        threads: usize,
    },
    /// A runtime thread could not be started.
    #[error("starting verbio pool thread {index}: {stage}")]
    Start {
        /// The thread's number.
        index: usize,
        /// What failed.
        stage: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The builder's settings cannot work.
    #[error("pool setting {setting}: {reason}")]
    Config {
        /// The setting.
        setting: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// A pool of runtime threads (see the [module docs](self)). `Send + Sync`;
/// dropping it shuts it down ([`Pool::shutdown`]).
pub struct Pool {
    threads: Vec<ThreadRef>,
    next: AtomicUsize,
    joins: Mutex<Vec<StdJoinHandle<()>>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads.len())
            .finish()
    }
}

impl Pool {
    /// A builder: thread count, CPU pinning, devices, runtime settings.
    pub fn builder() -> PoolBuilder {
        PoolBuilder::default()
    }

    /// The pool's threads, in order.
    pub fn threads(&self) -> &[ThreadRef] {
        &self.threads
    }

    /// The thread `placement` names.
    pub fn place(&self, placement: Placement) -> Result<&ThreadRef, PoolError> {
        let n = self.threads.len();
        let index = match placement {
            Placement::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % n,
            // Fibonacci hashing: nearby keys spread over the threads.
            Placement::Key(k) => {
                ((k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % n as u64) as usize
            }
            Placement::Thread(i) => i,
        };
        self.threads
            .get(index)
            .ok_or(PoolError::NoSuchThread { index, threads: n })
    }

    /// Runs `make`'s future on the thread `placement` names; the handle is
    /// a `Send` future of its output.
    ///
    /// `make` runs on that thread's loop, with the thread's
    /// [`ThreadContext`] (its device, its index), and returns a future that
    /// may be `!Send` (it uses `Rc`, verbio's QPs, ...), spawned there as a
    /// local task. A panic of that task ends the task only (the handle
    /// returns [`PoolError::TaskFailed`]); a panic of `make` itself, which
    /// runs in the loop's own frame, ends the thread, like a panic of a
    /// runtime's `block_on` future.
    pub fn spawn<F, Fut, T>(&self, placement: Placement, make: F) -> PoolJoinHandle<T>
    where
        F: FnOnce(&ThreadContext) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T> + 'static,
        T: Send + 'static,
    {
        match self.place(placement) {
            Ok(t) => t.spawn(make),
            Err(e) => PoolJoinHandle::failed(e),
        }
    }

    /// Stops the pool and waits for its threads: each takes no more work,
    /// runs what was queued, gives its tasks the builder's grace period to
    /// end, then drops its runtime (sends already posted reach the peer,
    /// in-flight work is drained within the runtime's drain timeout).
    /// Later calls of handles placed on the pool fail with
    /// [`PoolError::ThreadGone`]. Blocks the calling thread; calling it
    /// again does nothing. Returns how many threads had panicked. With
    /// `PoolBuilder::host_on_tokio` (feature `tokio`) it only starts the shutdown and
    /// returns 0: each hosted runtime ends on its own, within the grace
    /// period (or when its tokio runtime shuts down).
    pub fn shutdown(&self) -> usize {
        for t in &self.threads {
            t.close();
        }
        let joins = std::mem::take(&mut *self.joins.lock().unwrap_or_else(|p| p.into_inner()));
        joins
            .into_iter()
            .filter(|j| j.thread().id() != std::thread::current().id())
            .map(|j| j.join())
            .filter(Result::is_err)
            .count()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let panicked = self.shutdown();
        if panicked > 0 {
            tracing::warn!(
                panicked,
                "verbio pool shut down: some of its threads had panicked"
            );
        }
    }
}

/// Logs (debug) the tasks of runtime `index` (a `what`) still running
/// after the grace period of its shutdown: they are dropped with it.
fn note_tasks_dropped(what: &str, index: usize, rt: &crate::reactor::Runtime) {
    let tasks = rt.task_count();
    if tasks > 0 {
        tracing::debug!(
            index,
            tasks,
            "{what}: tasks still running after the grace period are dropped"
        );
    }
}

#[cfg(test)]
mod tests;
