//! The RPC engine over UD queue pairs of the software RDMA device: calls of
//! every size (one packet, many packets, INLINE and from registered
//! buffers), on one device and between two threads with their own devices
//! and runtimes; with the device dropping 10% and duplicating 5% of the
//! datagrams, every call completes once with the right answer and every
//! handler runs once; a peer that goes away fails the calls in bounded
//! time. With `VERBIO_TEST_DEVICE` (e.g. rxe0, `--features ibverbs`) the calls run
//! on that device and the fault injection test is skipped.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use verbio::provider::soft::UdFaults;
use verbio::rpc::ud::{UdConfig, UdTransport};
use verbio::rpc::{Request, Rpc, RpcAddr, RpcConfig, RpcError};
use verbio::runtime::{timeout, Device, Runtime};

const ECHO: u8 = 7;
/// Bound of every test's work.
const WAIT: Duration = Duration::from_secs(60);

/// Handler runs per request.
type Runs = Rc<RefCell<HashMap<Vec<u8>, u32>>>;

/// A fresh soft device, or the one named by `VERBIO_TEST_DEVICE` (rxe0 in
/// the VM).
fn device() -> Device {
    Device::open(common::test_context()).expect("device")
}

/// A UD transport on `dev`.
fn transport(dev: &Device) -> UdTransport {
    UdTransport::new(dev, &UdConfig::default()).expect("UD transport")
}

/// The response to `req`: its bytes reversed, then its length.
fn answer(req: &[u8]) -> Vec<u8> {
    let mut v: Vec<u8> = req.iter().rev().copied().collect();
    v.extend_from_slice(&(req.len() as u32).to_le_bytes());
    v
}

fn serve(rpc: &Rpc<UdTransport>) -> Runs {
    let runs: Runs = Rc::default();
    let counted = runs.clone();
    rpc.register(ECHO, move |req: Request| {
        *counted.borrow_mut().entry(req.data().to_vec()).or_insert(0) += 1;
        async move {
            let mut resp = req.response();
            resp.extend_from_slice(&answer(req.data()));
            resp
        }
    })
    .unwrap();
    runs
}

/// A request unique to `(task, i)`, `len` bytes long.
fn request(task: usize, i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len.max(8)];
    v[..4].copy_from_slice(&(task as u32).to_le_bytes());
    v[4..8].copy_from_slice(&(i as u32).to_le_bytes());
    for (j, b) in v.iter_mut().enumerate().skip(8) {
        *b = (j * 13 + i) as u8;
    }
    v
}

/// `tasks` tasks of `calls` sequential calls each on a new session to
/// `server`, request sizes from `len`; checks every answer.
async fn run_calls(
    cli: &Rc<Rpc<UdTransport>>,
    server: &[u8],
    tasks: usize,
    calls: usize,
    len: fn(usize) -> usize,
) {
    let s = cli.connect(server).await.expect("connect");
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let cli = cli.clone();
            verbio::runtime::spawn(async move {
                for i in 0..calls {
                    let req = request(t, i, len(i));
                    let resp = cli.call(s, ECHO, &req).await.expect("call");
                    assert_eq!(&resp[..], &answer(&req)[..], "task {t} call {i}");
                }
            })
        })
        .collect();
    for h in handles {
        h.await;
    }
}

fn sizes(i: usize) -> usize {
    match i % 10 {
        0 => 20_000,
        1 => 4096,
        2 => 300,
        _ => 32,
    }
}

#[test]
fn calls_of_every_size_on_one_device() {
    let rt = Runtime::new().unwrap();
    let dev = device();
    let srv_t = transport(&dev);
    let cli_t = transport(&dev);
    rt.block_on(async {
        timeout(WAIT, async {
            let srv = Rpc::new(srv_t, RpcConfig::default());
            let runs = serve(&srv);
            let cli = Rc::new(Rpc::new(cli_t, RpcConfig::default()));
            run_calls(&cli, &srv.local_addr(), 4, 250, sizes).await;
            let runs = runs.borrow();
            assert_eq!(runs.len(), 1000);
            assert!(runs.values().all(|&n| n == 1));
            println!("client {:?}\nserver {:?}", cli.stats(), srv.stats());
            println!(
                "ud client {:?}\nud server {:?}\ndevice {:?}",
                cli.with_transport(UdTransport::stats),
                srv.with_transport(UdTransport::stats),
                dev.context().as_soft().map(|s| s.ud_counters())
            );
        })
        .await
        .expect("timed out");
    });
}

