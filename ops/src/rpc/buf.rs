//! Message buffers recycled through a per-endpoint pool.
//!
//! Two lists: buffers of up to [`KEEP_MAX_CAPACITY`] (1 MiB), at most
//! [`POOL_MAX_BYTES`] of them, and larger ones (messages above 1 MiB, when
//! `max_msg_len` allows them), bounded by the endpoint's request memory
//! ([`RpcConfig::request_memory`](super::RpcConfig::request_memory)). A
//! buffer for a message of known length ([`BufPool::take_for`]) is one
//! already large enough when the pool has one, so a stream of large
//! messages reuses the same memory instead of allocating (and
//! page-faulting) a fresh buffer per message.

use std::cell::RefCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::rc::Rc;

/// Small buffers kept by the pool at most.
const POOL_MAX: usize = 1024;
/// Larger buffers go to the large list (or are freed).
pub(crate) const KEEP_MAX_CAPACITY: usize = 1 << 20;
/// From this length on, [`BufPool::take_for`] looks for a buffer that is
/// large enough instead of taking the last one given back.
const FIT_MIN: usize = 4096;
/// Small buffers [`BufPool::take_for`] looks at for one large enough.
const FIT_SCAN: usize = 64;
/// Bytes (of capacity) of buffers up to 1 MiB an endpoint's message pool
/// keeps at most: what traffic of messages leaves behind once it stopped.
/// Buffers above 1 MiB are kept apart, up to the endpoint's
/// [`RpcConfig::request_memory`](super::RpcConfig::request_memory).
pub const POOL_MAX_BYTES: usize = 8 << 20;

#[derive(Default)]
struct Pool {
    /// Buffers of up to `KEEP_MAX_CAPACITY`.
    bufs: Vec<Vec<u8>>,
    /// Capacity of `bufs`, in bytes.
    bytes: usize,
    /// Buffers above `KEEP_MAX_CAPACITY`.
    large: Vec<Vec<u8>>,
    /// Capacity of `large`, in bytes.
    large_bytes: usize,
    /// Bound of `large_bytes` (0: no large buffer is kept).
    large_max_bytes: usize,
}

/// A pool of byte buffers (single-threaded, shared by clones).
#[derive(Clone, Default)]
pub(crate) struct BufPool(Rc<RefCell<Pool>>);

impl BufPool {
    /// A pool that also keeps buffers above 1 MiB, up to `large_max_bytes`
    /// of them.
    pub(crate) fn new(large_max_bytes: usize) -> BufPool {
        BufPool(Rc::new(RefCell::new(Pool {
            large_max_bytes,
            ..Pool::default()
        })))
    }

    /// An empty buffer, reused when the pool has one.
    #[inline]
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut pool = self.0.borrow_mut();
        let buf = pool.bufs.pop().unwrap_or_default();
        pool.bytes -= buf.capacity();
        buf
    }

    /// An empty buffer with room for `len` bytes: one the pool keeps if it
    /// has one large enough (the smallest such above 1 MiB), else a new
    /// one.
    #[inline]
    pub(crate) fn take_for(&self, len: usize) -> Vec<u8> {
        if len < FIT_MIN {
            let mut buf = self.take();
            buf.reserve(len);
            return buf;
        }
        self.take_fit(len)
    }

    /// [`take_for`](Self::take_for) of `len` from [`FIT_MIN`] on.
    #[inline(never)]
    fn take_fit(&self, len: usize) -> Vec<u8> {
        let mut pool = self.0.borrow_mut();
        let found = if len > KEEP_MAX_CAPACITY {
            let best = (pool.large.iter().enumerate())
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(k, _)| k);
            best.map(|k| {
                let buf = pool.large.swap_remove(k);
                pool.large_bytes -= buf.capacity();
                buf
            })
        } else {
            let fit = (pool.bufs.iter().enumerate().rev())
                .take(FIT_SCAN)
                .find(|(_, b)| b.capacity() >= len)
                .map(|(k, _)| k);
            fit.map(|k| {
                let buf = pool.bufs.swap_remove(k);
                pool.bytes -= buf.capacity();
                buf
            })
        };
        found.unwrap_or_else(|| Vec::with_capacity(len))
    }

    /// Gives `buf` back (emptied). Inline always (whichever codegen unit
    /// the drop of a `MsgBuf` lands in): called for every message
    /// dropped (a small call drops two), where a call's register saves
    /// were half its cost.
    #[inline(always)]
    pub(crate) fn put(&self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap == 0 {
            return;
        }
        let mut pool = self.0.borrow_mut();
        if cap > KEEP_MAX_CAPACITY {
            if pool.large_bytes + cap <= pool.large_max_bytes {
                buf.clear();
                pool.large_bytes += cap;
                pool.large.push(buf);
            }
            return;
        }
        if pool.bufs.len() < POOL_MAX && pool.bytes + cap <= POOL_MAX_BYTES {
            buf.clear();
            pool.bytes += cap;
            pool.bufs.push(buf);
        }
    }

    /// Bytes the pool keeps.
    pub(crate) fn bytes(&self) -> usize {
        let pool = self.0.borrow();
        pool.bytes + pool.large_bytes
    }

    /// `buf` as a message that returns to this pool when dropped.
    pub(crate) fn msg(&self, buf: Vec<u8>) -> MsgBuf {
        MsgBuf {
            buf,
            pool: Some(self.clone()),
        }
    }
}
/// A message: the response of a call, or the response a handler fills.
/// Dereferences to a `Vec<u8>`; when dropped, its memory goes back to the
/// endpoint's pool for the next message.
pub struct MsgBuf {
    buf: Vec<u8>,
    pool: Option<BufPool>,
}

impl MsgBuf {
    /// The pool it returns to, if it has one.
    #[inline]
    pub(crate) fn pool(&self) -> Option<&BufPool> {
        self.pool.as_ref()
    }

    /// The bytes, taken out of the pool's reach. Inline: the drop that
    /// follows then folds away (no pool, an empty vector).
    #[inline]
    pub fn into_vec(mut self) -> Vec<u8> {
        self.pool = None;
        std::mem::take(&mut self.buf)
    }
}

impl From<Vec<u8>> for MsgBuf {
    /// A message of `buf` (not from a pool).
    fn from(buf: Vec<u8>) -> MsgBuf {
        MsgBuf { buf, pool: None }
    }
}

impl Deref for MsgBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl DerefMut for MsgBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

impl Drop for MsgBuf {
    #[inline]
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.put(std::mem::take(&mut self.buf));
        }
    }
}

impl fmt::Debug for MsgBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MsgBuf")
            .field("len", &self.buf.len())
            .finish()
    }
}
