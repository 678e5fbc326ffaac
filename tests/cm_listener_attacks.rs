//! The software device's CM listener (`CmListener` on the soft device),
//! attacked from raw TCP sockets: idle and half-open floods, malformed,
//! truncated and oversized frames, unacceptable requests (address family 0,
//! a QPN of 2^24), requests sent twice, a peer that never sends its
//! ready-to-use. Every test asserts that a legitimate client is served
//! during and after the attack. The soft device only: on libibverbs the
//! kernel's CM is the listener.

mod common;

use std::cell::{Cell, RefCell};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream as StdStream};
use std::rc::Rc;
use std::time::Duration;

use common::{block, runtime_and_device, test_device, WAIT};
use verbio::runtime::cm::reject::{
    REJECT_INVALID_ADDRESS, REJECT_INVALID_MTU, REJECT_NO_RESOURCES, REJECT_UNSUPPORTED,
};
use verbio::runtime::cm::{self, CmConnection, CmError, CmListener, CmOptions};
use verbio::runtime::{spawn, timeout, Device, JoinHandle, Runtime};

/// Skips (with the reason) on an ibverbs test device.
fn soft_only(test: &str) -> bool {
    if test_device().is_some() {
        println!("SKIPPED: {test}: attacks the soft device's TCP CM listener");
        return false;
    }
    true
}

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// The listener's accepted connections, and the task that takes requests
/// and accepts them (keeping each connection) until the test ends.
struct Server {
    addr: SocketAddr,
    accepted: Rc<Cell<usize>>,
    failed: Rc<RefCell<Option<CmError>>>,
    task: Option<JoinHandle<()>>,
}

fn serve(dev: &Device, opts: CmOptions) -> Server {
    let listener = CmListener::bind(dev, SocketAddr::new(LOCALHOST, 0), &opts).expect("bind");
    let addr = listener.local_addr().expect("local address");
    let accepted = Rc::new(Cell::new(0));
    let failed = Rc::new(RefCell::new(None));
    let (a, f) = (accepted.clone(), failed.clone());
    let task = spawn(async move {
        let mut conns: Vec<CmConnection> = Vec::new();
        loop {
            let req = match listener.request().await {
                Ok(r) => r,
                Err(e) => {
                    *f.borrow_mut() = Some(e);
                    return;
                }
            };
            // Per-connection failures (a peer that never confirms) are
            // that connection's; the loop goes on.
            if let Ok(conn) = req.accept(b"welcome").await {
                a.set(a.get() + 1);
                conns.push(conn);
            }
        }
    });
    Server {
        addr,
        accepted,
        failed,
        task: Some(task),
    }
}

impl Server {
    /// A legitimate client connects and is accepted within `within`.
    async fn serves_a_client(&self, dev: &Device, within: Duration) {
        let conn = timeout(
            within,
            cm::connect(dev, self.addr, &CmOptions::default(), b"hi"),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "a legitimate client was not served within {within:?} (listener failed: {:?})",
                self.failed.borrow()
            )
        })
        .expect("a legitimate client connects");
        assert_eq!(&conn.peer_private_data()[..7], b"welcome");
        assert!(
            self.failed.borrow().is_none(),
            "the listener failed: {:?}",
            self.failed.borrow()
        );
        conn.disconnect().await.expect("disconnect");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
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

fn raw(to: SocketAddr) -> StdStream {
    StdStream::connect(to).expect("connect")
}

