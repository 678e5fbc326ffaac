//! When a server's responses leave: in how many transport calls (the
//! in-memory network counts an endpoint's [`send`](super::Transport::send)
//! calls), and whether a handler still running holds the others back.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use verbio_runtime::Runtime;

use super::mem::MemNetwork;
use super::tests::{answer, request, ECHO};
use super::{MsgBuf, Request, Rpc, RpcConfig, SESSION_SLOTS};

/// Longest a call that should complete may take (the machine may be
/// loaded; a response held back waits for the client's retransmission,
/// [`quiet`]'s `rto`, far longer).
const BOUND: Duration = Duration::from_secs(5);

/// A configuration under which an endpoint sends only what calls make it
/// send: no retransmission within [`BOUND`], no idle sweep, no pings.
fn quiet() -> RpcConfig {
    RpcConfig {
        rto: Duration::from_secs(60),
        session_idle_timeout: None,
        session_keepalive: false,
        ..RpcConfig::default()
    }
}

/// A server endpoint on `net` and its id on the network.
fn server(net: &MemNetwork) -> (Rpc<super::mem::MemTransport>, u32) {
    let transport = net.endpoint();
    let id = transport.id();
    (Rpc::new(transport, quiet()), id)
}

/// A `register`ed handler answering the only request open has its
/// response sent in one transport call before any other task runs (by the
/// dispatcher that started it, or by its task if it waited; not by waking
/// the dispatcher again to flush), and nothing more is sent.
#[test]
fn the_last_open_handler_sends_its_response_in_one_transport_call() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(31, 4096);
        let (srv, srv_id) = server(&net);
        // The probe task, woken by the handler as it finishes: it runs
        // right after the turn that ran the handler, before a dispatcher
        // woken to flush would (the run queue is first in, first out).
        let probe: Rc<RefCell<Option<Waker>>> = Rc::default();
        let at_handler = Rc::new(Cell::new(None));
        let at_probe = Rc::new(Cell::new(None));
        {
            let (net, probe, at_handler) = (net.clone(), probe.clone(), at_handler.clone());
            srv.register(ECHO, move |req: Request| {
                at_handler.set(Some(net.send_calls(srv_id)));
                if let Some(w) = probe.borrow_mut().take() {
                    w.wake();
                }
                async move { MsgBuf::from(answer(req.data())) }
            })
            .unwrap();
        }
        let probe_task = {
            let (net, probe, at_probe, at_handler) = (
                net.clone(),
                probe.clone(),
                at_probe.clone(),
                at_handler.clone(),
            );
            verbio_runtime::spawn(poll_fn(move |cx| {
                if at_handler.get().is_some() {
                    at_probe.set(Some(net.send_calls(srv_id)));
                    return Poll::Ready(());
                }
                *probe.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }))
        };
        let cli = Rpc::new(net.endpoint(), quiet());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let req = request(0, 0, 32);
        let resp = verbio_runtime::timeout(BOUND, cli.call(s, ECHO, &req))
            .await
            .expect("the call completes")
            .unwrap();
        assert_eq!(&resp[..], &answer(&req)[..]);
        verbio_runtime::timeout(BOUND, probe_task)
            .await
            .expect("the handler woke the probe");
        let before = at_handler.get().expect("the handler ran");
        assert_eq!(
            at_probe.get(),
            Some(before + 1),
            "the response left in the handler's turn, before the next task ran"
        );
        assert_eq!(
            net.send_calls(srv_id),
            before + 1,
            "one transport call for the response, no other flush"
        );
        assert_eq!(srv.stats().handler_runs, 1);
    });
}

/// Requests arriving together, whose `register`ed handlers all finish in
/// the same turn: their responses leave in one transport call, not one
/// each.
#[test]
fn responses_finishing_in_one_turn_leave_in_one_transport_call() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(32, 4096);
        let (srv, srv_id) = server(&net);
        srv.register(ECHO, |req: Request| async move {
            MsgBuf::from(answer(req.data()))
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), quiet());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let reqs: Vec<Vec<u8>> = (0..SESSION_SLOTS).map(|i| request(1, i, 32)).collect();
        let (calls_before, packets_before) = (net.send_calls(srv_id), srv.stats().packets_sent);
        // One task polls every call in one turn: the requests are all in
        // the server's queue when its dispatcher next runs.
        let calls = futures::future::join_all(reqs.iter().map(|req| cli.call(s, ECHO, req)));
        let resps = verbio_runtime::timeout(BOUND, calls)
            .await
            .expect("the calls complete");
        for (req, resp) in reqs.iter().zip(resps) {
            assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
        }
        assert_eq!(
            srv.stats().packets_sent - packets_before,
            SESSION_SLOTS as u64,
            "one response packet per call"
        );
        assert_eq!(
            net.send_calls(srv_id) - calls_before,
            1,
            "{SESSION_SLOTS} responses finished in one turn leave in one transport call"
        );
    });
}

