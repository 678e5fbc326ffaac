//! The buffer traits: [`IoBuf`], [`IoBufMut`] and [`RegisteredBuf`].

use std::ops::RangeBounds;

use super::error::{resolve_range, BufError, Rejected};
use super::slice::Slice;
use crate::provider::Sge;

/// A buffer that can be handed to the device by value.
///
/// # Safety
///
/// Implementors promise that:
/// - `stable_ptr()` points to at least `bytes_total()` bytes that stay
///   allocated, at the same address, for as long as the value lives, even when
///   the value is moved (heap memory, `'static` data, a pool block);
/// - the first `bytes_init()` bytes are initialized, `bytes_init() <= bytes_total()`;
/// - while safe code holds the value (it is not owned by an in-flight work
///   request), nothing else writes the memory: no device, no peer. Shared
///   slices of the initialized bytes ([`Slice`]'s `Deref`) rely on this, which
///   is why memory a peer may write ([`RemoteAccessRegion`](super::RemoteAccessRegion))
///   does **not** implement this trait.
pub unsafe trait IoBuf: Unpin + 'static {
    /// Start of the memory. Stable across moves of `self`.
    fn stable_ptr(&self) -> *const u8;

    /// Number of initialized bytes (what a SEND or WRITE would transmit).
    fn bytes_init(&self) -> usize;

    /// Total capacity in bytes (what a RECV or READ may fill).
    fn bytes_total(&self) -> usize;

    /// Takes ownership and restricts it to `range` of the capacity. A range that
    /// does not fit `0..bytes_total()` is refused and the buffer given back.
    fn slice(self, range: impl RangeBounds<usize>) -> Result<Slice<Self>, Rejected<Self>>
    where
        Self: Sized,
    {
        match resolve_range("slice", range, self.bytes_total()) {
            Ok((begin, end)) => Ok(Slice::new(self, begin, end)),
            Err(e) => Err(Rejected::new(e, self)),
        }
    }

    /// Takes ownership as a slice over the whole capacity (never fails).
    fn slice_full(self) -> Slice<Self>
    where
        Self: Sized,
    {
        let end = self.bytes_total();
        Slice::new(self, 0, end)
    }
}

/// A buffer the device may write into (RECV, READ, atomics' results).
///
/// # Safety
///
/// Same as [`IoBuf`]; in addition `stable_mut_ptr()` returns the same address
/// as `stable_ptr()`, valid for writes of `bytes_total()` bytes.
pub unsafe trait IoBufMut: IoBuf {
    /// Start of the memory, for writes. Stable across moves of `self`.
    fn stable_mut_ptr(&mut self) -> *mut u8;

    /// Marks the first `pos` bytes as initialized, if that is more than now
    /// (it never shrinks the initialized part). Called after a completion
    /// reports how many bytes the device wrote.
    ///
    /// # Safety
    ///
    /// The first `pos` bytes must really be initialized and `pos <= bytes_total()`.
    unsafe fn set_init(&mut self, pos: usize);
}

/// An [`IoBuf`] whose memory lies inside a memory registration the caller's
/// protection domain knows, so a verb can describe it with an
/// [`Sge`](crate::provider::Sge) without registering per operation.
///
/// # Safety
///
/// `[stable_ptr(), stable_ptr() + bytes_total())` lies entirely inside one
/// registration with local key `lkey()`, registered with `LOCAL_WRITE`, that
/// stays registered as long as the value lives.
pub unsafe trait RegisteredBuf: IoBuf {
    /// Local key of the registration that contains the buffer.
    fn lkey(&self) -> u32;

    /// A scatter/gather element for `range` of the capacity.
    fn sge(&self, range: impl RangeBounds<usize>) -> Result<Sge, BufError>
    where
        Self: Sized,
    {
        let (begin, end) = resolve_range("sge", range, self.bytes_total())?;
        make_sge(self.stable_ptr(), begin, end - begin, self.lkey())
    }

    /// A scatter/gather element for the initialized bytes (what to send).
    fn sge_init(&self) -> Result<Sge, BufError>
    where
        Self: Sized,
    {
        make_sge(self.stable_ptr(), 0, self.bytes_init(), self.lkey())
    }

    /// A scatter/gather element for the whole capacity (where to receive).
    fn sge_total(&self) -> Result<Sge, BufError>
    where
        Self: Sized,
    {
        make_sge(self.stable_ptr(), 0, self.bytes_total(), self.lkey())
    }
}