/// A CM frame: magic, kind, zero, body length (u16 BE), body.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = b"vCM1".to_vec();
    f.push(kind);
    f.push(0);
    f.extend_from_slice(&(body.len() as u16).to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// A connect request's body; `family` 0 (no engine address), 4 or 6.
fn req_body(family: u8, qpn: u32, private: &[u8]) -> Vec<u8> {
    let mut b = vec![16, 16, private.len() as u8];
    b.extend_from_slice(private);
    b.extend_from_slice(&qpn.to_be_bytes());
    b.extend_from_slice(&0x42u32.to_be_bytes()); // PSN
    b.extend_from_slice(&0u16.to_be_bytes()); // LID
    b.extend_from_slice(&[0; 16]); // GID
    b.push(5); // MTU 4096
    b.push(family);
    match family {
        4 => {
            b.extend_from_slice(&[127, 0, 0, 1]);
            b.extend_from_slice(&4791u16.to_be_bytes());
        }
        6 => {
            b.extend_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
            b.extend_from_slice(&4791u16.to_be_bytes());
        }
        _ => {}
    }
    b
}

/// A well-formed connect request.
fn good_req() -> Vec<u8> {
    frame(1, &req_body(4, 7, b"raw"))
}

/// Reads what the listener answers on `s` until it closes (bounded by
/// `WAIT`: the listener's deadlines in these tests are far shorter).
fn answer(mut s: StdStream) -> Vec<u8> {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut out = Vec::new();
    if let Err(e) = s.read_to_end(&mut out) {
        // A reset after the answer is fine; a timeout is not an answer.
        assert_ne!(
            e.kind(),
            std::io::ErrorKind::WouldBlock,
            "no answer within {WAIT:?}"
        );
    }
    out
}

/// The reject reason in `answer`, which must be exactly one reject frame.
fn reject_reason(answer: &[u8]) -> u16 {
    assert!(answer.len() >= 11, "a reject frame, got {answer:?}");
    assert_eq!(&answer[..5], b"vCM1\x03", "a reject frame, got {answer:?}");
    u16::from_be_bytes([answer[8], answer[9]])
}

/// Runs `attack` (blocking socket work) on a thread while the runtime
/// serves, then checks a legitimate client is served.
fn attack_then_serve<T: Send + 'static>(
    rt: &Runtime,
    dev: &Device,
    server: &Server,
    attack: impl FnOnce() -> T + Send + 'static,
) -> T {
    let th = std::thread::spawn(attack);
    block(rt, async {
        // A client served while the attack runs...
        server.serves_a_client(dev, WAIT).await;
        while !th.is_finished() {
            verbio::runtime::sleep(Duration::from_millis(10)).await;
        }
        // ... and after it.
        server.serves_a_client(dev, WAIT).await;
    });
    th.join().expect("the attack thread")
}

fn short(opts: CmOptions, deadline_ms: u64) -> CmOptions {
    CmOptions {
        request_timeout: Duration::from_millis(deadline_ms),
        ..opts
    }
}

fn setup(test: &str) -> Option<(Runtime, Device)> {
    soft_only(test).then(runtime_and_device)
}

#[test]
fn idle_connections_do_not_delay_a_client() {
    let Some((rt, dev)) = setup("idle_connections_do_not_delay_a_client") else {
        return;
    };
    // A deadline far beyond the wait: the client cannot owe its service to
    // the idle connections timing out.
    let server = serve(&dev, short(CmOptions::default(), 60_000));
    // 20 connections that never send a byte, from another address than
    // the client's (so no per-source limit is involved).
    let idle: Vec<StdStream> = (0..20)
        .map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 2), server.addr))
        .collect();
    block(&rt, async {
        server.serves_a_client(&dev, WAIT).await;
        server.serves_a_client(&dev, WAIT).await;
    });
    assert_eq!(server.accepted.get(), 2);
    drop(idle);
}

