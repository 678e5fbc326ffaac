//! Memory windows through the verbs (`Verbs::bind_mw`, `local_inv`,
//! `send_with_inv`) on the software RDMA device (or rxe0 in the VM,
//! `VERBIO_TEST_DEVICE`): a peer reaches exactly the bound range with the
//! bound access, and nothing once the window is invalidated.

mod common;

use std::rc::Rc;

use verbio::ops::connect::{DeviceQps, QpConfig};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::{AccessFlags, QpState, WcStatus};
use verbio::runtime::buf::{MrPool, RemoteAccessRegion, Window};
use verbio::runtime::{Device, QueuePair, Runtime};

/// A runtime, the test device, two connected QPs of it (`a` the peer, `b`
/// the owner of the memory) and a bindable region of 64 KiB.
fn setup() -> (
    Runtime,
    Device,
    QueuePair,
    QueuePair,
    Rc<RemoteAccessRegion<Vec<u8>>>,
) {
    let (rt, dev) = common::runtime_and_device();
    let (a, b) = DeviceQps::new(dev.clone(), QpConfig::default())
        .connected_pair()
        .expect("connected QPs");
    let region = RemoteAccessRegion::bindable(dev.pd(), vec![0u8; 64 * 1024]).expect("bindable");
    (rt, dev, a, b, Rc::new(region))
}

fn rw() -> AccessFlags {
    AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE
}

#[test]
fn a_peer_reaches_the_window_until_it_is_invalidated() {
    let (rt, dev, a, b, region) = setup();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let window = Window::alloc(dev.pd()).expect("alloc_mw");
        let (granted, window) = b.bind_mw(window, region.clone(), 4096..8192, rw()).await;
        let remote = granted.expect("bind");
        assert_eq!((remote.addr(), remote.len()), (region.addr() + 4096, 4096));
        assert!(window.is_bound());
        let data = common::pattern(4096, 7);
        let (r, _) = a.write(common::buf_from(&pool, &data), remote).await;
        r.expect("write through the window");
        let mut got = vec![0u8; 4096];
        region.read_into(4096, &mut got).expect("read_into");
        assert_eq!(got, data);
        let (r, back) = a
            .read(
                common::buf(&pool, 512),
                remote.slice(512..1024u64).expect("slice"),
            )
            .await;
        r.expect("read through the window");
        assert_eq!(&back[..], &data[512..1024]);
        let (r, window) = b.local_inv(window).await;
        r.expect("local_inv");
        assert!(!window.is_bound(), "the window let the region go");
        assert_eq!(Rc::strong_count(&region), 1);
        let (r, _) = a
            .read(
                common::buf(&pool, 64),
                remote.slice(0..64u64).expect("slice"),
            )
            .await;
        let e = r.expect_err("the invalidated rkey");
        assert_eq!(e.status(), Some(WcStatus::RemAccessErr), "{e}");
    });
}

#[test]
fn a_window_grants_only_its_access() {
    let (rt, dev, a, b, region) = setup();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let window = Window::alloc(dev.pd()).expect("alloc_mw");
        let (granted, _window) = b
            .bind_mw(window, region.clone(), 0..4096, AccessFlags::REMOTE_READ)
            .await;
        let remote = granted.expect("bind");
        let (r, _) = a.write(common::buf_from(&pool, &[1u8; 64]), remote).await;
        let e = r.expect_err("write through a read-only window");
        assert_eq!(e.status(), Some(WcStatus::RemAccessErr), "{e}");
        let mut got = vec![1u8; 64];
        region.read_into(0, &mut got).expect("read_into");
        assert!(got.iter().all(|&x| x == 0), "nothing was written");
    });
}

