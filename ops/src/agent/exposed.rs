//! [`Exposed`]: memory a connection lets its peer reach (a grant, the
//! staging ring, a message offered for READ), and whose rkey reaches it
//! only through that connection.
//!
//! A connection with a protection domain of its own registers such memory
//! with its remote access: the PD keeps every other connection's QP out.
//! A connection on a listener's shared receive queue shares the device's
//! PD with every other connection on it (an SRQ's QPs must share its PD),
//! where a registration's rkey works from any of their QPs: a peer that
//! guessed or was told another connection's rkey would reach that
//! connection's memory. There the memory is registered with no remote
//! access of its own ([`RemoteAccessRegion::bindable`]) and reached
//! through a type 2 memory window bound by the connection's QP, which the
//! device lets only that QP's peer use (rxe's rule, which the soft device
//! follows: `runtime/tests/mw_cases`, `window_belongs_to_its_qp`). Ending
//! the exposure deallocates the window (its rkey fails from then on) and
//! then deregisters the memory.

use std::rc::Rc;

use verbio_runtime::buf::{IoBufMut, RemoteAccessRegion, Window};
use verbio_runtime::provider::AccessFlags;

use super::error::AgentError;
use super::rdma::Shared;
use super::wire::MrToken;
use crate::verbs::Verbs;

/// Memory the peer may reach, by the rkey [`Exposed::rkey`] names.
#[derive(Debug)]
pub(crate) enum Exposed<B = Vec<u8>> {
    /// Registered with remote access in the connection's own PD.
    Registered(RemoteAccessRegion<B>),
    /// Reached through a window bound by the connection's QP.
    Bound(BoundRegion<B>),
}

/// A region reached only through one window bound over all of it.
#[derive(Debug)]
pub(crate) struct BoundRegion<B> {
    /// Declared first: deallocated (the rkey fails) before the region is
    /// deregistered.
    window: Window<B>,
    region: Rc<RemoteAccessRegion<B>>,
    rkey: u32,
    access: AccessFlags,
}

/// Why memory could not be exposed, and the memory back when it can be
/// given back.
pub(crate) type Refused<B> = (AgentError, Option<B>);

/// Deregisters `region` once nothing else holds it, giving the memory back.
fn unwrap_region<B: IoBufMut>(region: Rc<RemoteAccessRegion<B>>) -> Option<B> {
    match Rc::try_unwrap(region) {
        Ok(r) => Some(r.revoke()),
        Err(r) => {
            // Not reached: only the window held another handle, and it
            // was deallocated first. Dropping this one deregisters the
            // memory once the last handle goes.
            tracing::warn!(rkey = r.rkey(), "exposed region still held at its revoke");
            None
        }
    }
}

impl<B: IoBufMut> Exposed<B> {
    /// Exposes `mem` to the peer with `access` (remote flags only): a
    /// registration in the connection's PD, or, on a shared receive queue,
    /// a window bound by its QP (one BIND_MW, awaited). On failure the
    /// memory comes back (unless the bind failed after taking it).
    pub(crate) async fn new(
        shared: &Shared,
        mem: B,
        access: AccessFlags,
        stage: &'static str,
    ) -> Result<Exposed<B>, Refused<B>> {
        if !shared.shares_pd() {
            return RemoteAccessRegion::grant(&shared.pd.0, mem, access)
                .map(Exposed::Registered)
                .map_err(|r| {
                    let e = AgentError::Buf {
                        stage,
                        source: r.error,
                    };
                    (e, Some(r.buf))
                });
        }
        let region = RemoteAccessRegion::bindable(&shared.pd.0, mem).map_err(|r| {
            let e = AgentError::Buf {
                stage,
                source: r.error,
            };
            (e, Some(r.buf))
        })?;
        let region = Rc::new(region);
        let window = match Window::alloc(&shared.pd.0) {
            Ok(w) => w,
            Err(source) => {
                let e = AgentError::Device {
                    stage: "allocating a memory window",
                    source,
                };
                return Err((e, unwrap_region(region)));
            }
        };
        let len = region.len();
        let (bound, window) = shared
            .qp
            .bind_mw(window, region.clone(), 0..len, access)
            .await;
        match bound {
            Ok(remote) => Ok(Exposed::Bound(BoundRegion {
                window,
                region,
                rkey: remote.rkey(),
                access,
            })),
            Err(e) => {
                drop(window);
                Err((AgentError::Verb(e), unwrap_region(region)))
            }
        }
    }

    /// The address the peer uses.
    pub(crate) fn addr(&self) -> u64 {
        self.region().addr()
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.region().len()
    }

    /// The rkey the peer uses.
    pub(crate) fn rkey(&self) -> u32 {
        match self {
            Exposed::Registered(r) => r.rkey(),
            Exposed::Bound(b) => b.rkey,
        }
    }

    /// The remote access granted.
    pub(crate) fn access(&self) -> AccessFlags {
        match self {
            Exposed::Registered(r) => r.access(),
            Exposed::Bound(b) => b.access,
        }
    }

    /// The memory, to read what the peer wrote.
    pub(crate) fn region(&self) -> &RemoteAccessRegion<B> {
        match self {
            Exposed::Registered(r) => r,
            Exposed::Bound(b) => &b.region,
        }
    }

    /// What the peer is told (`token_id`, no deadline) and the rkey of the
    /// registration beneath (the same for a registered region), for the
    /// test hook `Rdma::exposed_memory_unchecked`.
    pub(crate) fn keys(&self, token_id: u64) -> (MrToken, u32) {
        let token = MrToken {
            token_id,
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
            access: self.access().bits(),
            deadline_ms: 0,
            flags: 0,
        };
        (token, self.region().rkey())
    }

    /// Ends the exposure (the rkey fails from now on) and gives the memory
    /// back, with what the peer wrote.
    pub(crate) fn revoke(self) -> Option<B> {
        match self {
            Exposed::Registered(r) => Some(r.revoke()),
            Exposed::Bound(BoundRegion { window, region, .. }) => {
                // Deallocating the window ends every access through it and
                // drops its hold on the region.
                drop(window);
                unwrap_region(region)
            }
        }
    }
}
