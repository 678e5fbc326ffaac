//! Message buffers recycled through a per-endpoint pool.

use std::cell::RefCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::rc::Rc;

/// Buffers kept by the pool at most.
const POOL_MAX: usize = 1024;
/// Larger buffers are freed rather than kept.
const KEEP_MAX_CAPACITY: usize = 1 << 20;
/// Bytes (of capacity) an endpoint's message pool keeps at most: what
/// traffic of large messages leaves behind once it stopped.
pub const POOL_MAX_BYTES: usize = 8 << 20;

#[derive(Default)]
struct Pool {
    bufs: Vec<Vec<u8>>,
    /// Capacity of `bufs`, in bytes.
    bytes: usize,
}

/// A pool of byte buffers (single-threaded, shared by clones).
#[derive(Clone, Default)]
pub(crate) struct BufPool(Rc<RefCell<Pool>>);

impl BufPool {
    /// An empty buffer, reused when the pool has one.
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut pool = self.0.borrow_mut();
        let buf = pool.bufs.pop().unwrap_or_default();
        pool.bytes -= buf.capacity();
        buf
    }

    /// Gives `buf` back (emptied).
    pub(crate) fn put(&self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap == 0 || cap > KEEP_MAX_CAPACITY {
            return;
        }
        let mut pool = self.0.borrow_mut();
        if pool.bufs.len() < POOL_MAX && pool.bytes + cap <= POOL_MAX_BYTES {
            buf.clear();
            pool.bytes += cap;
            pool.bufs.push(buf);
        }
    }

    /// Bytes the pool keeps.
    pub(crate) fn bytes(&self) -> usize {
        self.0.borrow().bytes
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
    /// The bytes, taken out of the pool's reach.
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