#[test]
fn an_access_past_the_window_is_refused() {
    if common::test_device().is_some() {
        println!(
            "SKIPPED: soft-only: rxe (Linux 6.1) checks the region's bounds, not the window's"
        );
        return;
    }
    let (rt, dev, a, b, region) = setup();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let window = Window::alloc(dev.pd()).expect("alloc_mw");
        let (granted, _window) = b.bind_mw(window, region.clone(), 4096..8192, rw()).await;
        let remote = granted.expect("bind");
        let past = RemoteBuf::new(remote.addr() + 4096 - 8, 16, remote.rkey());
        let (r, _) = a.read(common::buf(&pool, 16), past).await;
        let e = r.expect_err("8 bytes past the window");
        assert_eq!(e.status(), Some(WcStatus::RemAccessErr), "{e}");
    });
}

#[test]
fn send_with_inv_revokes_the_peers_window() {
    let (rt, dev, a, b, region) = setup();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let window = Window::alloc(dev.pd()).expect("alloc_mw");
        let (granted, _window) = b.bind_mw(window, region.clone(), 0..4096, rw()).await;
        let remote = granted.expect("bind");
        let recv = b.recv(common::buf(&pool, 64));
        let (r, _) = a
            .send_with_inv(common::buf_from(&pool, b"done"), remote.rkey())
            .await;
        assert_eq!(r.expect("send_with_inv"), 4);
        let (r, got) = recv.await;
        r.expect("recv");
        assert_eq!(&got[..], b"done");
        let (r, _) = a
            .read(
                common::buf(&pool, 64),
                remote.slice(0..64u64).expect("slice"),
            )
            .await;
        let e = r.expect_err("the invalidated rkey");
        assert_eq!(e.status(), Some(WcStatus::RemAccessErr), "{e}");
    });
}

#[test]
fn binding_a_bound_window_and_invalidating_an_unbound_one_are_refused() {
    let (rt, dev, _a, b, region) = setup();
    common::block(&rt, async {
        let window = Window::alloc(dev.pd()).expect("alloc_mw");
        let (r, window) = b.local_inv(window).await;
        assert!(r.is_err(), "unbound window");
        let (granted, window) = b.bind_mw(window, region.clone(), 0..64, rw()).await;
        granted.expect("bind");
        let (r, window) = b.bind_mw(window, region.clone(), 0..64, rw()).await;
        assert!(r.is_err(), "bound window");
        let (r, window) = b.local_inv(window).await;
        r.expect("local_inv");
        let (r, window) = b.bind_mw(window, region.clone(), 0..0, rw()).await;
        assert!(r.is_err(), "empty range");
        let (r, window) = b
            .bind_mw(window, region.clone(), 0..64, AccessFlags::LOCAL_WRITE)
            .await;
        assert!(r.is_err(), "local access");
        let (r, _window) = b
            .bind_mw(window, region.clone(), 0..64 * 1024 + 1, rw())
            .await;
        assert!(r.is_err(), "past the region");
        assert_eq!(
            b.state().expect("state"),
            QpState::Rts,
            "nothing reached the device"
        );
    });
}

#[test]
fn a_failed_bind_leaves_the_window_unbound() {
    let (rt, dev, _a, b, region) = setup();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        // The owner's QP goes to ERR (its own READ with a key the peer
        // does not know): the bind that follows fails.
        let (r, _) = b
            .read(
                common::buf(&pool, 8),
                RemoteBuf::new(0x1000, 8, 0x00de_ad00),
            )
            .await;
        r.expect_err("a READ with an unknown rkey");
        let window = Window::alloc(dev.pd()).expect("alloc_mw");
        let (r, window) = b.bind_mw(window, region.clone(), 0..64, rw()).await;
        let e = r.expect_err("a bind on a QP in ERR");
        println!("failed bind: {e}");
        assert!(!window.is_bound(), "bound after {e}");
        assert!(window.remote().is_none());
        assert_eq!(Rc::strong_count(&region), 1, "the window let the region go");
        // Refused once the QP is closed: unbound too.
        b.close().await.expect("close");
        let (r, window) = b.bind_mw(window, region.clone(), 0..64, rw()).await;
        let e = r.expect_err("a bind on a closed QP");
        assert!(!window.is_bound(), "bound after {e}");
        assert_eq!(Rc::strong_count(&region), 1);
    });
}
