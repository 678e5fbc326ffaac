//! Atomics and immediates through `Send` handles (issue 32): remote
//! compare-and-swap and fetch-and-add, WRITE with immediate, and messages
//! with immediates, asked from tasks of tokio's multi-thread runtime on
//! connections living on pool threads.
mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use verbio::provider::open_device;
use verbio::runtime::{Placement, Pool};
use verbio::{AgentError, HandleError, ListenerHandle, RdmaHandle, RemoteMrHandle};

use common::pool::block_thread;
use common::WAIT;

/// Compile-time only: the futures of the atomics and immediates are
/// `Send`.
#[allow(dead_code)]
fn their_futures_are_send(h: &RdmaHandle, r: &RemoteMrHandle) {
    fn send_future<F: Future + Send>(_: F) {}
    send_future(h.send_with_imm(vec![], 1));
    send_future(h.receive_with_imm());
    send_future(h.write_with_imm(r, 0, vec![], 1));
    send_future(h.receive_write_imm());
    send_future(h.compare_and_swap(r, 0, 1, 2));
    send_future(h.fetch_and_add(r, 0, 1));
}

fn pool() -> Pool {
    Pool::builder()
        .threads(1)
        .grace_period(Duration::from_millis(200))
        .device_per_thread(|_| open_device(common::test_device().as_deref()))
        .build()
        .expect("pool")
}

