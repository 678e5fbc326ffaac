//! Allocations of the `Send` handle path in steady state (issue 32): a
//! send through an `RdmaHandle` allocates nothing per call on the calling
//! thread (a preallocated mailbox: a small send is answered at hand-over)
//! and nothing on the runtime thread (the ordered sender task, the agent's
//! inline send).
mod common;

use std::time::Duration;

use common::alloc_count::{allocs, Counting};
use futures::executor::block_on;
use verbio::provider::open_device;
use verbio::runtime::{spawn, Device, Placement, Pool, Runtime};
use verbio::{RdmaBuilder, RdmaHandle};

#[global_allocator]
static GLOBAL: Counting = Counting;

const WARM_UP: usize = 300;
const MEASURED: usize = 2000;

#[test]
fn a_steady_flow_of_sends_allocates_nothing_per_send() {
    // The peer: a runtime thread that takes every message and drops it.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let rt = Runtime::new().unwrap();
        let ctx = open_device(common::test_device().as_deref()).unwrap();
        let dev = Device::open(ctx).unwrap();
        rt.block_on(async {
            let l = RdmaBuilder::new()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .unwrap();
            addr_tx.send(l.local_addr().unwrap()).unwrap();
            let c = l.accept().await.unwrap();
            let mut got = 0;
            while got < WARM_UP + MEASURED {
                let m = c.receive_msg().await.unwrap();
                assert_eq!(m.len(), 64);
                got += 1;
            }
            // Let the last sends' acknowledgements through.
            spawn(async {}).await;
        });
    });
    let pool = Pool::builder()
        .threads(1)
        .device_per_thread(|_| open_device(common::test_device().as_deref()))
        .build()
        .unwrap();
    let addr = addr_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let h = block_on(RdmaHandle::connect(&pool, Placement::Thread(0), addr)).unwrap();
    let pool_allocs =
        || block_on(pool.spawn(Placement::Thread(0), |_| async { allocs() })).unwrap();
    for _ in 0..WARM_UP {
        block_on(h.send(vec![1; 64])).unwrap();
    }
    // The payloads are the caller's own allocations: made before.
    let payloads: Vec<Vec<u8>> = (0..MEASURED).map(|i| vec![i as u8; 64]).collect();
    let pool_before = pool_allocs();
    let mine_before = allocs();
    for p in payloads {
        block_on(h.send(p)).unwrap();
    }
    let mine = allocs() - mine_before;
    let on_pool = pool_allocs() - pool_before;
    println!("{MEASURED} sends: {mine} allocations on the calling thread, {on_pool} on the runtime thread");
    // A few amortized growths at most, nothing per send.
    assert!(
        mine <= 8,
        "{mine} allocations on the calling thread for {MEASURED} sends"
    );
    // The runtime thread's queues grow as used (the soft device's QP and CQ
    // queues, the memory pool's chunks, the queue of sends in order
    // double): each growth is one allocation, reached later when a slow run
    // lets a deeper queue build up (a small send is answered at hand-over,
    // so up to the mailbox's 256 may wait there). And when sends pile up
    // behind the credit window, the agent packs whole messages that waited
    // together into one SEND, each pack posted by a task of its own (the
    // task, its waker and join state, the pack and its member list: about
    // five allocations per pack of several messages, never one per
    // message). How many packs form depends on timing: 6 to 107
    // allocations were seen in runs on this machine. One allocation per
    // send would be 2,000.
    assert!(
        on_pool <= MEASURED as u64 / 8,
        "{on_pool} allocations on the runtime thread for {MEASURED} sends"
    );
    drop(h);
    server.join().unwrap();
}
