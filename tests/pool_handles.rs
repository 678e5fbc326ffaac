//! `Send` handles over a pool of runtime threads, used from tokio's
//! multi-thread runtime (issue 32): connections, listeners and remote
//! regions shared by tasks on any worker, a runtime thread that dies, and
//! futures dropped mid-flight (run under ASan by scripts/asan-test.sh).
mod common;

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use verbio::provider::open_device;
use verbio::runtime::pool::ThreadEnd;
use verbio::runtime::{Placement, Pool, PoolError};
use verbio::{HandleError, ListenerHandle, RdmaHandle, RemoteMrHandle};

use common::pool::block_thread;

/// Bound of every wait here.
const WAIT: Duration = Duration::from_secs(20);

fn send_sync_clone<T: Send + Sync + Clone>() {}
fn send_future<F: Future + Send>(_: F) {}

/// Compile-time only: every handle is `Send + Sync + Clone` and every
/// future it returns is `Send`.
#[allow(dead_code)]
fn handles_and_their_futures_are_send(
    pool: &Pool,
    h: &RdmaHandle,
    l: &ListenerHandle,
    r: &RemoteMrHandle,
    addr: SocketAddr,
    rpc: &verbio::RpcHandle,
    session: verbio::rpc::SessionId,
) {
    send_sync_clone::<RdmaHandle>();
    send_sync_clone::<ListenerHandle>();
    send_sync_clone::<RemoteMrHandle>();
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Pool>();
    send_sync::<HandleError>();
    send_future(RdmaHandle::connect(pool, Placement::RoundRobin, addr));
    send_future(RdmaHandle::connect_with(
        pool,
        Placement::Key(1),
        addr,
        |b| b,
    ));
    send_future(ListenerHandle::bind(pool, Placement::RoundRobin, addr));
    send_future(ListenerHandle::bind_with(
        pool,
        Placement::RoundRobin,
        addr,
        |b| b,
    ));
    send_future(l.accept());
    send_future(h.send(vec![]));
    send_future(h.flush());
    send_future(h.receive());
    send_future(h.request_remote_mr(1));
    send_future(h.write(r, 0, vec![]));
    send_future(h.read(r, 0, 1));
    send_future(h.send_local_mr(vec![], 0));
    send_future(h.receive_remote_mr(None));
    send_future(h.send_remote_mr(r.clone(), 0));
    send_future(h.receive_local_mr(Some(1)));
    send_future(pool.spawn(Placement::RoundRobin, |_| async {}));
    send_sync_clone::<verbio::RpcHandle>();
    send_future(rpc.connect(b"rpc address"));
    send_future(rpc.call(session, 1, vec![]));
    fn send<T: Send>() {}
    send::<verbio::HandleStream>();
}

/// A pool whose threads each have a device of their own (a fresh soft
/// device, or `VERBIO_TEST_DEVICE`'s).
fn pool(threads: usize) -> Pool {
    Pool::builder()
        .threads(threads)
        .grace_period(Duration::from_millis(200))
        .device_per_thread(|_| open_device(common::test_device().as_deref()))
        .build()
        .expect("pool")
}

fn any_addr() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Echoes every message back until the connection ends.
async fn echo(c: RdmaHandle) {
    while let Ok(m) = c.receive().await {
        if c.send(m).await.is_err() {
            break;
        }
    }
}

/// A listener on its own pool whose tokio tasks echo `conns` connections.
async fn echo_server(pool: &Pool, conns: usize) -> (ListenerHandle, tokio::task::JoinHandle<()>) {
    let (listener, _) = listening(pool).await;
    let l = listener.clone();
    let accepting = tokio::spawn(async move {
        for _ in 0..conns {
            let c = l.accept().await.expect("accept");
            tokio::spawn(echo(c));
        }
    });
    (listener, accepting)
}

