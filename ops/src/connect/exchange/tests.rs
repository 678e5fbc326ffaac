//! Both roles over an in-memory duplex pipe, under `futures::executor::block_on`.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use verbio_runtime::provider::{Gid, Mtu};

use super::*;

#[derive(Default)]
struct Half {
    data: VecDeque<u8>,
    closed: bool,
    reader: Option<Waker>,
}

/// One end of an in-memory, unbounded, full-duplex byte pipe.
struct End {
    rx: Rc<RefCell<Half>>,
    tx: Rc<RefCell<Half>>,
}

fn pipe() -> (End, End) {
    let a = Rc::new(RefCell::new(Half::default()));
    let b = Rc::new(RefCell::new(Half::default()));
    (
        End {
            rx: a.clone(),
            tx: b.clone(),
        },
        End { rx: b, tx: a },
    )
}

impl End {
    fn shut(&self) {
        let mut tx = self.tx.borrow_mut();
        tx.closed = true;
        if let Some(w) = tx.reader.take() {
            w.wake();
        }
    }
}

impl Drop for End {
    fn drop(&mut self) {
        self.shut();
    }
}

impl AsyncRead for End {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut rx = self.rx.borrow_mut();
        if rx.data.is_empty() {
            if rx.closed {
                return Poll::Ready(Ok(0));
            }
            rx.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = buf.len().min(rx.data.len());
        for (dst, src) in buf.iter_mut().zip(rx.data.drain(..n)) {
            *dst = src;
        }
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for End {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut tx = self.tx.borrow_mut();
        if tx.closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        tx.data.extend(buf);
        if let Some(w) = tx.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.shut();
        Poll::Ready(Ok(()))
    }
}

/// A timer on a helper thread: enough for tests (the reactor has real timers).
fn sleep(after: Duration) -> Deadline<impl Future<Output = ()>> {
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let _ = tx.send(());
    });
    Deadline {
        timer: async move {
            let _ = rx.await;
        },
        after,
    }
}

/// Generous: only a bug reaches it (and then the test fails instead of hanging).
const LIMIT: Duration = Duration::from_secs(10);

fn soft(qpn: u32, port: u16) -> Endpoint {
    Endpoint {
        provider: ProviderKind::Soft,
        qpn,
        psn: qpn * 7,
        lid: 0,
        gid: Gid::default(),
        mtu: Mtu::Mtu4096,
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], port)).into(),
    }
}

fn hw() -> Endpoint {
    Endpoint {
        provider: ProviderKind::Ibverbs,
        qpn: 5,
        psn: 9,
        lid: 1,
        gid: Gid::default(),
        mtu: Mtu::Mtu1024,
        addr: verbio_runtime::provider::ProviderAddr::NONE,
    }
}

