//! Registered buffers and memory regions (DESIGN section 5).
//!
//! Every verb takes its buffers **by value** and gives them back with the
//! result ([`BufResult`]): while a work request is in flight the device may
//! read or write the memory at any time, so no Rust reference to it may exist.
//! Owning the buffer is how the type system models "the device has it".
//!
//! - [`IoBuf`] / [`IoBufMut`]: a buffer with a stable address (moving the value
//!   does not move the bytes), implemented for `Vec<u8>`, `Box<[u8]>`,
//!   `&'static [u8]`, [`LocalBuf`], [`RegisteredMem`] and [`Slice`].
//! - [`RegisteredBuf`]: an [`IoBuf`] whose memory is registered, so a verb can
//!   build its scatter/gather element ([`Sge`](crate::provider::Sge)) without
//!   registering per operation.
//! - [`MrPool`]: registers large chunks once and carves them into power-of-two
//!   size classes; [`LocalBuf`] is one block, returned to its pool on drop.
//! - [`RegisteredMem`]: the user's own memory registered zero-copy for local
//!   use; [`RegisteredMem::into_inner`] deregisters before giving it back.
//! - [`RemoteAccessRegion`]: memory a peer may access, with its own
//!   exact-bounds registration and minimal access flags; only copying
//!   accessors while live, plain slices again after [`RemoteAccessRegion::revoke`].
//!
//! # The soundness rule
//!
//! Memory that a peer may still **write** (or run atomics on) is never visible
//! to safe code as `&[u8]` / `&mut [u8]`. Pool chunks and [`RegisteredMem`] are
//! registered for local access only (`LOCAL_WRITE`), so their rkeys give a peer
//! nothing even if guessed; every grant to a peer is a separate
//! [`RemoteAccessRegion`] whose registration is dropped (the rkey fails at once,
//! per the provider contract) before the memory is handed back as slices.

mod error;
mod io_buf;
mod local_buf;
mod pool;
mod region;
mod registrar;
mod size_class;
mod slice;
mod user_mr;
mod window;

pub use error::{BufError, Rejected};
pub use io_buf::{IoBuf, IoBufMut, RegisteredBuf};
pub use local_buf::LocalBuf;
pub use pool::{MrPool, PoolConfig, PoolStats};
pub use region::RemoteAccessRegion;
pub use slice::Slice;
pub use user_mr::RegisteredMem;
pub(crate) use window::binding as window_binding;
pub use window::Window;

/// The result of an operation that owned buffers: the outcome and the buffers,
/// returned whether the operation succeeded or not (io_uring style).
pub type BufResult<T, B, E = crate::provider::ProviderError> = (Result<T, E>, B);
