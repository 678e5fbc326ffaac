//! [`Runtime`] and its [`Builder`]: the loop that ties the executor, the
//! driver (CQs, sockets) and the timers together.

use std::cell::Cell;
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::driver::{Driver, WAKER_TOKEN};
use super::executor::Executor;
use super::spin::SpinPacer;
use super::timer::Timers;
use super::{Config, Handle, Inner, JoinHandle, RuntimeError, RuntimeStats};
use crate::op::Counters;

/// Every this many loop iterations without sleeping, sockets and channels
/// are polled anyway (zero timeout) and due timers fired, so busy tasks
/// cannot starve them.
const IO_EVERY: u32 = 16;

/// Busy-poll spins between two zero-timeout polls of the sockets, counted
/// across spin sessions (so that short ones, one per op, still add up to
/// a poll now and then, but cost no syscall per op).
const SPINS_PER_IO_POLL: u32 = 1024;

/// Configures a [`Runtime`].
#[derive(Clone, Debug)]
pub struct Builder {
    busy_poll: Duration,
    cq_batch: usize,
    task_budget: usize,
    op_slots: usize,
    events: usize,
    drain_timeout: Duration,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            busy_poll: Duration::ZERO,
            cq_batch: 32,
            task_budget: 128,
            op_slots: 1024,
            events: 256,
            drain_timeout: Duration::from_secs(2),
        }
    }
}

impl Builder {
    /// Spin on the CQs for up to `d` before sleeping (latency mode, like
    /// perftest's busy polling). Default: zero (sleep at once).
    ///
    /// The spinning reads the clock only every so many polls of the CQs,
    /// about every 50 µs (or every quarter of `d` if that is shorter), as
    /// measured while spinning: a read costs close to a microsecond where
    /// the clocksource is emulated, as in many VMs. So the spin lasts up to
    /// that much longer than `d`, and a timer due meanwhile fires up to
    /// that much late; a wait that ends within that time reads no clock.
    pub fn busy_poll(mut self, d: Duration) -> Self {
        self.busy_poll = d;
        self
    }

    /// Completions taken per `poll` call (default 32).
    pub fn cq_poll_batch(mut self, n: usize) -> Self {
        self.cq_batch = n.max(1);
        self
    }

    /// Task polls per loop iteration before the CQs and sockets get a turn
    /// (default 128).
    pub fn task_budget(mut self, n: usize) -> Self {
        self.task_budget = n.max(1);
        self
    }

    /// Op slots preallocated in the wr_id slab (default 1024; it grows past
    /// that, allocating).
    pub fn op_slots(mut self, n: usize) -> Self {
        self.op_slots = n;
        self
    }

    /// epoll events taken per wake-up (default 256).
    pub fn event_capacity(mut self, n: usize) -> Self {
        self.events = n;
        self
    }

    /// How long dropping the runtime waits (default 2 s): first, for up to
    /// half of it, for sends already posted (an inline send returns at its
    /// post) to reach the peer while every QP is still up; then, with the
    /// QPs in ERR, for in-flight work requests to complete or flush, before
    /// leaking the buffers the device may still touch.
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.drain_timeout = d;
        self
    }

    /// Creates the runtime and makes it this thread's current one.
    pub fn build(self) -> Result<Runtime, RuntimeError> {
        if Handle::try_current().is_some() {
            return Err(RuntimeError::AlreadyExists);
        }
        let poll = mio::Poll::new().map_err(|source| RuntimeError::Io {
            context: "creating the epoll instance",
            source,
        })?;
        let mio_waker =
            mio::Waker::new(poll.registry(), WAKER_TOKEN).map_err(|source| RuntimeError::Io {
                context: "creating the reactor's waker",
                source,
            })?;
        let driver = Driver::new(poll, self.events, self.op_slots, self.cq_batch)?;
        let handle = Handle {
            inner: Rc::new(Inner {
                driver,
                executor: Executor::new(mio_waker),
                timers: Timers::new(),
                config: Config {
                    busy_poll: self.busy_poll,
                    task_budget: self.task_budget,
                    drain_timeout: self.drain_timeout,
                },
                in_block_on: Cell::new(false),
                pass_hooks: Default::default(),
            }),
        };
        Handle::set_current(Some(handle.clone()));
        Ok(Runtime {
            handle,
            io_countdown: Cell::new(IO_EVERY),
            events_left: Cell::new(false),
            spins_to_io: Cell::new(SPINS_PER_IO_POLL),
            spin: SpinPacer::new(self.busy_poll),
        })
    }
}

