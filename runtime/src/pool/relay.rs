//! Answers delivered to tokio tasks through tokio's own reactor.
//!
//! A pool thread that wakes a task of tokio's multi-thread runtime from
//! outside it makes tokio schedule the task remotely: its injection queue
//! and a futex unpark of an idle worker, which, searching for work and
//! finding the task, unparks a second worker to keep searching (tokio's
//! rule for the last searching worker). Measured with `pool_echo` (64 B,
//! one in flight, 2 workers), every echo woke both workers: four threads
//! put to sleep per echo where tokio with 1 worker puts three, and about
//! 4 µs of p50 and of CPU more.
//!
//! So an asker polled on a worker of a multi-thread runtime (the `tokio`
//! feature) names that runtime's *relay*: an eventfd registered with the
//! runtime's reactor (`AsyncFd`) and a task waiting on it. The pool thread
//! hands the asker's waker to the relay's queue and rings the eventfd once
//! per burst (the first waker into an empty queue); the worker parked in
//! tokio's reactor wakes (a thread that sleeps anyway, as for a socket)
//! and wakes the askers on that worker: a local schedule, which runs the
//! task next there. A burst of several is woken while the reactor
//! dispatches the eventfd's event (`Dispatch`, the relay's own waker for
//! it), so that tokio unparks at most one other worker for the lot, once
//! its park ends; a single asker by the relay task, which unparks no one
//! else for it.
//!
//! One relay per tokio runtime, made by the first asker polled on it;
//! askers elsewhere (a current-thread runtime, another executor, a plain
//! thread) are woken directly. When the runtime shuts down (its relay task
//! is dropped) the relay is marked dead and wakes what it holds directly,
//! and so do later wakes. A relay (its small shared part and its eventfd,
//! which the pool threads ring without a lock) is kept for the process's
//! life and taken over by a later runtime: as many exist as multi-thread
//! runtimes ran handles' futures at once.
//! [`set_enabled`] turns relays off (benchmarks compare both ways).

use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Waker;

/// A relay's shared part; `&'static` (see the module docs).
pub struct Relay {
    /// The eventfd the pool threads ring: never closed (the relay is kept
    /// for the process's life), so a ring needs no lock; the relay task
    /// reads a duplicate of it registered with its runtime's reactor.
    #[cfg(feature = "tokio")]
    fd: std::os::fd::RawFd,
    #[cfg(feature = "tokio")]
    inner: std::sync::Mutex<imp::RelayInner>,
    /// Its task waits for the reactor, its waker registered there and not
    /// yet called (tests).
    #[cfg(all(test, feature = "tokio"))]
    idle: AtomicBool,
    #[cfg(not(feature = "tokio"))]
    _never: std::convert::Infallible,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").finish_non_exhaustive()
    }
}

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the delivery of answers through tokio's reactor on (the default,
/// with the `tokio` feature) or off (askers on tokio workers are then woken
/// directly from the pool thread, as from any other thread). For
/// comparisons; relays made before keep working until their runtime ends.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// The relay of the tokio multi-thread runtime the calling thread is a
/// worker of, if any (made on first use); `None` elsewhere (a `block_on`
/// thread, a blocking thread, another executor), or with relays off.
#[inline]
pub(crate) fn current() -> Option<&'static Relay> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    #[cfg(feature = "tokio")]
    {
        imp::current()
    }
    #[cfg(not(feature = "tokio"))]
    {
        None
    }
}

/// Wakes `w` through `relay` (see the module docs), or directly if the
/// relay is gone. Returns whether the relay must be rung
/// ([`ring`]): true for the first waker into its empty queue.
#[inline]
pub(crate) fn hand(relay: &'static Relay, w: Waker) -> bool {
    #[cfg(feature = "tokio")]
    {
        imp::hand(relay, w)
    }
    #[cfg(not(feature = "tokio"))]
    {
        let _ = w;
        match relay._never {}
    }
}

