//! [`RemoteAccessRegion`]: memory a peer may access, with its own registration.

use std::cell::UnsafeCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::{check_span, BufError, Rejected};
use super::io_buf::IoBufMut;
use super::registrar::{Registrar, Registration};
use crate::provider::{AccessFlags, Pd};

/// How many bytes an accessor copies per hold of the device's lock (so a
/// large copy never holds the device up long).
const COPY_CHUNK: usize = 64 * 1024;

/// A buffer granted to a peer: registered on its own, with exactly its bounds
/// and the minimal access flags, so its rkey never exposes more than the grant.
///
/// # Why this is sound (DESIGN section 5)
///
/// While the region is live a peer may write (or run atomics on) the memory at
/// any moment, from outside the Rust abstract machine (a NIC) or from a Rust
/// thread of the soft device. So the region never hands out `&[u8]`/`&mut [u8]`
/// or the inner buffer by reference: a reference would promise unchanging (or
/// exclusive) contents. Local code reads and writes only through
/// [`read_into`](Self::read_into), [`write_from`](Self::write_from) and
/// [`load_u64`](Self::load_u64), which copy through raw pointers while the
/// device's Rust threads stay off the memory (the soft device's MR-table lock,
/// which all its accesses to registered memory hold): two Rust threads never
/// access the bytes unordered, so there is no data race. A copy overlapping a
/// peer's write may still see a mix of old and new bytes (exactly what a NIC
/// gives); copies larger than 64 KiB take the lock once per 64 KiB. It is not
/// [`IoBuf`](super::IoBuf) either, for the same reason (`Slice` would hand out
/// slices).
///
/// [`revoke`](Self::revoke) drops the registration first; per the provider
/// contract the rkey fails at once and the device never touches the memory
/// again, and only then is the buffer given back, with plain slices.
/// The registration is the only handle to it (never cloned or exposed), so
/// dropping it really deregisters.
pub struct RemoteAccessRegion<B> {
    /// Declared first: dropped (deregistered) before `buf`.
    reg: Registration,
    /// # Invariant
    /// While `reg` lives, the registered bytes `[addr, addr + len)` (valid and
    /// initialized) are accessed only through raw pointers inside
    /// `reg.with_memory`, so never unordered with the device's Rust threads,
    /// and no reference into them is handed out; the cell only re-derives the
    /// raw pointer, on one thread (the type is `!Sync`).
    buf: UnsafeCell<B>,
    len: usize,
    addr: u64,
    access: AccessFlags,
}

impl<B: IoBufMut> RemoteAccessRegion<B> {
    /// Grants `access` (some of `REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`)
    /// to the whole capacity of `buf` (pass a [`Slice`](super::Slice) for a
    /// sub-range). `LOCAL_WRITE` is added only where verbs require it (remote
    /// write or atomic). Bytes past the buffer's initialized part are zeroed
    /// first, so the whole region is initialized and what the peer wrote is
    /// visible after [`revoke`](Self::revoke). On failure the buffer comes back.
    pub fn grant(pd: &Pd, buf: B, access: AccessFlags) -> Result<Self, Rejected<B>> {
        Self::grant_with(pd, buf, access)
    }

    pub(crate) fn grant_with(
        registrar: &dyn Registrar,
        buf: B,
        access: AccessFlags,
    ) -> Result<Self, Rejected<B>> {
        const WHAT: &str = "RemoteAccessRegion::grant";
        let remote = access
            & (AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC);
        if remote.is_empty() {
            let e = BufError::AccessNotAllowed {
                what: WHAT,
                requested: access,
                reason: "no remote access requested; use RegisteredMem for local use",
            };
            return Err(Rejected::new(e, buf));
        }
        let mut flags = remote;
        if remote.contains(AccessFlags::REMOTE_WRITE) || remote.contains(AccessFlags::REMOTE_ATOMIC)
        {
            // Verbs refuse remote write/atomic without local write.
            flags |= AccessFlags::LOCAL_WRITE;
        }
        Self::register_region(WHAT, registrar, buf, flags)
    }

    /// A region peers reach only through memory windows bound over it
    /// ([`Window`](super::Window)): registered with `LOCAL_WRITE` and
    /// `MW_BIND` and no remote access of its own (its rkey reaches
    /// nothing). Zeroed past the initialized part, read and written like a
    /// granted region. On failure the buffer comes back.
    pub fn bindable(pd: &Pd, buf: B) -> Result<Self, Rejected<B>> {
        Self::register_region(
            "RemoteAccessRegion::bindable",
            pd,
            buf,
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )
    }

