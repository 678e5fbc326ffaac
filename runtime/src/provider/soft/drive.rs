//! App-driven receive: an application that busy-polls a CQ receives for
//! it on its own thread, instead of waiting for the engine thread to wake,
//! read, and deliver (one thread hand-off fewer per message).
//!
//! When a poll finds the CQ empty, and the CQ was polled empty before
//! without being armed (the application busy-polls; a sleeping one arms
//! the CQ first), the poll takes the engine lock if it is free (never
//! waiting for it: if the engine works, the engine delivers) and runs the
//! engine's own receive code on the connections whose packets complete
//! the CQ's WRs: it reads their sockets (non-blocking), places data,
//! produces completions, and writes the ACKs and responses (or parks ACKs
//! for its next post to take along). Then it polls again.
//!
//! So that the engine thread does not wake for the packets the application
//! reads, every driving poll renews a lease on the connection (about 1 ms,
//! `VERBIO_SOFT_LEASE_US`; 0 turns app-driven receive off), and the engine,
//! when its poll reports input on a leased connection, stops watching the
//! socket's input ("mutes" it: the registration keeps WRITABLE only). It
//! watches it again when the lease runs out (it wakes for that while it has
//! muted sockets, unless the renewals moved that wake-up later, see
//! `engine/lease_sleep.rs`; finding its lock held by an application, which
//! is receiving and so renewing leases, it sleeps on, for up to
//! `LEASE_SKIPS` leases), or at once when an application arms a CQ the
//! connection feeds that has no completion channel to wake it (arming such
//! a CQ ends the lease, and the engine never mutes a socket while one is
//! armed).
//! Arming a CQ with a channel puts the connection's socket in the channel's
//! set, renews the lease and mutes the socket (the engine adopts it into its
//! list of muted ones, for the lease's end): the sleeping application
//! wakes on the packet, the engine does not, and the application's
//! `get_event` receives (`channel.rs`); if the engine keeps its lock
//! (over `DRIVE_WAIT`), or writes to the connection, the socket goes to the
//! engine at once. Arming also writes the ACKs the application's receives
//! held for its next request to take along (`Cq::req_notify`): none comes
//! while it sleeps, and its peer may wait for them (a requester whose next
//! request waits for a completion); the engine would send them only when
//! it next woke, up to a lease later. Data that arrived meanwhile makes the engine's poll
//! report the socket as soon as it watches it again. The engine keeps its
//! timers, connections and everything else; an RNR wait an application's
//! receive started rings it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, Instant};

use slab::Slab;
use smallvec::SmallVec;

use super::channel::Channel;
use super::conn::Conn;
use super::context::Context;
use super::cq::CqShared;
use super::engine::{EQp, Engine};
use super::lock;
use super::wire::LeaseCheck;
use super::IdMap;

/// How long a sleeping application woken by a packet waits for the engine
/// lock before it leaves the receive to the engine.
const DRIVE_WAIT: Duration = Duration::from_micros(20);

impl Context {
    /// Receives for `cq` on this thread, if the engine is not at work.
    pub(crate) fn drive(&self, cq: &CqShared) {
        let mut eng = match self.core().try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        eng.drive(cq);
    }

    /// Receives on connections `cids` on this thread, if the engine is not
    /// at work (false if it is).
    /// `quiet`: the channel whose `get_event` receives (its events are
    /// queued without a signal: the caller takes them).
    ///
    /// The engine holds its lock only for a loop turn (it sleeps without
    /// it), so this waits up to `DRIVE_WAIT` for it: an engine awake for
    /// something else (a timer, its spin after a delivery) must not take
    /// the receive over, which would keep it awake for the next one.
    pub(crate) fn drive_conns(&self, cids: &[usize], quiet: Option<&Arc<Channel>>) -> bool {
        let mut until = None;
        let mut eng = loop {
            match self.core().try_lock() {
                Ok(g) => break g,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    let now = Instant::now();
                    if *until.get_or_insert(now + DRIVE_WAIT) <= now {
                        return false;
                    }
                    std::thread::yield_now();
                }
            }
        };
        eng.quiet = quiet.cloned();
        eng.drive_conns(cids);
        eng.quiet = None;
        true
    }
}

