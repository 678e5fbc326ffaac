//! What a [`timeout`] around an op costs, measured side by side in one
//! run: the same loop of futures that are pending once (each wakes itself,
//! like an op whose completion arrives on the next reactor turn), awaited
//! bare and wrapped in `timeout(10 s, ..)` (the deadline never fires:
//! registered on the first poll, removed when the future completes), with
//! 0 and with 10,000 other timers pending (other tasks' timeouts). Prints
//! the thread CPU time per iteration and the difference, the timeout's
//! cost.
//!
//! Run: `cargo run --release -p verbio-runtime --example timer_overhead [iterations [bare|timed]]`

mod common;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use verbio_runtime::{sleep, spawn, timeout, Runtime};

/// Pending on its first poll (waking itself), ready on the second.
struct PendingOnce(bool);

impl Future for PendingOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn per_iter(rt: &Runtime, iters: u32, with_timeout: bool) -> f64 {
    rt.block_on(async {
        let t = thread_cpu_ns();
        for _ in 0..iters {
            if with_timeout {
                timeout(Duration::from_secs(10), PendingOnce(false))
                    .await
                    .expect("no timeout");
            } else {
                PendingOnce(false).await;
            }
        }
        (thread_cpu_ns() - t) as f64 / f64::from(iters)
    })
}

/// Which loop `ONLY` runs.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Only {
    /// Awaits without a timeout.
    Bare,
    /// Awaits wrapped in a timeout.
    Timed,
}

/// What a reactor timer costs per await.
#[derive(clap::Parser)]
struct Cli {
    /// Awaits per round.
    #[arg(default_value_t = 200_000)]
    iterations: u32,
    /// Run one loop only, once (for instruction counts under callgrind: run
    /// both and divide the difference by the iterations).
    #[arg(value_enum)]
    only: Option<Only>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    common::init_tracing();
    let iters = cli.iterations;
    if let Some(only) = cli.only {
        let rt = Runtime::new().expect("runtime");
        per_iter(&rt, iters, only == Only::Timed);
        return;
    }
    const ROUNDS: usize = 7;
    println!("{iters} awaits per round, medians of {ROUNDS} alternating rounds, thread CPU time");
    println!(
        "{:<28} {:>12} {:>14} {:>14}",
        "other timers pending", "bare", "with timeout", "timeout costs"
    );
    for others in [0usize, 10_000] {
        let rt = Runtime::new().expect("runtime");
        // Other tasks' timers, pending for the whole run.
        rt.block_on(async {
            for _ in 0..others {
                spawn(sleep(Duration::from_secs(3600)));
            }
            PendingOnce(false).await; // let them register
        });
        let (mut bare, mut timed) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            bare.push(per_iter(&rt, iters, false));
            timed.push(per_iter(&rt, iters, true));
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (b, t) = (median(&mut bare), median(&mut timed));
        println!(
            "{:<28} {:>9.1} ns {:>11.1} ns {:>11.1} ns",
            others,
            b,
            t,
            t - b
        );
    }
}
