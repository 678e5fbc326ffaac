//! What granting a peer access to memory and revoking it costs, with a
//! fresh registration per grant versus a memory window bound over memory
//! registered once, measured side by side in one run on one device:
//!
//! - **registration**: what the agent does per grant by default: allocate
//!   `size` zeroed bytes, register them with remote read/write
//!   (`RemoteAccessRegion::grant`), then deregister and free them
//!   (`revoke`);
//! - **window**: BIND_MW of a window over `size` bytes of a region
//!   registered once (`Verbs::bind_mw`), then LOCAL_INV (`Verbs::local_inv`),
//!   each awaited (two work requests through the runtime);
//! - **window + zeroing**: the same plus zeroing the range before the bind,
//!   as the agent's window grants do (`RdmaBuilder::grant_windows`).
//!
//! Each round runs the three loops back to back (rotating which goes
//! first); the figures are medians over the rounds of the mean time per
//! grant + revoke, and the ratios medians of the per-round ratios.
//!
//! Run: `cargo run --release --example mw_grant_cost -- [--device NAME]
//! [--sizes 4096,65536,1048576] [--iters N] [--rounds R]` (default: a fresh
//! soft device, those sizes, 500 grants per loop, 9 rounds).

mod cli;

use std::rc::Rc;
use std::time::{Duration, Instant};

use clap::Parser;
use verbio::ops::connect::{DeviceQps, QpConfig};
use verbio::ops::verbs::Verbs;
use verbio::provider::AccessFlags;
use verbio::runtime::buf::{RemoteAccessRegion, Window};
use verbio::runtime::{Device, QueuePair, Runtime};

#[derive(Parser)]
#[command(about = "grant + revoke cost: registration per grant vs a memory window")]
struct Args {
    /// RDMA device (default: a fresh soft device).
    #[arg(long)]
    device: Option<String>,
    /// Grant sizes in bytes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,65536,1048576")]
    sizes: Vec<usize>,
    /// Grants per loop.
    #[arg(long, default_value_t = 500, value_parser = cli::at_least_one)]
    iters: usize,
    /// Rounds (each runs the three loops).
    #[arg(long, default_value_t = 9, value_parser = cli::at_least_one)]
    rounds: usize,
}

fn rw() -> AccessFlags {
    AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE
}

/// Mean time per grant + revoke through a fresh registration.
fn registration(dev: &Device, size: usize, iters: usize) -> Duration {
    let t = Instant::now();
    for _ in 0..iters {
        let region =
            RemoteAccessRegion::grant(dev.pd(), vec![0u8; size], rw()).expect("registration");
        drop(region.revoke());
    }
    t.elapsed() / iters as u32
}

/// Mean time per bind + invalidate of a window over `region`.
async fn window(
    qp: &QueuePair,
    dev: &Device,
    region: &Rc<RemoteAccessRegion<Vec<u8>>>,
    size: usize,
    iters: usize,
    zero: bool,
) -> Duration {
    let zeros = vec![0u8; size];
    let mut w = Window::alloc(dev.pd()).expect("alloc_mw");
    let t = Instant::now();
    for _ in 0..iters {
        if zero {
            region.write_from(0, &zeros).expect("zeroing");
        }
        let (r, bound) = qp.bind_mw(w, region.clone(), 0..size, rw()).await;
        r.expect("bind_mw");
        let (r, unbound) = qp.local_inv(bound).await;
        r.expect("local_inv");
        w = unbound;
    }
    t.elapsed() / iters as u32
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    cli::init_tracing();
    let args = Args::parse();
    let ctx = cli::open_device_or_soft(args.device.as_deref(), [127, 0, 0, 1].into())
        .expect("open the device");
    let rt = Runtime::new().expect("runtime");
    let dev = Device::open(ctx).expect("device");
    let (a, _b) = DeviceQps::new(dev.clone(), QpConfig::default())
        .connected_pair()
        .expect("connected QPs");
    let biggest = args.sizes.iter().copied().max().unwrap_or(4096);
    let region = Rc::new(
        RemoteAccessRegion::bindable(dev.pd(), vec![0u8; biggest]).expect("bindable region"),
    );
    println!(
        "grant + revoke on {} ({} grants per loop, median of {} rounds)",
        dev.context().name(),
        args.iters,
        args.rounds
    );
    println!(
        "{:>9}  {:>14}  {:>11}  {:>13}  {:>17}  {:>20}",
        "size", "registration", "window", "window+zero", "reg/window", "reg/(window+zero)"
    );
    for &size in &args.sizes {
        let (mut reg, mut win, mut winz) = (Vec::new(), Vec::new(), Vec::new());
        let (mut ratio, mut ratio_z) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            let mut t = [Duration::ZERO; 3];
            for k in 0..3 {
                let which = (k + round) % 3;
                t[which] = match which {
                    0 => registration(&dev, size, args.iters),
                    1 => rt.block_on(window(&a, &dev, &region, size, args.iters, false)),
                    _ => rt.block_on(window(&a, &dev, &region, size, args.iters, true)),
                };
            }
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            reg.push(us(t[0]));
            win.push(us(t[1]));
            winz.push(us(t[2]));
            ratio.push(us(t[0]) / us(t[1]));
            ratio_z.push(us(t[0]) / us(t[2]));
        }
        println!(
            "{:>9}  {:>11.2} µs  {:>8.2} µs  {:>10.2} µs  {:>16.2}x  {:>19.2}x",
            size,
            median(&mut reg),
            median(&mut win),
            median(&mut winz),
            median(&mut ratio),
            median(&mut ratio_z)
        );
    }
}
