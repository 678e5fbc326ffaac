//! The op layer: `Op<T>`, an in-flight chain of work requests tracked by
//! wr_id in a preallocated slab (`OpTable`), the entries it holds on its
//! queues, and the wr_id codec. It knows nothing of queue pairs or of the
//! reactor: the reactor feeds `OpTable::complete_all` with completions, and
//! the QP layer inserts ops and hands them their entries.
//!
//! # wr_id layout
//!
//! ```text
//!  63   62     48 47          24 23           0
//! [ R | index   | generation    | slab key     ]
//! ```
//!
//! * `key` (24 bits): the op's slot in the reactor's slab.
//! * `generation` (24 bits, never 0): taken from a per-runtime counter when the
//!   slot is filled. A completion whose generation does not match the slot is
//!   stale (its op is gone, the slot was reused) and is ignored.
//! * `index` (14 bits): the WR's position in the op's chain. Only the last WR
//!   of a chain is signaled; a completion for an earlier index only happens on
//!   error (or flush) and is remembered until the last one arrives.
//! * `R` (bit 63): the reserved namespace, see [`wr_id`]. Such completions never
//!   touch the slab. Inside it, [`wr_id::INLINE`] ids belong to inline sends
//!   posted without an op (they name their QP and the entries they return).
//!
//! Files: `wr_id.rs` (the codec), `error.rs` ([`SubmitError`]), `entries.rs`
//! (entry pools and the `HeldEntries` an op holds), `table.rs` (`OpTable`),
//! `future.rs` ([`Op`]).

mod counters;
mod entries;
mod error;
mod future;
mod table;
pub mod wr_id;

pub(crate) use counters::Counters;
pub(crate) use entries::{QpEntries, QueueEntries, Ticket};
pub use error::SubmitError;
pub use future::Op;
pub(crate) use table::OpTable;

use crate::provider::Completion;

/// What an op turns into when its work completes: implemented by each verb.
///
/// The value owns everything the device may touch (buffers, MR handles) at
/// stable (heap) addresses; the runtime keeps it alive until the device is
/// done with it, even if the op future is dropped.
pub trait Completable: 'static {
    /// The op future's output, typically `(Result<..>, buffers)`.
    type Output;
    /// Called with the completion of the op: the first error completion of
    /// the chain if there was one, else the last (signaled) WR's completion.
    fn complete(self, completion: Completion) -> Self::Output;
    /// Called instead when the op could not be posted (nothing of it reached
    /// the device, or what did has been flushed).
    fn fail(self, error: SubmitError) -> Self::Output;
}

#[cfg(test)]
mod table_tests;
