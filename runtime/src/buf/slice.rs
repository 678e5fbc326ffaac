//! [`Slice`]: an owned view of part of a buffer.

use std::ops::{Deref, DerefMut};

use super::io_buf::{IoBuf, IoBufMut, RegisteredBuf};

/// Owns a buffer and restricts operations to `begin..end` of its capacity.
/// Made by [`IoBuf::slice`]; [`Slice::into_inner`] gives the whole buffer back.
///
/// As a buffer, the slice starts at `begin`: its `bytes_total()` is
/// `end - begin` and its initialized bytes are those of the inner buffer that
/// fall inside the range. `Deref` shows those initialized bytes.
#[derive(Debug)]
pub struct Slice<B> {
    buf: B,
    /// # Invariant
    /// `begin <= end <= buf.bytes_total()`.
    begin: usize,
    end: usize,
}

impl<B: IoBuf> Slice<B> {
    /// Callers guarantee `begin <= end <= buf.bytes_total()`.
    pub(crate) fn new(buf: B, begin: usize, end: usize) -> Self {
        debug_assert!(begin <= end && end <= buf.bytes_total());
        Slice { buf, begin, end }
    }

    /// Offset of the slice's start in the inner buffer.
    pub fn begin(&self) -> usize {
        self.begin
    }
    /// Offset of the slice's end (exclusive) in the inner buffer.
    pub fn end(&self) -> usize {
        self.end
    }
    /// The inner buffer.
    pub fn get_ref(&self) -> &B {
        &self.buf
    }
    /// The inner buffer, mutably. Changing its capacity breaks nothing (the
    /// range is clamped), but a growing `Vec` would move: do not do that while
    /// the slice is being used for I/O (it cannot be: an op owns it then).
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.buf
    }
    /// Gives the whole inner buffer back.
    pub fn into_inner(self) -> B {
        self.buf
    }

    fn total(&self) -> usize {
        // Clamped in case the inner buffer was changed through `get_mut`.
        let cap = self.buf.bytes_total();
        self.end.min(cap).saturating_sub(self.begin)
    }
}

// SAFETY: the pointer is the inner buffer's stable pointer plus `begin`, which
// stays inside its capacity (clamped in `total`); the initialized part is the
// inner initialized part intersected with the range.
unsafe impl<B: IoBuf> IoBuf for Slice<B> {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr().wrapping_add(self.begin)
    }
    fn bytes_init(&self) -> usize {
        self.buf
            .bytes_init()
            .saturating_sub(self.begin)
            .min(self.total())
    }
    fn bytes_total(&self) -> usize {
        self.total()
    }
}

// SAFETY: as for `IoBuf`; `set_init` forwards an offset inside the range.
unsafe impl<B: IoBufMut> IoBufMut for Slice<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.stable_mut_ptr().wrapping_add(self.begin)
    }
    unsafe fn set_init(&mut self, pos: usize) {
        let pos = pos.min(self.total());
        // The inner buffer's bytes before `begin` must already be initialized
        // for its init count to cover `begin + pos` (a Vec cannot have holes).
        if self.buf.bytes_init() >= self.begin {
            // SAFETY: the caller guarantees the slice's first `pos` bytes are
            // initialized; with the inner bytes up to `begin` initialized too,
            // the first `begin + pos` inner bytes are, and they are within
            // the inner capacity.
            unsafe { self.buf.set_init(self.begin + pos) };
        }
    }
}

// SAFETY: a sub-range of a registered buffer lies inside the same registration.
unsafe impl<B: RegisteredBuf> RegisteredBuf for Slice<B> {
    fn lkey(&self) -> u32 {
        self.buf.lkey()
    }
}

impl<B: IoBuf> Deref for Slice<B> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `IoBuf` guarantees the initialized bytes are readable and not
        // written by anyone else while we hold the value; `bytes_init` counts
        // only initialized bytes inside the range.
        unsafe { std::slice::from_raw_parts(self.stable_ptr(), self.bytes_init()) }
    }
}

impl<B: IoBufMut> DerefMut for Slice<B> {
    fn deref_mut(&mut self) -> &mut [u8] {
        let n = self.bytes_init();
        // SAFETY: as for `Deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.stable_mut_ptr(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_views_and_gives_back() {
        let v: Vec<u8> = (0..10).collect();
        let mut s = v.slice(3..7).unwrap();
        assert_eq!((s.begin(), s.end()), (3, 7));
        assert_eq!(&s[..], &[3, 4, 5, 6]);
        assert_eq!(s.bytes_total(), 4);
        s[0] = 99;
        let v = s.into_inner();
        assert_eq!(v[3], 99);
        assert_eq!(v.len(), 10);
    }

    #[test]
    fn slice_of_uninitialized_tail() {
        let mut v = Vec::with_capacity(16);
        v.extend_from_slice(&[1u8, 2, 3, 4]);
        let mut s = v.slice(2..12).unwrap();
        assert_eq!(&s[..], &[3, 4]);
        assert_eq!(s.bytes_total(), 10);
        // SAFETY: 6 bytes from the slice start lie in the Vec's capacity.
        unsafe {
            std::ptr::write_bytes(s.stable_mut_ptr(), 9, 6);
            s.set_init(6);
        }
        assert_eq!(&s[..], &[9, 9, 9, 9, 9, 9]);
        let v = s.into_inner();
        assert_eq!(v, [1, 2, 9, 9, 9, 9, 9, 9]);
    }

    #[test]
    fn slice_past_init_does_not_claim_holes() {
        let mut v = Vec::with_capacity(16);
        v.push(1u8);
        let mut s = v.slice(4..8).unwrap();
        assert_eq!(s.bytes_init(), 0);
        // The inner Vec has only 1 initialized byte, so bytes 1..4 would be a
        // hole: set_init must not extend the Vec.
        // SAFETY: writes inside the capacity.
        unsafe {
            std::ptr::write_bytes(s.stable_mut_ptr(), 5, 4);
            s.set_init(4);
        }
        assert_eq!(s.into_inner().len(), 1);
    }

    #[test]
    fn nested_slices_and_empty_ranges() {
        let v: Vec<u8> = (0..10).collect();
        let s = v.slice(2..8).unwrap().slice(1..3).unwrap();
        assert_eq!(&s[..], &[3, 4]);
        let v = s.into_inner().into_inner();
        let e = v.slice(10..).unwrap();
        assert!(e.is_empty());
        let v = e.into_inner();
        assert!(v.slice(11..).is_err());
    }
}
