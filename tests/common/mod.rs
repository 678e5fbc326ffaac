//! Shared helpers of the verbs integration tests: devices bound to runtimes
//! (a fresh soft device, or the one named by `VERBIO_TEST_DEVICE`, e.g.
//! `rxe0` in scripts/rxe-test.sh with `--features ibverbs`), a server
//! thread, region descriptors sent over the QP, and the two halves of the
//! every-verb script (used across threads and processes).
#![allow(dead_code)]

pub mod alloc_count;
pub mod crowd;
pub mod example_bin;
pub mod netns;
pub mod peer;
pub mod pool;
pub mod raw_agent;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Duration;

use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio::ops::verbs::{Batch, RemoteBuf, Verbs};
use verbio::provider::{open_device, AccessFlags, Context, SoftConfig};
use verbio::runtime::buf::{IoBuf, LocalBuf, MrPool, RemoteAccessRegion};
use verbio::runtime::{timeout, Device, QueuePair, Runtime};
use verbio::{Rdma, RdmaBuilder};

/// Bound of every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// Names the device the tests run on instead of a fresh soft device.
pub const TEST_DEVICE_ENV: &str = "VERBIO_TEST_DEVICE";

/// The device named by [`TEST_DEVICE_ENV`], if set and non-empty.
pub fn test_device() -> Option<String> {
    std::env::var(TEST_DEVICE_ENV)
        .ok()
        .filter(|n| !n.trim().is_empty())
}

/// A runtime with a device bound to it: a fresh soft device (ephemeral
/// loopback port), or the device named by [`TEST_DEVICE_ENV`].
pub fn runtime_and_device() -> (Runtime, Device) {
    let rt = Runtime::new().expect("runtime");
    let dev = Device::open(test_context()).expect("device");
    (rt, dev)
}

/// The device the tests run on: the one named by [`TEST_DEVICE_ENV`], else
/// a fresh soft device on loopback.
pub fn test_context() -> Context {
    match test_device() {
        Some(name) => open_device(Some(name.trim()))
            .unwrap_or_else(|e| panic!("{TEST_DEVICE_ENV}={name}: {e}")),
        None => Context::open_soft(SoftConfig::default()).expect("soft device"),
    }
}

/// Limit of each TCP connect + handshake.
pub const HANDSHAKE: Duration = Duration::from_secs(10);

/// QP attributes of the tests (default transport timeout ≈ 67 ms × 6
/// retries: tolerant of a loaded machine).
pub fn qps(dev: &Device) -> DeviceQps {
    DeviceQps::new(dev.clone(), QpConfig::default())
}

/// A listener for `dev`'s QPs on an ephemeral loopback port.
pub fn listen(dev: &Device) -> Listener<DeviceQps> {
    Listener::bind("127.0.0.1:0".parse().unwrap(), qps(dev), HANDSHAKE).expect("listener")
}

/// Bound of a whole test body run by [`block`]: [`WAIT`] on the soft
/// device; three times that on a device named by [`TEST_DEVICE_ENV`] (rxe
/// in the emulated VM, where bytes move 10-50x slower than here and the
/// host's load stretches that further: tests that move 16 MiB messages or
/// 2,000 round trips of 16 KiB took over 20 s there with the host loaded).
pub fn test_bound() -> Duration {
    if test_device().is_some() {
        WAIT * 3
    } else {
        WAIT
    }
}

/// Runs `f` on `rt`, failing the test after [`test_bound`].
pub fn block<F: Future>(rt: &Runtime, f: F) -> F::Output {
    let bound = test_bound();
    rt.block_on(timeout(bound, f))
        .unwrap_or_else(|_| panic!("timed out: the test body did not finish within {bound:?}"))
}

/// A server on its own thread and runtime: accepts `conns` clients, then
/// runs `body` with their QPs. Returns the listen address and the thread.
pub fn serve<F, Fut, R>(conns: usize, body: F) -> (SocketAddr, std::thread::JoinHandle<R>)
where
    F: FnOnce(Vec<QueuePair>, Device) -> Fut + Send + 'static,
    Fut: Future<Output = R> + 'static,
    R: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        let listener = listen(&dev);
        tx.send(listener.local_addr().expect("addr")).unwrap();
        block(&rt, async {
            let mut qps = Vec::new();
            while qps.len() < conns {
                qps.push(listener.accept().await.expect("accept").qp);
            }
            body(qps, dev).await
        })
    });
    let addr = rx.recv_timeout(WAIT).expect("server did not start");
    (addr, th)
}

/// Connects a client QP to `addr`.
pub async fn dial(dev: &Device, addr: SocketAddr) -> QueuePair {
    connect(addr, &qps(dev), HANDSHAKE)
        .await
        .expect("connect")
        .qp
}

