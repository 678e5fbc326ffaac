//! The RPC engine's hot path does not allocate: after warm-up, a small call
//! (request, handler task, response) makes no heap allocation on either
//! side, counted by a global allocator (per thread, so parallel tests do
//! not interfere). Over the in-memory transport.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::rc::Rc;

use verbio::rpc::mem::MemNetwork;
use verbio::rpc::{Request, Rpc, RpcConfig};
use verbio::runtime::Runtime;

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

const ECHO: u8 = 1;
const WARM_UP: usize = 2_000;
const MEASURED: usize = 20_000;

/// Runs `tasks` tasks of sequential 32-byte calls; returns the allocations
/// made during the measured calls.
fn allocations(tasks: usize) -> u64 {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(1, 4096);
        let srv = Rpc::new(net.endpoint(), RpcConfig::default());
        srv.register(ECHO, |req: Request| async move {
            let mut resp = req.response();
            resp.extend_from_slice(req.data());
            resp
        });
        let cli = Rc::new(Rpc::new(net.endpoint(), RpcConfig::default()));
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let run = |calls: usize| {
            let handles: Vec<_> = (0..tasks)
                .map(|t| {
                    let cli = cli.clone();
                    verbio::runtime::spawn(async move {
                        let mut req = [0u8; 32];
                        for i in 0..calls / tasks {
                            req[..8].copy_from_slice(&((t << 32) | i).to_le_bytes());
                            let resp = cli.call(s, ECHO, &req).await.unwrap();
                            assert_eq!(&resp[..], &req[..]);
                        }
                    })
                })
                .collect();
            handles
        };
        for h in run(WARM_UP) {
            h.await;
        }
        // The task handles are allocated before counting starts.
        let handles = run(MEASURED);
        let before = allocs();
        for h in handles {
            h.await;
        }
        let n = allocs() - before;
        println!(
            "{tasks} task(s): {n} allocations in {MEASURED} calls ({:.4} per call)",
            n as f64 / MEASURED as f64
        );
        n
    })
}

#[test]
fn a_small_call_does_not_allocate_after_warm_up() {
    assert_eq!(allocations(1), 0);
}

#[test]
fn eight_concurrent_callers_do_not_allocate_after_warm_up() {
    assert_eq!(allocations(8), 0);
}
