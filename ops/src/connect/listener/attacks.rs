//! The handshake listener attacked from raw TCP sockets (with the fake QP
//! factory): idle and half-open floods, frames at and past every length
//! limit, a hello sent twice, the caps on pending handshakes per listener
//! and per source, and `EMFILE` in a child process with a lowered
//! descriptor limit. Each asserts that a legitimate client is served during
//! and after the attack.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream as StdStream};
use std::rc::Rc;

use verbio_runtime::provider::ProviderKind;
use verbio_runtime::{spawn, timeout, JoinHandle, Runtime};

use super::super::handshake::{
    self, decode_frame, encode_reject, Frame, HEADER_LEN, HELLO_BODY_LEN, MAX_BODY_LEN,
};
use super::tests::{any_port, hello_bytes, FakeQps, LIMIT};
use super::*;

/// A listener whose accept loop runs in a task, keeping every connection;
/// the task ends (and the test fails) only if the listener itself fails.
struct Server {
    addr: SocketAddr,
    listener: Rc<Listener<FakeQps>>,
    served: Rc<RefCell<Vec<Connection<u32>>>>,
    task: Option<JoinHandle<HandshakeError>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

fn serve(listener: Listener<FakeQps>) -> Server {
    let addr = listener.local_addr().unwrap();
    let listener = Rc::new(listener);
    let served = Rc::new(RefCell::new(Vec::new()));
    let (l, s) = (listener.clone(), served.clone());
    let task = spawn(async move {
        loop {
            match l.accept().await {
                Ok(c) => s.borrow_mut().push(c),
                Err(e) => return e,
            }
        }
    });
    Server {
        addr,
        listener,
        served,
        task: Some(task),
    }
}

impl Server {
    /// A legitimate client connects within `LIMIT` and the listener keeps
    /// its connection.
    async fn serves_a_client(&self, qpn: u32) {
        let qps = FakeQps::new(ProviderKind::Soft, qpn);
        let before = self.served.borrow().len();
        let c = timeout(LIMIT, connect(self.addr, &qps, LIMIT))
            .await
            .expect("a legitimate client is served within LIMIT")
            .expect("a legitimate client connects");
        assert_eq!(c.qp, qpn);
        // The server side finishes when the client's ready arrives.
        timeout(LIMIT, async {
            while self.served.borrow().len() == before {
                verbio_runtime::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("the listener returned the connection");
        assert!(
            self.served.borrow().iter().any(|s| s.remote.qpn == qpn),
            "served client {qpn}"
        );
    }
}

/// Runs `attack` (blocking socket work) on a thread while the runtime
/// serves; a legitimate client is served during it and after it.
fn attack_then_serve<T: Send + 'static>(
    rt: &Runtime,
    server: &Server,
    attack: impl FnOnce() -> T + Send + 'static,
) -> T {
    let th = std::thread::spawn(attack);
    rt.block_on(async {
        server.serves_a_client(1000).await;
        timeout(LIMIT * 2, async {
            while !th.is_finished() {
                verbio_runtime::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the attack finished");
        server.serves_a_client(2000).await;
    });
    th.join().expect("the attack thread")
}

/// A raw connection from `src` (any address of 127/8 on loopback).
fn raw_from(src: Ipv4Addr, to: SocketAddr) -> StdStream {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::new(IpAddr::V4(src), 0).into())
        .expect("bind the source address");
    s.connect(&to.into()).expect("connect");
    s.into()
}

/// What the listener answers on `s` until it closes (bounded by `LIMIT`).
fn answer(mut s: StdStream) -> Vec<u8> {
    s.set_read_timeout(Some(LIMIT)).unwrap();
    let mut out = Vec::new();
    if let Err(e) = s.read_to_end(&mut out) {
        assert_ne!(
            e.kind(),
            std::io::ErrorKind::WouldBlock,
            "no answer within {LIMIT:?}"
        );
    }
    out
}

fn reject_text(answer: &[u8]) -> String {
    match decode_frame(answer) {
        Ok(Frame::Reject(reason)) => reason,
        other => panic!("a reject frame, got {other:?} from {answer:?}"),
    }
}

fn bind(timeout: Duration) -> Listener<FakeQps> {
    Listener::bind(any_port(), FakeQps::new(ProviderKind::Soft, 1), timeout).unwrap()
}

#[test]
fn idle_connections_do_not_delay_a_client() {
    let rt = Runtime::new().unwrap();
    // A deadline far beyond the test: no client owes its service to the
    // idle connections timing out.
    let server = rt.block_on(async { serve(bind(Duration::from_secs(120))) });
    let addr = server.addr;
    let idle: Vec<StdStream> = (0..20)
        .map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 2), addr))
        .collect();
    rt.block_on(async {
        server.serves_a_client(1).await;
        assert!(
            server.listener.in_flight() >= 20,
            "the idle connections are still pending"
        );
    });
    drop(idle);
}

#[test]
fn idle_and_half_open_connections_are_closed_at_the_deadline() {
    let rt = Runtime::new().unwrap();
    // Long enough for the legitimate clients' whole handshake on a loaded
    // machine: the deadline bounds theirs too.
    let server = rt.block_on(async { serve(bind(Duration::from_millis(1000))) });
    let addr = server.addr;
    let answers = attack_then_serve(&rt, &server, move || {
        let hello = hello_bytes();
        let conns: Vec<StdStream> = (0..12)
            .map(|i| {
                let mut s = raw_from(Ipv4Addr::new(127, 0, 0, 3), addr);
                match i % 3 {
                    0 => {}
                    1 => s.write_all(&hello[..7]).unwrap(),
                    _ => s.write_all(&hello[..40]).unwrap(),
                }
                s
            })
            .collect();
        conns.into_iter().map(answer).collect::<Vec<_>>()
    });
    // Each one is closed (`answer` fails the test if not within LIMIT),
    // with nothing to read.
    for a in answers {
        assert!(a.is_empty(), "{a:?}");
    }
}

/// A hello frame whose body is `body_len` bytes: the version-1.0 fields,
/// then zeros (fields of newer minor versions, which are skipped).
fn hello_of(body_len: usize) -> Vec<u8> {
    let mut f = hello_bytes();
    f[10..12].copy_from_slice(&(body_len as u16).to_le_bytes());
    f.resize(HEADER_LEN + body_len.max(HELLO_BODY_LEN), 0);
    f
}

#[test]
fn lengths_at_and_past_every_limit() {
    let rt = Runtime::new().unwrap();
    let server = rt.block_on(async { serve(bind(Duration::from_secs(2))) });
    let addr = server.addr;
    let mut long_reject = encode_reject("x");
    long_reject[10..12].copy_from_slice(&((MAX_BODY_LEN + 1) as u16).to_le_bytes());
    // (what, bytes, expected words of the reject)
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "hello one byte short",
            hello_of(HELLO_BODY_LEN - 1),
            "too short",
        ),
        (
            "body over MAX_BODY_LEN",
            hello_of(MAX_BODY_LEN + 1),
            "MAX_BODY_LEN",
        ),
        ("body length 0xffff", hello_of(0xffff), "MAX_BODY_LEN"),
        ("reject over MAX_BODY_LEN", long_reject, "MAX_BODY_LEN"),
        ("ready first", handshake::encode_ready().to_vec(), "ready"),
        (
            "header only",
            hello_bytes()[..HEADER_LEN].to_vec(),
            "truncated",
        ),
    ];
    let answers = attack_then_serve(&rt, &server, move || {
        cases
            .into_iter()
            .map(|(what, bytes, want)| {
                let mut s = StdStream::connect(addr).unwrap();
                // The server refuses on the header and closes: bytes of
                // ours that reach it after its close reset the connection,
                // and our last write or the shutdown can then fail (CI saw
                // `NotConnected` under load). The reject came before the
                // reset and is still read.
                if let Err(e) = s
                    .write_all(&bytes)
                    .and_then(|()| s.shutdown(std::net::Shutdown::Write))
                {
                    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, NotConnected};
                    assert!(
                        matches!(e.kind(), NotConnected | BrokenPipe | ConnectionReset),
                        "{what}: sending: {e}"
                    );
                }
                (what, answer(s), want)
            })
            .collect::<Vec<_>>()
    });
    for (what, got, want) in answers {
        let text = reject_text(&got);
        assert!(text.contains(want), "{what}: {text}");
    }
    // At the limit a hello is accepted: a client sending the longest body
    // (a newer minor version's fields) is served.
    let served = attack_then_serve(&rt, &server, move || {
        let mut s = StdStream::connect(addr).unwrap();
        s.write_all(&hello_of(MAX_BODY_LEN)).unwrap();
        let mut reply = vec![0u8; handshake::HELLO_LEN];
        s.set_read_timeout(Some(LIMIT)).unwrap();
        s.read_exact(&mut reply).unwrap();
        s.write_all(&handshake::encode_ready()).unwrap();
        decode_frame(&reply).map(|f| f.kind_name())
    });
    assert_eq!(served.unwrap(), "hello");
}