/// A pool buffer holding `data`.
pub fn buf_from(pool: &MrPool, data: &[u8]) -> LocalBuf {
    pool.alloc_from(data).expect("pool")
}

/// An empty pool buffer of at least `cap` bytes.
pub fn buf(pool: &MrPool, cap: usize) -> LocalBuf {
    pool.alloc(cap).expect("pool")
}

/// Test data.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Grants a zeroed region of `len` bytes with read/write/atomic access.
pub fn grant(dev: &Device, len: usize) -> RemoteAccessRegion<Vec<u8>> {
    RemoteAccessRegion::grant(
        dev.pd(),
        vec![0u8; len],
        AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
    )
    .unwrap_or_else(|r| panic!("grant: {}", r.error))
}

/// Sends a region descriptor (addr, len, rkey) to the peer.
pub async fn send_remote(qp: &QueuePair, pool: &MrPool, r: RemoteBuf) {
    assert_eq!(
        try_send_remote(qp, pool, r).await.expect("send descriptor"),
        20
    );
}

/// Sends a region descriptor; the outcome of the SEND is returned, not checked.
pub async fn try_send_remote(
    qp: &QueuePair,
    pool: &MrPool,
    r: RemoteBuf,
) -> Result<usize, verbio::ops::Error> {
    let mut msg = Vec::with_capacity(20);
    msg.extend_from_slice(&r.addr().to_le_bytes());
    msg.extend_from_slice(&r.len().to_le_bytes());
    msg.extend_from_slice(&r.rkey().to_le_bytes());
    qp.send(buf_from(pool, &msg)).await.0
}

/// Receives a region descriptor from the peer.
pub async fn recv_remote(qp: &QueuePair, pool: &MrPool) -> RemoteBuf {
    let (res, b) = qp.recv(buf(pool, 64)).await;
    let r = res.expect("recv descriptor");
    assert_eq!(r.len, 20, "descriptor length");
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    RemoteBuf::new(
        u(0),
        u(8),
        u32::from_le_bytes(b[16..20].try_into().unwrap()),
    )
}

// Layout of the every-verb region.
const REGION: usize = 4096;
const WORD: u64 = 0;
const WRITE_AT: u64 = 64;
const READ_AT: u64 = 1024;
const BATCH_AT: u64 = 2048;

/// Server half of the every-verb script: grants a region, answers the
/// client's SENDs and checks what its WRITEs, atomics and batch left.
/// Returns a description of the first mismatch.
pub async fn verbs_server(qp: QueuePair, dev: Device) -> Result<(), String> {
    let pool = MrPool::new(dev.pd());
    let region = grant(&dev, REGION);
    region
        .write_from(READ_AT as usize, &pattern(1024, 7))
        .map_err(|e| e.to_string())?;
    region
        .write_from(WORD as usize, &100u64.to_ne_bytes())
        .map_err(|e| e.to_string())?;
    // Receives first: the client's SENDs find them waiting.
    let r1 = qp.recv(buf(&pool, 256));
    let r2 = qp.recv(buf(&pool, 256));
    let r3 = qp.recv(buf(&pool, 256));
    let r4 = qp.recv(buf(&pool, 256));
    send_remote(&qp, &pool, RemoteBuf::from(&region)).await;

    let (res, b) = r1.await;
    let r = res.map_err(|e| format!("recv 1: {e}"))?;
    if (r.len, r.imm, r.by_write, &b[..]) != (5, None, false, &b"hello"[..]) {
        return Err(format!("recv 1: {r:?} {:?}", &b[..]));
    }
    let (res, b) = r2.await;
    let r = res.map_err(|e| format!("recv 2: {e}"))?;
    if (r.len, r.imm, &b[..]) != (3, Some(0x1234), &b"imm"[..]) {
        return Err(format!("recv 2: {r:?} {:?}", &b[..]));
    }
    let (res, b) = r3.await;
    let r = res.map_err(|e| format!("recv 3: {e}"))?;
    if (r.len, r.imm, r.by_write, b.len()) != (64, Some(77), true, 0) {
        return Err(format!(
            "recv 3 (write_with_imm): {r:?}, buffer len {}",
            b.len()
        ));
    }
    let (res, b) = r4.await;
    res.map_err(|e| format!("recv 4: {e}"))?;
    if &b[..] != b"done" {
        return Err(format!("recv 4: {:?}", &b[..]));
    }
    let all = region.to_vec();
    let at = |off: u64, len: usize| &all[off as usize..off as usize + len];
    let mut problems = Vec::new();
    if at(WRITE_AT, 64) != [0xab; 64] {
        problems.push("write area");
    }
    if region.load_u64(WORD as usize).map_err(|e| e.to_string())? != 205 {
        problems.push("atomic word");
    }
    for (i, v) in [1u8, 2, 3].into_iter().enumerate() {
        if at(BATCH_AT + 64 * i as u64, 64) != [v; 64] {
            problems.push("batch area");
        }
    }
    let reply = if problems.is_empty() {
        "ok".to_string()
    } else {
        format!("bad: {problems:?}")
    };
    let (res, _) = qp.send(buf_from(&pool, reply.as_bytes())).await;
    res.map_err(|e| format!("reply: {e}"))?;
    if problems.is_empty() {
        Ok(())
    } else {
        Err(reply)
    }
}