/// A `register`ed handler that never finishes holds back no other
/// response: the others are sent (the dispatcher flushes them) within
/// [`BOUND`], not at the client's retransmission.
#[test]
fn a_handler_that_never_finishes_holds_back_no_other_response() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(33, 4096);
        let (srv, _) = server(&net);
        let stuck = Rc::new(Cell::new(false));
        {
            let stuck = stuck.clone();
            srv.register(ECHO, move |req: Request| {
                let never = req.data() == b"never";
                if never {
                    stuck.set(true);
                }
                async move {
                    if never {
                        std::future::pending::<()>().await;
                    }
                    MsgBuf::from(answer(req.data()))
                }
            })
            .unwrap();
        }
        let cli = Rc::new(Rpc::new(net.endpoint(), quiet()));
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let never = {
            let cli = cli.clone();
            verbio_runtime::spawn(async move {
                let _ = cli.call(s, ECHO, b"never").await;
            })
        };
        verbio_runtime::timeout(BOUND, async {
            while !stuck.get() {
                verbio_runtime::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the handler that never finishes started");
        // The other slots of the session, together, then one by one.
        let reqs: Vec<Vec<u8>> = (0..SESSION_SLOTS - 1).map(|i| request(2, i, 32)).collect();
        let calls = futures::future::join_all(reqs.iter().map(|req| cli.call(s, ECHO, req)));
        let resps = verbio_runtime::timeout(BOUND, calls)
            .await
            .expect("the other calls complete while one handler runs on");
        for (req, resp) in reqs.iter().zip(resps) {
            assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
        }
        for i in 0..3 {
            let req = request(3, i, 32);
            let resp = verbio_runtime::timeout(BOUND, cli.call(s, ECHO, &req))
                .await
                .expect("a later call completes while one handler runs on")
                .unwrap();
            assert_eq!(&resp[..], &answer(&req)[..]);
        }
        assert_eq!(srv.stats().handler_runs, SESSION_SLOTS as u64 + 3);
        drop(never);
    });
}

/// Client packets sent by `calls` calls started together (one task polls
/// them all in one turn) on a session of a fresh endpoint, the network
/// batching call starts or not: the transport calls they took.
fn client_sends_for_calls_started_together(batch: bool, calls: usize) -> u64 {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(33, 4096);
        net.set_batch_call_starts(batch);
        let (srv, _) = server(&net);
        srv.register(ECHO, |req: Request| async move {
            MsgBuf::from(answer(req.data()))
        })
        .unwrap();
        let transport = net.endpoint();
        let cli_id = transport.id();
        let cli = Rpc::new(transport, quiet());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let reqs: Vec<Vec<u8>> = (0..calls).map(|i| request(2, i, 32)).collect();
        let before = net.send_calls(cli_id);
        let all = futures::future::join_all(reqs.iter().map(|req| cli.call(s, ECHO, req)));
        let resps = verbio_runtime::timeout(BOUND, all)
            .await
            .expect("the calls complete");
        for (req, resp) in reqs.iter().zip(resps) {
            assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
        }
        net.send_calls(cli_id) - before
    })
}

/// With call starts batched (UD's way), the first of calls started
/// together leaves at once (it is alone: no wait on the latency path) and
/// the others, started while it is under way, leave together, sent by the
/// dispatcher (woken by the first of them): two transport calls (two post lists on UD) for a
/// session's worth of calls, not one per call; unbatched, one per call.
#[test]
fn calls_started_together_leave_in_two_transport_calls() {
    assert_eq!(
        client_sends_for_calls_started_together(true, SESSION_SLOTS),
        2,
        "the first call at once, the other {} together",
        SESSION_SLOTS - 1
    );
    assert_eq!(
        client_sends_for_calls_started_together(false, SESSION_SLOTS),
        SESSION_SLOTS as u64,
        "unbatched: one transport call per call start"
    );
    assert_eq!(
        client_sends_for_calls_started_together(true, 1),
        1,
        "a call alone leaves at its start"
    );
}
