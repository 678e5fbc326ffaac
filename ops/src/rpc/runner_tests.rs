//! `register`ed handlers started by the dispatcher in a handler task's
//! slot (`runner.rs`): futures that wait are finished by their task,
//! handlers may use their own endpoint, and more requests than tasks
//! queue and are served.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use verbio_runtime::Runtime;

use super::header::Status;
use super::mem::MemNetwork;
use super::tests::{answer, config, request, server, ECHO};
use super::{MsgBuf, Request, Rpc, RpcConfig, RpcError, SESSION_SLOTS};

/// Longest a call that should complete may take (the machine may be loaded).
const BOUND: Duration = Duration::from_secs(10);

/// A server endpoint on `net` with `handler_tasks` tasks for its
/// `register`ed handlers.
fn with_tasks(net: &MemNetwork, handler_tasks: usize) -> Rpc<super::mem::MemTransport> {
    Rpc::new(
        net.endpoint(),
        RpcConfig {
            handler_tasks,
            ..config()
        },
    )
}

/// Handler futures that wait (a timer; a wake of their own, then
/// `Pending` once; several waits) are finished by their tasks: with two
/// tasks and eight calls at once, six requests queue behind them and
/// every call gets its answer, each handler run once.
#[test]
fn handlers_that_wait_are_finished_by_their_tasks() {
    const SLEEPS: u8 = 2;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(41, 4096);
        let srv = with_tasks(&net, 2);
        let runs = Rc::new(Cell::new(0u32));
        let counted = runs.clone();
        srv.register(SLEEPS, move |req: Request| {
            counted.set(counted.get() + 1);
            async move {
                // Pending once, having woken itself.
                let mut yielded = false;
                poll_fn(|cx| {
                    if std::mem::replace(&mut yielded, true) {
                        Poll::Ready(())
                    } else {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                })
                .await;
                for _ in 0..usize::from(req.data()[4] % 3) {
                    verbio_runtime::sleep(Duration::from_millis(1)).await;
                }
                MsgBuf::from(answer(req.data()))
            }
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        for round in 0..3 {
            let reqs: Vec<Vec<u8>> = (0..SESSION_SLOTS).map(|i| request(round, i, 32)).collect();
            let calls = futures::future::join_all(reqs.iter().map(|r| cli.call(s, SLEEPS, r)));
            let resps = verbio_runtime::timeout(BOUND, calls)
                .await
                .expect("handlers that wait answer");
            for (req, resp) in reqs.iter().zip(resps) {
                assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
            }
        }
        assert_eq!(runs.get(), 3 * SESSION_SLOTS as u32);
        assert_eq!(srv.stats().handler_runs, 3 * SESSION_SLOTS as u64);
        assert_eq!(srv.stats().handler_panics, 0);
    });
}

/// A handler that calls another server through its own endpoint, from
/// its future's first poll (the dispatcher holds no borrow of the
/// endpoint while it starts a handler) and again after waiting.
#[test]
fn a_handler_may_call_through_its_own_endpoint() {
    const PROXY: u8 = 3;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(42, 4096);
        let (backend, _) = server(&net, config());
        let proxy = Rc::new(Rpc::new(net.endpoint(), config()));
        let to_backend = proxy.connect(&backend.local_addr()).await.unwrap();
        let weak = Rc::downgrade(&proxy);
        proxy
            .register(PROXY, move |req: Request| {
                let proxy = weak.upgrade().expect("the proxy endpoint");
                async move {
                    let once = proxy.call(to_backend, ECHO, req.data()).await.unwrap();
                    let twice = proxy.call(to_backend, ECHO, &once).await.unwrap();
                    MsgBuf::from(twice.to_vec())
                }
            })
            .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&proxy.local_addr()).await.unwrap();
        for i in 0..4 {
            let req = request(7, i, 40);
            let resp = verbio_runtime::timeout(BOUND, cli.call(s, PROXY, &req))
                .await
                .expect("the proxied call completes")
                .unwrap();
            assert_eq!(&resp[..], &answer(&answer(&req))[..]);
        }
        assert_eq!(proxy.stats().handler_panics, 0);
    });
}

