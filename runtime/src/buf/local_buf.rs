//! [`LocalBuf`]: one block of registered memory from an [`MrPool`](super::MrPool).

use std::cell::RefCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::rc::Rc;

use super::error::BufError;
use super::io_buf::{IoBuf, IoBufMut, RegisteredBuf};
use super::pool::{FreeBlock, PoolInner};

/// An owned buffer of registered memory: `'static`, stable address, `!Send`.
///
/// Behaves like a fixed-capacity `Vec<u8>`: `len()` initialized bytes (what
/// `Deref` shows and a SEND transmits) out of `capacity()` (what a RECV may
/// fill). Dropping it returns the block to its pool (no allocation, no device
/// call) or, for a dedicated buffer, deregisters and frees it.
///
/// The memory is registered for local access only, so while safe code holds a
/// `LocalBuf` nothing else can write it: verbs take it by value for the
/// duration of a work request.
pub struct LocalBuf {
    /// # Invariant
    /// Points to `cap` bytes inside a registration with key `lkey`, alive as
    /// long as `pool` is (a pooled block's chunk, or a dedicated buffer's
    /// own registration, which the pool keeps until this buffer drops).
    ptr: NonNull<u8>,
    /// # Invariant
    /// `len <= cap`; the first `len` bytes are initialized (all bytes are:
    /// chunks are zeroed when allocated). `u32`s, as an SGE's length (the
    /// pool refuses larger buffers): every op moves its buffer several
    /// times, and four words move in two vector moves (six took three).
    len: u32,
    cap: u32,
    lkey: u32,
    /// The size class of a pooled block, [`DEDICATED`] for a buffer with
    /// its own registration (larger than the biggest class).
    class: u32,
    pool: Rc<RefCell<PoolInner>>,
}

/// [`LocalBuf::class`] of a dedicated buffer.
const DEDICATED: u32 = u32::MAX;

impl LocalBuf {
    /// A block of size class `class`, `cap` bytes (at most `u32::MAX`:
    /// the classes are far smaller).
    pub(crate) fn pooled(
        pool: Rc<RefCell<PoolInner>>,
        block: FreeBlock,
        cap: usize,
        class: usize,
    ) -> LocalBuf {
        debug_assert!(cap <= u32::MAX as usize);
        LocalBuf {
            ptr: block.ptr,
            len: 0,
            cap: cap as u32,
            lkey: block.lkey,
            // Size classes are powers of two indexed by shift (< 64).
            class: class as u32,
            pool,
        }
    }

    /// A dedicated buffer: `block` is the start of a registration of `cap`
    /// bytes (checked `<= u32::MAX` by the pool) that the pool keeps until
    /// this buffer drops.
    pub(crate) fn dedicated(pool: Rc<RefCell<PoolInner>>, block: FreeBlock, cap: u32) -> LocalBuf {
        LocalBuf {
            ptr: block.ptr,
            len: 0,
            cap,
            lkey: block.lkey,
            class: DEDICATED,
            pool,
        }
    }

    /// Initialized bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// True if no byte is initialized.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Capacity in bytes (the size-class block size, or the exact size of a
    /// dedicated buffer).
    pub fn capacity(&self) -> usize {
        self.cap as usize
    }
    /// Room left after the initialized bytes.
    pub fn remaining(&self) -> usize {
        (self.cap - self.len) as usize
    }
    /// True if it came from a size class, false for a dedicated registration.
    pub fn is_pooled(&self) -> bool {
        self.class != DEDICATED
    }

    /// The pool it came from (see [`MrPool::owns`](super::MrPool::owns)).
    pub(crate) fn pool_inner(&self) -> &Rc<RefCell<PoolInner>> {
        &self.pool
    }

    /// Forgets the contents (`len = 0`).
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Shortens to `len` bytes (no effect if already shorter).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len as usize {
            // Fits: less than a `u32`.
            self.len = len as u32;
        }
    }

    /// Appends `data`; fails (changing nothing) if it does not fit the capacity.
    pub fn extend_from_slice(&mut self, data: &[u8]) -> Result<(), BufError> {
        if data.len() > self.remaining() {
            return Err(BufError::OutOfBounds {
                what: "LocalBuf::extend_from_slice",
                start: self.len(),
                end: self.len().saturating_add(data.len()),
                len: self.capacity(),
            });
        }
        // SAFETY: `len + data.len() <= cap`: the destination is inside our
        // block, which `data` (a shared borrow of other memory, or of ours
        // only through `&self`, impossible with `&mut self`) does not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(self.len()),
                data.len(),
            );
        }
        // At most `cap`: a `u32`.
        self.len += data.len() as u32;
        Ok(())
    }

    /// Fails (`what`: the caller) if `new_len` exceeds the capacity.
    #[inline]
    fn check_len(&self, what: &'static str, new_len: usize) -> Result<(), BufError> {
        if new_len > self.capacity() {
            return Err(BufError::OutOfBounds {
                what,
                start: 0,
                end: new_len,
                len: self.capacity(),
            });
        }
        Ok(())
    }

    /// Sets the length to `new_len`, filling new bytes with `value`; fails if
    /// `new_len` exceeds the capacity.
    pub fn resize(&mut self, new_len: usize, value: u8) -> Result<(), BufError> {
        self.check_len("LocalBuf::resize", new_len)?;
        let len = self.len();
        if new_len > len {
            // SAFETY: `[len, new_len)` is inside the block.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(len), value, new_len - len) };
        }
        // At most `cap`: a `u32`.
        self.len = new_len as u32;
        Ok(())
    }

    /// Sets the length to `new_len` without writing. Every byte of a `LocalBuf`
    /// is initialized (chunks are zeroed once), so this only exposes whatever
    /// the block held before (a previous user's data, or what the device wrote).
    pub fn set_len(&mut self, new_len: usize) -> Result<(), BufError> {
        self.check_len("LocalBuf::set_len", new_len)?;
        // At most `cap`: a `u32`.
        self.len = new_len as u32;
        Ok(())
    }
}

