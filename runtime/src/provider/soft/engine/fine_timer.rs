//! Wake-ups finer than a millisecond. The engine sleeps in mio's poll,
//! whose timeout epoll takes in whole milliseconds, rounded up: a 50 µs ACK
//! hold (`ack_delay`) ended after 1 ms or more, and a requester waiting for
//! that ACK (a SEND's completion) waited that long. A deadline that is not
//! a whole number of milliseconds away is also set on a timerfd in the same
//! poll, which wakes it on time (the rounded timeout stays as a backstop).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};

/// The timer's token in the engine's poll (never a connection's:
/// connection tokens count up from `CONN_BASE`).
pub(crate) const TIMER: Token = Token(usize::MAX);

/// A one-shot monotonic timerfd registered with the engine's poll.
pub(crate) struct FineTimer {
    fd: OwnedFd,
}

impl FineTimer {
    /// A disarmed timer, registered with `registry` under [`TIMER`].
    pub(crate) fn new(registry: &Registry) -> io::Result<FineTimer> {
        // SAFETY: plain system call; the returned fd is checked below and
        // owned from here on.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh, valid fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        registry.register(&mut SourceFd(&fd.as_raw_fd()), TIMER, Interest::READABLE)?;
        Ok(FineTimer { fd })
    }

    /// The timeout to give the poll to sleep `timeout`: a timeout epoll
    /// would round up also arms the timer for the exact time.
    pub(crate) fn arm(&self, timeout: Option<Duration>) -> Option<Duration> {
        let t = timeout?;
        if t.is_zero() || t.subsec_nanos() % 1_000_000 == 0 {
            return timeout;
        }
        // (The poll's own rounded timeout still wakes it, late, should
        // this fail.)
        self.arm_exact(t);
        timeout
    }

    /// Arms the timer to fire `after` from now, also a whole number of
    /// milliseconds (a sleep for leases only has no poll timeout of the
    /// same time: the renewing applications move this timer later, see
    /// `lease_sleep.rs`). False if it could not be armed (then it keeps
    /// its earlier setting).
    pub(crate) fn arm_exact(&self, after: Duration) -> bool {
        // (A zero `it_value` would disarm it.)
        let t = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
            },
        };
        // SAFETY: valid fd owned by `self`; `spec` is a valid itimerspec,
        // the old value is not asked for.
        let r =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            tracing::debug!(error = %crate::report::ErrorChain(&io::Error::last_os_error()), "soft engine: arming the timerfd failed");
        }
        r == 0
    }

    /// The timer fired: consumes its expiration (so its next one is
    /// reported again).
    pub(crate) fn fired(&self) {
        let mut n = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `n` from a valid fd owned by
        // `self` (non-blocking: nothing to read is EAGAIN, ignored).
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), n.as_mut_ptr().cast(), n.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_sub_millisecond_deadline_wakes_the_poll_before_a_millisecond() {
        let mut poll = mio::Poll::new().expect("poll");
        let timer = FineTimer::new(poll.registry()).expect("timerfd");
        let mut events = mio::Events::with_capacity(4);
        // Best of a few tries: a loaded machine may deschedule the thread.
        let mut best = Duration::MAX;
        for _ in 0..20 {
            let start = Instant::now();
            let timeout = timer.arm(Some(Duration::from_micros(100)));
            assert_eq!(timeout, Some(Duration::from_micros(100)));
            poll.poll(&mut events, timeout).expect("poll");
            let took = start.elapsed();
            assert!(
                events.iter().any(|e| e.token() == TIMER),
                "woken by the timer"
            );
            timer.fired();
            best = best.min(took);
        }
        assert!(best < Duration::from_millis(1), "slept {best:?} for 100 us");
        // Whole milliseconds and no timeout are left to the poll.
        assert_eq!(timer.arm(None), None);
        assert_eq!(
            timer.arm(Some(Duration::from_millis(2))),
            Some(Duration::from_millis(2))
        );
    }
}
