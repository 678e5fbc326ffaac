//! The listener over the reactor's real TCP, with a fake QP factory (no
//! device needed): concurrent handshakes, bad clients refused, timeouts.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use futures::io::{AsyncReadExt, AsyncWriteExt};
use verbio_runtime::provider::{Gid, Mtu, ProviderKind};
use verbio_runtime::{spawn, timeout, Runtime};

use super::super::handshake::{self, decode_frame, Frame, Hello, HEADER_LEN, HELLO_LEN};
use super::*;

/// Hands out QP numbers and records connections instead of touching a device.
pub(super) struct Fake {
    kind: ProviderKind,
    next_qpn: Cell<u32>,
    connected: RefCell<Vec<(u32, Endpoint)>>,
}

#[derive(Clone)]
pub(super) struct FakeQps(Rc<Fake>);

impl FakeQps {
    pub(super) fn new(kind: ProviderKind, first_qpn: u32) -> FakeQps {
        FakeQps(Rc::new(Fake {
            kind,
            next_qpn: Cell::new(first_qpn),
            connected: RefCell::new(Vec::new()),
        }))
    }
}

impl QpFactory for FakeQps {
    type Qp = u32;
    fn provider(&self) -> ProviderKind {
        self.0.kind
    }
    fn create(&self) -> Result<(u32, Endpoint), HandshakeError> {
        let qpn = self.0.next_qpn.get();
        self.0.next_qpn.set(qpn + 1);
        let soft = self.0.kind == ProviderKind::Soft;
        Ok((
            qpn,
            Endpoint {
                provider: self.0.kind,
                qpn,
                psn: qpn + 1000,
                lid: if soft { 0 } else { 1 },
                gid: Gid::default(),
                mtu: Mtu::Mtu4096,
                addr: if soft {
                    SocketAddr::from(([127, 0, 0, 1], 9)).into()
                } else {
                    verbio_runtime::provider::ProviderAddr::NONE
                },
            },
        ))
    }
    fn connect(&self, qp: &u32, local: &Endpoint, remote: &Endpoint) -> Result<(), HandshakeError> {
        assert_eq!(*qp, local.qpn);
        self.0.connected.borrow_mut().push((*qp, *remote));
        Ok(())
    }
}

/// Bounds every test; only a bug reaches it.
pub(super) const LIMIT: Duration = Duration::from_secs(10);

pub(super) fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Sends `bytes`, optionally half-closes, and returns everything the server
/// answers until it closes.
async fn raw_client(addr: SocketAddr, bytes: Vec<u8>, half_close: bool) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&bytes).await.unwrap();
    if half_close {
        s.close().await.unwrap();
    }
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply).await;
    reply
}

pub(super) fn hello_bytes() -> Vec<u8> {
    let ep = FakeQps::new(ProviderKind::Soft, 1).create().unwrap().1;
    handshake::encode(&Hello::new(ep)).unwrap().to_vec()
}

#[test]
fn client_and_server_connect_their_qps() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let server_qps = FakeQps::new(ProviderKind::Soft, 100);
        let listener = Listener::bind(any_port(), server_qps.clone(), LIMIT).unwrap();
        let addr = listener.local_addr().unwrap();
        let client_qps = FakeQps::new(ProviderKind::Soft, 500);
        let cq = client_qps.clone();
        let client = spawn(async move { connect(addr, &cq, LIMIT).await });
        let server = timeout(LIMIT, listener.accept()).await.unwrap().unwrap();
        let client = timeout(LIMIT, client).await.unwrap().unwrap();
        assert_eq!((server.qp, client.qp), (100, 500));
        assert_eq!(server.remote, client.local);
        assert_eq!(client.remote, server.local);
        assert_eq!(client.peer_addr, addr);
        assert_eq!(*server_qps.0.connected.borrow(), [(100, client.local)]);
        assert_eq!(*client_qps.0.connected.borrow(), [(500, server.local)]);
        assert_eq!(listener.in_flight(), 0);
    });
}

