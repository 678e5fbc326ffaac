//! [`Window`]: a type 2 memory window and the region it is bound over.
//!
//! Peers reach a [`RemoteAccessRegion::bindable`] region only through
//! windows: each binding names a sub-range, remote access flags and a fresh
//! rkey (the window's index, a new key byte), and one LOCAL_INV revokes it.
//! While bound, the window holds the region (an `Rc`), so the memory and
//! its registration outlive every access through the window; the window
//! lets the region go only once an invalidation has completed, or when it
//! is deallocated itself (the provider window first, then the region). The
//! binding and invalidation are work requests: see
//! [`QueuePair::bind_window`](crate::QueuePair::bind_window) and
//! [`QueuePair::invalidate_window`](crate::QueuePair::invalidate_window).

use std::fmt;
use std::rc::Rc;

use super::region::RemoteAccessRegion;
use crate::provider::{AccessFlags, Mw, Pd, ProviderError};

/// What a bound window grants.
pub(crate) struct Binding<B> {
    pub(crate) region: Rc<RemoteAccessRegion<B>>,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) rkey: u32,
    pub(crate) access: AccessFlags,
}

/// The binding [`QueuePair::bind_window`](crate::QueuePair::bind_window)
/// records.
pub(crate) fn binding<B>(
    region: Rc<RemoteAccessRegion<B>>,
    addr: u64,
    len: u64,
    rkey: u32,
    access: AccessFlags,
) -> Binding<B> {
    Binding {
        region,
        addr,
        len,
        rkey,
        access,
    }
}

/// A type 2 memory window over regions of memory `B`.
pub struct Window<B> {
    /// Declared first: deallocated (every access through it ends) before
    /// the region is let go.
    pub(crate) mw: Mw,
    pub(crate) bound: Option<Binding<B>>,
}

impl<B> Window<B> {
    /// Allocates an unbound window in `pd` (the PD of the QPs that bind it
    /// and of the regions it is bound over).
    pub fn alloc(pd: &Pd) -> Result<Window<B>, ProviderError> {
        Ok(Window {
            mw: pd.alloc_mw()?,
            bound: None,
        })
    }

    /// True while a binding is in force (from the post of its bind to the
    /// completion of its invalidation).
    pub fn is_bound(&self) -> bool {
        self.bound.is_some()
    }

    /// The binding's remote address, length and rkey (what a peer needs).
    pub fn remote(&self) -> Option<(u64, u64, u32)> {
        self.bound.as_ref().map(|b| (b.addr, b.len, b.rkey))
    }

    /// The binding's remote access flags.
    pub fn access(&self) -> Option<AccessFlags> {
        self.bound.as_ref().map(|b| b.access)
    }

    /// The region the window is bound over.
    pub fn region(&self) -> Option<&Rc<RemoteAccessRegion<B>>> {
        self.bound.as_ref().map(|b| &b.region)
    }
}

impl<B> fmt::Debug for Window<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("mw", &self.mw)
            .field("remote", &self.remote())
            .finish()
    }
}