#[test]
fn idle_and_half_open_connections_are_closed_at_the_deadline() {
    let Some((rt, dev)) = setup("idle_and_half_open_connections_are_closed_at_the_deadline") else {
        return;
    };
    // Long enough for the legitimate clients' whole set-up on a loaded
    // machine: the deadline also bounds their ready-to-use.
    let server = serve(&dev, short(CmOptions::default(), 1_000));
    let addr = server.addr;
    let closed = attack_then_serve(&rt, &dev, &server, move || {
        let mut conns = Vec::new();
        for i in 0..12 {
            let mut s = raw_from(Ipv4Addr::new(127, 0, 0, 3), addr);
            match i % 3 {
                0 => {}                                       // idle
                1 => s.write_all(b"vCM1\x01\x00").unwrap(),   // half a header
                _ => s.write_all(&good_req()[..20]).unwrap(), // half a body
            }
            conns.push(s);
        }
        // Each is closed by the listener (read gives the end, no answer).
        conns.into_iter().map(answer).collect::<Vec<_>>()
    });
    assert!(
        closed.iter().all(Vec::is_empty),
        "no answer to silence: {closed:?}"
    );
}

#[test]
fn address_family_0_is_rejected_and_the_listener_serves_on() {
    let Some((rt, dev)) = setup("address_family_0_is_rejected_and_the_listener_serves_on") else {
        return;
    };
    let server = serve(&dev, CmOptions::default());
    let addr = server.addr;
    let got = attack_then_serve(&rt, &dev, &server, move || {
        let mut s = raw(addr);
        s.write_all(&frame(1, &req_body(0, 7, b""))).unwrap();
        answer(s)
    });
    assert_eq!(reject_reason(&got), REJECT_INVALID_ADDRESS);
}

#[test]
fn qpn_of_2_pow_24_is_rejected_and_the_listener_serves_on() {
    let Some((rt, dev)) = setup("qpn_of_2_pow_24_is_rejected_and_the_listener_serves_on") else {
        return;
    };
    let server = serve(&dev, CmOptions::default());
    let addr = server.addr;
    let got = attack_then_serve(&rt, &dev, &server, move || {
        let mut s = raw(addr);
        s.write_all(&frame(1, &req_body(4, 1 << 24, b""))).unwrap();
        answer(s)
    });
    assert_eq!(reject_reason(&got), REJECT_UNSUPPORTED);
}

#[test]
fn malformed_truncated_and_oversized_frames_are_refused() {
    let Some((rt, dev)) = setup("malformed_truncated_and_oversized_frames_are_refused") else {
        return;
    };
    let server = serve(&dev, short(CmOptions::default(), 2_000));
    let addr = server.addr;
    let req = good_req();
    let mut trailing = req.clone();
    trailing[7] += 1; // one byte more than the fields
    trailing.push(0);
    let mut padded_body = req_body(4, 7, b"");
    padded_body.resize(512, 0);
    let padded = frame(1, &padded_body);
    let mut bad_mtu = frame(1, &req_body(4, 7, b""));
    let mtu_at = bad_mtu.len() - 8;
    bad_mtu[mtu_at] = 0;
    let mut long_private = frame(1, &req_body(4, 7, b""));
    long_private[10] = 200; // private data running past the body
                            // (bytes sent, expected reject reason; None: closed without an answer)
    let cases: Vec<(&str, Vec<u8>, Option<u16>)> = vec![
        ("http", b"GET / HTTP/1.0\r\n\r\n".to_vec(), None),
        (
            "body of 513 bytes",
            frame(1, &[0; 513]),
            Some(REJECT_UNSUPPORTED),
        ),
        (
            "request padded to 512 bytes",
            padded,
            Some(REJECT_UNSUPPORTED),
        ),
        (
            "header only, length 0",
            frame(1, &[]),
            Some(REJECT_UNSUPPORTED),
        ),
        ("trailing byte", trailing, Some(REJECT_UNSUPPORTED)),
        ("MTU code 0", bad_mtu, Some(REJECT_INVALID_MTU)),
        (
            "private data past the body",
            long_private,
            Some(REJECT_UNSUPPORTED),
        ),
        (
            "address family 9",
            frame(1, &req_body(9, 7, b"")),
            Some(REJECT_INVALID_ADDRESS),
        ),
        (
            "ready-to-use first",
            frame(4, &[]),
            Some(REJECT_UNSUPPORTED),
        ),
        (
            "accept instead of a request",
            {
                let mut f = good_req();
                f[4] = 2;
                f
            },
            Some(REJECT_UNSUPPORTED),
        ),
        ("frame type 9", frame(9, &[]), Some(REJECT_UNSUPPORTED)),
        ("reject instead of a request", frame(3, &[0, 28, 0]), None),
        ("truncated then closed", req[..req.len() - 3].to_vec(), None),
    ];
    let answers = attack_then_serve(&rt, &dev, &server, move || {
        cases
            .into_iter()
            .map(|(name, bytes, want)| {
                let mut s = raw(addr);
                s.write_all(&bytes).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                (name, answer(s), want)
            })
            .collect::<Vec<_>>()
    });
    for (name, got, want) in answers {
        match want {
            Some(reason) => assert_eq!(reject_reason(&got), reason, "{name}"),
            None => assert!(got.is_empty(), "{name}: no answer expected, got {got:?}"),
        }
    }
}

