//! The RPC engine's hot path does not allocate: after warm-up, a small call
//! (request, handler task, response) makes no heap allocation on either
//! side, counted by a global allocator (per thread, so parallel tests do
//! not interfere). Over the in-memory transport, and over UD queue pairs of
//! the soft device; the device's engine thread
//! is not counted, the runtime's thread (posting, polling) is.

mod common;

use std::rc::Rc;

use common::alloc_count::{allocs, big_allocs, Counting};

use verbio::provider::{Context, SoftConfig};
use verbio::rpc::mem::MemNetwork;
use verbio::rpc::ud::{UdConfig, UdTransport};
use verbio::rpc::{Request, Rpc, RpcConfig, Transport};
use verbio::runtime::{Device, Runtime};

#[global_allocator]
static GLOBAL: Counting = Counting;

const ECHO: u8 = 1;
/// Allowed allocations in the measured calls: none per call, but a queue or
/// batch buffer may still grow (amortized, bounded) when the scheduling of a
/// loaded machine makes a larger burst than the warm-up did.
const GROWTH: u64 = (MEASURED / 1000) as u64;
const WARM_UP: usize = 2_000;
const MEASURED: usize = 20_000;

/// Runs `tasks` tasks of sequential 32-byte calls from `client` to
/// `server`; returns the allocations made during the measured calls.
async fn allocations<T: Transport>(server: Rpc<T>, client: Rpc<T>, tasks: usize) -> u64 {
    allocations_with(server, client, tasks, false, 32).await
}

/// As [`allocations`], the echo run by the dispatcher
/// (`Rpc::register_inline`) if `inline`, calls of `len` bytes.
async fn allocations_with<T: Transport>(
    server: Rpc<T>,
    client: Rpc<T>,
    tasks: usize,
    inline: bool,
    len: usize,
) -> u64 {
    let echo = |req: Request| {
        let mut resp = req.response();
        resp.extend_from_slice(req.data());
        resp
    };
    if inline {
        server.register_inline(ECHO, echo).unwrap();
    } else {
        server
            .register(ECHO, move |req: Request| std::future::ready(echo(req)))
            .unwrap();
    }
    let cli = Rc::new(client);
    let s = cli.connect(&server.local_addr()).await.unwrap();
    let run = |calls: usize| {
        let handles: Vec<_> = (0..tasks)
            .map(|t| {
                let cli = cli.clone();
                // (Allocated before the counting starts.)
                let mut req = vec![0u8; len];
                verbio::runtime::spawn(async move {
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
        "{tasks} task(s), {len} B: {n} allocations in {MEASURED} calls ({:.4} per call)",
        n as f64 / MEASURED as f64
    );
    n
}

/// Allocations over the in-memory network.
fn in_memory(tasks: usize) -> u64 {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(1, 4096);
        let server = Rpc::new(net.endpoint(), RpcConfig::default());
        let client = Rpc::new(net.endpoint(), RpcConfig::default());
        allocations(server, client, tasks).await
    })
}

/// Allocations over two UD queue pairs of one soft device.
fn over_ud(tasks: usize) -> u64 {
    over_ud_sized(tasks, 32)
}

/// [`over_ud`] with calls of `len` bytes.
fn over_ud_sized(tasks: usize, len: usize) -> u64 {
    let rt = Runtime::new().unwrap();
    let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
    let dev = Device::open(ctx).expect("device");
    let transport = || UdTransport::new(&dev, &UdConfig::default()).expect("UD transport");
    let (st, ct) = (transport(), transport());
    // The soft device's engine thread carries these datagrams: on a loaded
    // host it can be off the CPU longer than the default 5 retries of 20 ms
    // (a call timed out so once with 8 callers); what this counts is
    // allocations, not loss.
    let config = RpcConfig {
        max_retries: 50,
        ..RpcConfig::default()
    };
    rt.block_on(async {
        let server = Rpc::new(st, config.clone());
        let client = Rpc::new(ct, config);
        allocations_with(server, client, tasks, false, len).await
    })
}

#[test]
fn a_small_call_does_not_allocate_after_warm_up() {
    assert!(in_memory(1) <= GROWTH);
}

#[test]
fn eight_concurrent_callers_do_not_allocate_after_warm_up() {
    assert!(in_memory(8) <= GROWTH);
}

#[test]
fn inline_handlers_do_not_allocate_after_warm_up() {
    for tasks in [1, 8] {
        let rt = Runtime::new().unwrap();
        let n = rt.block_on(async {
            let net = MemNetwork::new(1, 4096);
            let server = Rpc::new(net.endpoint(), RpcConfig::default());
            let client = Rpc::new(net.endpoint(), RpcConfig::default());
            allocations_with(server, client, tasks, true, 32).await
        });
        assert!(n <= GROWTH, "{tasks} task(s): {n}");
    }
}

#[test]
fn a_small_call_over_ud_does_not_allocate_after_warm_up() {
    assert!(over_ud(1) <= GROWTH);
}

#[test]
fn eight_concurrent_callers_over_ud_do_not_allocate_after_warm_up() {
    assert!(over_ud(8) <= GROWTH);
}

/// Echo calls of `len` bytes over the in-memory network (by READ and
/// WRITE: its large-message path); the allocations of 1 MiB or more made by
/// `calls` calls after three warm-up calls.
fn big_allocations_per_echo(len: usize, calls: usize) -> u64 {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(1, 4096);
        let config = RpcConfig {
            max_msg_len: 16 << 20,
            ..RpcConfig::default()
        };
        let server = Rpc::new(net.endpoint(), config.clone());
        let client = Rpc::new(net.endpoint(), config);
        server
            .register(ECHO, |req: Request| {
                let mut resp = req.response_with_capacity(req.data().len());
                resp.extend_from_slice(req.data());
                std::future::ready(resp)
            })
            .unwrap();
        let s = client.connect(&server.local_addr()).await.unwrap();
        let req: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        let mut before = 0;
        for i in 0..3 + calls {
            if i == 3 {
                before = big_allocs();
            }
            let resp = client.call(s, ECHO, &req).await.unwrap();
            assert!(resp[..] == req[..], "call {i}: echo differs");
        }
        let c = client.stats();
        // Responses as long as their requests are written into the
        // buffer the request offered.
        assert!(
            c.bulk_reads + c.bulk_writes >= 3,
            "the calls went by READ or WRITE"
        );
        let n = big_allocs() - before;
        println!("{len} bytes: {n} allocations of 1 MiB or more in {calls} calls");
        n
    })
}

/// A large message's buffers (the READ's target on each side, the
/// handler's response) come back from the endpoint's pool: a stream of
/// 4 MiB calls allocates no new 4 MiB buffer per call (it did: the pool
/// freed every buffer above 1 MiB, so each call allocated three and
/// page-faulted them in). Also at 1 MiB, the largest the small list keeps.
#[test]
fn large_messages_reuse_pooled_buffers() {
    for len in [1 << 20, 4 << 20] {
        let n = big_allocations_per_echo(len, 10);
        assert_eq!(n, 0, "{len}-byte echoes allocated {n} large buffers");
    }
}

/// Calls of 1 KiB over UD: their packets are larger than the INLINE size,
/// so they go from registered buffers; each send is kept until its
/// completion and its buffer reused (a send's future dropped while the
/// device still reads its buffer had the runtime box the buffer: an
/// allocation per packet, two per call).
#[test]
fn calls_sent_from_registered_buffers_over_ud_do_not_allocate_after_warm_up() {
    for tasks in [1, 8] {
        let n = over_ud_sized(tasks, 1024);
        assert!(n <= GROWTH, "{tasks} task(s): {n}");
    }
}