impl Engine {
    /// An application's receive for `cq` (under the engine lock): reads
    /// the CQ's connections, then does what the engine's loop turn does
    /// with what arrived.
    pub(crate) fn drive(&mut self, cq: &CqShared) {
        let Some(feeds) = self.cq_feeds.get(&cq.handle) else {
            return;
        };
        let cids: SmallVec<[usize; 4]> = feeds.iter().copied().collect();
        self.drive_conns(&cids);
    }

    /// An application's receive on connections `cids` (under the engine
    /// lock), as [`drive`](Self::drive).
    pub(crate) fn drive_conns(&mut self, cids: &[usize]) {
        let now = Instant::now();
        self.clock = Some(now);
        let until = self.sh.nanos_at(now + self.sh.lease);
        // (The engine's spin after its own deliveries is not for these.)
        let completed = self.sh.completed.load(Ordering::Relaxed);
        self.in_app = true;
        let packets = self.app_packets;
        let mut renewed = false;
        for &cid in cids {
            match self.conns.get(cid) {
                Some(Conn {
                    stream: Some(w),
                    connected: true,
                    ..
                }) => w.renew_lease(until),
                _ => continue,
            }
            renewed = true;
            self.on_readable(cid, false);
        }
        // ACKs held for a post to ride with go out once due.
        let busy = self.end_turn();
        self.sh.completed.store(completed, Ordering::Relaxed);
        self.in_app = false;
        self.clock = None;
        let handled = self.app_packets != packets;
        if busy || std::mem::take(&mut self.kick) || self.engine_sleeps_too_long(handled) {
            // Work left that does not wait for the socket, or timers the
            // sleeping engine does not know of.
            self.sh.ring();
        } else if renewed {
            // An engine asleep for these leases only sleeps on (not past
            // what this receive left it: `turn_by`).
            self.sh.lease_renewed(until);
        }
    }

    /// True if the sleeping engine would not wake in time for what this
    /// receive left it (the application may stop polling now): ACKs held
    /// for a post to ride with (sent once their hold ends, should no post
    /// come), and, if packets were handled, the timers they may have
    /// started (ACK timeouts, RNR waits: the engine's first deadline, which
    /// they queued).
    ///
    /// ACKs held on a connection the engine has muted for this
    /// application's lease need no wake-up of their own: the engine wakes
    /// when that lease ends (by then, or the lease was renewed by a receive,
    /// which sends them once due, or by an arming, which writes them), and
    /// the lease, just renewed, ends before their hold plus a lease. Noted
    /// as a need (`turn_by`), they made the engine's next wake-up for
    /// leases a whole loop turn even after a post had taken them along,
    /// about once a lease while the application answered.
    fn engine_sleeps_too_long(&self, handled: bool) -> bool {
        let held = self
            .held
            .iter()
            .filter_map(|&c| {
                let conn = self.conns.get(c)?;
                let need = conn.ack_hold? + self.sh.lease;
                let leased = self.muted.contains(&c)
                    && conn
                        .stream
                        .as_ref()
                        .is_some_and(|w| w.lease_until() <= self.sh.nanos_at(need));
                (!leased).then_some(need)
            })
            .min();
        let timers = handled.then(|| self.first_due()).flatten();
        let Some(need) = held.into_iter().chain(timers).min() else {
            return false;
        };
        let need = self.sh.nanos_at(need);
        // (A wake-up for leases only must not skip its turn: see
        // `engine/run.rs`.)
        self.sh.turn_by.fetch_min(need, Ordering::SeqCst);
        // (`wake_by` is current while the engine sleeps: it set it under
        // the engine lock, which we hold, or, on a wake-up for leases only,
        // after reading `turn_by`, which it reads again after.)
        self.sh.sleeping.load(Ordering::SeqCst) && self.sh.wake_by.load(Ordering::SeqCst) > need
    }

    /// The engine's poll reported input on `cid`: stop watching it while
    /// an application's lease lasts.
    pub(crate) fn mute(&mut self, cid: usize, now: Instant) {
        let Some(conn) = self.conns.get(cid) else {
            return;
        };
        let Some(w) = &conn.stream else {
            return;
        };
        // (An application sleeping on an armed CQ's channel wakes when the
        // socket receives, if the socket is in the channel's set.)
        let armed = || {
            conn.cqs
                .iter()
                .any(|(_, c)| c.upgrade().is_some_and(|c| c.armed() && !c.app_wakes(w)))
        };
        if w.mute(&self.sh.registry, self.sh.nanos_at(now), armed) {
            self.muted.push(cid);
        }
    }