#[test]
fn garbage_client_is_told_and_the_next_one_is_served() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let listener =
            Listener::bind(any_port(), FakeQps::new(ProviderKind::Soft, 1), LIMIT).unwrap();
        let addr = listener.local_addr().unwrap();
        let garbage = spawn(raw_client(addr, b"GET / HTTP/1.1\r\n\r\n".to_vec(), false));
        let (peer, err) = timeout(LIMIT, listener.accept_attempt())
            .await
            .unwrap()
            .unwrap_err();
        assert!(peer.is_some());
        assert!(matches!(err, HandshakeError::BadMagic { .. }), "{err}");
        match decode_frame(&timeout(LIMIT, garbage).await.unwrap()) {
            Ok(Frame::Reject(reason)) => assert!(reason.contains("bad magic"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let qps = FakeQps::new(ProviderKind::Soft, 50);
        let client = spawn(async move { connect(addr, &qps, LIMIT).await });
        let server = timeout(LIMIT, listener.accept()).await.unwrap().unwrap();
        assert_eq!(server.remote.qpn, 50);
        timeout(LIMIT, client).await.unwrap().unwrap();
    });
}

#[test]
fn accept_skips_failed_clients() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let listener =
            Listener::bind(any_port(), FakeQps::new(ProviderKind::Soft, 1), LIMIT).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut bad = hello_bytes();
        bad[6] = 7; // version 7
        let bad_client = spawn(raw_client(addr, bad, true));
        // Let the bad client's handshake fail first (it is skipped, not returned).
        let reply = timeout(LIMIT, async {
            loop {
                if bad_client.is_finished() {
                    break;
                }
                let _ = futures::future::select(
                    std::pin::pin!(listener.accept()),
                    std::pin::pin!(verbio_runtime::sleep(Duration::from_millis(5))),
                )
                .await;
            }
            bad_client.await
        })
        .await
        .unwrap();
        match decode_frame(&reply) {
            Ok(Frame::Reject(reason)) => assert!(reason.contains("version 7"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let qps = FakeQps::new(ProviderKind::Soft, 70);
        let client = spawn(async move { connect(addr, &qps, LIMIT).await });
        let server = timeout(LIMIT, listener.accept()).await.unwrap().unwrap();
        assert_eq!(server.remote.qpn, 70);
        timeout(LIMIT, client).await.unwrap().unwrap();
    });
}

#[test]
fn a_silent_client_does_not_hold_up_the_others() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let listener =
            Listener::bind(any_port(), FakeQps::new(ProviderKind::Soft, 1), LIMIT).unwrap();
        let addr = listener.local_addr().unwrap();
        // Connected, never sends: its handshake waits for the full LIMIT.
        let silent = TcpStream::connect(addr).await.unwrap();
        let qps = FakeQps::new(ProviderKind::Soft, 80);
        let client = spawn(async move {
            verbio_runtime::sleep(Duration::from_millis(20)).await;
            connect(addr, &qps, LIMIT).await
        });
        // A listener that handled clients one at a time would only get here
        // after the silent client's 10 s timeout: half of that fails the test.
        let server = timeout(LIMIT / 2, listener.accept())
            .await
            .expect("served while another handshake is pending")
            .unwrap();
        assert_eq!(server.remote.qpn, 80);
        assert_eq!(
            listener.in_flight(),
            1,
            "the silent client is still pending"
        );
        timeout(LIMIT, client).await.unwrap().unwrap();
        drop(silent);
    });
}

#[test]
fn silent_and_truncated_clients_get_named_errors() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let listener = Listener::bind(
            any_port(),
            FakeQps::new(ProviderKind::Soft, 1),
            Duration::from_millis(100),
        )
        .unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = TcpStream::connect(addr).await.unwrap();
        let (_, err) = timeout(LIMIT, listener.accept_attempt())
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::Timeout {
                    stage: "reading the client's hello",
                    ..
                }
            ),
            "{err}"
        );
        drop(silent);
        let truncated = spawn(raw_client(addr, hello_bytes()[..20].to_vec(), true));
        let (_, err) = timeout(LIMIT, listener.accept_attempt())
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::Truncated {
                    needed: HELLO_LEN,
                    got: 20
                }
            ),
            "{err}"
        );
        let _ = timeout(LIMIT, truncated).await.unwrap();
        let short = spawn(raw_client(addr, hello_bytes()[..5].to_vec(), true));
        let (_, err) = timeout(LIMIT, listener.accept_attempt())
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::Truncated {
                    needed: HEADER_LEN,
                    got: 5
                }
            ),
            "{err}"
        );
        let _ = timeout(LIMIT, short).await.unwrap();
    });
}