/// A listener on thread 0 of `pool`, and its address.
async fn listening(pool: &Pool) -> (ListenerHandle, SocketAddr) {
    let listener = ListenerHandle::bind(pool, Placement::Thread(0), any_addr())
        .await
        .expect("bind");
    let addr = listener.local_addr();
    (listener, addr)
}

/// A connection to `addr` from thread `thread` of `pool`.
async fn connect(pool: &Pool, thread: usize, addr: SocketAddr) -> RdmaHandle {
    tokio::time::timeout(
        WAIT,
        RdmaHandle::connect(pool, Placement::Thread(thread), addr),
    )
    .await
    .expect("connect in time")
    .expect("connect")
}

/// One connection `c` through an echo server: two pools of one thread,
/// the server's (echoing `conns` connections) and the client's. Dropped in
/// this order: the connection, the listener, the clients' pool, the
/// server's (bind every field: one left to `..` is dropped at once).
struct Echoed {
    c: RdmaHandle,
    listener: ListenerHandle,
    clients: Pool,
    servers: Pool,
}

async fn echoed(conns: usize) -> Echoed {
    let servers = pool(1);
    let clients = pool(1);
    let (listener, _accepting) = echo_server(&servers, conns).await;
    let c = connect(&clients, 0, listener.local_addr()).await;
    Echoed {
        c,
        listener,
        clients,
        servers,
    }
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

const TASKS: u32 = 16;
const CONNS: usize = 4;
const MESSAGES: u32 = 25;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_tokio_tasks_share_handles_on_two_runtime_threads() {
    let servers = pool(1);
    let clients = pool(2);
    let (listener, accepting) = echo_server(&servers, CONNS).await;
    let addr = listener.local_addr();
    let mut conns = Vec::new();
    for i in 0..CONNS {
        let c = tokio::time::timeout(
            WAIT,
            RdmaHandle::connect(&clients, Placement::RoundRobin, addr),
        )
        .await
        .expect("connect in time")
        .expect("connect");
        assert_eq!(c.thread().index(), i % 2, "round-robin placement");
        conns.push(c);
    }
    tokio::time::timeout(WAIT, accepting)
        .await
        .unwrap()
        .unwrap();
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let c = conns[t as usize % CONNS].clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                // Messages: the echoes of a connection's four tasks come
                // back to whichever of them receives; each is checked and
                // counted once.
                for i in 0..MESSAGES {
                    c.send(message(t, i)).await.expect("send");
                    let m = c.receive().await.expect("receive");
                    assert!(
                        seen.lock().unwrap().insert(check(&m)),
                        "a message came back twice"
                    );
                }
                // One-sided: the peer's memory, written and read back.
                let remote = c.request_remote_mr(8192).await.expect("request_remote_mr");
                assert_eq!(remote.len(), 8192);
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
    for t in 0..TASKS {
        for i in 0..MESSAGES {
            assert!(seen.contains(&(t, i)), "message ({t}, {i}) never came back");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_thread_that_dies_fails_its_handles_fast() {
    let servers = pool(1);
    let clients = pool(2);
    let (listener, _accepting) = echo_server(&servers, 2).await;
    let addr = listener.local_addr();
    let doomed = connect(&clients, 0, addr).await;
    let alive = connect(&clients, 1, addr).await;
    // A receive waiting when the thread dies.
    let waiting = tokio::spawn({
        let d = doomed.clone();
        async move { d.receive().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let killed = clients.spawn(Placement::Thread(0), |_| -> std::future::Ready<()> {
        panic!("runtime thread panic (expected by the test)")
    });
    assert!(killed.await.is_err());
    let gone = |r: Result<Vec<u8>, HandleError>| {
        matches!(
            r,
            Err(HandleError::Pool(PoolError::ThreadGone {
                index: 0,
                end: ThreadEnd::Panicked
            }))
        )
    };
    let r = tokio::time::timeout(WAIT, waiting)
        .await
        .expect("the waiting receive ends")
        .unwrap();
    assert!(gone(r), "the waiting receive fails with ThreadGone");
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
    // The other thread's connection goes on.
    alive.send(message(1, 2)).await.unwrap();
    assert_eq!(check(&alive.receive().await.unwrap()), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn futures_dropped_mid_flight_leave_the_connection_working() {
    let Echoed {
        c,
        listener,
        clients,
        servers: _servers,
    } = echoed(2).await;
    let remote = c.request_remote_mr(1 << 16).await.unwrap();
    // Dropped after their first poll: their requests are queued or in
    // flight, their buffers owned by the runtime thread until done.
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
    // A receive dropped while waiting leaves its message to the next one.
    let _ = tokio::time::timeout(Duration::from_millis(5), c.receive()).await;
    // The echoes of the sends that did go are in the way: drain them by tag.
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
    // One-sided still right.
    let data: Vec<u8> = (0..1000u32).map(|k| k as u8).collect();
    c.write(&remote, 100, data.clone()).await.unwrap();
    assert_eq!(c.read(&remote, 100, 1000).await.unwrap(), data);
    // A remote region of another connection, or a range outside it, is
    // refused before anything is queued.
    assert!(matches!(
        c.read(&remote, (1 << 16) - 10, 11).await,
        Err(HandleError::OutOfBounds { .. })
    ));
    let other = connect(&clients, 0, listener.local_addr()).await;
    assert!(matches!(
        other.write(&remote, 0, vec![1]).await,
        Err(HandleError::ForeignRemote { what: "write" })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_waiting_calls_and_fails_later_ones() {
    let Echoed {
        c,
        listener: _listener,
        clients,
        servers: _servers,
    } = echoed(1).await;
    let waiting = tokio::spawn({
        let c = c.clone();
        async move { c.receive().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    tokio::task::block_in_place(|| assert_eq!(clients.shutdown(), 0));
    let r = tokio::time::timeout(WAIT, waiting)
        .await
        .expect("ends")
        .unwrap();
    assert!(
        r.is_err(),
        "a waiting receive ends with an error at shutdown"
    );
    let r = c.send(vec![1]).await;
    assert!(
        matches!(
            r,
            Err(HandleError::Pool(PoolError::ThreadGone {
                end: ThreadEnd::ShutDown,
                ..
            }))
        ),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handle_stream_carries_every_byte_through_tokio_io() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use verbio::HandleStream;
    fn send_sync<T: Send>() {}
    send_sync::<HandleStream>();

    let servers = pool(1);
    let clients = pool(2);
    let (listener, addr) = listening(&servers).await;
    // The server echoes the stream with tokio::io::copy, then ends its side.
    let server = tokio::spawn(async move {
        let s = HandleStream::new(listener.accept().await.unwrap());
        let (mut r, mut w) = tokio::io::split(s);
        let n = tokio::io::copy(&mut r, &mut w).await.unwrap();
        w.shutdown().await.unwrap();
        n
    });
    let c = connect(&clients, 1, addr).await;
    let (mut r, mut w) = tokio::io::split(HandleStream::with_chunk(c, 10_000));
    let data: Vec<u8> = (0..(1u32 << 20) + 12_345)
        .map(|k| (k.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        // Odd write sizes: the stream gathers them into its chunks.
        for piece in sent.chunks(7_777) {
            w.write_all(piece).await.unwrap();
        }
        w.shutdown().await.unwrap();
    });
    let mut back = Vec::new();
    tokio::time::timeout(WAIT, r.read_to_end(&mut back))
        .await
        .expect("in time")
        .unwrap();
    writer.await.unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "the echoed stream differs");
    assert_eq!(server.await.unwrap(), data.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_stream_speaks_futures_io_too() {
    use futures::io::{AsyncReadExt, AsyncWriteExt};
    use verbio::HandleStream;

    let servers = pool(1);
    let clients = pool(1);
    let (listener, addr) = listening(&servers).await;
    let reader = tokio::spawn(async move {
        let mut s = HandleStream::new(listener.accept().await.unwrap());
        let mut got = String::new();
        s.read_to_string(&mut got).await.unwrap();
        got
    });
    let mut s = HandleStream::new(connect(&clients, 0, addr).await);
    s.write_all(b"hello ").await.unwrap();
    s.write_all(b"over a pool").await.unwrap();
    s.close().await.unwrap();
    assert!(
        s.write_all(b"late").await.is_err(),
        "a write after close fails"
    );
    assert_eq!(
        tokio::time::timeout(WAIT, reader).await.unwrap().unwrap(),
        "hello over a pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rpc_calls_from_tokio_tasks_through_a_handle() {
    use verbio::rpc::ud::{UdConfig, UdTransport};
    use verbio::rpc::{Request, Rpc, RpcConfig, RpcError};
    use verbio::{ErrorChain, RpcHandle};
    type BoxError = Box<dyn std::error::Error + Send + Sync>;
    const REVERSE: u8 = 7;
    send_sync_clone::<RpcHandle>();

    fn endpoint(cx: &verbio::runtime::pool::ThreadContext) -> Result<Rpc<UdTransport>, BoxError> {
        let dev = cx.device().ok_or("the pool has a device per thread")?;
        Ok(Rpc::new(
            UdTransport::new(dev, &UdConfig::default())?,
            RpcConfig::default(),
        ))
    }
    let servers = pool(1);
    let clients = pool(2);
    let server = RpcHandle::start(&servers, Placement::Thread(0), |cx| {
        let rpc = endpoint(cx)?;
        rpc.register(REVERSE, |req: Request| {
            let mut resp = req.response();
            resp.extend(req.data().iter().rev());
            async move { resp }
        })?;
        Ok::<_, BoxError>(rpc)
    })
    .await
    .expect("server endpoint");
    let client = RpcHandle::start(&clients, Placement::Thread(1), endpoint)
        .await
        .expect("client endpoint");
    let session = tokio::time::timeout(WAIT, client.connect(server.local_addr()))
        .await
        .expect("connect in time")
        .expect("connect");
    let tasks: Vec<_> = (0..16u32)
        .map(|t| {
            let client = client.clone();
            tokio::spawn(async move {
                for i in 0..40u32 {
                    let req = message(t, i);
                    let resp = client
                        .call(session, REVERSE, req.clone())
                        .await
                        .expect("call");
                    let mut want = req;
                    want.reverse();
                    assert!(resp == want, "call ({t}, {i}): a wrong response");
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(WAIT, t)
            .await
            .expect("in time")
            .expect("task");
    }
    // An unknown session fails that call only, with the engine's error
    // typed; from a tokio task it `?`s into a `Send + Sync` box.
    client.disconnect(session);
    let r = client.call(session, REVERSE, vec![1]).await;
    assert!(
        matches!(
            &r,
            Err(HandleError::Rpc {
                what: "call",
                source: RpcError::SessionClosed { session: s },
            }) if *s == session
        ),
        "{r:?}"
    );
    let e = r.unwrap_err();
    assert_eq!(
        ErrorChain(&e).to_string(),
        format!("RPC call failed: session {} is closed", session.number())
    );
    let from_task = tokio::spawn({
        let client = client.clone();
        async move {
            client.call(session, REVERSE, vec![2]).await?;
            Ok::<_, BoxError>(())
        }
    });
    let e = from_task.await.expect("task").unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<HandleError>(),
            Some(HandleError::Rpc {
                source: RpcError::SessionClosed { .. },
                ..
            })
        ),
        "{e:?}"
    );

    // The making closure's error comes back typed, as the setup's source.
    let r = RpcHandle::start(&clients, Placement::Thread(0), |cx| {
        let rpc = endpoint(cx)?;
        rpc.register(REVERSE, |req: Request| async move { req.response() })?;
        rpc.register(REVERSE, |req: Request| async move { req.response() })?;
        Ok::<_, BoxError>(rpc)
    })
    .await;
    let Err(HandleError::Setup { what, source }) = r else {
        panic!("a second handler for one type must fail: {r:?}");
    };
    assert_eq!(what, "making the RPC endpoint");
    assert!(
        matches!(
            source.downcast_ref::<RpcError>(),
            Some(RpcError::HandlerExists { req_type: REVERSE })
        ),
        "{source:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_is_handed_over_and_back_through_handles() {
    let servers = pool(1);
    let clients = pool(1);
    let (listener, addr) = listening(&servers).await;
    let accepted = tokio::spawn({
        let l = listener.clone();
        async move { l.accept().await }
    });
    let c = connect(&clients, 0, addr).await;
    let s = tokio::time::timeout(WAIT, accepted)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // The client grants a copy of its bytes; the server reads, rewrites
    // and hands the region back; the client gets the rewritten bytes.
    let data: Vec<u8> = (0..4096u32).map(|k| (k * 7) as u8).collect();
    let token = c.send_local_mr(data.clone(), 5).await.unwrap();
    assert_eq!(token.len, 4096);
    let (remote, tag) = tokio::time::timeout(WAIT, s.receive_remote_mr(Some(5)))
        .await
        .expect("the grant arrives")
        .unwrap();
    assert_eq!((remote.len(), tag), (4096, 5));
    assert_eq!(s.read(&remote, 0, 4096).await.unwrap(), data);
    let rewritten: Vec<u8> = data.iter().map(|b| b ^ 0xA5).collect();
    s.write(&remote, 0, rewritten.clone()).await.unwrap();
    let other_clone = remote.clone();
    s.send_remote_mr(remote, 9).await.unwrap();
    let (back, tag) = tokio::time::timeout(WAIT, c.receive_local_mr(Some(9)))
        .await
        .expect("the hand-back arrives")
        .unwrap();
    assert_eq!(tag, 9);
    assert!(
        back == rewritten,
        "the memory came back with the peer's writes"
    );
    // A clone of a grant handed back no longer works, with a clear error.
    assert!(matches!(
        s.read(&other_clone, 0, 1).await,
        Err(HandleError::GrantGone)
    ));
    assert!(matches!(
        s.send_remote_mr(other_clone, 0).await,
        Err(HandleError::GrantGone)
    ));
    // A receive of a grant dropped while waiting leaves the next grant to
    // the next receive.
    let _ = tokio::time::timeout(Duration::from_millis(5), s.receive_remote_mr(None)).await;
    c.send_local_mr(vec![1, 2, 3], 11).await.unwrap();
    let (r, tag) = tokio::time::timeout(WAIT, s.receive_remote_mr(None))
        .await
        .expect("in time")
        .unwrap();
    assert_eq!((r.len(), tag), (3, 11));
    assert_eq!(s.read(&r, 0, 3).await.unwrap(), vec![1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_util_codecs_frame_a_handle_stream() {
    use futures::{SinkExt, StreamExt};
    use tokio_util::codec::{Framed, LengthDelimitedCodec};
    use verbio::HandleStream;

    let servers = pool(1);
    let clients = pool(1);
    let (listener, addr) = listening(&servers).await;
    // The server answers each frame with the frame reversed.
    let server = tokio::spawn(async move {
        let s = HandleStream::new(listener.accept().await.unwrap());
        let mut framed = Framed::new(s, LengthDelimitedCodec::new());
        while let Some(frame) = framed.next().await {
            let mut f = frame.unwrap().to_vec();
            f.reverse();
            framed.send(bytes::Bytes::from(f)).await.unwrap();
        }
    });
    let c = connect(&clients, 0, addr).await;
    let mut framed = Framed::new(
        HandleStream::with_chunk(c, 1500),
        LengthDelimitedCodec::new(),
    );
    for i in 0..100u32 {
        let m = message(i, i * 3);
        framed.send(bytes::Bytes::from(m.clone())).await.unwrap();
        let back = tokio::time::timeout(WAIT, framed.next())
            .await
            .expect("in time")
            .expect("a frame")
            .unwrap();
        let mut want = m;
        want.reverse();
        assert!(back[..] == want[..], "frame {i} came back wrong");
    }
    drop(framed);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_stream_keeps_a_window_of_writes_in_flight() {
    use futures::FutureExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use verbio::HandleStream;

    const CHUNK: usize = 1000;
    let window = HandleStream::WRITE_WINDOW;
    let servers = pool(1);
    let clients = pool(1);
    let (listener, addr) = listening(&servers).await;
    let reader = tokio::spawn(async move {
        let mut s = HandleStream::new(listener.accept().await.unwrap());
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        got
    });
    let c = connect(&clients, 0, addr).await;
    let mut s = HandleStream::with_chunk(c, CHUNK);
    let data: Vec<u8> = (0..CHUNK * (window + 4)).map(|i| (i % 251) as u8).collect();
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();

    // The connection's thread sends nothing while blocked: every message
    // handed over stays in flight.
    let go = block_thread(&clients).await;
    for (i, chunk) in chunks[..window].iter().enumerate() {
        let n = s.write(chunk).now_or_never();
        assert_eq!(
            n.map(Result::unwrap),
            Some(CHUNK),
            "write {i} in the window"
        );
        assert_eq!(s.sends_in_flight(), i + 1);
    }
    // Past the window, one chunk is gathered, and the next write waits.
    let n = s.write(chunks[window]).now_or_never();
    assert_eq!(n.map(Result::unwrap), Some(CHUNK), "a write gathered");
    assert_eq!(s.sends_in_flight(), window);
    assert!(
        s.write(chunks[window + 1]).now_or_never().is_none(),
        "a write waits when the window and the buffer are full"
    );
    assert!(s.flush().now_or_never().is_none(), "flush waits");
    go.send(true).unwrap();
    for chunk in &chunks[window + 1..] {
        tokio::time::timeout(WAIT, s.write_all(chunk))
            .await
            .expect("writes go on once the thread does")
            .unwrap();
    }
    tokio::time::timeout(WAIT, s.shutdown())
        .await
        .expect("shutdown flushes")
        .unwrap();
    assert_eq!(s.sends_in_flight(), 0);
    let got = tokio::time::timeout(WAIT, reader).await.unwrap().unwrap();
    assert!(
        got == data,
        "every byte in order ({} of {})",
        got.len(),
        data.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_send_in_flight_surfaces_on_flush() {
    use futures::FutureExt;
    use tokio::io::AsyncWriteExt;
    use verbio::HandleStream;

    let Echoed {
        c,
        listener: _listener,
        clients,
        servers: _servers,
    } = echoed(1).await;
    let mut s = HandleStream::with_chunk(c, 100);
    let go = block_thread(&clients).await;
    for i in 0..HandleStream::WRITE_WINDOW {
        let n = s.write(&[i as u8; 100]).now_or_never();
        assert_eq!(n.map(Result::unwrap), Some(100), "handed over");
    }
    // The thread dies with the messages in its mailbox.
    go.send(false).unwrap();
    let e = tokio::time::timeout(WAIT, s.flush())
        .await
        .expect("flush ends")
        .expect_err("the lost sends fail the flush");
    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    assert!(e.to_string().contains("not sent"), "{e}");
    let again = tokio::time::timeout(WAIT, s.write(b"more")).await.unwrap();
    assert!(again.is_err(), "later writes fail too");
    assert!(tokio::time::timeout(WAIT, s.shutdown())
        .await
        .unwrap()
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_sends_are_answered_at_hand_over_and_keep_their_order() {
    use futures::FutureExt;

    let Echoed {
        c,
        listener: _listener,
        clients,
        servers: _servers,
    } = echoed(1).await;
    // Small messages are answered once handed over: even with the
    // connection's thread blocked, each send is done at its first poll.
    let go = block_thread(&clients).await;
    for i in 0..8u8 {
        let sent = c.send(vec![i; 16]).now_or_never();
        assert!(
            matches!(sent, Some(Ok(()))),
            "send {i} answered at hand-over"
        );
    }
    assert!(
        c.flush().now_or_never().is_none(),
        "flush waits for the messages handed over"
    );
    go.send(true).unwrap();
    // A large message goes after the small ones before it, and small ones
    // after it after it: the echoes come back in the order sent.
    c.send(vec![8; 70_000]).await.unwrap();
    for i in 9..16u8 {
        c.send(vec![i; 16]).await.unwrap();
    }
    tokio::time::timeout(WAIT, c.flush())
        .await
        .expect("flush ends")
        .unwrap();
    for i in 0..16u8 {
        let m = tokio::time::timeout(WAIT, c.receive())
            .await
            .expect("the echo comes")
            .unwrap();
        let len = if i == 8 { 70_000 } else { 16 };
        assert_eq!(m, vec![i; len], "echo {i} in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_failed_after_hand_over_surfaces_on_flush_once() {
    let servers = pool(1);
    let clients = pool(1);
    let (listener, addr) = listening(&servers).await;
    let accepted = tokio::spawn(async move { listener.accept().await.unwrap() });
    let c = connect(&clients, 0, addr).await;
    // The peer goes: the read-ahead reports it to the next receive.
    drop(tokio::time::timeout(WAIT, accepted).await.unwrap().unwrap());
    let r = tokio::time::timeout(WAIT, c.receive())
        .await
        .expect("the receive ends");
    assert!(r.is_err(), "the peer is gone: {r:?}");
    // Handed over, then failed on the runtime thread: the flush says so,
    // once.
    assert!(c.send(vec![1; 8]).await.is_ok(), "answered at hand-over");
    let r = tokio::time::timeout(WAIT, c.flush())
        .await
        .expect("flush ends");
    assert!(
        matches!(r, Err(HandleError::Agent(verbio::AgentError::Closed(_)))),
        "{r:?}"
    );
    let r = tokio::time::timeout(WAIT, c.flush()).await.unwrap();
    assert!(r.is_ok(), "reported once: {r:?}");
    // A large send is answered when done, with its own error.
    let r = tokio::time::timeout(WAIT, c.send(vec![2; 70_000]))
        .await
        .unwrap();
    assert!(r.is_err(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_read_ahead_wait_for_a_receive_and_none_is_lost() {
    let servers = pool(1);
    let clients = pool(1);
    let (listener, addr) = listening(&servers).await;
    const N: u32 = 300;
    let (go, start) = tokio::sync::oneshot::channel::<()>();
    // More messages than the read-ahead holds (64), none received yet.
    let sender = tokio::spawn(async move {
        let s = listener.accept().await.unwrap();
        start.await.unwrap();
        for i in 0..N {
            s.send(message(7, i)).await.unwrap();
        }
        s.flush().await.unwrap();
        s
    });
    let c = connect(&clients, 0, addr).await;
    // Receives dropped while waiting (nothing was sent yet) take nothing
    // away.
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { c.receive().await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    for w in &waiting {
        w.abort();
    }
    for w in waiting {
        assert!(w.await.unwrap_err().is_cancelled());
    }
    go.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..N {
        let m = tokio::time::timeout(WAIT, c.receive())
            .await
            .expect("the message comes")
            .unwrap();
        assert_eq!(check(&m), (7, i), "in order");
    }
    let s = tokio::time::timeout(WAIT, sender).await.unwrap().unwrap();
    drop(s);
}