/// Rings `relay`'s eventfd: its task wakes and wakes what was handed.
pub(crate) fn ring(relay: &'static Relay) {
    #[cfg(feature = "tokio")]
    imp::ring(relay);
    #[cfg(not(feature = "tokio"))]
    match relay._never {}
}

#[cfg(feature = "tokio")]
mod imp {
    use std::cell::Cell;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::{Arc, Mutex, MutexGuard};
    use std::task::{Context, Poll, Wake, Waker};

    use futures::task::AtomicWaker;

    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;
    use tokio::runtime::{Handle, RuntimeFlavor};

    use super::Relay;

    pub(super) struct RelayInner {
        /// The relay task runs (reads the eventfd).
        alive: bool,
        /// Wakers handed and not yet woken.
        queue: Vec<Waker>,
        /// The eventfd was written and the task has not taken the queue since.
        rung: bool,
    }

    /// Every relay ever made, with the runtime it serves (a dead one is
    /// reused by the next runtime).
    static RELAYS: Mutex<Vec<(Option<tokio::runtime::Id>, &'static Relay)>> =
        Mutex::new(Vec::new());

    /// Stands for "no relay" in [`RELAYS`]: a runtime without an I/O
    /// driver (never alive).
    static NO_RELAY: Relay = Relay {
        fd: -1,
        inner: Mutex::new(RelayInner {
            alive: false,
            queue: Vec::new(),
            rung: false,
        }),
        #[cfg(test)]
        idle: std::sync::atomic::AtomicBool::new(false),
    };

    thread_local! {
        /// This thread's last relay and its runtime (a worker thread stays
        /// with one runtime, so this is the answer from its second ask on).
        static CACHED: Cell<Option<(tokio::runtime::Id, &'static Relay)>> = const { Cell::new(None) };
    }

    fn lock(r: &Relay) -> MutexGuard<'_, RelayInner> {
        r.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn current() -> Option<&'static Relay> {
        // Only a worker's wakes are scheduled locally: a task polled by a
        // `block_on` or on a blocking thread is woken directly.
        tokio::runtime::worker_index()?;
        let h = Handle::try_current().ok()?;
        if h.runtime_flavor() != RuntimeFlavor::MultiThread {
            return None;
        }
        let id = h.id();
        if let Ok(Some((cached, r))) = CACHED.try_with(Cell::get) {
            if cached == id {
                return lock(r).alive.then_some(r);
            }
        }
        let r = relay_of(&h, id);
        let _ = CACHED.try_with(|c| c.set(Some((id, r))));
        lock(r).alive.then_some(r)
    }

    /// The relay of the runtime `h` (`id`), made if it has none; a dead
    /// one (or [`NO_RELAY`]) if it cannot have one.
    fn relay_of(h: &Handle, id: tokio::runtime::Id) -> &'static Relay {
        let mut all = RELAYS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&(_, r)) = all.iter().find(|(i, _)| *i == Some(id)) {
            return r;
        }
        // Entries of runtimes without an I/O driver go with their runtime
        // (they cannot be told apart once it ends: kept at most a few).
        if all
            .iter()
            .filter(|(_, r)| std::ptr::eq(*r, &NO_RELAY))
            .count()
            >= 16
        {
            all.retain(|(_, r)| !std::ptr::eq(*r, &NO_RELAY));
        }
        let reuse = all
            .iter()
            .position(|(_, r)| !std::ptr::eq(*r, &NO_RELAY) && !lock(r).alive);
        let (r, fresh) = match reuse {
            Some(at) => (all[at].1, false),
            None => {
                // SAFETY: plain eventfd creation; the result is checked.
                let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
                if raw < 0 {
                    tracing::debug!("pool relay: no eventfd; answers wake tokio tasks directly");
                    return &NO_RELAY;
                }
                let r: &'static Relay = Box::leak(Box::new(Relay {
                    fd: raw,
                    inner: Mutex::new(RelayInner {
                        alive: false,
                        queue: Vec::new(),
                        rung: false,
                    }),
                    #[cfg(test)]
                    idle: std::sync::atomic::AtomicBool::new(false),
                }));
                (r, true)
            }
        };
        // The task's own descriptor of the same eventfd: registered with
        // the runtime's reactor, closed with the task.
        // SAFETY: `r.fd` is open for the process's life; `dup` is checked.
        let dup = unsafe { libc::fcntl(r.fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            if fresh {
                all.push((None, r));
            }
            tracing::debug!("pool relay: no descriptor; answers wake tokio tasks directly");
            return &NO_RELAY;
        }
        // SAFETY: `dup` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(dup) };
        let registered = {
            let _enter = h.enter();
            // tokio panics (rather than fails) when the runtime has no I/O
            // driver (built without `enable_io`): caught, and the runtime is
            // remembered as one without a relay.
            std::panic::catch_unwind(|| {
                // SAFETY: `fd` is an open eventfd the `AsyncFd` owns: it
                // stays open, the same file, until the `AsyncFd` is dropped.
                unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            })
        };
        let afd = match registered {
            Ok(Ok(afd)) => afd,
            Ok(Err(e)) => {
                if fresh {
                    all.push((None, r));
                }
                let (_, e) = e.into_parts();
                tracing::debug!(error = %e, "pool relay: not registered with tokio's reactor; answers wake tokio tasks directly");
                return &NO_RELAY;
            }
            Err(_) => {
                tracing::debug!("pool relay: the tokio runtime has no I/O driver; answers wake its tasks directly");
                if fresh {
                    // Kept for a later runtime (its eventfd stays open).
                    all.push((None, r));
                }
                all.push((Some(id), &NO_RELAY));
                return &NO_RELAY;
            }
        };
        match reuse {
            Some(at) => all[at].0 = Some(id),
            None => all.push((Some(id), r)),
        }
        {
            let mut g = lock(r);
            g.alive = true;
            g.rung = false;
        }
        h.spawn(relay_loop(RelayTask {
            afd: Some(afd),
            relay: r,
        }));
        r
    }

    pub(super) fn hand(relay: &'static Relay, w: Waker) -> bool {
        #[cfg(test)]
        super::tests::HANDED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut g = lock(relay);
        if !g.alive {
            drop(g);
            w.wake();
            return false;
        }
        g.queue.push(w);
        !std::mem::replace(&mut g.rung, true)
    }

    pub(super) fn ring(relay: &'static Relay) {
        let one: u64 = 1;
        // SAFETY: `fd` is the relay's eventfd, open for the process's life
        // (a relay is never freed); an 8-byte count is what an eventfd
        // takes. Rung after its task ended, it is read by the next runtime
        // that takes the relay over (a spurious wake), or by nobody. It
        // fails only if the counter would overflow (then it is readable
        // anyway).
        unsafe { libc::write(relay.fd, (&one as *const u64).cast(), 8) };
    }

    /// The relay task's state: its end marks the relay dead and wakes what
    /// it holds before the eventfd closes (also if dropped unpolled).
    struct RelayTask {
        afd: Option<AsyncFd<OwnedFd>>,
        relay: &'static Relay,
    }

    impl Drop for RelayTask {
        fn drop(&mut self) {
            let left = {
                #[cfg(test)]
                self.relay
                    .idle
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                let mut g = lock(self.relay);
                g.alive = false;
                std::mem::take(&mut g.queue)
            };
            for w in left {
                w.wake();
            }
            // The task's descriptor (the relay keeps its own).
            drop(self.afd.take());
        }
    }

    /// The waker the relay task registers for its eventfd's readiness:
    /// tokio's reactor calls it from its dispatch of the event, on the
    /// worker that polled the reactor, while that worker is parked. The
    /// askers are woken from there: tokio schedules each locally and, as it
    /// does for a socket's wakes, unparks at most one other worker once its
    /// park ends. Woken from a task instead (the relay task's poll), each
    /// asker that displaced another from the worker's LIFO slot unparked a
    /// sibling (measured: about 2.2 unparks, eventfd writes or futex
    /// wakes, per burst of answers). It then wakes the relay task, which
    /// reads the eventfd and clears the readiness, so that the next ring
    /// is a new event.
    struct Dispatch {
        relay: &'static Relay,
        task: AtomicWaker,
    }

    impl Wake for Dispatch {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            #[cfg(test)]
            self.relay
                .idle
                .store(false, std::sync::atomic::Ordering::SeqCst);
            // A single asker is the task's to wake: woken here, the asker
            // and the task would be two tasks runnable at the park's end,
            // for which tokio unparks another worker.
            take_and_wake(self.relay, 2);
            self.task.wake();
        }
    }

    #[cfg(test)]
    thread_local! {
        /// The relay task is being polled on this thread (tests).
        pub(super) static IN_TASK: Cell<bool> = const { Cell::new(false) };
    }

    /// Marks the relay task's poll (tests).
    #[cfg(test)]
    struct InTask;

    #[cfg(test)]
    impl InTask {
        fn enter() -> InTask {
            IN_TASK.with(|t| t.set(true));
            InTask
        }
    }

    #[cfg(test)]
    impl Drop for InTask {
        fn drop(&mut self) {
            IN_TASK.with(|t| t.set(false));
        }
    }

    /// Wakes what was handed to `relay` if at least `min` wakers were;
    /// a hand after this rings again.
    fn take_and_wake(relay: &'static Relay, min: usize) {
        let mut batch = {
            let mut g = lock(relay);
            if g.queue.len() < min {
                // Left to the task, which reads the eventfd first.
                return;
            }
            g.rung = false;
            if g.queue.is_empty() {
                return;
            }
            std::mem::take(&mut g.queue)
        };
        for w in batch.drain(..) {
            w.wake();
        }
        // The buffer goes back (no allocation per burst), unless a hand
        // made a new one meanwhile.
        let mut g = lock(relay);
        if g.queue.capacity() == 0 {
            g.queue = batch;
        }
    }

    async fn relay_loop(task: RelayTask) {
        let dispatch = Arc::new(Dispatch {
            relay: task.relay,
            task: AtomicWaker::new(),
        });
        let on_ready = Waker::from(dispatch.clone());
        std::future::poll_fn(|cx| {
            #[cfg(test)]
            let _polling = InTask::enter();
            #[cfg(test)]
            task.relay
                .idle
                .store(false, std::sync::atomic::Ordering::SeqCst);
            dispatch.task.register(cx.waker());
            let Some(afd) = task.afd.as_ref() else {
                return Poll::Ready(());
            };
            loop {
                match afd.poll_read_ready(&mut Context::from_waker(&on_ready)) {
                    Poll::Pending => {
                        #[cfg(test)]
                        task.relay
                            .idle
                            .store(true, std::sync::atomic::Ordering::SeqCst);
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(e)) => {
                        tracing::warn!(error = %e, "pool relay: its eventfd failed; answers wake tokio tasks directly");
                        return Poll::Ready(());
                    }
                    Poll::Ready(Ok(mut guard)) => {
                        let mut count = [0u8; 8];
                        // SAFETY: reads the eventfd's 8-byte counter into
                        // `count` (resetting it); nonblocking, so an empty
                        // counter returns EAGAIN, which is fine.
                        unsafe { libc::read(afd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
                        guard.clear_ready();
                        // After the read: a ring since makes a new event.
                        take_and_wake(task.relay, 0);
                    }
                }
            }
        })
        .await;
    }
}

#[cfg(all(test, feature = "tokio"))]
mod tests;