#[test]
fn a_request_sent_twice_is_rejected() {
    let Some((rt, dev)) = setup("a_request_sent_twice_is_rejected") else {
        return;
    };
    let server = serve(&dev, CmOptions::default());
    let addr = server.addr;
    let got = attack_then_serve(&rt, &dev, &server, move || {
        let mut s = raw(addr);
        let mut twice = good_req();
        twice.extend_from_slice(&good_req());
        s.write_all(&twice).unwrap();
        answer(s)
    });
    // Either the listener saw the second copy before answering (a reject),
    // or its accept read a request where the ready-to-use belongs (the
    // accept fails, the connection closes after the accept frame).
    if got.get(4) == Some(&3) {
        assert_eq!(reject_reason(&got), REJECT_UNSUPPORTED);
    } else {
        assert_eq!(
            got.get(4),
            Some(&2),
            "an accept frame, then the end: {got:?}"
        );
    }
}

#[test]
fn a_requester_that_never_confirms_fails_only_its_accept() {
    let Some((rt, dev)) = setup("a_requester_that_never_confirms_fails_only_its_accept") else {
        return;
    };
    let server = serve(&dev, short(CmOptions::default(), 1_000));
    let addr = server.addr;
    let got = attack_then_serve(&rt, &dev, &server, move || {
        let mut s = raw(addr);
        s.write_all(&good_req()).unwrap();
        // Reads the accept; never sends ready-to-use; the listener closes.
        answer(s)
    });
    assert_eq!(got.get(4), Some(&2), "an accept frame: {got:?}");
    assert_eq!(server.accepted.get(), 2, "only the legitimate clients");
}

#[test]
fn pending_connections_are_capped_per_source_and_per_listener() {
    let Some((rt, dev)) = setup("pending_connections_are_capped_per_source_and_per_listener")
    else {
        return;
    };
    let opts = CmOptions {
        max_pending: 6,
        max_pending_per_source: 3,
        ..short(CmOptions::default(), 3_000)
    };
    let server = serve(&dev, opts);
    let addr = server.addr;
    let (over_source, idle) = attack_then_serve(&rt, &dev, &server, move || {
        // Three idle from 127.0.0.4 take that source's slots; a fourth is
        // rejected at once.
        let mut idle: Vec<StdStream> = (0..3)
            .map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 4), addr))
            .collect();
        // Time for the listener to take them (well within their deadline).
        std::thread::sleep(Duration::from_millis(500));
        let fourth = answer(raw_from(Ipv4Addr::new(127, 0, 0, 4), addr));
        // Three more from another source fill the listener: the next
        // connection waits in the kernel's backlog until the idle ones
        // reach their deadline, then is served.
        idle.extend((0..3).map(|_| raw_from(Ipv4Addr::new(127, 0, 0, 5), addr)));
        // Each idle one is closed at its deadline.
        let idle: Vec<Vec<u8>> = idle.into_iter().map(answer).collect();
        (fourth, idle)
    });
    assert_eq!(reject_reason(&over_source), REJECT_NO_RESOURCES);
    assert!(
        idle.iter().all(Vec::is_empty),
        "no answer to silence: {idle:?}"
    );
}