#[test]
fn every_call_completes_once_when_the_device_drops_and_duplicates() {
    let rt = Runtime::new().unwrap();
    let dev = device();
    let srv_t = transport(&dev);
    let cli_t = transport(&dev);
    let Some(soft) = dev.context().as_soft() else {
        println!("SKIPPED: fault injection needs the soft device (VERBIO_TEST_DEVICE is set)");
        return;
    };
    soft.set_ud_faults(Some(UdFaults {
        drop: 0.10,
        duplicate: 0.05,
        seed: 14,
    }))
    .expect("fault injection");
    // A call fails only after a second without any answer: far beyond
    // what 10% loss makes (0.2^100), not beyond a stall of this machine.
    let config = RpcConfig {
        rto: Duration::from_millis(10),
        max_retries: 100,
        ..RpcConfig::default()
    };
    rt.block_on(async {
        timeout(WAIT, async {
            let srv = Rpc::new(srv_t, config.clone());
            let runs = serve(&srv);
            let cli = Rc::new(Rpc::new(cli_t, config));
            run_calls(&cli, &srv.local_addr(), 8, 250, sizes).await;
            let runs = runs.borrow();
            assert_eq!(runs.len(), 2000, "every request reached a handler");
            assert!(runs.values().all(|&n| n == 1), "a handler ran twice");
            let (c, s) = (cli.stats(), srv.stats());
            let d = soft.ud_counters();
            println!("client {c:?}\nserver {s:?}\ndevice {d:?}");
            assert!(d.dropped_injected > 0 && d.duplicated > 0, "{d:?}");
            assert!(c.retransmissions > 0 && s.duplicate_requests > 0);
            assert_eq!(c.timeouts, 0);
        })
        .await
        .expect("timed out");
    });
}

/// What the server thread reports: requests handled, and whether each
/// handler ran once.
type ServerReport = std::thread::JoinHandle<(usize, bool)>;

/// A server thread with its own runtime and soft device: sends its
/// address in text form (as to another process), serves until `stop`
/// fires, returns its handler runs.
fn server_thread(stop: oneshot::Receiver<()>) -> (RpcAddr, ServerReport) {
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let rt = Runtime::new().unwrap();
        let dev = device();
        let t = transport(&dev);
        rt.block_on(async {
            let srv = Rpc::new(t, RpcConfig::default());
            let runs = serve(&srv);
            tx.send(srv.local_addr().to_string()).unwrap();
            srv.serve_until(stop).await.expect("stop sent");
            let runs = runs.borrow();
            (runs.len(), runs.values().all(|&n| n == 1))
        })
    });
    let text = rx.recv().unwrap();
    assert!(text.starts_with("rpc:"), "{text}");
    (text.parse().expect("the server's address"), th)
}

#[test]
fn calls_between_two_threads_and_devices() {
    let (stop_tx, stop_rx) = oneshot::channel();
    let (addr, th) = server_thread(stop_rx);
    let rt = Runtime::new().unwrap();
    let dev = device();
    // A call fails only after a second without progress: rxe in an
    // emulated VM loses bursts of datagrams and stalls for more than the
    // default 5 × 20 ms now and then (the calls then complete after
    // retransmissions, as they should).
    let config = RpcConfig {
        rto: Duration::from_millis(20),
        max_retries: 50,
        ..RpcConfig::default()
    };
    let cli = Rc::new(Rpc::new(transport(&dev), config));
    rt.block_on(async {
        timeout(WAIT, run_calls(&cli, &addr, 8, 250, sizes))
            .await
            .expect("timed out");
    });
    stop_tx.send(()).unwrap();
    let (runs, once) = th.join().unwrap();
    assert_eq!(runs, 2000);
    assert!(once, "a handler ran twice");
    println!("client {:?}", cli.stats());
}

#[test]
fn a_server_that_goes_away_fails_calls_in_bounded_time() {
    let (stop_tx, stop_rx) = oneshot::channel();
    let (addr, th) = server_thread(stop_rx);
    let rt = Runtime::new().unwrap();
    let dev = device();
    let config = RpcConfig {
        rto: Duration::from_millis(20),
        max_retries: 5,
        ..RpcConfig::default()
    };
    let cli = Rpc::new(transport(&dev), config);
    rt.block_on(async {
        timeout(WAIT, async {
            let s = cli.connect(&addr).await.expect("connect");
            cli.call(s, ECHO, b"hello").await.expect("call");
            stop_tx.send(()).unwrap();
            th.join().unwrap();
            let t0 = Instant::now();
            let e = cli.call(s, ECHO, b"anyone?").await.unwrap_err();
            let took = t0.elapsed();
            assert!(matches!(e, RpcError::Timeout { retries: 5, .. }), "{e}");
            // 6 waits of 20 ms (the first from 13 ms: timer ticks are
            // rto / 3 apart).
            assert!(took >= Duration::from_millis(100), "{took:?}");
            assert!(took < Duration::from_secs(2), "{took:?}");
            println!("failed after {took:?}: {e}");
        })
        .await
        .expect("timed out");
    });
}