/// What one [`Runtime::turn`] left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Turn {
    /// Work is ready: call `turn` again without waiting.
    pub ready: bool,
    /// The earliest timer deadline, if any: wait on the fd no longer than that.
    pub next_timer: Option<Instant>,
}

impl Turn {
    /// How long a driver may wait on [`Runtime::as_raw_fd`] before turning
    /// again (`Some(ZERO)` if work is ready, `None` = until the fd is readable).
    pub fn wait_for(&self) -> Option<Duration> {
        if self.ready {
            return Some(Duration::ZERO);
        }
        self.next_timer
            .map(|d| d.saturating_duration_since(Instant::now()))
    }
}

/// A single-threaded runtime (`!Send`): local executor, CQ/socket reactor
/// and timers. One per thread; it is the thread's current runtime from
/// creation until it is dropped.
///
/// Dropping it drops every task, moves every QP still open to ERR, and waits
/// up to the drain timeout for the in-flight work requests to complete or
/// flush, so that parked buffers are freed only once the device is done
/// with them. Buffers still in flight after the timeout are leaked on
/// purpose (with a warning), never freed under the device.
///
/// # Example
///
/// ```
/// # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use std::time::Duration;
/// use verbio::runtime::{sleep, spawn, timeout, Runtime};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?; // this thread's runtime
/// let answer = rt.block_on(async {
///     let task = spawn(async {
///         sleep(Duration::from_millis(1)).await;
///         42
///     });
///     // A wait that cannot last for ever: `Err(Elapsed)` after 5 s;
///     // `task.result()` would give a panic of the task as a `JoinError`.
///     timeout(Duration::from_secs(5), task).await
/// })?;
/// assert_eq!(answer, 42);
/// # Ok(())
/// # }
/// ```
pub struct Runtime {
    handle: Handle,
    io_countdown: Cell<u32>,
    /// Events may wait behind the epoll fd that no new readiness will tell
    /// of: a turn was told of readiness (or, [`turn`](Self::turn), takes
    /// events anyway) and returned busy before its `epoll_wait`, or that
    /// wait filled its batch. The next turn that gets that far takes them.
    events_left: Cell<bool>,
    /// Busy-poll spins left before the sockets are polled.
    spins_to_io: Cell<u32>,
    /// Which busy-poll spins read the clock.
    spin: SpinPacer,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("tasks", &self.handle.inner.executor.task_count())
            .field("ops", &self.handle.ops().len())
            .finish()
    }
}

impl Runtime {
    /// A runtime with default settings.
    pub fn new() -> Result<Runtime, RuntimeError> {
        Builder::default().build()
    }