type ServerResult = Result<(Endpoint, &'static str), HandshakeError>;

async fn run_server(mut s: End, local: Endpoint) -> ServerResult {
    accept_exchange(
        &mut s,
        local.provider,
        |remote| {
            assert_eq!(remote.provider, local.provider);
            Ok((local, "qp"))
        },
        sleep(LIMIT),
    )
    .await
}

#[test]
fn both_sides_learn_each_others_endpoint() {
    let (mut c, s) = pipe();
    let (ce, se) = (soft(100, 4000), soft(200, 5000));
    let connected = Cell::new(None);
    let (cr, sr) = futures::executor::block_on(async {
        futures::join!(
            connect_exchange(
                &mut c,
                &ce,
                |remote| {
                    connected.set(Some(*remote));
                    Ok(())
                },
                sleep(LIMIT)
            ),
            run_server(s, se)
        )
    });
    assert_eq!(cr.unwrap(), se);
    assert_eq!(connected.get(), Some(se));
    let (remote, qp) = sr.unwrap();
    assert_eq!((remote, qp), (ce, "qp"));
}

#[test]
fn provider_mismatch_is_named_on_both_sides() {
    let (mut c, s) = pipe();
    let ce = hw();
    let (cr, sr) = futures::executor::block_on(async {
        futures::join!(
            connect_exchange(&mut c, &ce, |_| Ok(()), sleep(LIMIT)),
            run_server(s, soft(1, 4000))
        )
    });
    assert!(matches!(
        sr,
        Err(HandshakeError::ProviderMismatch {
            local: ProviderKind::Soft,
            remote: ProviderKind::Ibverbs
        })
    ));
    match cr {
        Err(HandshakeError::RejectedByPeer { reason }) => {
            assert!(reason.contains("provider mismatch"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// Feeds raw bytes to a server and returns its result.
fn serve_raw(bytes: &[u8], then_close: bool, limit: Duration) -> (ServerResult, Vec<u8>) {
    let (mut c, s) = pipe();
    futures::executor::block_on(async {
        c.write_all(bytes).await.unwrap();
        if then_close {
            c.close().await.unwrap();
        }
        let r = accept_exchange(
            &mut { s },
            ProviderKind::Soft,
            |_| -> Result<(Endpoint, ()), _> { panic!("setup must not run for a bad client") },
            sleep(limit),
        )
        .await
        .map(|(ep, ())| (ep, ""));
        let mut answer = Vec::new();
        // The server's end is dropped (closed) by now: read to EOF.
        c.read_to_end(&mut answer).await.unwrap();
        (r, answer)
    })
}

#[test]
fn garbage_client_gets_bad_magic_without_a_full_header() {
    let (r, answer) = serve_raw(b"GET", false, LIMIT);
    assert!(matches!(r, Err(HandshakeError::BadMagic { ref got, .. }) if got == b"GET"));
    // The client is told why.
    match decode_frame(&answer) {
        Ok(Frame::Reject(reason)) => assert!(reason.contains("bad magic"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_client_is_reported_with_sizes() {
    let f = handshake::encode(&Hello::new(soft(1, 4000))).unwrap();
    let (r, _) = serve_raw(&f[..20], true, LIMIT);
    assert!(matches!(
        r,
        Err(HandshakeError::Truncated {
            needed: handshake::HELLO_LEN,
            got: 20
        })
    ));
    let (r, _) = serve_raw(&f[..8], true, LIMIT);
    assert!(matches!(
        r,
        Err(HandshakeError::Truncated {
            needed: HEADER_LEN,
            got: 8
        })
    ));
}

#[test]
fn wrong_version_and_bad_fields_are_refused() {
    let mut f = handshake::encode(&Hello::new(soft(1, 4000))).unwrap();
    f[6] = 9;
    let (r, answer) = serve_raw(&f, false, LIMIT);
    assert!(matches!(
        r,
        Err(HandshakeError::UnsupportedVersion {
            got: 9,
            supported: 2
        })
    ));
    assert!(matches!(decode_frame(&answer), Ok(Frame::Reject(_))));
    // A provider address longer than the field, or cut short: refused and
    // answered, never read past the frame.
    for n in [200, 3] {
        let mut f = handshake::encode(&Hello::new(soft(1, 4000))).unwrap();
        f[HEADER_LEN + 2] = n;
        let (r, answer) = serve_raw(&f, false, LIMIT);
        assert!(
            matches!(r, Err(HandshakeError::InvalidField { field, .. }) if field.starts_with("addr")),
            "{r:?}"
        );
        assert!(matches!(decode_frame(&answer), Ok(Frame::Reject(_))));
    }
    let mut f = handshake::encode(&Hello::new(soft(1, 4000))).unwrap();
    f[HEADER_LEN + 1] = 77; // MTU
    let (r, _) = serve_raw(&f, false, LIMIT);
    assert!(matches!(
        r,
        Err(HandshakeError::InvalidField { field: "mtu", .. })
    ));
}

#[test]
fn silent_client_times_out_with_the_stage() {
    let (r, _) = serve_raw(b"", false, Duration::from_millis(50));
    match r {
        Err(HandshakeError::Timeout { stage, after }) => {
            assert_eq!(stage, "reading the client's hello");
            assert_eq!(after, Duration::from_millis(50));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn server_setup_failure_reaches_the_client() {
    let (mut c, mut s) = pipe();
    let ce = soft(1, 4000);
    let (cr, sr) = futures::executor::block_on(async {
        futures::join!(
            connect_exchange(&mut c, &ce, |_| Ok(()), sleep(LIMIT)),
            async {
                let r = accept_exchange(
                    &mut s,
                    ProviderKind::Soft,
                    |_| -> Result<(Endpoint, ()), _> {
                        Err(HandshakeError::InvalidField {
                            field: "test",
                            value: 0,
                            reason: "no QP for you",
                        })
                    },
                    sleep(LIMIT),
                )
                .await;
                drop(s);
                r
            }
        )
    });
    assert!(matches!(
        sr,
        Err(HandshakeError::InvalidField { field: "test", .. })
    ));
    match cr {
        Err(HandshakeError::RejectedByPeer { reason }) => {
            assert!(reason.contains("no QP for you"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn client_connect_failure_reaches_the_server() {
    let (mut c, s) = pipe();
    let (cr, sr) = futures::executor::block_on(async {
        futures::join!(
            async {
                let r = connect_exchange(
                    &mut c,
                    &soft(1, 4000),
                    |_| {
                        Err(HandshakeError::InvalidField {
                            field: "test",
                            value: 1,
                            reason: "RTR failed",
                        })
                    },
                    sleep(LIMIT),
                )
                .await;
                drop(c);
                r
            },
            run_server(s, soft(2, 5000))
        )
    });
    assert!(matches!(
        cr,
        Err(HandshakeError::InvalidField { field: "test", .. })
    ));
    match sr {
        Err(HandshakeError::RejectedByPeer { reason }) => assert!(reason.contains("RTR failed")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn server_that_closes_early_is_truncated_for_the_client() {
    let (mut c, s) = pipe();
    drop(s);
    let r = futures::executor::block_on(connect_exchange(
        &mut c,
        &soft(1, 4000),
        |_| Ok(()),
        sleep(LIMIT),
    ));
    // Writing into a closed pipe fails first.
    assert!(matches!(
        r,
        Err(HandshakeError::Io {
            stage: "sending hello",
            ..
        } | HandshakeError::Truncated { got: 0, .. })
    ));
}
