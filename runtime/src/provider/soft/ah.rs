//! Address handles of the software device: the route to a remote port.
//!
//! An address handle names the engine that owns the destination (its
//! data-plane address, `AhAttr::addr`) and the GID of that engine's
//! port. Its raw handle ([`AhHandle`]) is a number unique in the process;
//! the context's table maps it to the route while a clone of the [`Ah`]
//! lives, and the post path and the engine resolve it there for every
//! datagram. A handle that is no longer in the table (every clone dropped),
//! or that belongs to another protection domain or device, fails its work
//! request as rxe does (`LOC_QP_OP_ERR`, and the QP goes to ERR).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::context::{gid_of, Context};
use super::{lock, IdHasher};
use crate::provider::{AhAttr, AhHandle, Gid, ProviderError, Result};

/// What a live address handle resolves to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AhEntry {
    /// The protection domain it was created in.
    pub pd: u32,
    /// The destination engine's data-plane address.
    pub addr: SocketAddr,
    /// The destination port's GID.
    pub dgid: Gid,
    /// The hop limit (TTL) its datagrams carry.
    pub hop_limit: u8,
}

/// The live address handles of one context, by raw handle.
pub(crate) type AhTable = HashMap<u64, AhEntry, BuildHasherDefault<IdHasher>>;

/// Raw handles: unique in the process (a handle of another device is never
/// found in this one's table), never reused.
static NEXT_AH: AtomicU64 = AtomicU64::new(1);

struct AhInner {
    id: u64,
    /// Keeps the device (and its table) alive.
    ctx: Context,
}

impl Drop for AhInner {
    fn drop(&mut self) {
        lock(&self.ctx.shared().ahs).remove(&self.id);
    }
}

/// An address handle of the software device.
#[derive(Clone)]
pub struct Ah(Arc<AhInner>);

impl std::fmt::Debug for Ah {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Ah").field(&self.0.id).finish()
    }
}

fn invalid(what: String) -> ProviderError {
    ProviderError::InvalidArgument {
        call: "create_ah",
        what,
    }
}

/// Checks `attr` and returns the route it names (in protection domain `pd`).
pub(crate) fn route(pd: u32, attr: &AhAttr) -> Result<AhEntry> {
    if attr.port != 1 {
        return Err(invalid(format!(
            "port {} (the soft device has port 1 only)",
            attr.port
        )));
    }
    if attr.sgid_index != 0 {
        return Err(invalid(format!(
            "source GID index {} (the soft device has GID 0 only)",
            attr.sgid_index
        )));
    }
    let Some(addr) = attr.addr.to_socket() else {
        return Err(invalid(
            "no engine address (AhAttr::addr): the soft device reaches a destination through its engine's \
             data-plane address (build the AhAttr with AhAttr::to_endpoint from a soft \
             device's Endpoint)"
                .into(),
        ));
    };
    let expect = gid_of(addr.ip());
    if attr.dgid != expect {
        return Err(invalid(format!(
            "destination GID {} is not the soft device GID of the engine at {addr} ({})",
            attr.dgid, expect
        )));
    }
    Ok(AhEntry {
        pd,
        addr,
        dgid: attr.dgid,
        hop_limit: attr.hop_limit,
    })
}

impl Ah {
    /// Creates an address handle for `attr` in protection domain `pd` of `ctx`.
    pub(crate) fn create(ctx: &Context, pd: u32, attr: &AhAttr) -> Result<Ah> {
        let entry = route(pd, attr)?;
        let id = NEXT_AH.fetch_add(1, Ordering::Relaxed);
        lock(&ctx.shared().ahs).insert(id, entry);
        Ok(Ah(Arc::new(AhInner {
            id,
            ctx: ctx.clone(),
        })))
    }

    /// The handle UD work requests carry.
    pub fn raw(&self) -> AhHandle {
        AhHandle(self.0.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::SoftConfig;

    fn attr(addr: SocketAddr) -> AhAttr {
        AhAttr {
            dlid: 0,
            dgid: gid_of(addr.ip()),
            sgid_index: 0,
            hop_limit: 64,
            sl: 0,
            port: 1,
            addr: addr.into(),
        }
    }

    #[test]
    fn a_handle_is_live_while_a_clone_exists() {
        let ctx = Context::open(SoftConfig::default()).expect("open");
        let a = Ah::create(&ctx, 1, &attr(ctx.local_addr())).expect("ah");
        let raw = a.raw().0;
        let b = a.clone();
        drop(a);
        assert!(lock(&ctx.shared().ahs).contains_key(&raw));
        drop(b);
        assert!(!lock(&ctx.shared().ahs).contains_key(&raw));
        let c = Ah::create(&ctx, 1, &attr(ctx.local_addr())).expect("ah");
        assert_ne!(c.raw().0, raw, "handles are never reused");
    }

    #[test]
    fn attributes_that_name_no_soft_port_are_refused() {
        let addr: SocketAddr = "127.0.0.1:4000".parse().expect("literal");
        assert!(route(1, &attr(addr)).is_ok());
        let what = |a: AhAttr| match route(1, &a) {
            Err(ProviderError::InvalidArgument { what, .. }) => what,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(what(AhAttr {
            addr: crate::provider::ProviderAddr::NONE,
            ..attr(addr)
        })
        .contains("no engine address"));
        assert!(what(AhAttr {
            dgid: Gid([0xfe; 16]),
            ..attr(addr)
        })
        .contains("not the soft device GID"));
        assert!(what(AhAttr {
            port: 2,
            ..attr(addr)
        })
        .contains("port 2"));
        assert!(what(AhAttr {
            sgid_index: 1,
            ..attr(addr)
        })
        .contains("GID index 1"));
    }
}