#[test]
fn a_hello_sent_twice_fails_that_handshake_only() {
    let rt = Runtime::new().unwrap();
    let server = rt.block_on(async { serve(bind(Duration::from_secs(2))) });
    let addr = server.addr;
    let got = attack_then_serve(&rt, &server, move || {
        let mut s = StdStream::connect(addr).unwrap();
        let mut twice = hello_bytes();
        twice.extend_from_slice(&hello_bytes());
        s.write_all(&twice).unwrap();
        answer(s)
    });
    // The server's hello, then a reject: a hello where ready belongs.
    let first = decode_frame(&got[..handshake::HELLO_LEN]).expect("the server's hello");
    assert_eq!(first.kind_name(), "hello");
    let text = reject_text(&got[handshake::HELLO_LEN..]);
    assert!(text.contains("hello"), "{text}");
}

#[test]
fn pending_handshakes_are_capped_per_source_and_per_listener() {
    let rt = Runtime::new().unwrap();
    let server =
        rt.block_on(async { serve(bind(Duration::from_millis(3000)).with_pending_caps(6, 3)) });
    let addr = server.addr;
    let (over_source, idle) = attack_then_serve(&rt, &server, move || {
        let mut idle: Vec<StdStream> = (0..3)
            .map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 4), addr))
            .collect();
        // Time for the listener to take them (well within their deadline).
        std::thread::sleep(Duration::from_millis(500));
        // A fourth from the same source is refused at once.
        let fourth = answer(raw_from(Ipv4Addr::new(127, 0, 0, 4), addr));
        // Three from another source fill the listener: the next connection
        // waits in the kernel's backlog until the idle ones time out.
        idle.extend((0..3).map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 5), addr)));
        let idle: Vec<Vec<u8>> = idle.into_iter().map(answer).collect();
        (fourth, idle)
    });
    assert!(
        reject_text(&over_source).contains("per address"),
        "{over_source:?}"
    );
    // Closed at their deadline (`answer` is bounded by LIMIT).
    for a in idle {
        assert!(a.is_empty(), "{a:?}");
    }
    assert!(server.listener.in_flight() <= 6);
}