    fn register_region(
        what: &'static str,
        registrar: &dyn Registrar,
        mut buf: B,
        flags: AccessFlags,
    ) -> Result<Self, Rejected<B>> {
        let len = buf.bytes_total();
        if len == 0 {
            return Err(Rejected::new(BufError::Empty { what }, buf));
        }
        let init = buf.bytes_init().min(len);
        let ptr = buf.stable_mut_ptr();
        // SAFETY: `[init, len)` is inside the capacity; after zeroing, all
        // `len` bytes are initialized.
        unsafe {
            std::ptr::write_bytes(ptr.add(init), 0, len - init);
            buf.set_init(len);
        }
        // SAFETY: `IoBufMut` keeps the memory valid and in place while `buf`
        // lives; `buf` is dropped after the registration (field order, `revoke`).
        match unsafe { registrar.register(ptr, len, flags) } {
            Ok(reg) => {
                tracing::debug!(
                    addr = ptr as u64,
                    len,
                    rkey = reg.rkey,
                    ?flags,
                    "granted region"
                );
                Ok(RemoteAccessRegion {
                    reg,
                    buf: UnsafeCell::new(buf),
                    len,
                    addr: ptr as u64,
                    access: flags,
                })
            }
            Err(source) => Err(Rejected::new(BufError::Register { what, len, source }, buf)),
        }
    }

    /// Remote key the peer uses.
    pub fn rkey(&self) -> u32 {
        self.reg.rkey
    }
    /// Start address the peer uses.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false: empty regions are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The flags the region is registered with.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// The registration's handle for bind WRs (`None` for a test double).
    pub(crate) fn mr_handle(&self) -> Option<crate::provider::MrHandle> {
        self.reg.mr().map(|m| m.raw())
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: the type is `!Sync` and this is not re-entrant, so this
        // `&mut B` is the only reference to the buffer value for the duration
        // of the call; it does not reference the registered bytes themselves.
        unsafe { (*self.buf.get()).stable_mut_ptr() }
    }

    /// Copies `dst.len()` bytes at offset `off` of the region into `dst`.
    /// A peer writing at the same time may leave a mix of old and new bytes.
    pub fn read_into(&self, off: usize, dst: &mut [u8]) -> Result<(), BufError> {
        check_span("RemoteAccessRegion::read_into", off, dst.len(), self.len)?;
        let base = self.ptr();
        for (i, part) in dst.chunks_mut(COPY_CHUNK).enumerate() {
            let at = off + i * COPY_CHUNK;
            // SAFETY: inside the region (checked above); `buf`'s invariant.
            let copy = || unsafe { std::ptr::copy(base.add(at), part.as_mut_ptr(), part.len()) };
            self.reg.with_memory(copy);
        }
        Ok(())
    }

    /// Appends the `n` bytes at offset `off` of the region to `dst`
    /// (one copy, into `dst`'s spare capacity: no zeroing first, unlike
    /// [`read_into`](Self::read_into) into a fresh vector). As
    /// `read_into`, a peer writing at the same time may leave a mix of old
    /// and new bytes.
    pub fn append_to(&self, off: usize, n: usize, dst: &mut Vec<u8>) -> Result<(), BufError> {
        check_span("RemoteAccessRegion::append_to", off, n, self.len)?;
        dst.reserve(n);
        let base = self.ptr();
        let mut done = 0;
        while done < n {
            let part = (n - done).min(COPY_CHUNK);
            let start = dst.len();
            // SAFETY: inside the region (checked above; `buf`'s invariant)
            // into `dst`'s reserved spare capacity (`reserve` above: at
            // least `n - done` bytes past `start`); the bytes are
            // initialized by the copy before `set_len` exposes them.
            let copy = || unsafe {
                std::ptr::copy(base.add(off + done), dst.as_mut_ptr().add(start), part);
                dst.set_len(start + part);
            };
            self.reg.with_memory(copy);
            done += part;
        }
        Ok(())
    }

    /// Copies `src` to offset `off` of the region.
    pub fn write_from(&self, off: usize, src: &[u8]) -> Result<(), BufError> {
        check_span("RemoteAccessRegion::write_from", off, src.len(), self.len)?;
        let base = self.ptr();
        for (i, part) in src.chunks(COPY_CHUNK).enumerate() {
            let at = off + i * COPY_CHUNK;
            // SAFETY: inside the region (checked above); `buf`'s invariant.
            let copy = || unsafe { std::ptr::copy(part.as_ptr(), base.add(at), part.len()) };
            self.reg.with_memory(copy);
        }
        Ok(())
    }

