//! A global allocator that counts, per thread, the allocations made on
//! that thread (so tests running in parallel do not see each other's). A
//! test binary installs it with
//! `#[global_allocator] static GLOBAL: Counting = Counting;` and reads
//! [`allocs`] before and after the code it measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The counting allocator (forwards to [`System`]).
pub struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static BIG: Cell<u64> = const { Cell::new(0) };
}

/// Allocations of at least this many bytes are also counted by [`big_allocs`].
pub const BIG_ALLOC: usize = 1 << 20;

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

/// Counts an allocation (or growth) to `size` bytes if it is big.
fn count_big(size: usize) {
    if size >= BIG_ALLOC {
        let _ = BIG.try_with(|c| c.set(c.get() + 1));
    }
}

/// Adds `delta` bytes to this thread's live bytes.
fn live(delta: i64) {
    let _ = LIVE.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        count_big(layout.size());
        live(layout.size() as i64);
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        live(-(layout.size() as i64));
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        count_big(layout.size());
        live(layout.size() as i64);
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        if new_size > layout.size() {
            count_big(new_size);
        }
        live(new_size as i64 - layout.size() as i64);
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations made on this thread so far.
pub fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// Allocations (or reallocations growing to) [`BIG_ALLOC`] bytes or more
/// made on this thread so far.
pub fn big_allocs() -> u64 {
    BIG.with(|c| c.get())
}

/// Bytes allocated on this thread and not freed (on this thread) since it
/// started: exact for memory a thread allocates and frees itself.
pub fn live_bytes() -> i64 {
    LIVE.with(|c| c.get())
}
