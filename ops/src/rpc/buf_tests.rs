//! The message pool (`buf.rs`): which buffers it keeps, which it hands
//! out for a length, and its bounds.

use super::buf::{BufPool, POOL_MAX_BYTES};

const MIB: usize = 1 << 20;

#[test]
fn a_large_buffer_given_back_is_handed_out_again_for_its_length() {
    let pool = BufPool::new(64 * MIB);
    let big = Vec::<u8>::with_capacity(4 * MIB);
    let at = big.as_ptr();
    pool.put(big);
    assert_eq!(pool.bytes(), 4 * MIB);
    // A small take does not get it.
    assert_eq!(pool.take().capacity(), 0);
    // Too large for it: a new buffer; it stays.
    let other = pool.take_for(5 * MIB);
    assert!(other.capacity() >= 5 * MIB);
    assert_ne!(other.as_ptr(), at);
    let again = pool.take_for(3 * MIB);
    assert_eq!(again.as_ptr(), at, "the kept buffer");
    assert_eq!(pool.bytes(), 0);
}

#[test]
fn the_smallest_large_buffer_that_fits_is_taken() {
    let pool = BufPool::new(64 * MIB);
    let (a, b, c) = (
        Vec::<u8>::with_capacity(8 * MIB),
        Vec::<u8>::with_capacity(2 * MIB),
        Vec::<u8>::with_capacity(4 * MIB),
    );
    let want = c.as_ptr();
    pool.put(a);
    pool.put(b);
    pool.put(c);
    let got = pool.take_for(3 * MIB);
    assert_eq!(got.as_ptr(), want);
}

#[test]
fn large_buffers_are_kept_up_to_the_bound_only() {
    let pool = BufPool::new(10 * MIB);
    for _ in 0..4 {
        pool.put(Vec::<u8>::with_capacity(4 * MIB));
    }
    assert_eq!(pool.bytes(), 8 * MIB, "two fit under 10 MiB");
    // Without a bound (the default pool) none is kept.
    let none = BufPool::default();
    none.put(Vec::<u8>::with_capacity(2 * MIB));
    assert_eq!(none.bytes(), 0);
}

#[test]
fn a_buffer_large_enough_is_found_under_smaller_ones() {
    let pool = BufPool::new(0);
    let mid = Vec::<u8>::with_capacity(100 << 10);
    let at = mid.as_ptr();
    pool.put(mid);
    for _ in 0..10 {
        pool.put(Vec::<u8>::with_capacity(64));
    }
    let got = pool.take_for(100_000);
    assert_eq!(got.as_ptr(), at);
    assert_eq!(pool.bytes(), 640);
    // Nothing fits: a new buffer of the length, the small ones stay.
    assert!(pool.take_for(200_000).capacity() >= 200_000);
    assert_eq!(pool.bytes(), 640);
    // Small lengths take the last buffer given back.
    assert_eq!(pool.take_for(16).capacity(), 64);
}

#[test]
fn small_buffers_stay_within_pool_max_bytes() {
    let pool = BufPool::new(64 * MIB);
    for _ in 0..(POOL_MAX_BYTES / MIB + 4) {
        pool.put(Vec::<u8>::with_capacity(MIB));
    }
    assert_eq!(pool.bytes(), POOL_MAX_BYTES);
}