impl Drop for LocalBuf {
    fn drop(&mut self) {
        // Never re-entered: pool methods do not drop `LocalBuf`s while borrowed,
        // and the pool is `!Send`. `try_borrow_mut` keeps this panic-free anyway
        // (a failure would only leak the block).
        let Ok(mut pool) = self.pool.try_borrow_mut() else {
            tracing::error!("MrPool busy while a LocalBuf was dropped: block leaked");
            return;
        };
        if self.class != DEDICATED {
            pool.give_back(
                self.class as usize,
                FreeBlock {
                    ptr: self.ptr,
                    lkey: self.lkey,
                },
            );
            return;
        }
        let raw = pool.dedicated_dropped(self.ptr);
        drop(pool);
        // Deregistered, then freed, with no borrow of the pool held.
        drop(raw);
    }
}

impl fmt::Debug for LocalBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("lkey", &self.lkey)
            .field("pooled", &self.is_pooled())
            .finish()
    }
}

impl Deref for LocalBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes inside our block are initialized; the block is
        // registered for local access only and owned by us, so nothing writes
        // it while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }
}

impl DerefMut for LocalBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `Deref`; `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }
}

// SAFETY: the block (a chunk's, or a dedicated registration the pool keeps
// until this buffer drops) lives as long as the pool, kept alive by
// `self.pool`, at a fixed address; `len` bytes are initialized; the memory is
// registered local-only.
unsafe impl IoBuf for LocalBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as for `IoBuf`; the block is writable.
unsafe impl IoBufMut for LocalBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        // At most `cap`: a `u32`.
        self.len = self.len.max(pos.min(self.capacity()) as u32);
    }
}

// SAFETY: `[ptr, ptr + cap)` lies in one chunk (or the dedicated region)
// registered with `LOCAL_WRITE` under `lkey`, registered while `self` lives.
unsafe impl RegisteredBuf for LocalBuf {
    fn lkey(&self) -> u32 {
        self.lkey
    }
}

#[cfg(test)]
mod tests {
    use super::super::registrar::fake::FakeRegistrar;
    use super::super::{MrPool, PoolConfig};
    use super::*;

    /// Every op moves its buffer several times (into the op, out with the
    /// output): it stays small.
    #[test]
    fn a_local_buf_is_four_words() {
        assert_eq!(std::mem::size_of::<LocalBuf>(), 32);
    }

    fn pool() -> MrPool {
        MrPool::from_registrar(Box::new(FakeRegistrar::default()), PoolConfig::default()).unwrap()
    }

    #[test]
    fn behaves_like_a_fixed_capacity_vec() {
        let pool = pool();
        let mut b = pool.alloc(10).unwrap();
        assert_eq!((b.len(), b.capacity()), (0, 64));
        b.extend_from_slice(b"hello").unwrap();
        assert_eq!(&b[..], b"hello");
        b[0] = b'j';
        assert_eq!(&b[..], b"jello");
        assert!(b.extend_from_slice(&[0; 60]).is_err());
        assert_eq!(b.len(), 5, "failed append changes nothing");
        b.resize(8, b'!').unwrap();
        assert_eq!(&b[..], b"jello!!!");
        b.truncate(2);
        assert_eq!(&b[..], b"je");
        assert!(b.resize(65, 0).is_err());
        b.set_len(5).unwrap();
        assert_eq!(&b[..], b"jello", "set_len re-exposes the block's bytes");
        assert!(b.set_len(65).is_err());
        b.clear();
        assert!(b.is_empty());
    }

    #[test]
    fn io_buf_impl_and_sges() {
        let pool = pool();
        let mut b = pool.alloc_from(b"abcdef").unwrap();
        let p = b.stable_ptr();
        let moved = vec![b];
        b = moved.into_iter().next().unwrap();
        assert_eq!(b.stable_ptr(), p, "moving does not move the bytes");
        assert_eq!((b.bytes_init(), b.bytes_total()), (6, 64));
        let sge = b.sge_init().unwrap();
        assert_eq!((sge.addr, sge.length, sge.lkey), (p as u64, 6, b.lkey()));
        assert_eq!(b.sge_total().unwrap().length, 64);
        // SAFETY: writes inside the capacity then declares the bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(b"XYZ".as_ptr(), b.stable_mut_ptr().add(6), 3);
            b.set_init(9);
            b.set_init(1000); // clamped to the capacity
        }
        assert_eq!(b.len(), 64);
        assert_eq!(&b[..9], b"abcdefXYZ");
    }

    #[test]
    fn slices_keep_ownership_and_registration() {
        let pool = pool();
        let b = pool.alloc_from(b"0123456789").unwrap();
        let lkey = b.lkey();
        let base = b.stable_ptr() as u64;
        let s = b.slice(2..6).unwrap();
        assert_eq!(&s[..], b"2345");
        assert_eq!(s.lkey(), lkey);
        let sge = s.sge(1..3).unwrap();
        assert_eq!((sge.addr, sge.length), (base + 3, 2));
        assert!(s.sge(0..5).is_err());
        let r = s.into_inner().slice(60..70).unwrap_err();
        assert!(matches!(r.error, BufError::OutOfBounds { len: 64, .. }));
        let b = r.into_inner();
        assert_eq!(&b[..], b"0123456789");
        assert_eq!(pool.stats().blocks_in_use, 1);
        drop(b);
        assert_eq!(pool.stats().blocks_in_use, 0);
    }
}