/// A handler future that panics after waiting fails its call only; its
/// task serves the next requests; so does one whose handler panics
/// before it returns a future, and one that panics on its first poll.
#[test]
fn handler_panics_at_any_point_fail_their_call_only() {
    const PANICS: u8 = 4;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(43, 4096);
        let srv = with_tasks(&net, 1);
        let woke: Rc<RefCell<Vec<u8>>> = Rc::default();
        let log = woke.clone();
        srv.register(PANICS, move |req: Request| {
            if req.data() == b"before" {
                panic!("handler test panic before its future");
            }
            let log = log.clone();
            async move {
                match req.data() {
                    b"first" => panic!("handler test panic at the first poll"),
                    b"later" => {
                        verbio_runtime::sleep(Duration::from_millis(1)).await;
                        panic!("handler test panic after waiting");
                    }
                    _ => {}
                }
                log.borrow_mut().extend_from_slice(req.data());
                MsgBuf::from(answer(req.data()))
            }
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        for bad in [&b"before"[..], b"first", b"later"] {
            let e = verbio_runtime::timeout(BOUND, cli.call(s, PANICS, bad))
                .await
                .expect("the failed call is answered")
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    RpcError::Remote {
                        status: Status::HandlerPanicked,
                        ..
                    }
                ),
                "{e}"
            );
            let resp = verbio_runtime::timeout(BOUND, cli.call(s, PANICS, b"ok"))
                .await
                .expect("the one task serves on")
                .unwrap();
            assert_eq!(&resp[..], &answer(b"ok")[..]);
        }
        assert_eq!(srv.stats().handler_panics, 3);
        assert_eq!(&woke.borrow()[..], b"okokok");
    });
}

/// A handler that holds its own endpoint (a proxy would) does not keep it
/// alive past its runtime: the endpoint knows its idle handler tasks by
/// weak references, so dropping the runtime's tasks frees it.
#[test]
fn a_handler_holding_its_endpoint_does_not_keep_it_alive() {
    let net = MemNetwork::new(44, 4096);
    let rt = Runtime::new().unwrap();
    let weak = rt.block_on(async {
        let srv = Rc::new(Rpc::new(net.endpoint(), config()));
        let held = srv.clone();
        srv.register(ECHO, move |req: Request| {
            let _ = &held;
            async move { MsgBuf::from(answer(req.data())) }
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let resp = cli.call(s, ECHO, b"held").await.unwrap();
        assert_eq!(&resp[..], &answer(b"held")[..]);
        Rc::downgrade(&srv)
    });
    assert!(weak.upgrade().is_some(), "alive while its runtime is");
    drop(rt);
    assert!(
        weak.upgrade().is_none(),
        "the endpoint is freed with its runtime's tasks"
    );
}

/// A request queued while every handler task is busy stays in its
/// session's slot until a task takes it: if its session closes first, no
/// handler runs for it (its response could go nowhere), its memory goes
/// back with the session, and the task serves the next request.
#[test]
fn a_queued_request_of_a_closed_session_runs_no_handler() {
    const GATED: u8 = 4;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(43, 4096);
        let srv = with_tasks(&net, 1);
        let runs = Rc::new(Cell::new(0u32));
        let open = Rc::new(Cell::new(false));
        let (counted, gate) = (runs.clone(), open.clone());
        srv.register(GATED, move |req: Request| {
            counted.set(counted.get() + 1);
            let gate = gate.clone();
            async move {
                while !gate.get() {
                    verbio_runtime::sleep(Duration::from_millis(1)).await;
                }
                MsgBuf::from(answer(req.data()))
            }
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let a = cli.connect(&srv.local_addr()).await.unwrap();
        let b = cli.connect(&srv.local_addr()).await.unwrap();
        let (req_a, req_b) = (request(1, 0, 32), request(1, 1, 32));
        let control = async {
            // A's request holds the only task; B's is dispatched behind it.
            while srv.stats().handler_runs < 2 {
                verbio_runtime::sleep(Duration::from_millis(1)).await;
            }
            cli.disconnect(b);
            while srv.memory().server_sessions > 1 {
                verbio_runtime::sleep(Duration::from_millis(1)).await;
            }
            open.set(true);
        };
        let (got_a, got_b, ()) = verbio_runtime::timeout(
            BOUND,
            futures::future::join3(
                cli.call(a, GATED, &req_a),
                cli.call(b, GATED, &req_b),
                control,
            ),
        )
        .await
        .expect("the session closes and the first call completes");
        assert_eq!(&got_a.unwrap()[..], &answer(&req_a)[..]);
        assert!(
            matches!(got_b, Err(RpcError::SessionClosed { .. })),
            "{got_b:?}"
        );
        assert_eq!(
            runs.get(),
            1,
            "no handler ran for the closed session's request"
        );
        let again = verbio_runtime::timeout(BOUND, cli.call(a, GATED, &req_b))
            .await
            .expect("the task serves the next request");
        assert_eq!(&again.unwrap()[..], &answer(&req_b)[..]);
        assert_eq!(runs.get(), 2);
        assert_eq!(srv.memory().request_bytes, 0);
        assert_eq!(srv.stats().handler_panics, 0);
    });
}