    /// Takes over the connections applications muted (see
    /// [`Shared::app_muted`](super::context::Shared::app_muted)): their
    /// leases expire as those of the ones the engine muted.
    pub(crate) fn adopt_app_muted(&mut self) {
        let mut list = std::mem::take(&mut self.adopted);
        std::mem::swap(&mut *lock(&self.sh.app_muted), &mut list);
        for cid in list.drain(..) {
            if !self.muted.contains(&cid) {
                self.muted.push(cid);
            }
        }
        self.adopted = list;
    }

    /// Watches the input of muted connections again once their lease ended.
    pub(crate) fn expire_leases(&mut self, now: Instant) {
        if self.muted.is_empty() {
            return;
        }
        let t = self.sh.nanos_at(now);
        let Engine {
            muted, conns, sh, ..
        } = self;
        muted.retain(|&cid| {
            let Some(w) = conns.get(cid).and_then(|c| c.stream.as_ref()) else {
                return false;
            };
            match w.unmute_expired(&sh.registry, t) {
                LeaseCheck::Muted => true,
                LeaseCheck::Unmuted { unread } => {
                    // (Data no application read waited for the lease's end.)
                    if unread {
                        sh.stale_leases.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(cid, "soft engine: a lease ended with unread data");
                    }
                    false
                }
            }
        });
    }

    /// When the first lease of a muted connection ends.
    pub(crate) fn lease_deadline(&self) -> Option<Instant> {
        self.muted
            .iter()
            .filter_map(|&cid| self.conns.get(cid)?.stream.as_ref())
            .map(|w| w.lease_until())
            .min()
            .map(|n| self.sh.instant_at(n))
    }

    /// Forgets connection `cid` (being closed) in the CQs it fed.
    pub(crate) fn forget_feeds(&mut self, cid: usize, conn: &Conn) {
        for list in self.cq_feeds.values_mut() {
            list.retain(|c| *c != cid);
        }
        if let Some(wire) = &conn.stream {
            for cq in conn.cqs.iter().filter_map(|(_, c)| c.upgrade()) {
                lock(&cq.feeds).retain(|w| !Arc::ptr_eq(w, wire));
            }
        }
        for eq in self.qps.values_mut() {
            if eq.rx_conn == Some(cid) {
                eq.rx_conn = None;
            }
            if eq.resp_conn == Some(cid) {
                eq.resp_conn = None;
            }
        }
        self.muted.retain(|c| *c != cid);
    }
}

#[cfg(test)]
#[path = "drive_tests.rs"]
pub(crate) mod tests;

/// A packet for `eq` arrived on `cid`: its CQs are fed by that connection.
pub(crate) fn note_feed(
    feeds: &mut IdMap<SmallVec<[usize; 2]>>,
    conns: &mut Slab<Conn>,
    eq: &mut EQp,
    cid: usize,
) {
    if eq.rx_conn == Some(cid) {
        return;
    }
    eq.rx_conn = Some(cid);
    let Some(conn) = conns.get_mut(cid) else {
        return;
    };
    // (The loopback connection has no socket to read.)
    let Some(wire) = conn.stream.clone() else {
        return;
    };
    // (CQs destroyed meanwhile are forgotten here.)
    conn.cqs.retain(|(handle, c)| {
        let alive = c.strong_count() > 0;
        if !alive {
            feeds.remove(handle);
        }
        alive
    });
    for cq in [&eq.sh.recv_cq, &eq.sh.send_cq] {
        let list = feeds.entry(cq.handle).or_default();
        if !list.contains(&cid) {
            list.push(cid);
        }
        if !conn.cqs.iter().any(|(_, c)| c.as_ptr() == Arc::as_ptr(cq)) {
            conn.cqs.push((cq.handle, Arc::downgrade(cq)));
        }
        let mut f = lock(&cq.feeds);
        if !f.iter().any(|w| Arc::ptr_eq(w, &wire)) {
            f.push(wire.clone());
        }
    }
}
