//! The owner's grant table: every region a peer may access has its own
//! [`RemoteAccessRegion`] (exact bounds, minimal access) or, on a shared
//! receive queue, a window over one ([`Exposed`]), an id and a
//! deadline. Released, handed-back and expired grants are revoked (the rkey
//! fails at once); unknown ids are refused.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use verbio_runtime::buf::RemoteAccessRegion;
use verbio_runtime::provider::{AccessFlags, Pd};

use super::exposed::Exposed;
use super::wire::{MrToken, RefuseCode};

/// One live grant.
#[derive(Debug)]
struct Grant {
    region: Exposed,
    deadline: Instant,
}

/// A grant revoked because the connection went down, its memory kept for
/// a hand-back the peer sent before that (still to be delivered, in order,
/// by the agent).
#[derive(Debug)]
struct Revoked {
    addr: u64,
    len: u64,
    rkey: u32,
    mem: Vec<u8>,
}

/// The grants of one connection.
#[derive(Debug, Default)]
pub(crate) struct GrantTable {
    next_id: Cell<u64>,
    grants: RefCell<HashMap<u64, Grant>>,
    /// Grants revoked by [`GrantTable::clear`], until the agent stops.
    revoked: RefCell<HashMap<u64, Revoked>>,
}

/// Milliseconds since the Unix epoch of `deadline` (for the token).
fn epoch_ms(deadline: Instant) -> u64 {
    let left = deadline.saturating_duration_since(Instant::now());
    let at = SystemTime::now() + left;
    at.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl GrantTable {
    /// Registers `mem` for the peer with `access` until `lifetime` passes;
    /// returns the token and the deadline.
    pub(crate) fn grant(
        &self,
        pd: &Pd,
        mem: Vec<u8>,
        access: AccessFlags,
        lifetime: Duration,
    ) -> Result<(MrToken, Instant), RefuseCode> {
        let region = RemoteAccessRegion::grant(pd, mem, access).map_err(|r| {
            tracing::warn!(error = %r.error, "registering a grant failed");
            RefuseCode::NoMemory
        })?;
        Ok(self.insert(Exposed::Registered(region), lifetime))
    }

    /// Grants memory already exposed to the peer until `lifetime` passes;
    /// returns the token and the deadline.
    pub(crate) fn insert(&self, region: Exposed, lifetime: Duration) -> (MrToken, Instant) {
        let id = self.next_id.get() + 1;
        self.next_id.set(id);
        let deadline = Instant::now() + lifetime;
        let token = MrToken {
            token_id: id,
            addr: region.addr(),
            len: region.len() as u64,
            rkey: region.rkey(),
            access: region.access().bits(),
            deadline_ms: epoch_ms(deadline),
            flags: 0,
        };
        self.grants
            .borrow_mut()
            .insert(id, Grant { region, deadline });
        (token, deadline)
    }

    /// Revokes grant `id` if `token` (when given) matches it; the memory
    /// comes back. `None` for an unknown, released or expired id.
    /// A grant already revoked by [`GrantTable::clear`] (the connection
    /// is down) still gives its memory back to a matching hand-back: one
    /// the peer sent before it left, which the agent delivers in order.
    pub(crate) fn revoke(&self, id: u64, token: Option<&MrToken>) -> Option<Vec<u8>> {
        let mut grants = self.grants.borrow_mut();
        let Some(g) = grants.get(&id) else {
            drop(grants);
            let token = token?;
            let mut revoked = self.revoked.borrow_mut();
            let r = revoked.get(&id)?;
            if token.addr != r.addr || token.len != r.len || token.rkey != r.rkey {
                return None;
            }
            return revoked.remove(&id).map(|r| r.mem);
        };
        if let Some(t) = token {
            if t.addr != g.region.addr()
                || t.len != g.region.len() as u64
                || t.rkey != g.region.rkey()
            {
                return None;
            }
        }
        grants.remove(&id).and_then(|g| g.region.revoke())
    }

    /// Revokes grant `id` if its deadline has passed; true if it did.
    pub(crate) fn expire(&self, id: u64) -> bool {
        let mut grants = self.grants.borrow_mut();
        match grants.get(&id) {
            Some(g) if g.deadline <= Instant::now() => {
                if let Some(g) = grants.remove(&id) {
                    drop(g.region.revoke());
                }
                true
            }
            _ => false,
        }
    }

    /// The live grants' keys (see `Exposed::keys`).
    pub(crate) fn keys(&self) -> Vec<(MrToken, u32)> {
        let grants = self.grants.borrow();
        grants.iter().map(|(id, g)| g.region.keys(*id)).collect()
    }

    /// Live grants.
    pub(crate) fn len(&self) -> usize {
        self.grants.borrow().len()
    }

    /// Bytes of all live grants.
    pub(crate) fn bytes(&self) -> u64 {
        self.grants
            .borrow()
            .values()
            .map(|g| g.region.len() as u64)
            .sum()
    }

    /// Revokes everything (connection down): every rkey fails from now on.
    /// The memory is kept until [`GrantTable::forget_revoked`], for the
    /// hand-backs the peer sent before it left.
    pub(crate) fn clear(&self) {
        let all: Vec<(u64, Grant)> = self.grants.borrow_mut().drain().collect();
        for (id, g) in all {
            let (addr, len, rkey) = (g.region.addr(), g.region.len() as u64, g.region.rkey());
            let mem = g.region.revoke().unwrap_or_default();
            self.revoked.borrow_mut().insert(
                id,
                Revoked {
                    addr,
                    len,
                    rkey,
                    mem,
                },
            );
        }
    }

    /// Drops the memory of the grants [`GrantTable::clear`] revoked (the
    /// agent stopped: no hand-back can come any more).
    pub(crate) fn forget_revoked(&self) {
        let all: Vec<Revoked> = self.revoked.borrow_mut().drain().map(|(_, r)| r).collect();
        drop(all);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verbio_runtime::provider::{Context, SoftConfig};

    fn table() -> (GrantTable, Pd) {
        let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
        (GrantTable::default(), ctx.alloc_pd().expect("pd"))
    }

    #[test]
    fn refuses_unknown_released_forged_and_keeps_live_until_deadline() {
        let (t, pd) = table();
        let (tok, _) = t
            .grant(
                &pd,
                vec![7; 32],
                AccessFlags::REMOTE_READ,
                Duration::from_secs(60),
            )
            .unwrap();
        assert_eq!(tok.len, 32);
        assert_eq!(tok.access, AccessFlags::REMOTE_READ.bits());
        assert!(t.revoke(tok.token_id + 1, None).is_none(), "unknown id");
        let forged = MrToken {
            rkey: tok.rkey ^ 1,
            ..tok
        };
        assert!(
            t.revoke(tok.token_id, Some(&forged)).is_none(),
            "forged token"
        );
        assert!(!t.expire(tok.token_id), "not yet due");
        assert_eq!(t.revoke(tok.token_id, Some(&tok)), Some(vec![7; 32]));
        assert!(t.revoke(tok.token_id, None).is_none(), "already released");
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn expires_after_the_deadline() {
        let (t, pd) = table();
        let (tok, deadline) = t
            .grant(&pd, vec![0; 8], AccessFlags::REMOTE_WRITE, Duration::ZERO)
            .unwrap();
        assert!(deadline <= Instant::now());
        assert!(t.expire(tok.token_id));
        assert!(t.revoke(tok.token_id, None).is_none(), "expired");
        let (tok2, _) = t
            .grant(
                &pd,
                vec![0; 8],
                AccessFlags::REMOTE_WRITE,
                Duration::from_secs(60),
            )
            .unwrap();
        assert_ne!(tok2.token_id, tok.token_id, "ids are never reused");
        t.clear();
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_hand_back_sent_before_the_connection_went_down_still_returns_the_memory() {
        let (t, pd) = table();
        let grant = |fill| {
            t.grant(
                &pd,
                vec![fill; 16],
                AccessFlags::REMOTE_WRITE,
                Duration::from_secs(60),
            )
            .unwrap()
            .0
        };
        let (a, b, c) = (grant(1), grant(2), grant(3));
        t.clear();
        assert_eq!(t.len(), 0, "no grant is live once the connection is down");
        assert_eq!(t.bytes(), 0);
        // The peer's hand-back of `a`, delivered after the failure.
        assert_eq!(t.revoke(a.token_id, Some(&a)), Some(vec![1; 16]));
        assert!(t.revoke(a.token_id, Some(&a)).is_none(), "given back once");
        let forged = MrToken {
            addr: b.addr + 1,
            ..b
        };
        assert!(t.revoke(b.token_id, Some(&forged)).is_none(), "forged");
        assert!(
            t.revoke(b.token_id, None).is_none(),
            "a release gives nothing back"
        );
        assert_eq!(t.revoke(b.token_id, Some(&b)), Some(vec![2; 16]));
        // The agent stopped: what was not handed back is gone.
        t.forget_revoked();
        assert!(t.revoke(c.token_id, Some(&c)).is_none());
    }
}
