use super::*;
use verbio_runtime::provider::{AccessFlags, Context, Pd, SoftConfig};

fn pd() -> Pd {
    let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
    ctx.alloc_pd().expect("pd")
}

/// A registered vector of `cap` bytes, its first `init` written.
fn mem(pd: &Pd, cap: usize, init: u8) -> RegisteredMem<Vec<u8>> {
    let mut v = Vec::with_capacity(cap);
    v.resize(cap, init);
    RegisteredMem::register(pd, v, AccessFlags::LOCAL_WRITE).expect("register")
}

#[test]
fn a_dropped_message_gives_its_vector_back_for_a_message_it_fits() {
    let pd = pd();
    let bufs = ReadBufs::new(1 << 30);
    let m = ReadInto::new(mem(&pd, 1000, 5), 700, &bufs);
    assert_eq!((m.len(), m.bytes()), (700, &[5u8; 700][..]));
    drop(m);
    assert_eq!(bufs.kept(), 1);
    assert!(bufs.take(1001).is_none(), "too small");
    assert!(bufs.take(499).is_none(), "more than twice the message");
    let again = bufs.take(500).expect("fits");
    assert_eq!(again.bytes_total(), 1000);
    // Reused for a shorter message: only its bytes show.
    let m = ReadInto::new(again, 500, &bufs);
    assert_eq!(m.bytes().len(), 500);
    assert_eq!(
        m.into_vec(),
        vec![5u8; 500],
        "taken whole, cut to the message"
    );
    assert_eq!(bufs.kept(), 0, "a vector taken by the application leaves");
}

#[test]
fn kept_vectors_are_bounded_in_count_and_bytes_and_freed_with_the_connection() {
    let pd = pd();
    let bufs = ReadBufs::new(10_000);
    for _ in 0..KEPT + 2 {
        bufs.give_back(mem(&pd, 100, 0));
    }
    assert_eq!(bufs.kept(), KEPT, "at most KEPT vectors");
    let bufs = ReadBufs::new(10_000);
    bufs.give_back(mem(&pd, 6_000, 0));
    bufs.give_back(mem(&pd, 6_000, 0));
    assert_eq!(bufs.kept(), 1, "at most max_unread_bytes of them");
    // The smallest that fits is taken.
    bufs.give_back(mem(&pd, 4_000, 0));
    assert_eq!(bufs.take(3_000).map(|m| m.bytes_total()), Some(4_000));
    // A message that outlives its connection frees its vector.
    let m = ReadInto::new(mem(&pd, 100, 0), 100, &bufs);
    drop(bufs);
    drop(m);
}