    /// Atomically loads the 8-byte value at `off` (which must be 8-byte aligned
    /// in memory), as remote atomics (compare-and-swap, fetch-and-add) leave
    /// it: never torn with respect to other atomics.
    pub fn load_u64(&self, off: usize) -> Result<u64, BufError> {
        const WHAT: &str = "RemoteAccessRegion::load_u64";
        check_span(WHAT, off, 8, self.len)?;
        let addr = self.addr.wrapping_add(off as u64);
        if addr & 7 != 0 {
            return Err(BufError::Misaligned {
                what: WHAT,
                addr,
                align: 8,
            });
        }
        let p = self.ptr();
        // SAFETY: aligned, inside the region (checked above); `buf`'s invariant.
        let load =
            || unsafe { AtomicU64::from_ptr(p.add(off).cast::<u64>()) }.load(Ordering::Acquire);
        Ok(self.reg.with_memory(load))
    }

    /// Copies the whole region into a new `Vec`.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // `v` has exactly `len` bytes: cannot fail.
        let _ = self.read_into(0, &mut v);
        v
    }

    /// Ends the grant: deregisters (the rkey fails from now on and the device
    /// no longer touches the memory), then gives the buffer back, fully
    /// initialized, with what the peer wrote.
    pub fn revoke(self) -> B {
        let RemoteAccessRegion { reg, buf, .. } = self;
        let rkey = reg.rkey;
        reg.deregister();
        tracing::debug!(rkey, "revoked region");
        buf.into_inner()
    }
}

