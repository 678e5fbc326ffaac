//! Measures what the MR pool saves: allocating a registered 4 KiB buffer from
//! an `MrPool` versus registering a fresh buffer per operation (and a plain
//! heap `Vec`, as a floor), on the software RDMA device, in one run.
//!
//! Run: `cargo run --release -p verbio-runtime --example buf_pool_bench`

mod common;

use std::hint::black_box;
use std::time::Instant;

use verbio_runtime::buf::{IoBuf, MrPool, RegisteredMem};
use verbio_runtime::provider::{AccessFlags, Context, SoftConfig};

fn per_op(n: u32, mut f: impl FnMut()) -> f64 {
    // Warm up, then time.
    for _ in 0..n / 10 {
        f();
    }
    let start = Instant::now();
    for _ in 0..n {
        f();
    }
    start.elapsed().as_nanos() as f64 / f64::from(n)
}

/// What the MR pool saves per registered 4 KiB buffer, on the soft device.
#[derive(clap::Parser)]
struct Cli {}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The whole cause chain, not only the top error.
            eprintln!("buf_pool_bench: {}", verbio_runtime::ErrorChain(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    <Cli as clap::Parser>::parse();
    common::init_tracing();
    const SIZE: usize = 4096;
    let Ok(ctx) = std::panic::catch_unwind(|| Context::open_soft(SoftConfig::default())) else {
        println!("SKIPPED: the soft RDMA device is not implemented in this build");
        return Ok(());
    };
    let ctx = ctx?;
    let pd = ctx.alloc_pd()?;
    let pool = MrPool::new(&pd);
    pool.reserve(SIZE, 16)?;

    let pooled = per_op(200_000, || {
        let b = pool.alloc(SIZE).expect("pool alloc");
        black_box(b.stable_ptr());
    });
    let heap = per_op(200_000, || {
        let v: Vec<u8> = Vec::with_capacity(SIZE);
        black_box(v.as_ptr());
    });
    let register = per_op(20_000, || {
        let m = RegisteredMem::register(&pd, vec![0u8; SIZE], AccessFlags::LOCAL_WRITE)
            .expect("register");
        black_box(m.into_inner());
    });

    println!("4 KiB buffer, allocate + free (ns/op):");
    println!("  MrPool::alloc            {pooled:10.1}");
    println!("  Vec::with_capacity       {heap:10.1}");
    println!("  Vec + reg_mr + dereg_mr  {register:10.1}");
    println!(
        "ratio: register-per-op / pool = {:.1}x; pool / heap = {:.2}x",
        register / pooled,
        pooled / heap
    );
    println!("pool stats: {:?}", pool.stats());
    Ok(())
}
