//! `Send` handles over a pool whose runtimes are hosted on tokio's
//! multi-thread runtime (`PoolBuilder::host_on_tokio`): each runtime turned
//! by a tokio task on whichever worker polls it. The same guarantees as
//! with runtime threads: many tasks on many workers share handles, a
//! runtime that dies fails its handles fast, and futures dropped
//! mid-flight leave their buffers to the runtime until the device is done
//! (run under ASan by scripts/asan-test.sh).
mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use verbio::provider::open_device;
use verbio::runtime::pool::ThreadEnd;
use verbio::runtime::{Placement, Pool, PoolError};
use verbio::{HandleError, ListenerHandle, RdmaHandle};

/// Bound of every wait here.
const WAIT: Duration = Duration::from_secs(20);

/// A pool of `runtimes` hosted on the calling task's tokio runtime, each
/// with a device of its own.
fn hosted(runtimes: usize) -> Pool {
    Pool::builder()
        .threads(runtimes)
        .grace_period(Duration::from_millis(200))
        .device_per_thread(|_| open_device(common::test_device().as_deref()))
        .host_on_tokio(tokio::runtime::Handle::current())
        .build()
        .expect("hosted pool")
}

/// Echoes every message back until the connection ends.
async fn echo(c: RdmaHandle) {
    while let Ok(m) = c.receive().await {
        if c.send(m).await.is_err() {
            break;
        }
    }
}

/// A listener on runtime 0 of `pool` whose tokio tasks echo `conns`
/// connections, and its address.
async fn echo_server(pool: &Pool, conns: usize) -> (ListenerHandle, SocketAddr) {
    let listener = ListenerHandle::bind(pool, Placement::Thread(0), "127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    let addr = listener.local_addr();
    let l = listener.clone();
    tokio::spawn(async move {
        for _ in 0..conns {
            let c = l.accept().await.expect("accept");
            tokio::spawn(echo(c));
        }
    });
    (listener, addr)
}

async fn connect(pool: &Pool, placement: Placement, addr: SocketAddr) -> RdmaHandle {
    tokio::time::timeout(WAIT, RdmaHandle::connect(pool, placement, addr))
        .await
        .expect("connect in time")
        .expect("connect")
}

/// Message `i` of task `t`: its tag, then bytes derived from it.
fn message(t: u32, i: u32) -> Vec<u8> {
    let len = 8 + ((t * 131 + i * 977) % 3000) as usize;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&t.to_le_bytes());
    m.extend_from_slice(&i.to_le_bytes());
    m.extend((8..len).map(|k| (k as u32 ^ t.wrapping_mul(31) ^ i) as u8));
    m
}