/// Client half of the every-verb script; panics on the first failure.
pub async fn verbs_client(qp: QueuePair, dev: Device) {
    let pool = MrPool::new(dev.pd());
    let remote = recv_remote(&qp, &pool).await;
    // RECVs are consumed in order: post the one for the verdict only now.
    let reply = qp.recv(buf(&pool, 256));
    assert_eq!(remote.len(), REGION as u64);

    // A slice of a pool buffer: only its bytes go out.
    let slice = buf_from(&pool, b"[[hello]]").slice(2..7).expect("slice");
    let (res, b) = qp.send(slice).await;
    assert_eq!(res.expect("send"), 5);
    assert_eq!(&b[..], b"hello");
    assert_eq!(
        &b.into_inner()[..],
        b"[[hello]]",
        "buffer comes back intact"
    );

    let (res, _) = qp.send_with_imm(buf_from(&pool, b"imm"), 0x1234).await;
    assert_eq!(res.expect("send_with_imm"), 3);

    let target = remote.at(WRITE_AT, 64).unwrap();
    let (res, _) = qp.write(buf_from(&pool, &[0xab; 64]), target).await;
    res.expect("write");

    // A WRITE that does not fit its target is refused locally.
    let (res, b) = qp.write(buf_from(&pool, &[0xcd; 65]), target).await;
    assert!(
        matches!(res, Err(verbio::ops::Error::RemoteOutOfBounds { .. })),
        "{res:?}"
    );
    assert_eq!(b.len(), 65);

    let (res, b) = qp
        .read(buf(&pool, 1024), remote.at(READ_AT, 1024).unwrap())
        .await;
    res.expect("read");
    assert_eq!(&b[..], &pattern(1024, 7)[..], "read data");

    let word = remote.word(WORD).unwrap();
    let (res, b) = qp.compare_and_swap(buf(&pool, 8), word, 100, 200).await;
    assert_eq!(res.expect("cas"), 100);
    let (res, _) = qp.compare_and_swap(b, word, 100, 300).await;
    assert_eq!(
        res.expect("cas"),
        200,
        "failed compare returns the current value"
    );
    let (res, _) = qp.fetch_and_add(buf(&pool, 8), word, 5).await;
    assert_eq!(res.expect("faa"), 200);

    let batch = Batch::new()
        .write(buf_from(&pool, &[1; 64]), remote.at(BATCH_AT, 64).unwrap())
        .write(
            buf_from(&pool, &[2; 64]),
            remote.at(BATCH_AT + 64, 64).unwrap(),
        )
        .write_with_imm(
            buf_from(&pool, &[3; 64]),
            remote.at(BATCH_AT + 128, 64).unwrap(),
            77,
        );
    let (res, bufs) = qp.post_batch(batch).await;
    res.expect("batch");
    assert_eq!(bufs.len(), 3);

    let (res, _) = qp.send(buf_from(&pool, b"done")).await;
    res.expect("send done");
    let (res, b) = reply.await;
    res.expect("reply");
    assert_eq!(
        std::str::from_utf8(&b[..]).unwrap(),
        "ok",
        "server's verdict"
    );
}

/// An `Rdma` server thread: accepts `conns` connections with `builder`, runs `body`.
pub fn serve_rdma<F, Fut, R>(
    builder: impl FnOnce() -> RdmaBuilder + Send + 'static,
    conns: usize,
    body: F,
) -> (SocketAddr, std::thread::JoinHandle<R>)
where
    F: FnOnce(Vec<Rdma>) -> Fut + Send + 'static,
    Fut: Future<Output = R> + 'static,
    R: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = builder()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            let mut v = Vec::new();
            for _ in 0..conns {
                v.push(l.accept().await.expect("accept"));
            }
            body(v).await
        })
    });
    (rx.recv_timeout(WAIT).expect("server start"), th)
}

pub async fn dial_rdma(
    builder: RdmaBuilder,
    dev: &verbio::runtime::Device,
    addr: SocketAddr,
) -> Rdma {
    builder
        .device(dev.clone())
        .connect(addr)
        .await
        .expect("connect")
}