/// A flood from a source at its cap: each connection over it waits at
/// most `PARK_GRACE` (no more than `MAX_PARKED` at once; the rest are
/// refused at once) and then gets the per-address reject, and a client
/// from another address is served meanwhile; the listener holds no
/// handshake for them.
#[test]
fn a_flood_over_a_sources_cap_is_refused_after_the_grace_and_others_are_served() {
    const FLOOD: usize = MAX_PARKED + 16;
    let rt = Runtime::new().unwrap();
    let server =
        rt.block_on(async { serve(bind(Duration::from_secs(120)).with_pending_caps(128, 1)) });
    let addr = server.addr;
    let (answers, _holder) = attack_then_serve(&rt, &server, move || {
        // Holds the source's only slot for the whole test (no hello).
        let holder = raw_from(Ipv4Addr::new(127, 0, 0, 6), addr);
        std::thread::sleep(Duration::from_millis(200));
        let flood: Vec<StdStream> = (0..FLOOD)
            .map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 6), addr))
            .collect();
        let answers: Vec<Vec<u8>> = flood.into_iter().map(answer).collect();
        (answers, holder)
    });
    for a in &answers {
        assert!(reject_text(a).contains("per address"), "{a:?}");
    }
    // Only the holder's handshake runs.
    assert_eq!(server.listener.in_flight(), 1);
}