/// A client handle and the server's handle of the same connection, each
/// on a pool of its own.
async fn pair(servers: &Pool, clients: &Pool) -> (RdmaHandle, RdmaHandle) {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let listener = ListenerHandle::bind(servers, Placement::Thread(0), any)
        .await
        .expect("bind");
    let accepted = tokio::spawn({
        let l = listener.clone();
        async move { l.accept().await }
    });
    let c = RdmaHandle::connect(clients, Placement::Thread(0), listener.local_addr())
        .await
        .expect("connect");
    let s = tokio::time::timeout(WAIT, accepted)
        .await
        .expect("accepted in time")
        .unwrap()
        .expect("accept");
    (c, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn atomics_on_a_peer_word_from_many_tokio_tasks() {
    let (servers, clients) = (pool(), pool());
    let (c, _s) = pair(&servers, &clients).await;
    let remote = c.request_remote_mr(64).await.expect("grant");

    assert_eq!(c.fetch_and_add(&remote, 8, 5).await.unwrap(), 0);
    assert_eq!(c.compare_and_swap(&remote, 8, 5, 42).await.unwrap(), 5);
    // No swap: the word is not 5 any more.
    assert_eq!(c.compare_and_swap(&remote, 8, 5, 7).await.unwrap(), 42);
    assert_eq!(c.fetch_and_add(&remote, 8, 0).await.unwrap(), 42);
    // Wrapping add.
    assert_eq!(c.fetch_and_add(&remote, 8, u64::MAX).await.unwrap(), 42);
    assert_eq!(c.fetch_and_add(&remote, 8, 0).await.unwrap(), 41);
    // The word's bytes as a READ sees them (native order, as the device's).
    let bytes = c.read(&remote, 8, 8).await.unwrap();
    assert_eq!(u64::from_ne_bytes(bytes.try_into().unwrap()), 41);

    // 16 tasks on 4 workers add to one word: no add is lost, and every
    // previous value is seen exactly once.
    const TASKS: u64 = 16;
    const ADDS: u64 = 25;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (c, remote, seen) = (c.clone(), remote.clone(), seen.clone());
            tokio::spawn(async move {
                for _ in 0..ADDS {
                    let prev = c.fetch_and_add(&remote, 0, 1).await.unwrap();
                    seen.lock().unwrap().push(prev);
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(WAIT, t)
            .await
            .expect("the adds end")
            .unwrap();
    }
    assert_eq!(c.fetch_and_add(&remote, 0, 0).await.unwrap(), TASKS * ADDS);
    let mut seen = std::mem::take(&mut *seen.lock().unwrap());
    seen.sort_unstable();
    assert_eq!(seen, (0..TASKS * ADDS).collect::<Vec<_>>());

    // A misaligned word fails that call, with the connection's error, and
    // the connection goes on.
    assert!(matches!(
        c.fetch_and_add(&remote, 4, 1).await,
        Err(HandleError::Agent(AgentError::Verb(
            verbio::ops::Error::BadAtomicTarget { .. }
        )))
    ));
    // Outside the region: refused before anything is queued.
    assert!(matches!(
        c.compare_and_swap(&remote, 60, 0, 1).await,
        Err(HandleError::OutOfBounds {
            what: "compare_and_swap",
            ..
        })
    ));
    assert!(matches!(
        c.fetch_and_add(&remote, u64::MAX - 3, 1).await,
        Err(HandleError::OutOfBounds { .. })
    ));
    assert_eq!(c.fetch_and_add(&remote, 8, 0).await.unwrap(), 41);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediates_with_writes_and_messages() {
    let (servers, clients) = (pool(), pool());
    let (c, s) = pair(&servers, &clients).await;
    let remote = c.request_remote_mr(4096).await.expect("grant");

    // WRITE with immediate: the peer hears the immediate once the bytes
    // are in its memory.
    let data: Vec<u8> = (0..1000u32).map(|k| (k * 13) as u8).collect();
    c.write_with_imm(&remote, 100, data.clone(), 0xC0FF_EE01)
        .await
        .unwrap();
    let imm = tokio::time::timeout(WAIT, s.receive_write_imm())
        .await
        .expect("the immediate arrives")
        .unwrap();
    assert_eq!(imm, 0xC0FF_EE01);
    assert_eq!(c.read(&remote, 100, 1000).await.unwrap(), data);
    // A wait dropped before the immediate came leaves it to the next.
    let _ = tokio::time::timeout(Duration::from_millis(5), s.receive_write_imm()).await;
    c.write_with_imm(&remote, 0, vec![7; 16], 9).await.unwrap();
    let imm = tokio::time::timeout(WAIT, s.receive_write_imm())
        .await
        .expect("in time")
        .unwrap();
    assert_eq!(imm, 9);
    // Outside the region: refused before anything is queued.
    assert!(matches!(
        c.write_with_imm(&remote, 4000, vec![0; 97], 1).await,
        Err(HandleError::OutOfBounds {
            what: "write_with_imm",
            ..
        })
    ));

    // Messages with and without immediates, in order, each with its own.
    c.send_with_imm(b"first".to_vec(), 1).await.unwrap();
    c.send(b"second".to_vec()).await.unwrap();
    c.send_with_imm(b"third".to_vec(), u32::MAX).await.unwrap();
    c.send_with_imm(Vec::new(), 0).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(
            tokio::time::timeout(WAIT, s.receive_with_imm())
                .await
                .expect("the message arrives")
                .unwrap(),
        );
    }
    assert_eq!(
        got,
        vec![
            (b"first".to_vec(), Some(1)),
            (b"second".to_vec(), None),
            (b"third".to_vec(), Some(u32::MAX)),
        ]
    );
    // A plain receive takes a message sent with an immediate (its bytes).
    let last = tokio::time::timeout(WAIT, s.receive())
        .await
        .expect("in time")
        .unwrap();
    assert!(last.is_empty());
    // Both ways: the server's immediates reach the client.
    s.send_with_imm(b"back".to_vec(), 77).await.unwrap();
    assert_eq!(
        tokio::time::timeout(WAIT, c.receive_with_imm())
            .await
            .expect("in time")
            .unwrap(),
        (b"back".to_vec(), Some(77))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_is_left_for_the_next_asker_when_the_first_left_before_being_served() {
    let (servers, clients) = (pool(), pool());
    let (c, s) = pair(&servers, &clients).await;
    let remote = c.request_remote_mr(64).await.expect("grant");
    // The server's runtime thread is held: the first wait is queued, not
    // served, when its asker leaves; the immediate then arrives before the
    // thread serves that request (it must not be taken for nobody).
    let go = block_thread(&servers).await;
    let first = tokio::time::timeout(Duration::from_millis(20), s.receive_write_imm()).await;
    assert!(first.is_err(), "nothing was written yet");
    c.write_with_imm(&remote, 0, vec![1; 8], 77).await.unwrap();
    go.send(true).unwrap();
    let imm = tokio::time::timeout(WAIT, s.receive_write_imm())
        .await
        .expect("the immediate is left for the next wait")
        .unwrap();
    assert_eq!(imm, 77);
    // The same for a message and a receive.
    let go = block_thread(&servers).await;
    let first = tokio::time::timeout(Duration::from_millis(20), s.receive_with_imm()).await;
    assert!(first.is_err(), "nothing was sent yet");
    c.send_with_imm(b"kept".to_vec(), 5).await.unwrap();
    go.send(true).unwrap();
    let m = tokio::time::timeout(WAIT, s.receive_with_imm())
        .await
        .expect("the message is left for the next receive")
        .unwrap();
    assert_eq!(m, (b"kept".to_vec(), Some(5)));
}
