use super::*;
use crate::reactor::Runtime;

#[test]
fn a_pending_connection_holds_a_small_fixed_amount_of_memory() {
    let rt = Runtime::new().expect("runtime");
    rt.block_on(async {
        let tcp = TcpListener::bind("127.0.0.1:0".parse().unwrap()).expect("bind");
        let addr = tcp.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.expect("connect");
        let (stream, peer) = tcp.accept().await.expect("accept");
        let limits = PendingLimits::new("test", 1, 1);
        let slot = limits.admit(peer).expect("a slot");
        let shared = Rc::new(Shared {
            queue: RefCell::new(VecDeque::new()),
            backlog: 1,
            waiters: RefCell::new(Vec::new()),
            failed: RefCell::new(None),
            tcp: RefCell::new(None),
        });
        let reading = read_request(stream, peer, slot, shared, Duration::from_secs(1));
        // Its state (the frame buffer on its stack included) is all a
        // connection holds before its request is validated.
        let size = std::mem::size_of_val(&reading);
        assert!(
            size <= 2048,
            "a pending connection's task takes {size} bytes"
        );
        assert_eq!(limits.pending(), 1);
        drop(reading);
        assert_eq!(limits.pending(), 0, "dropping it frees the slot");
    });
}

#[test]
fn requests_are_checked_before_they_are_queued() {
    let ep = Endpoint {
        provider: ProviderKind::Soft,
        qpn: 7,
        psn: 1,
        lid: 0,
        gid: Default::default(),
        mtu: crate::provider::Mtu::Mtu4096,
        addr: "127.0.0.1:4791"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    };
    assert_eq!(check_request(&ep), Ok(()));
    let with = |f: &dyn Fn(&mut Endpoint)| {
        let mut e = ep;
        f(&mut e);
        check_request(&e).map_err(|(reason, _)| reason)
    };
    assert_eq!(with(&|e| e.qpn = 1 << 24), Err(REJECT_UNSUPPORTED));
    assert_eq!(with(&|e| e.psn = 1 << 24), Err(REJECT_UNSUPPORTED));
    assert_eq!(
        with(&|e| e.addr = crate::provider::ProviderAddr::NONE),
        Err(REJECT_INVALID_ADDRESS)
    );
    assert_eq!(
        with(&|e| e.addr = "0.0.0.0:4791"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into()),
        Err(REJECT_INVALID_ADDRESS)
    );
    assert_eq!(
        with(&|e| e.addr = "127.0.0.1:0"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into()),
        Err(REJECT_INVALID_ADDRESS)
    );
}