#[test]
fn a_pending_handshake_holds_a_small_fixed_amount_of_memory() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let tcp = verbio_runtime::TcpListener::bind(any_port()).unwrap();
        let _client = TcpStream::connect(tcp.local_addr().unwrap()).await.unwrap();
        let (stream, peer) = tcp.accept().await.unwrap();
        let qps = Rc::new(FakeQps::new(ProviderKind::Soft, 1));
        let attempt = handshake(stream, peer, qps, LIMIT, tracing::Span::none());
        // Its state, the frame buffer (header + MAX_BODY_LEN) included, is
        // all a connection holds before its hello is validated.
        let size = std::mem::size_of_val(&attempt);
        assert!(size <= 4096, "a pending handshake takes {size} bytes");
    });
}

/// Makes `emfile_child` the listener process.
const EMFILE_CHILD: &str = "VERBIO_HANDSHAKE_EMFILE_CHILD";

/// The child of `the_listener_survives_emfile`: a listener whose process
/// runs out of descriptors. Returns at once in a normal test run.
#[test]
fn emfile_child() {
    if std::env::var_os(EMFILE_CHILD).is_none() {
        return;
    }
    let rt = Runtime::new().unwrap();
    let listener = rt.block_on(async { bind(LIMIT) });
    println!("addr {}", listener.local_addr().unwrap());
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let limit = open + 16;
    // SAFETY: setrlimit reads the struct we pass; nothing is handed over.
    let rc = unsafe {
        libc::setrlimit(
            libc::RLIMIT_NOFILE,
            &libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            },
        )
    };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    let mut fillers = Vec::new();
    loop {
        // SAFETY: dup of our own stdin; the descriptor is owned by `fillers`.
        let fd = unsafe { libc::dup(0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
            break;
        }
        fillers.push(fd);
    }
    println!("full");
    rt.block_on(async {
        let freer = spawn(async move {
            // The parent connects now: accept meets EMFILE until then.
            verbio_runtime::sleep(Duration::from_millis(500)).await;
            for fd in fillers {
                // SAFETY: closes a descriptor dup'ed above and owned here.
                unsafe { libc::close(fd) };
            }
            println!("freed");
        });
        let c = timeout(LIMIT, listener.accept())
            .await
            .expect("served within LIMIT")
            .expect("accept survives EMFILE");
        freer.await;
        println!("served {}", c.remote.qpn);
    });
}

#[test]
fn the_listener_survives_emfile() {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "connect::listener::attacks::emfile_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EMFILE_CHILD, "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the listener process");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut next = |want: &str| loop {
        let line = lines.next().expect("the child's output").unwrap();
        // libtest may print "test ... " before the first line.
        if let Some(at) = line.find(want) {
            return line[at + want.len()..].trim().to_string();
        }
    };
    let addr: SocketAddr = next("addr").parse().unwrap();
    next("full");
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let qps = FakeQps::new(ProviderKind::Soft, 77);
        let c = timeout(LIMIT, connect(addr, &qps, LIMIT))
            .await
            .expect("served within LIMIT")
            .expect("a client is served after EMFILE");
        assert_eq!(c.qp, 77);
    });
    next("freed");
    assert_eq!(next("served"), "77");
    let status = child.wait().unwrap();
    assert!(status.success(), "the listener process: {status}");
}