/// The tag of a message that is exactly what [`message`] makes.
fn check(m: &[u8]) -> (u32, u32) {
    assert!(m.len() >= 8, "a message of {} bytes", m.len());
    let t = u32::from_le_bytes(m[..4].try_into().unwrap());
    let i = u32::from_le_bytes(m[4..8].try_into().unwrap());
    assert_eq!(
        m,
        &message(t, i)[..],
        "message ({t}, {i}) came back changed"
    );
    (t, i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_tokio_tasks_share_handles_on_two_hosted_runtimes() {
    const TASKS: u32 = 16;
    const CONNS: usize = 4;
    const MESSAGES: u32 = 25;
    let servers = hosted(1);
    let clients = hosted(2);
    let (_listener, addr) = echo_server(&servers, CONNS).await;
    let mut conns = Vec::new();
    for i in 0..CONNS {
        let c = connect(&clients, Placement::RoundRobin, addr).await;
        assert_eq!(c.thread().index(), i % 2, "round-robin placement");
        conns.push(c);
    }
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let c = conns[t as usize % CONNS].clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                for i in 0..MESSAGES {
                    c.send(message(t, i)).await.expect("send");
                    let m = c.receive().await.expect("receive");
                    assert!(
                        seen.lock().unwrap().insert(check(&m)),
                        "a message came back twice"
                    );
                }
                let remote = c.request_remote_mr(8192).await.expect("request_remote_mr");
                for round in 0..4u32 {
                    let data: Vec<u8> = (0..4096u32)
                        .map(|k| (k ^ t ^ round.wrapping_mul(77)) as u8)
                        .collect();
                    let off = u64::from(round % 2) * 4096;
                    c.write(&remote, off, data.clone()).await.expect("write");
                    let back = c.read(&remote, off, data.len()).await.expect("read");
                    assert_eq!(
                        back, data,
                        "task {t} round {round}: read back what it wrote"
                    );
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(WAIT, t)
            .await
            .expect("task in time")
            .expect("task");
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), (TASKS * MESSAGES) as usize);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosted_runtime_that_dies_fails_its_handles_fast() {
    let servers = hosted(1);
    let clients = hosted(2);
    let (_listener, addr) = echo_server(&servers, 2).await;
    let doomed = connect(&clients, Placement::Thread(0), addr).await;
    let alive = connect(&clients, Placement::Thread(1), addr).await;
    let waiting = tokio::spawn({
        let d = doomed.clone();
        async move { d.receive().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let killed = clients.spawn(Placement::Thread(0), |_| -> std::future::Ready<()> {
        panic!("hosted runtime panic (expected by the test)")
    });
    assert!(killed.await.is_err());
    let r = tokio::time::timeout(WAIT, waiting)
        .await
        .expect("the waiting receive ends")
        .unwrap();
    assert!(
        matches!(
            r,
            Err(HandleError::Pool(PoolError::ThreadGone {
                index: 0,
                end: ThreadEnd::Panicked
            }))
        ),
        "the waiting receive fails with ThreadGone: {r:?}"
    );
    let r = tokio::time::timeout(WAIT, doomed.send(vec![1]))
        .await
        .expect("fails fast");
    assert!(
        matches!(
            r,
            Err(HandleError::Pool(PoolError::ThreadGone { index: 0, .. }))
        ),
        "{r:?}"
    );
    alive.send(message(1, 2)).await.unwrap();
    assert_eq!(check(&alive.receive().await.unwrap()), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn futures_dropped_mid_flight_on_a_hosted_runtime_leave_it_working() {
    let servers = hosted(1);
    let clients = hosted(1);
    let (_listener, addr) = echo_server(&servers, 1).await;
    let c = connect(&clients, Placement::Thread(0), addr).await;
    let remote = c.request_remote_mr(1 << 16).await.unwrap();
    // Dropped after their first poll: their requests are queued or in
    // flight, their buffers owned by the runtime until done.
    for round in 0..20u32 {
        let data = vec![round as u8; 1 << 16];
        let w = c.write(&remote, 0, data);
        let r = c.read(&remote, 0, 1 << 16);
        let s = c.send(message(round, 0));
        let _ = tokio::time::timeout(Duration::ZERO, async {
            let _ = tokio::join!(w, r, s);
        })
        .await;
    }
    let _ = tokio::time::timeout(Duration::from_millis(5), c.receive()).await;
    c.send(message(999, 1)).await.unwrap();
    loop {
        let m = tokio::time::timeout(WAIT, c.receive())
            .await
            .expect("the echo comes")
            .unwrap();
        if check(&m) == (999, 1) {
            break;
        }
    }
    let data: Vec<u8> = (0..1000u32).map(|k| k as u8).collect();
    c.write(&remote, 100, data.clone()).await.unwrap();
    assert_eq!(c.read(&remote, 100, 1000).await.unwrap(), data);
    // Shut down with the connection open: `shutdown` does not wait for a
    // hosted runtime, which serves what was queued and ends within its
    // grace period (calls meanwhile may see the connection's local
    // close); from then on every call fails at once with `ThreadGone`.
    drop(clients);
    let failed = tokio::time::timeout(WAIT, async {
        loop {
            match c.read(&remote, 0, 8).await {
                Err(HandleError::Pool(e)) => return e,
                Err(HandleError::Agent(_)) | Ok(_) => {}
                Err(e) => panic!("a read after shutdown: {e:?}"),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("calls fail once the hosted runtime has ended");
    assert!(
        matches!(
            failed,
            PoolError::ThreadGone {
                index: 0,
                end: ThreadEnd::ShutDown
            }
        ),
        "{failed:?}"
    );
}

#[test]
fn a_tokio_runtime_without_timers_is_refused() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_io()
        .build()
        .unwrap();
    let r = Pool::builder()
        .threads(1)
        .host_on_tokio(rt.handle().clone())
        .build();
    assert!(
        matches!(
            r,
            Err(PoolError::Config {
                setting: "host_on_tokio",
                ..
            })
        ),
        "{r:?}"
    );
}

/// Small sends from tokio tasks to a connection on a hosted runtime are
/// made on the asking worker when they can be (posted at once, no request
/// between); they keep their order with the larger sends between them
/// (answered when done, through the runtime's tasks) and with the small
/// ones handed over while the runtime was held elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_and_large_sends_on_a_hosted_runtime_keep_their_order() {
    let servers = hosted(1);
    let clients = hosted(1);
    let (_listener, addr) = echo_server(&servers, 2).await;
    let a = connect(&clients, Placement::Thread(0), addr).await;
    let b = connect(&clients, Placement::Thread(0), addr).await;
    let mut tasks = Vec::new();
    // Mostly 8 to 64 bytes (INLINE), every seventh up to 3 KB.
    let sized = |t: u32, i: u32| {
        let mut m = message(t, i);
        if i % 7 != 0 {
            m.truncate(8 + (i as usize % 57));
        }
        m
    };
    for (t, c) in [(0u32, a), (1, b)] {
        tasks.push(tokio::spawn(async move {
            for i in 0..300u32 {
                c.send(sized(t, i)).await.unwrap();
                if i % 50 == 49 {
                    c.flush().await.unwrap();
                }
            }
            for i in 0..300u32 {
                let m = tokio::time::timeout(WAIT, c.receive())
                    .await
                    .expect("the echo comes")
                    .unwrap();
                assert_eq!(m, sized(t, i), "message ({t}, {i}) in the order sent");
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(WAIT * 2, t)
            .await
            .expect("the tasks end")
            .unwrap();
    }
}
