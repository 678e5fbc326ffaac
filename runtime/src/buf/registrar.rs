//! What the buffer module needs from a protection domain: registering memory.
//! A small internal trait so the pool's logic is testable without a device.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use super::error::BufError;
use crate::provider::{AccessFlags, Mr, Pd, ProviderError};

/// Alignment of every chunk and dedicated allocation (a page).
pub(crate) const ALIGN: usize = 4096;

/// A live registration; dropping it deregisters.
pub(crate) struct Registration {
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    /// Held for its `Drop` (deregistration) and for `with_memory`.
    _handle: Handle,
}

impl Registration {
    /// Deregisters now (the same as dropping it, spelled out at call sites
    /// where the order "deregister, then give the memory back" matters).
    pub(crate) fn deregister(self) {
        // `self` (and with it the provider's `Mr`) is dropped here.
    }

    /// Runs `f` ordered with the device's Rust-thread accesses to the
    /// registered memory ([`Mr::with_memory`]).
    /// The provider's registration (`None` for a test double).
    pub(crate) fn mr(&self) -> Option<&Mr> {
        match &self._handle {
            Handle::Mr(mr) => Some(mr),
            #[cfg(test)]
            Handle::Fake(_) => None,
        }
    }

    pub(crate) fn with_memory<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self._handle {
            Handle::Mr(mr) => mr.with_memory(f),
            #[cfg(test)]
            Handle::Fake(_) => f(),
        }
    }
}

enum Handle {
    Mr(Mr),
    #[cfg(test)]
    Fake(#[allow(dead_code)] fake::Token),
}

/// Registers memory for a device.
pub(crate) trait Registrar {
    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    ///
    /// As [`Pd::reg_mr`]: the memory stays valid until the registration is dropped.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Registration, ProviderError>;
}

impl Registrar for Pd {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Registration, ProviderError> {
        // SAFETY: forwarded contract.
        let mr = unsafe { self.reg_mr(addr, len, access)? };
        Ok(Registration {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            _handle: Handle::Mr(mr),
        })
    }
}

/// Page-aligned, zero-initialized heap memory; freed on drop.
pub(crate) struct RawMem {
    /// # Invariant
    /// Allocated with `layout` (non-zero size), live until drop.
    ptr: NonNull<u8>,
    layout: Layout,
}

impl RawMem {
    pub(crate) fn new(what: &'static str, len: usize) -> Result<RawMem, BufError> {
        let layout =
            Layout::from_size_align(len.max(1), ALIGN).map_err(|_| BufError::TooLarge {
                what,
                len,
                max: isize::MAX as usize - ALIGN,
            })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(BufError::Alloc { what, len })?;
        Ok(RawMem { ptr, layout })
    }
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for RawMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Memory plus its registration. Field order matters: the registration is
/// dropped (deregistered) before the memory is freed.
pub(crate) struct RegisteredRaw {
    pub(crate) reg: Registration,
    pub(crate) mem: RawMem,
}

impl RegisteredRaw {
    pub(crate) fn new(
        what: &'static str,
        registrar: &dyn Registrar,
        len: usize,
        access: AccessFlags,
    ) -> Result<RegisteredRaw, BufError> {
        let mem = RawMem::new(what, len)?;
        // SAFETY: `mem` lives in the same struct and is dropped after `reg`.
        let reg = unsafe { registrar.register(mem.ptr().as_ptr(), mem.len(), access) }
            .map_err(|source| BufError::Register { what, len, source })?;
        Ok(RegisteredRaw { reg, mem })
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A registrar without a device: hands out keys and counts live registrations.

    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    #[derive(Default)]
    pub(crate) struct State {
        pub(crate) registered: Cell<usize>,
        pub(crate) live: Cell<usize>,
        pub(crate) fail_next: Cell<bool>,
        pub(crate) last_access: Cell<Option<AccessFlags>>,
    }

    pub(crate) struct Token(Rc<State>);

    impl Drop for Token {
        fn drop(&mut self) {
            self.0.live.set(self.0.live.get() - 1);
        }
    }

    #[derive(Clone, Default)]
    pub(crate) struct FakeRegistrar(pub(crate) Rc<State>);

    impl Registrar for FakeRegistrar {
        unsafe fn register(
            &self,
            _addr: *mut u8,
            _len: usize,
            access: AccessFlags,
        ) -> Result<Registration, ProviderError> {
            if self.0.fail_next.replace(false) {
                return Err(ProviderError::InvalidArgument {
                    call: "fake_reg_mr",
                    what: "told to fail".into(),
                });
            }
            let n = self.0.registered.get() + 1;
            self.0.registered.set(n);
            self.0.live.set(self.0.live.get() + 1);
            self.0.last_access.set(Some(access));
            Ok(Registration {
                lkey: 0x1000 + n as u32,
                rkey: 0x2000 + n as u32,
                _handle: Handle::Fake(Token(self.0.clone())),
            })
        }
    }
}
