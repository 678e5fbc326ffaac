//! An engine asleep only until a lease ends, whose timer the applications
//! renewing that lease move later.
//!
//! An engine that muted sockets for applications' leases (`drive.rs`)
//! must wake when a lease ends, to take back the socket of an application
//! that stopped receiving. An application that keeps receiving renews its
//! lease every poll, and the engine used to wake at each old end to find
//! it renewed and sleep on (`lease_sleeps`): about once a lease (1 ms),
//! two thread switches on the application's CPU each, more than the
//! messages' own at 1 MiB one at a time.
//!
//! Now the engine sleeps for leases only on its timerfd alone (its poll's
//! timeout is its next other deadline), and publishes that sleep here:
//! when it wakes, which sockets' leases it waits for, and the first other
//! deadline. An application renewing a lease (`Shared::lease_renewed`)
//! that finds the engine due to wake over half a lease before the renewed
//! end moves the timer to the new end of the first of those leases
//! (never past the first other deadline, nor past what posting threads
//! and receives left since the engine's last turn, `Shared::turn_by`): one
//! `timerfd_settime` per half lease at most, instead of two switches per
//! lease. An application that stops renewing leaves the timer where it
//! was: the engine wakes when that lease ends, as before.
//!
//! Posting threads trust `Shared::wake_by` (they ring only if the engine
//! would wake after their need): a mover raises it before it moves the
//! timer, then reads `turn_by` (as the engine's own `sleep_on`), so the
//! engine never wakes later than `wake_by` says. Moves and the engine's
//! arming are serialized by the lock; the engine ends the sleep under it
//! when it wakes, after which no application moves its timer.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::context::Shared;
use super::super::lock;
use super::super::wire::Wire;
use super::fine_timer::FineTimer;

/// The engine's current sleep for leases only (see the module docs).
#[derive(Default)]
pub(crate) struct LeaseSleep {
    /// The engine's timer (none without a timerfd: then no sleep is
    /// published and nothing moves).
    timer: Option<Arc<FineTimer>>,
    /// When the engine wakes ([`Shared::nanos_at`]; 0: it is not asleep
    /// for leases only).
    wake: u64,
    /// Its first deadline that is not a lease's (`u64::MAX`: none).
    cap: u64,
    /// The muted sockets whose leases it waits for.
    wires: Vec<Arc<Wire>>,
}

impl Shared {
    /// Engine: gives its timer to the applications that move it.
    pub(crate) fn set_lease_timer(&self, timer: Arc<FineTimer>) {
        lock(&self.lease_sleep).timer = Some(timer);
    }

    /// Engine, before it sleeps: sleeps until `until` for the leases of
    /// `wires` only (its next other deadline is `cap`) on its timer, which
    /// renewals may move. False if it cannot (no timer, the time passed,
    /// arming failed): then it sleeps with a timeout as before.
    pub(crate) fn begin_lease_sleep(&self, until: u64, cap: u64, wires: &[Arc<Wire>]) -> bool {
        let mut s = lock(&self.lease_sleep);
        let Some(timer) = s.timer.clone() else {
            return false;
        };
        let now = self.nanos_at(Instant::now());
        if until <= now || !timer.arm_exact(Duration::from_nanos(until - now)) {
            return false;
        }
        s.wake = until;
        s.cap = cap;
        s.wires.clear();
        s.wires.extend(wires.iter().cloned());
        self.lease_wake_hint.store(until, Ordering::SeqCst);
        true
    }

    /// Engine, woken: no application moves its timer from here on.
    pub(crate) fn end_lease_sleep(&self) {
        // (Only the engine publishes a sleep: none published, none to end.)
        if self.lease_wake_hint.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut s = lock(&self.lease_sleep);
        s.wake = 0;
        s.wires.clear();
        self.lease_wake_hint.store(0, Ordering::SeqCst);
    }

    /// Application: it renewed a lease to `until`. If the engine sleeps
    /// for leases only and would wake more than half a lease before that,
    /// moves its wake-up to the first end of the leases it waits for.
    pub(crate) fn lease_renewed(&self, until: u64) {
        let half = u64::try_from(self.lease.as_nanos() / 2).unwrap_or(u64::MAX);
        let hint = self.lease_wake_hint.load(Ordering::Relaxed);
        if hint == 0 || hint.saturating_add(half) >= until {
            return;
        }
        let mut s = lock(&self.lease_sleep);
        if s.wake == 0 {
            return;
        }
        let Some(timer) = s.timer.clone() else {
            return;
        };
        let first = s.wires.iter().map(|w| w.lease_until()).min().unwrap_or(0);
        let to = first.min(s.cap);
        if to <= s.wake {
            return;
        }
        // (Posting threads that read this ring if they need the engine
        // sooner; those that read the old one are in `turn_by`.)
        self.wake_by.store(to, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let to = to.min(self.turn_by.load(Ordering::SeqCst));
        let now = self.nanos_at(Instant::now());
        if to <= s.wake || to <= now || !timer.arm_exact(Duration::from_nanos(to - now)) {
            return;
        }
        s.wake = to;
        self.lease_wake_hint.store(to, Ordering::SeqCst);
        self.lease_moves.fetch_add(1, Ordering::Relaxed);
    }
}