fn make_sge(ptr: *const u8, offset: usize, len: usize, lkey: u32) -> Result<Sge, BufError> {
    let length = u32::try_from(len).map_err(|_| BufError::TooLarge {
        what: "sge",
        len,
        max: u32::MAX as usize,
    })?;
    Ok(Sge {
        addr: (ptr as u64).wrapping_add(offset as u64),
        length,
        lkey,
    })
}

// SAFETY: a Vec's heap buffer does not move when the Vec is moved; only
// `bytes_total()` = capacity bytes are reported and `len` bytes are initialized.
// The owner cannot grow (reallocate) it while an op owns it.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as for `IoBuf`; `as_mut_ptr` is the same address as `as_ptr`.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len() < pos {
            // SAFETY: the caller guarantees `pos <= capacity` and that the
            // first `pos` bytes are initialized.
            unsafe { self.set_len(pos) };
        }
    }
}

// SAFETY: a boxed slice's heap memory does not move with the box; all of it is
// initialized.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for `IoBuf`; the memory is uniquely owned by the box.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {
        // Every byte of a boxed slice is initialized already.
    }
}

// SAFETY: 'static data never moves and is never freed; it is immutable, so it
// is `IoBuf` only (never handed to the device for writing).
unsafe impl IoBuf for &'static [u8] {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for `&'static [u8]`.
unsafe impl IoBuf for &'static str {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved<T>(t: T) -> T {
        t
    }

    #[test]
    fn vec_is_stable_and_tracks_init() {
        let mut v = Vec::with_capacity(32);
        v.extend_from_slice(b"abc");
        let p = v.stable_ptr();
        let mut v = moved(v);
        assert_eq!(v.stable_ptr(), p);
        assert_eq!(v.bytes_init(), 3);
        assert_eq!(v.bytes_total(), v.capacity());
        // SAFETY: writes 5 bytes inside the capacity, then declares them.
        unsafe {
            std::ptr::copy_nonoverlapping(b"defgh".as_ptr(), v.stable_mut_ptr().add(3), 5);
            v.set_init(8);
            // never shrinks
            v.set_init(2);
        }
        assert_eq!(&v[..], b"abcdefgh");
    }

    #[test]
    fn box_and_static_report_full_length() {
        let mut b: Box<[u8]> = vec![7u8; 10].into_boxed_slice();
        assert_eq!((b.bytes_init(), b.bytes_total()), (10, 10));
        let p = b.stable_mut_ptr() as *const u8;
        assert_eq!(moved(b).stable_ptr(), p);
        let s: &'static [u8] = b"hello";
        assert_eq!((s.bytes_init(), s.bytes_total()), (5, 5));
        assert_eq!("hey".bytes_total(), 3);
    }

    #[test]
    fn slicing_out_of_bounds_gives_the_buffer_back() {
        let v = vec![1u8, 2, 3, 4];
        let r = v.slice(2..9).unwrap_err();
        assert!(matches!(
            r.error,
            BufError::OutOfBounds {
                what: "slice",
                start: 2,
                end: 9,
                len: 4
            }
        ));
        let v = r.into_inner();
        assert_eq!(v, [1, 2, 3, 4]);
        let s = v.slice(1..3).unwrap();
        assert_eq!(&s[..], &[2, 3]);
    }

    #[test]
    fn sge_math_is_checked() {
        struct Fake(Vec<u8>);
        // SAFETY: delegates to Vec.
        unsafe impl IoBuf for Fake {
            fn stable_ptr(&self) -> *const u8 {
                self.0.stable_ptr()
            }
            fn bytes_init(&self) -> usize {
                self.0.len()
            }
            fn bytes_total(&self) -> usize {
                self.0.capacity()
            }
        }
        // SAFETY: test only; the lkey is never used with a device.
        unsafe impl RegisteredBuf for Fake {
            fn lkey(&self) -> u32 {
                42
            }
        }
        let mut v = Vec::with_capacity(100);
        v.extend_from_slice(&[0u8; 10]);
        let f = Fake(v);
        let base = f.stable_ptr() as u64;
        let cap = f.bytes_total() as u32;
        assert_eq!(
            f.sge(4..20).unwrap(),
            Sge {
                addr: base + 4,
                length: 16,
                lkey: 42
            }
        );
        assert_eq!(f.sge_init().unwrap().length, 10);
        assert_eq!(f.sge_total().unwrap().length, cap);
        assert!(f.sge(0..cap as usize + 1).is_err());
    }
}