    /// Settings: busy poll, CQ batch, task budget, ...
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// The runtime's handle.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Spawns a local task.
    pub fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        self.handle.spawn(fut)
    }

    /// Runs `fut` to completion on this thread, driving every task, op,
    /// timer and socket meanwhile.
    ///
    /// # Panics
    ///
    /// If called from inside `block_on` (nested), or if `fut` panics (the
    /// panic propagates). A spawned task's panic ends that task only (see
    /// [`JoinHandle`](super::JoinHandle)); `fut` sees it if it awaits the
    /// task's handle.
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        let inner = &self.handle.inner;
        assert!(
            !inner.in_block_on.replace(true),
            "Runtime::block_on called from inside block_on"
        );
        struct Exit<'a>(&'a Cell<bool>, &'a super::driver::Driver);
        impl Drop for Exit<'_> {
            fn drop(&mut self) {
                self.0.set(false);
                // (After a panic of the future: what it submitted is posted.)
                self.1.end_batch();
            }
        }
        let _exit = Exit(&inner.in_block_on, &inner.driver);
        let mut fut = pin!(fut);
        let waker = inner.executor.main_waker().clone();
        let mut cx = Context::from_waker(&waker);
        inner.executor.wake_main();
        loop {
            if inner.executor.take_main_woken() {
                inner.driver.begin_batch();
                let res = fut.as_mut().poll(&mut cx);
                inner.driver.end_batch();
                if let Poll::Ready(v) = res {
                    return v;
                }
            }
            if !self.tick() {
                self.park();
            }
        }
    }

    /// One non-blocking iteration of the loop, for driving the runtime from
    /// another executor or thread: run ready tasks, drain the CQs, take
    /// socket/channel events without waiting, fire timers, and if idle arm
    /// the CQs. Afterwards wait until [`as_raw_fd`](AsRawFd::as_raw_fd) is
    /// readable (or [`Turn::wait_for`] passes) and turn again.
    ///
    /// Call it on the runtime's thread, after polling your own futures (a
    /// [`Sleep`](super::Sleep) polled by them may move the next deadline).
    /// Under tokio, for example (a `LocalSet` on the same thread):
    ///
    /// ```text
    /// let fd = tokio::io::unix::AsyncFd::new(rt.as_raw_fd())?;
    /// loop {
    ///     let t = rt.turn();
    ///     if t.ready { tokio::task::yield_now().await; continue; }
    ///     let wait = t.wait_for().unwrap_or(Duration::from_secs(3600));
    ///     if let Ok(guard) = tokio::time::timeout(wait, fd.readable()).await {
    ///         guard?.clear_ready();
    ///     }
    /// }
    /// ```
    pub fn turn(&self) -> Turn {
        self.turn_taking(true, true)
    }

    /// A [`turn`](Self::turn) for a driver that watches the epoll fd
    /// edge-triggered and knows whether it became readable since the last
    /// turn: with `readable` false, and every completion channel an
    /// edge-triggered source
    /// ([`ProviderCaps::edge_triggered_channel`](crate::provider::ProviderCaps)),
    /// the turn makes no `epoll_wait`. The events behind the fd are then
    /// all ones its driver will be told of (and turn for); with a channel
    /// that is no such source (the software device's) the turn takes
    /// events as `turn` does, since there the wait is what finds them.
    ///
    /// With `timers` false an idle turn fires no timer and so reads no
    /// clock: for a driver that waits for [`Turn::next_timer`] with a timer
    /// of its own and turns with `timers` true once that one fired (a clock
    /// read per idle turn is a system call where the clocksource is
    /// emulated, e.g. in a VM). Busy turns still fire due timers every few
    /// turns, as [`turn`](Self::turn)'s do.
    #[cfg(feature = "tokio")]
    pub(crate) fn turn_told(&self, readable: bool, timers: bool) -> Turn {
        self.turn_taking(
            readable || !self.handle.inner.driver.channels_edge_safe(),
            timers,
        )
    }

    fn turn_taking(&self, take_events: bool, fire_timers: bool) -> Turn {
        let inner = &self.handle.inner;
        // Kept until a turn gets as far as the `epoll_wait`: a busy turn
        // returns before it, and the readiness it was told of is not told
        // again.
        if take_events {
            self.events_left.set(true);
        }
        // Between turns the runtime counts as asleep, so that cross-thread
        // wakes kick the epoll fd the outside driver waits on.
        inner
            .executor
            .shared
            .sleeping
            .store(false, Ordering::SeqCst);
        self.tick();
        if inner.executor.has_ready() || inner.pass_hooks.has_pending() {
            return self.turn_result(true);
        }
        let d = &inner.driver;
        d.arm_cqs();
        if d.drain_cqs() > 0 {
            return self.turn_result(true);
        }
        // A full batch of events means more may be pending in epoll: with
        // an edge-triggered outer poller they would raise no new edge.
        let saturated = if self.events_left.get() {
            match d.poll_io(Some(Duration::ZERO)) {
                Ok(n) => n >= d.event_capacity(),
                Err(e) => {
                    tracing::warn!(error = %crate::report::ErrorChain(&e), "epoll failed");
                    false
                }
            }
        } else {
            false
        };
        self.events_left.set(saturated);
        if fire_timers {
            inner.timers.fire_due();
        }
        if saturated {
            return self.turn_result(true);
        }
        // A channel event may have disarmed a CQ: re-arm and re-check.
        d.arm_cqs();
        let more = d.drain_cqs() > 0;
        inner.executor.collect();
        self.turn_result(more || inner.executor.has_ready())
    }

    fn turn_result(&self, ready: bool) -> Turn {
        let ex = &self.handle.inner.executor;
        let ready = if ready {
            true
        } else {
            ex.shared.sleeping.store(true, Ordering::SeqCst);
            ex.has_ready()
        };
        Turn {
            ready,
            next_timer: self.handle.inner.timers.next_deadline(),
        }
    }

    /// Runs tasks and drains the CQs; never sleeps. True if work is ready
    /// (then, every [`IO_EVERY`] busy turns, it also fires due timers and
    /// polls the sockets); false if the loop is idle, leaving timers and
    /// sockets to [`park`](Self::park), which reads the clock once for both
    /// its due check and its timeout.
    fn tick(&self) -> bool {
        let inner = &self.handle.inner;
        inner.pass_hooks.begin_pass();
        inner.driver.begin_batch();
        let polled = inner.executor.run(inner.config.task_budget);
        inner.driver.end_batch();
        // Hooks fire before the pass's own CQ drain: a wake that drain
        // causes schedules its hook for the next pass, after the task it
        // woke has run.
        inner.pass_hooks.end_pass();
        inner.driver.drain_cqs();
        let exhausted = polled >= inner.config.task_budget;
        if !exhausted && !inner.executor.has_ready() && !inner.pass_hooks.has_pending() {
            return false;
        }
        let c = self.io_countdown.get();
        if exhausted || c <= 1 {
            self.io_countdown.set(IO_EVERY);
            // Timers with the sockets: a clock read per busy turn would
            // cost every op wrapped in a `timeout` (the clock is read only
            // while a timer is live) and microseconds per read where the
            // clocksource is emulated; a timer fires at most `IO_EVERY`
            // busy turns late (each bounded by the task budget).
            inner.timers.fire_due();
            match inner.driver.poll_io(Some(Duration::ZERO)) {
                // A full batch: more may wait (see `events_left`).
                Ok(n) if n >= inner.driver.event_capacity() => self.events_left.set(true),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %crate::report::ErrorChain(&e), "epoll failed")
                }
            }
        } else {
            self.io_countdown.set(c - 1);
        }
        true
    }

    /// Nothing is runnable: busy-poll, fire due timers, arm, re-check,
    /// sleep; after the wake, take the completions. With live timers it
    /// reads the clock once (before the sleep); without, never.
    fn park(&self) {
        let inner = &self.handle.inner;
        let d = &inner.driver;
        self.io_countdown.set(IO_EVERY);
        if !inner.config.busy_poll.is_zero() && self.spin_on_cqs() {
            return;
        }
        // Read before arming: the sleep may then last longer than needed by
        // the arming's few microseconds, never shorter (a timer never fires
        // early).
        let timeout = match inner.timers.next_deadline() {
            None => None,
            Some(t) => {
                let now = Instant::now();
                if t <= now {
                    inner.timers.fire(now);
                    return;
                }
                inner.timers.saw(now);
                Some(t - now)
            }
        };
        d.arm_cqs();
        if d.drain_cqs() > 0 {
            return;
        }
        let shared = &inner.executor.shared;
        shared.sleeping.store(true, Ordering::SeqCst);
        if inner.executor.has_ready() {
            shared.sleeping.store(false, Ordering::SeqCst);
            return;
        }
        // Awake again as soon as epoll returns: the wakes its events cause
        // on this thread (sockets) then need no kick of the epoll fd.
        Counters::bump(&d.ops.counters.parks);
        let events = d.poll_io_then(timeout, || shared.sleeping.store(false, Ordering::SeqCst));
        if matches!(events, Ok(n) if n > 0) {
            Counters::bump(&d.ops.counters.wakeups);
        }
        match events {
            // Woken by a channel, a socket or another thread: take the
            // completions now, so the tasks they wake run in the very next
            // loop turn instead of one turn later.
            Ok(n) if n > 0 => {
                d.drain_cqs();
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %crate::report::ErrorChain(&e), "epoll failed"),
        }
        // No timer check here: the loop's next turn makes it, before
        // anything else waits (a busy turn fires due timers, an idle one
        // parks again, which fires them first).
    }

    /// Spins on the CQs for about the busy-poll time; true if work turned
    /// up (a completion, a socket event, a wake) or a timer came due, false
    /// once the time is up.
    ///
    /// The clock is read only every so many spins (about every 50 µs, as
    /// measured; see [`super::spin`]), and the busy-poll time runs
    /// from the first read: it is extended by that many spins, and a due
    /// timer is seen that many spins late at worst.
    /// Sockets and async events are polled (epoll, zero timeout) every
    /// [`SPINS_PER_IO_POLL`] spins, counted across spin sessions: a
    /// busy-polling runtime sees them within about a thousand spins (tens
    /// of microseconds) rather than only once the spinning ends, at the cost
    /// of one syscall per that many spins.
    fn spin_on_cqs(&self) -> bool {
        let inner = &self.handle.inner;
        let d = &inner.driver;
        let mut end = None;
        let mut session = self.spin.session();
        loop {
            if d.drain_cqs() > 0 || inner.executor.has_ready() {
                return true;
            }
            let to_io = self.spins_to_io.get();
            if to_io > 1 {
                self.spins_to_io.set(to_io - 1);
            } else {
                self.spins_to_io.set(SPINS_PER_IO_POLL);
                match d.poll_io(Some(Duration::ZERO)) {
                    // A channel event carries no work of its own (the
                    // completions are polled above); anything else may
                    // have woken a task.
                    Ok(n) if n > 0 => {
                        if d.drain_cqs() > 0 || inner.executor.has_ready() {
                            return true;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %crate::report::ErrorChain(&e), "epoll failed")
                    }
                }
            }
            if let Some(now) = session.spin() {
                if now >= *end.get_or_insert(now + inner.config.busy_poll) {
                    return false;
                }
                if inner.timers.next_deadline().is_some_and(|t| t <= now) {
                    inner.timers.fire(now);
                    return true;
                }
            }
            // No `pause` (`std::hint::spin_loop`) per spin, as in perftest's
            // loop: under QEMU's TCG it ends the translated block and
            // returns to the vCPU's main loop (`helper_pause`: "let another
            // CPU run"), at every spin.
        }
    }

    /// A snapshot of the runtime's counters ([`Handle::stats`]).
    pub fn stats(&self) -> RuntimeStats {
        self.handle.stats()
    }

    /// Ops in the slab (in flight, parked, or completed but uncollected).
    pub fn ops_in_slab(&self) -> usize {
        self.handle.ops().len()
    }

    /// Receive rings the reactor keeps: live ones, and dropped ones whose
    /// buffers are still posted (their memory is freed after the flush).
    pub fn receive_rings(&self) -> usize {
        self.handle.driver().ring_count()
    }

    /// Live tasks.
    pub fn task_count(&self) -> usize {
        self.handle.inner.executor.task_count()
    }
}

