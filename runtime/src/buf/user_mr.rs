//! [`RegisteredMem`]: the user's own memory, registered zero-copy for local use.

use std::fmt;
use std::ops::{Deref, DerefMut};

use super::error::{BufError, Rejected};
use super::io_buf::{IoBuf, IoBufMut, RegisteredBuf};
use super::registrar::{Registrar, Registration};
use crate::provider::{AccessFlags, Pd};

/// A user buffer registered as it is (no copy), owned while registered.
///
/// The registration is local-only (`LOCAL_WRITE` or nothing), so plain slices
/// of it are sound; memory a peer may access goes through
/// [`RemoteAccessRegion`](super::RemoteAccessRegion) instead. It is a
/// [`RegisteredBuf`], so verbs use it directly; [`RegisteredMem::into_inner`]
/// deregisters and gives the buffer back.
pub struct RegisteredMem<B> {
    /// Declared first: dropped (deregistered) before `buf`.
    reg: Registration,
    /// # Invariant
    /// Never handed out mutably as `B` (only as bytes), so it cannot grow and
    /// move out of the registration.
    buf: B,
}

impl<B: IoBufMut> RegisteredMem<B> {
    /// Registers the whole capacity of `buf` with `pd`. `access` may be
    /// `LOCAL_WRITE` (the device may write it: RECV, READ) or
    /// [`AccessFlags::NONE`] (the device only reads it); remote flags are
    /// refused. On failure the buffer comes back in the error.
    pub fn register(pd: &Pd, buf: B, access: AccessFlags) -> Result<Self, Rejected<B>> {
        Self::register_with(pd, buf, access)
    }

    pub(crate) fn register_with(
        registrar: &dyn Registrar,
        mut buf: B,
        access: AccessFlags,
    ) -> Result<Self, Rejected<B>> {
        const WHAT: &str = "RegisteredMem::register";
        if !AccessFlags::LOCAL_WRITE.contains(access) {
            let e = BufError::AccessNotAllowed {
                what: WHAT,
                requested: access,
                reason: "remote access goes through RemoteAccessRegion",
            };
            return Err(Rejected::new(e, buf));
        }
        let len = buf.bytes_total();
        if len == 0 {
            return Err(Rejected::new(BufError::Empty { what: WHAT }, buf));
        }
        let ptr = buf.stable_mut_ptr();
        // SAFETY: `IoBufMut` keeps `[ptr, ptr + len)` valid and in place while
        // `buf` lives; `buf` lives in the returned value and is dropped after
        // the registration (field order, and `into_inner` drops it first).
        match unsafe { registrar.register(ptr, len, access) } {
            Ok(reg) => Ok(RegisteredMem { reg, buf }),
            Err(source) => Err(Rejected::new(
                BufError::Register {
                    what: WHAT,
                    len,
                    source,
                },
                buf,
            )),
        }
    }

    /// Deregisters, then gives the buffer back.
    pub fn into_inner(self) -> B {
        let RegisteredMem { reg, buf } = self;
        reg.deregister();
        buf
    }

    /// The buffer, read-only.
    pub fn get_ref(&self) -> &B {
        &self.buf
    }

    /// Remote key of the registration. It grants a peer nothing (no remote
    /// access flag); reported for completeness.
    pub fn rkey(&self) -> u32 {
        self.reg.rkey
    }
}

impl<B> fmt::Debug for RegisteredMem<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredMem")
            .field("lkey", &self.reg.lkey)
            .finish_non_exhaustive()
    }
}

// SAFETY: forwards to the inner buffer, which keeps its memory in place.
unsafe impl<B: IoBufMut> IoBuf for RegisteredMem<B> {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.buf.bytes_init()
    }
    fn bytes_total(&self) -> usize {
        self.buf.bytes_total()
    }
}

// SAFETY: forwards to the inner buffer.
unsafe impl<B: IoBufMut> IoBufMut for RegisteredMem<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.stable_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        // SAFETY: forwarded contract.
        unsafe { self.buf.set_init(pos) }
    }
}

// SAFETY: the registration covers the inner buffer's whole capacity and lives
// as long as `self`; local-only access (`LOCAL_WRITE` when the device writes).
unsafe impl<B: IoBufMut> RegisteredBuf for RegisteredMem<B> {
    fn lkey(&self) -> u32 {
        self.reg.lkey
    }
}

impl<B: IoBufMut> Deref for RegisteredMem<B> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `IoBuf`: the initialized bytes are readable, and with a
        // local-only registration nothing else writes them while we hold `self`.
        unsafe { std::slice::from_raw_parts(self.buf.stable_ptr(), self.buf.bytes_init()) }
    }
}

impl<B: IoBufMut> DerefMut for RegisteredMem<B> {
    fn deref_mut(&mut self) -> &mut [u8] {
        let n = self.buf.bytes_init();
        // SAFETY: as for `Deref`; `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.buf.stable_mut_ptr(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::registrar::fake::FakeRegistrar;
    use super::*;

    #[test]
    fn registers_in_place_and_deregisters_before_giving_back() {
        let reg = FakeRegistrar::default();
        let v = b"zero copy".to_vec();
        let p = v.as_ptr();
        let mut m = RegisteredMem::register_with(&reg, v, AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(reg.0.live.get(), 1);
        assert_eq!(m.stable_ptr(), p, "no copy");
        assert_eq!(&m[..], b"zero copy");
        m[0] = b'Z';
        let sge = m.sge_init().unwrap();
        assert_eq!((sge.addr, sge.length, sge.lkey), (p as u64, 9, m.lkey()));
        let v = m.into_inner();
        assert_eq!(reg.0.live.get(), 0);
        assert_eq!(v, b"Zero copy");
    }

    #[test]
    fn refuses_remote_access_empty_buffers_and_returns_them() {
        let reg = FakeRegistrar::default();
        let r = RegisteredMem::register_with(&reg, vec![1u8; 4], AccessFlags::REMOTE_WRITE)
            .unwrap_err();
        assert!(matches!(r.error, BufError::AccessNotAllowed { .. }));
        assert_eq!(r.into_inner(), [1, 1, 1, 1]);
        let r =
            RegisteredMem::register_with(&reg, Vec::new(), AccessFlags::LOCAL_WRITE).unwrap_err();
        assert!(matches!(r.error, BufError::Empty { .. }));
        reg.0.fail_next.set(true);
        let r = RegisteredMem::register_with(&reg, vec![3u8; 4], AccessFlags::NONE).unwrap_err();
        assert!(matches!(r.error, BufError::Register { len: 4, .. }));
        assert_eq!(r.buf, [3, 3, 3, 3]);
        assert_eq!(reg.0.live.get(), 0);
    }

    #[test]
    fn a_slice_of_registered_memory_keeps_the_lkey() {
        let reg = FakeRegistrar::default();
        let m = RegisteredMem::register_with(
            &reg,
            vec![0u8; 100].into_boxed_slice(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
        let lkey = m.lkey();
        let s = m.slice(10..20).unwrap();
        assert_eq!(s.lkey(), lkey);
        assert_eq!(s.sge_total().unwrap().length, 10);
        drop(s);
        assert_eq!(
            reg.0.live.get(),
            0,
            "dropping the slice drops the registration"
        );
    }
}