impl<B> fmt::Debug for RemoteAccessRegion<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteAccessRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("rkey", &self.reg.rkey)
            .field("access", &self.access)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::registrar::fake::FakeRegistrar;
    use super::super::IoBuf;
    use super::*;

    #[test]
    fn registers_exact_bounds_with_minimal_flags() {
        let reg = FakeRegistrar::default();
        let v: Vec<u8> = (0..100).collect();
        let base = v.as_ptr() as u64;
        let s = v.slice(10..30).unwrap();
        let r = RemoteAccessRegion::grant_with(&reg, s, AccessFlags::REMOTE_READ).unwrap();
        assert_eq!((r.addr(), r.len()), (base + 10, 20));
        assert_eq!(r.access(), AccessFlags::REMOTE_READ);
        assert_eq!(reg.0.last_access.get(), Some(AccessFlags::REMOTE_READ));
        drop(r);
        let r =
            RemoteAccessRegion::grant_with(&reg, vec![0u8; 8], AccessFlags::REMOTE_WRITE).unwrap();
        assert_eq!(
            r.access(),
            AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE
        );
        let r2 =
            RemoteAccessRegion::grant_with(&reg, vec![0u8; 8], AccessFlags::REMOTE_ATOMIC).unwrap();
        assert_eq!(
            r2.access(),
            AccessFlags::REMOTE_ATOMIC | AccessFlags::LOCAL_WRITE
        );
        assert_ne!(r.rkey(), r2.rkey());
    }

    #[test]
    fn copying_accessors_check_bounds() {
        let reg = FakeRegistrar::default();
        let r =
            RemoteAccessRegion::grant_with(&reg, b"abcdefgh".to_vec(), AccessFlags::REMOTE_WRITE)
                .unwrap();
        let mut out = [0u8; 3];
        r.read_into(2, &mut out).unwrap();
        assert_eq!(&out, b"cde");
        r.write_from(6, b"XY").unwrap();
        assert!(r.write_from(7, b"XY").is_err());
        assert!(r.read_into(usize::MAX, &mut out).is_err());
        assert!(r.read_into(6, &mut out).is_err());
        r.read_into(8, &mut []).unwrap();
        let mut v = b"<".to_vec();
        r.append_to(1, 3, &mut v).unwrap();
        assert_eq!(v, b"<bcd");
        assert!(r.append_to(6, 3, &mut v).is_err());
        assert!(r.append_to(usize::MAX, 1, &mut v).is_err());
        assert_eq!(v, b"<bcd", "nothing appended out of bounds");
        assert_eq!(r.to_vec(), b"abcdefXY");
        let v = r.revoke();
        assert_eq!(reg.0.live.get(), 0, "revoke deregistered");
        assert_eq!(v, b"abcdefXY");
    }

    #[test]
    fn atomic_loads_need_alignment() {
        let reg = FakeRegistrar::default();
        let pool = super::super::MrPool::from_registrar(Box::new(reg.clone()), Default::default())
            .unwrap();
        let r = RemoteAccessRegion::grant_with(
            &reg,
            pool.alloc_zeroed(64).unwrap(),
            AccessFlags::REMOTE_ATOMIC,
        )
        .unwrap();
        r.write_from(8, &0x0102_0304_0506_0708u64.to_ne_bytes())
            .unwrap();
        assert_eq!(r.load_u64(8).unwrap(), 0x0102_0304_0506_0708);
        assert!(matches!(
            r.load_u64(4),
            Err(BufError::Misaligned { align: 8, .. })
        ));
        assert!(matches!(r.load_u64(60), Err(BufError::OutOfBounds { .. })));
    }

    #[test]
    fn uninitialized_capacity_is_zeroed_and_counted_after_revoke() {
        let reg = FakeRegistrar::default();
        let mut v = Vec::with_capacity(16);
        v.extend_from_slice(b"hi");
        let cap = v.capacity();
        let r = RemoteAccessRegion::grant_with(&reg, v, AccessFlags::REMOTE_WRITE).unwrap();
        assert_eq!(r.len(), cap);
        r.write_from(cap - 1, b"!").unwrap();
        let v = r.revoke();
        assert_eq!(v.len(), cap);
        assert_eq!(&v[..2], b"hi");
        assert!(v[2..cap - 1].iter().all(|&b| b == 0));
        assert_eq!(v[cap - 1], b'!');
    }

    #[test]
    fn refuses_local_only_or_empty_grants() {
        let reg = FakeRegistrar::default();
        let r =
            RemoteAccessRegion::grant_with(&reg, vec![1u8], AccessFlags::LOCAL_WRITE).unwrap_err();
        assert!(matches!(r.error, BufError::AccessNotAllowed { .. }));
        let r =
            RemoteAccessRegion::grant_with(&reg, Vec::new(), AccessFlags::REMOTE_READ).unwrap_err();
        assert!(matches!(r.error, BufError::Empty { .. }));
        reg.0.fail_next.set(true);
        let r = RemoteAccessRegion::grant_with(&reg, vec![5u8; 3], AccessFlags::REMOTE_READ)
            .unwrap_err();
        assert_eq!(r.into_inner(), [5, 5, 5]);
    }

    #[test]
    fn a_pool_buffer_can_be_granted_and_comes_back_to_its_pool() {
        let fake = FakeRegistrar::default();
        let pool = super::super::MrPool::from_registrar(Box::new(fake.clone()), Default::default())
            .unwrap();
        let b = pool.alloc_from(b"grant me").unwrap();
        let p = b.stable_ptr();
        let r =
            RemoteAccessRegion::grant_with(&fake, b.slice(0..8).unwrap(), AccessFlags::REMOTE_READ)
                .unwrap();
        assert_eq!(fake.0.live.get(), 2, "chunk + region");
        let b = r.revoke().into_inner();
        assert_eq!(fake.0.live.get(), 1);
        assert_eq!(b.stable_ptr(), p);
        assert_eq!(&b[..], b"grant me");
    }

    /// The accessors are ordered with the soft device's accesses: while a
    /// device thread holds the MR-table lock (as the engine does for every
    /// copy to or from registered memory), a copy waits for it. (A plain
    /// copy would run at once, racing the device's.)
    #[test]
    fn accessors_wait_while_the_soft_device_touches_memory() {
        use std::sync::mpsc;
        use std::time::{Duration, Instant};

        const HOLD: Duration = Duration::from_millis(200);
        let ctx = crate::provider::Context::open_soft(Default::default()).expect("soft device");
        let pd = ctx.alloc_pd().expect("pd");
        let r = RemoteAccessRegion::grant(&pd, vec![7u8; 100], AccessFlags::REMOTE_WRITE).unwrap();
        // Another registration of the same device: its `with_memory` holds
        // the device-wide lock the engine copies under.
        let mut other = vec![0u8; 8];
        // SAFETY: `other` outlives `mr` (dropped first, below); no WR uses it.
        let mr = unsafe { pd.reg_mr(other.as_mut_ptr(), 8, AccessFlags::LOCAL_WRITE) }.unwrap();
        // Runs `access` on this thread while another holds the device's lock
        // for `HOLD`; returns how long `access` took.
        let timed_under_hold = |access: &dyn Fn()| {
            let (held, wait) = mpsc::channel();
            std::thread::scope(|s| {
                s.spawn(|| {
                    mr.with_memory(|| {
                        held.send(()).unwrap();
                        std::thread::sleep(HOLD);
                    })
                });
                wait.recv().unwrap();
                let t = Instant::now();
                access();
                t.elapsed()
            })
        };
        let out = std::cell::Cell::new([0u8; 3]);
        let took = timed_under_hold(&|| {
            let mut b = [0u8; 3];
            r.read_into(97, &mut b).unwrap();
            out.set(b);
        });
        assert!(
            took >= HOLD / 2,
            "read_into ran while the device held its lock"
        );
        assert_eq!(out.get(), [7; 3]);
        let took = timed_under_hold(&|| r.write_from(0, b"abc").unwrap());
        assert!(
            took >= HOLD / 2,
            "write_from ran while the device held its lock"
        );
        drop(mr);
        drop(other);
        assert_eq!(&r.revoke()[..4], b"abc\x07");
    }
}