impl AsRawFd for Runtime {
    /// The reactor's epoll fd: readable when a completion channel, a socket,
    /// or a cross-thread wake needs a [`Runtime::turn`].
    fn as_raw_fd(&self) -> RawFd {
        self.handle.driver().poll_fd()
    }
}

impl Drop for Runtime {
    /// Shutdown in three steps, all within [`Builder::drain_timeout`]:
    /// sends already posted (an inline send returns at its post) are let
    /// through to the peer, for up to half the timeout, before anything
    /// moves to ERR; tasks are dropped and every QP is closed; the flushes
    /// of the work still outstanding are drained, and whatever the device
    /// may still touch after that is leaked.
    fn drop(&mut self) {
        let inner = &self.handle.inner;
        let d = &inner.driver;
        let start = Instant::now();
        wait_drained(d, start + inner.config.drain_timeout / 2, || {
            !d.sends_in_flight()
        });
        inner.executor.drop_all();
        d.close_all_qps();
        wait_drained(d, start + inner.config.drain_timeout, || {
            d.ops.in_flight() == 0 && d.ring_buffers_posted() == 0
        });
        d.ops.shut_down();
        let leaked_ops = d.ops.leak_parked();
        let leaked_qps = d.release_qps();
        let leaked_rings = d.release_rings();
        if leaked_ops + leaked_qps + leaked_rings > 0 {
            tracing::warn!(
                leaked_ops,
                leaked_qps,
                leaked_rings,
                "runtime dropped with work requests still in flight: their buffers are leaked"
            );
        }
        // Tasks spawned by destructors above.
        inner.executor.drop_all();
        inner.pass_hooks.clear();
        inner.timers.clear();
        d.clear();
        Handle::set_current(None);
    }
}

/// Drains the CQs, sleeping on their channels, until `done` or `deadline`.
fn wait_drained(d: &Driver, deadline: Instant, mut done: impl FnMut() -> bool) {
    loop {
        d.drain_cqs();
        if done() {
            return;
        }
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        d.arm_cqs();
        if d.drain_cqs() > 0 {
            continue;
        }
        let wait = (deadline - now).min(Duration::from_millis(10));
        if let Err(e) = d.poll_io(Some(wait)) {
            tracing::warn!(error = %crate::report::ErrorChain(&e), "epoll failed during shutdown");
            return;
        }
    }
}
