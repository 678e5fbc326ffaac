//! The engine thread's loop: handle what `poll` reported, do the work that
//! does not wait, decide how long to sleep, sleep without the engine lock.

use std::io;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use mio::{Events, Poll, Token};

use super::super::context::Shared;
use super::super::lock;
use super::super::wire::Wire;
use super::fine_timer::{FineTimer, TIMER};
use super::{env_us, Engine, CONN_BASE, DEFAULT_SPIN_US, LISTENER, WAKER};

/// How many leases in a row a sleeping engine lets pass without its loop
/// turn while applications hold its lock (then it waits for the lock: its
/// timers must run).
pub(crate) const LEASE_SKIPS: u32 = 4;

/// How the engine sleeps after a loop turn.
struct Sleep {
    /// How long (`None`: until woken).
    timeout: Option<Duration>,
    /// Yield the CPU first.
    yield_first: bool,
    /// Only to see whether leases ended (see `run`).
    lease_wake: bool,
    /// With `lease_wake`: the sockets whose leases those are, when the
    /// first ends, and when the engine must wake for anything else
    /// ([`Shared::nanos_at`]; `u64::MAX`: when woken).
    ///
    /// [`Shared::nanos_at`]: super::super::context::Shared::nanos_at
    leases: Vec<Arc<Wire>>,
    lease_at: u64,
    other: u64,
}

/// On a wake-up only to see whether leases ended: if the applications
/// renewed every one of them (they are still receiving), and nothing
/// else is due before the first ends (`other`, and what posting threads
/// and receives left since the last turn, `Shared::turn_by`), how long to
/// sleep on and whether that is again for a lease only. `None`: a lease
/// ended, or something else is due: the engine takes its lock and runs a
/// loop turn. (With the sleep again for a lease only: when it ends.)
///
/// This keeps an engine whose applications receive themselves from
/// waking for a whole loop turn every lease: that turn took locks an
/// application holds across a long system call (the MR table while it
/// writes or reads a large payload), and the engine then slept on them
/// and was woken again when they were released, two more thread switches
/// on the application's CPU per lease.
fn sleep_on(sh: &Shared, leases: &[Arc<Wire>], other: u64) -> Option<(Duration, Option<u64>)> {
    let now = sh.nanos_at(Instant::now());
    let lease = leases.iter().map(|w| w.lease_until()).min()?;
    if lease <= now || sh.stop.load(Ordering::SeqCst) || !lock(&sh.app_muted).is_empty() {
        return None;
    }
    let until = lease.min(other).min(sh.turn_by.load(Ordering::SeqCst));
    if until <= now {
        return None;
    }
    sh.wake_by.store(until, Ordering::SeqCst);
    // (A post or receive that needs a turn sooner either sees this
    // `wake_by` and rings, or its need is seen here; see
    // `Shared::notify_direct`.)
    if sh.turn_by.load(Ordering::SeqCst) < until || !lock(&sh.app_muted).is_empty() {
        return None;
    }
    Some((
        Duration::from_nanos(until - now),
        (until == lease).then_some(until),
    ))
}

/// The shared state of the engine `core`.
fn core_sh(core: &Mutex<Engine>) -> Arc<Shared> {
    lock(core).sh.clone()
}

