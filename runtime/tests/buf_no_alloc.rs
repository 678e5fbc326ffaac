//! The pool's hot path does not allocate: after warm-up, `MrPool::alloc` and
//! dropping a `LocalBuf` make no heap allocation (counted by a global
//! allocator, per thread, so parallel tests do not interfere) and no new
//! registration.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use verbio_runtime::buf::{IoBuf, MrPool};
use verbio_runtime::provider::{Context, SoftConfig};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

#[test]
fn alloc_and_free_after_warm_up_do_not_allocate() {
    let Ok(ctx) = std::panic::catch_unwind(|| Context::open_soft(SoftConfig::default())) else {
        println!("SKIPPED: the soft RDMA device is not implemented in this build");
        return;
    };
    let ctx = ctx.expect("open soft device");
    let pd = ctx.alloc_pd().expect("pd");
    let pool = MrPool::new(&pd);
    let sizes = [1usize, 64, 100, 4096, 9000, 65_536, 1 << 20];
    for &s in &sizes {
        pool.reserve(s, 8).expect("reserve");
    }
    let regs = pool.stats().registrations;
    let before = allocs();
    let mut sum = 0usize;
    for round in 0..1000 {
        let a = pool.alloc(sizes[round % sizes.len()]).expect("alloc");
        let b = pool.alloc(sizes[(round + 3) % sizes.len()]).expect("alloc");
        sum = sum.wrapping_add(a.stable_ptr() as usize ^ b.bytes_total());
        drop(a);
        drop(b);
    }
    let after = allocs();
    assert_ne!(sum, 0);
    assert_eq!(after - before, 0, "heap allocations on the pool's hot path");
    assert_eq!(pool.stats().registrations, regs, "no new registrations");
    // The counter works: a dedicated (oversize) buffer does allocate.
    let big = pool.alloc(2 << 20).expect("dedicated");
    assert!(allocs() > after);
    drop(big);
}