#[test]
fn provider_mismatch_is_refused_on_both_sides() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let listener =
            Listener::bind(any_port(), FakeQps::new(ProviderKind::Soft, 1), LIMIT).unwrap();
        let addr = listener.local_addr().unwrap();
        let qps = FakeQps::new(ProviderKind::Ibverbs, 9);
        let client = spawn(async move { connect(addr, &qps, LIMIT).await });
        let (_, err) = timeout(LIMIT, listener.accept_attempt())
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::ProviderMismatch {
                    local: ProviderKind::Soft,
                    remote: ProviderKind::Ibverbs
                }
            ),
            "{err}"
        );
        match timeout(LIMIT, client).await.unwrap() {
            Err(HandshakeError::RejectedByPeer { reason }) => {
                assert!(reason.contains("provider mismatch"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn client_errors_connect_refused_and_silent_server() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let qps = FakeQps::new(ProviderKind::Soft, 1);
        // A port nobody listens on: bind one, note it, close it.
        let closed = {
            let l = TcpListener::bind(any_port()).unwrap();
            l.local_addr().unwrap()
        };
        let err = timeout(LIMIT, connect(closed, &qps, LIMIT))
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::Io {
                    stage: "connecting over TCP",
                    ..
                }
            ),
            "{err}"
        );
        // A listener that accepts (backlog) but never answers.
        let mute = TcpListener::bind(any_port()).unwrap();
        let err = timeout(
            LIMIT,
            connect(mute.local_addr().unwrap(), &qps, Duration::from_millis(100)),
        )
        .await
        .unwrap()
        .unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::Timeout {
                    stage: "reading the server's hello",
                    ..
                }
            ),
            "{err}"
        );
    });
}

/// A client that waits for its handshakes before dialing more is never
/// refused, even when the listener's thread runs late: the listener ends
/// the handshakes whose last frame has arrived before it counts the
/// client's next connections against the per-source cap. (It counted them
/// first: `tests/handshake_crowd.rs` was refused at 32 pending on a loaded
/// machine while dialing 16 at a time.)
#[test]
fn a_late_listener_ends_finished_handshakes_before_counting_new_ones() {
    const PER_SOURCE: usize = 2;
    const ROUNDS: usize = 20;
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let rt = Runtime::new().unwrap();
        rt.block_on(async {
            let listener = Listener::bind(any_port(), FakeQps::new(ProviderKind::Soft, 1), LIMIT)
                .unwrap()
                .with_pending_caps(128, PER_SOURCE);
            tx.send(listener.local_addr().unwrap()).unwrap();
            for i in 0..PER_SOURCE * ROUNDS {
                timeout(LIMIT, listener.accept())
                    .await
                    .unwrap_or_else(|_| panic!("accept {i}: not within {LIMIT:?}"))
                    .unwrap_or_else(|e| panic!("accept {i}: {e}"));
                // The listener's thread runs late: meanwhile the client
                // ends its handshakes and dials the next ones.
                std::thread::sleep(Duration::from_millis(5));
            }
        });
    });
    let addr = rx.recv_timeout(LIMIT).expect("the listener's address");
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let qps = FakeQps::new(ProviderKind::Soft, 1000);
        for round in 0..ROUNDS {
            let dials: Vec<_> = (0..PER_SOURCE)
                .map(|_| {
                    let qps = qps.clone();
                    spawn(async move { connect(addr, &qps, LIMIT).await })
                })
                .collect();
            for (k, d) in dials.into_iter().enumerate() {
                timeout(LIMIT, d)
                    .await
                    .unwrap_or_else(|_| panic!("round {round}, dial {k}: not within {LIMIT:?}"))
                    .unwrap_or_else(|e| panic!("round {round}, dial {k}: {e}"));
            }
        }
    });
    server.join().expect("the listener thread");
}