/// Engine thread body: works under the engine lock, sleeps in `poll`
/// without it.
///
/// Woken only to see whether leases ended, the engine sleeps on without
/// a loop turn if the applications renewed them all and nothing else is
/// due (`sleep_on`), and does not wait for its lock if an application
/// holds it: that application is receiving, and renewing its leases; the
/// engine sleeps another lease instead (it is rung for anything else, or
/// wakes within a lease anyway). Either way up to `LEASE_SKIPS` times in a
/// row.
pub(crate) fn run(core: Arc<Mutex<Engine>>, mut poll: Poll) {
    let mut events = Events::with_capacity(256);
    let spin = env_us("VERBIO_SOFT_SPIN_US", DEFAULT_SPIN_US);
    // When the last completion was delivered, while no post followed.
    let mut spin_from: Option<Instant> = None;
    let timer = match FineTimer::new(poll.registry()) {
        Ok(t) => {
            let t = Arc::new(t);
            core_sh(&core).set_lease_timer(t.clone());
            Some(t)
        }
        Err(e) => {
            tracing::warn!(error = %crate::report::ErrorChain(&e), "soft engine: no timerfd: sub-millisecond deadlines wake it late");
            None
        }
    };
    let mut eng = lock(&core);
    loop {
        if let Some(t) = timer
            .as_ref()
            .filter(|_| events.iter().any(|e| e.token() == TIMER))
        {
            t.fired();
        }
        eng.handle_events(&events);
        let Some(Sleep {
            mut timeout,
            yield_first,
            mut lease_wake,
            mut leases,
            lease_at,
            other,
        }) = eng.turn(&mut spin_from, spin)
        else {
            tracing::debug!(addr = %eng.sh.addr, "soft engine stopped");
            return;
        };
        let sh = eng.sh.clone();
        drop(eng);
        if yield_first {
            std::thread::yield_now();
        }
        let mut skips = 0;
        // A sleep for leases only, which renewals may move later (see
        // `lease_sleep.rs`): until when.
        let mut movable = (lease_wake && timeout != Some(Duration::ZERO)).then_some(lease_at);
        let (res, guard) = loop {
            let res = match (&timer, movable) {
                (Some(_), Some(at)) if sh.begin_lease_sleep(at, other, &leases) => {
                    // The timer alone ends it; the poll's timeout is the
                    // next other deadline (the timer is armed for it too
                    // if it comes first, exactly).
                    let now = sh.nanos_at(Instant::now());
                    let backstop = (other != u64::MAX)
                        .then(|| Duration::from_nanos(other.saturating_sub(now)));
                    poll.poll(&mut events, backstop)
                }
                (Some(t), _) => poll.poll(&mut events, t.arm(timeout)),
                (None, _) => poll.poll(&mut events, timeout),
            };
            sh.end_lease_sleep();
            // (The timer is no event of its own: it only ends the sleep.)
            let timer_only = events.iter().all(|e| e.token() == TIMER);
            if lease_wake && res.is_ok() && timer_only && skips < LEASE_SKIPS {
                if let Some((t, again)) = sleep_on(&sh, &leases, other) {
                    skips += 1;
                    if let Some(t) = timer.as_ref().filter(|_| !events.is_empty()) {
                        t.fired();
                    }
                    sh.lease_sleeps.fetch_add(1, Ordering::Relaxed);
                    timeout = Some(t);
                    lease_wake = again.is_some();
                    movable = again;
                    continue;
                }
            }
            if !(lease_wake && res.is_ok() && timer_only) || skips == LEASE_SKIPS {
                break (res, lock(&core));
            }
            skips += 1;
            if let Some(t) = timer.as_ref().filter(|_| !events.is_empty()) {
                t.fired();
            }
            match core.try_lock() {
                Err(TryLockError::WouldBlock) => {
                    // Posting threads ring if they need us earlier (those
                    // that did not, as we were to wake by now, wait at most
                    // a lease more: their WRs' timeouts are detected that
                    // much later at worst). Everything else rings anyway.
                    timeout = Some(sh.lease);
                    movable = None;
                    let wake_by = sh.nanos_at(Instant::now() + sh.lease);
                    sh.wake_by.store(wake_by, Ordering::SeqCst);
                }
                Ok(g) => break (res, g),
                Err(TryLockError::Poisoned(p)) => break (res, p.into_inner()),
            }
        };
        eng = guard;
        // (Events other than the timer, or a poll that did not sleep, are
        // not wake-ups by time.)
        if res.is_ok()
            && timeout != Some(Duration::ZERO)
            && events.iter().all(|e| e.token() == TIMER)
        {
            eng.sh.timer_wakes.fetch_add(1, Ordering::Relaxed);
        }
        leases.clear();
        eng.lease_wires = leases;
        eng.sh.sleeping.store(false, Ordering::SeqCst);
        eng.sh.wakes.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = res {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::error!(error = %crate::report::ErrorChain(&e), "soft engine: poll failed");
                return;
            }
            events.clear();
        }
    }
}