/// Environment variable that makes `emfile_child` the listener process.
const EMFILE_CHILD: &str = "VERBIO_CM_EMFILE_CHILD";

/// The child of `the_listener_survives_emfile`: a listener whose process
/// runs out of descriptors. Does nothing in a normal test run.
#[test]
fn emfile_child() {
    if std::env::var_os(EMFILE_CHILD).is_none() {
        return;
    }
    let (rt, dev) = runtime_and_device();
    let listener =
        CmListener::bind(&dev, SocketAddr::new(LOCALHOST, 0), &CmOptions::default()).unwrap();
    println!("addr {}", listener.local_addr().unwrap());
    // Fill the descriptor table: dups of stdin under a lowered limit.
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let limit = open + 16;
    // SAFETY: setrlimit reads the struct we pass; no memory is handed over.
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
        // SAFETY: dup of our own stdin; the new descriptor is owned below.
        let fd = unsafe { libc::dup(0) };
        if fd < 0 {
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EMFILE)
            );
            break;
        }
        fillers.push(fd);
    }
    println!("full");
    let fillers = std::cell::RefCell::new(fillers);
    block(&rt, async {
        let freer = spawn(async move {
            // The parent connects now; accept meets EMFILE until the
            // descriptors are freed.
            verbio::runtime::sleep(Duration::from_millis(500)).await;
            for fd in fillers.borrow_mut().drain(..) {
                // SAFETY: closes descriptors this loop dup'ed and owns.
                unsafe { libc::close(fd) };
            }
            println!("freed");
        });
        let req = listener.request().await.expect("request after EMFILE");
        let conn = req.accept(b"welcome").await.expect("accept");
        freer.await;
        conn.disconnected().await;
    });
    println!("served");
}

#[test]
fn the_listener_survives_emfile() {
    let Some((rt, dev)) = setup("the_listener_survives_emfile") else {
        return;
    };
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["emfile_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(EMFILE_CHILD, "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the listener process");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut next = |want: &str| loop {
        let line = lines.next().expect("the child's output").unwrap();
        // libtest may print "test emfile_child ... " before the first line.
        if let Some(at) = line.find(want) {
            return line[at + want.len()..].trim().to_string();
        }
    };
    let addr: SocketAddr = next("addr").parse().unwrap();
    next("full");
    block(&rt, async {
        // Accepted only once the child frees descriptors; its process
        // must not have exited meanwhile.
        let conn = timeout(WAIT, cm::connect(&dev, addr, &CmOptions::default(), b"hi"))
            .await
            .expect("served within WAIT")
            .expect("a client is served after EMFILE");
        assert_eq!(&conn.peer_private_data()[..7], b"welcome");
        conn.disconnect().await.expect("disconnect");
    });
    next("freed");
    next("served");
    let status = child.wait().unwrap();
    assert!(status.success(), "the listener process: {status}");
}

#[test]
fn a_listener_that_never_answers_fails_the_connect_in_time() {
    let Some((rt, dev)) = setup("a_listener_that_never_answers_fails_the_connect_in_time") else {
        return;
    };
    // Listens (the kernel completes the TCP handshake) but never answers.
    let mute = std::net::TcpListener::bind(SocketAddr::new(LOCALHOST, 0)).unwrap();
    let addr = mute.local_addr().unwrap();
    let opts = CmOptions {
        connect_timeout: Duration::from_millis(300),
        ..CmOptions::default()
    };
    block(&rt, async {
        let err = timeout(WAIT, cm::connect(&dev, addr, &opts, b"hi"))
            .await
            .expect("bounded by connect_timeout")
            .expect_err("nobody answers");
        assert!(
            matches!(&err, CmError::Event { event, status, .. } if event == "UNREACHABLE" && *status == -libc::ETIMEDOUT),
            "{err}"
        );
    });
    drop(mute);
}