impl Engine {
    /// Handles what the last `poll` reported.
    fn handle_events(&mut self, events: &Events) {
        let now = Instant::now();
        for ev in events.iter() {
            match ev.token() {
                WAKER | TIMER => {}
                LISTENER => self.accept_all(),
                Token(t) => {
                    let cid = t - CONN_BASE;
                    if ev.is_writable() {
                        self.on_writable(cid);
                    }
                    if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                        // An application drives this connection: stop
                        // watching its input until the lease ends.
                        if ev.is_readable() && !self.sh.lease.is_zero() {
                            self.mute(cid, now);
                        }
                        self.on_readable(cid, ev.is_read_closed() || ev.is_error());
                    }
                }
            }
        }
        // What arrived completed WRs: their consumers are woken at the
        // turn's end, once per CQ, after the answers (ACKs) were written
        // or parked for the consumers' own writes (an answer posted before
        // that would have to queue behind them).
    }

    /// The end of a turn, the engine's own ([`turn`](Self::turn)) or one
    /// an application's receive drives (`drive.rs`): the connections whose
    /// ACKs were held for a post to ride with are served with the other
    /// active ones, the request posts corked behind the ACKs this turn read
    /// go out (see `Shared::flush_corked`), the overflows of this turn and
    /// of the last turn's events fail, and the events are raised. True if
    /// serving left work that does not wait for a socket.
    #[inline(always)]
    pub(crate) fn end_turn(&mut self) -> bool {
        let mut held = std::mem::take(&mut self.held);
        for cid in held.drain(..) {
            self.activate(cid);
        }
        self.held = held;
        let busy = self.service_active(false);
        self.sh.flush_corked();
        self.fail_overflowed();
        self.raise_events();
        busy
    }

    /// One loop turn: the work that does not wait. Returns how to sleep,
    /// `None` to stop.
    fn turn(&mut self, spin_from: &mut Option<Instant>, spin: Duration) -> Option<Sleep> {
        if self.sh.stop.load(Ordering::SeqCst) {
            // Best effort: queued responses leave before the sockets close.
            for cid in std::mem::take(&mut self.held) {
                self.activate(cid);
            }
            self.service_active(true);
            self.raise_events();
            return None;
        }
        // (The engine is awake: an application's receive need not ring it.)
        self.kick = false;
        // (What posts and receives left from here on is theirs to note.)
        self.sh.turn_by.store(u64::MAX, Ordering::SeqCst);
        let posted = self.service_dirty();
        let now = Instant::now();
        if posted {
            // The post the spin waited for came: what follows is the
            // network's turn.
            *spin_from = None;
        }
        if self.sh.completed.swap(false, Ordering::Relaxed) {
            *spin_from = Some(now);
        }
        self.timers(now);
        self.sweep_port(now);
        self.resume_proven();
        self.retry_conn_waits();
        self.adopt_app_muted();
        self.expire_leases(now);
        let busy = self.end_turn();
        let awaiting_post = spin_from.is_some_and(|t| now.duration_since(t) < spin);
        let mut yield_first = false;
        let mut lease_wake = false;
        let mut other = None;
        let mut lease_at = 0;
        let mut timeout = if busy {
            Some(Duration::ZERO)
        } else if awaiting_post || self.awaits_post_for_held(now) {
            // A completion was just delivered and its application has
            // not posted since: it is likely to post at once, so stay
            // awake a little (no doorbell syscall and wakeup for that
            // post; held ACKs wait for it), but let other threads run.
            // Waiting for the network needs no spinning: data arriving
            // wakes the poll (and an idle CPU is worth more to the woken
            // threads on a small machine).
            yield_first = true;
            Some(Duration::ZERO)
        } else {
            let (deadline, lease_only, not_lease) = self.next_deadline();
            lease_wake = lease_only;
            lease_at = deadline.map_or(0, |d| self.sh.nanos_at(d));
            other = not_lease.into_iter().chain(self.port.wake_at()).min();
            match (deadline, self.port.wake_at()) {
                // The port's deadline comes first.
                (d, Some(p)) if d.is_none_or(|d| p < d) => {
                    lease_wake = false;
                    Some(p.saturating_duration_since(now))
                }
                (d, _) => d.map(|d| d.saturating_duration_since(now)),
            }
        };
        let mut leases = std::mem::take(&mut self.lease_wires);
        if lease_wake {
            let Engine { muted, conns, .. } = self;
            leases.extend(
                muted
                    .iter()
                    .filter_map(|&cid| conns.get(cid)?.stream.clone()),
            );
        }
        if timeout != Some(Duration::ZERO) {
            // Posting threads that transmit themselves ring only if we
            // would not wake in time to time their WRs out.
            let wake_by = timeout.map_or(u64::MAX, |t| self.sh.nanos_at(now + t));
            self.sh.wake_by.store(wake_by, Ordering::SeqCst);
            // (A ring from here on is for this sleep: see `Shared::rung`.)
            self.sh.rung.store(false, Ordering::SeqCst);
            self.sh.sleeping.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            // (Work queued before `sleeping` was seen: no one rang for it.)
            if !lock(&self.sh.dirty).is_empty()
                || !lock(&self.sh.app_muted).is_empty()
                || self.sh.stop.load(Ordering::SeqCst)
            {
                timeout = Some(Duration::ZERO);
            }
        }
        Some(Sleep {
            timeout,
            yield_first,
            lease_wake,
            leases,
            lease_at,
            other: other.map_or(u64::MAX, |o| self.sh.nanos_at(o)),
        })
    }

    /// True if ACKs the engine holds wait for a post it should stay awake
    /// for: ACKs held by its own receive. Those an application's receive
    /// held (on a connection it drives, see `drive.rs`) wait for that
    /// application's post, which takes them along without the engine; the
    /// engine sleeps until their hold ends (the receive rang it if it would
    /// sleep much longer), and does not keep its lock busy meanwhile, which
    /// would make the application's next receive wait for it.
    pub(crate) fn awaits_post_for_held(&self, now: Instant) -> bool {
        let t = self.sh.nanos_at(now);
        self.held.iter().any(|&cid| {
            self.conns.get(cid).is_some_and(|c| match &c.stream {
                Some(w) => w.lease_until() <= t,
                None => true,
            })
        })
    }

    /// The time (see `clock`).
    pub(crate) fn now(&self) -> Instant {
        self.clock.unwrap_or_else(Instant::now)
    }

    /// Raises the channel events of the CQs that completions disarmed.
    pub(crate) fn raise_events(&mut self) {
        let mut list = std::mem::take(&mut self.fired_buf);
        std::mem::swap(&mut list, &mut *lock(&self.sh.fired));
        for cq in list.drain(..) {
            cq.signal(self.quiet.as_deref());
        }
        self.fired_buf = list;
    }
}
