//! Unit tests of UD queue pairs on the fake QP: receive rings that leave
//! room for the GRH and report the source, losses that don't stop a ring,
//! and sends that must name a peer.

use futures::FutureExt;

use crate::op::SubmitError;
use crate::provider::{Endpoint, Gid, Mtu, ProviderKind, QpCaps, QpType, WcStatus, GRH_LEN};
use crate::qp::{RecvRing, RecvRingConfig, RecvRingError, RingMsg, UdEndpoint};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 8,
        max_recv_wr: 16,
        ..QpCaps::default()
    }
}

fn next_now(r: &mut RecvRing) -> Option<Option<Result<RingMsg, RecvRingError>>> {
    r.next().now_or_never()
}

#[test]
fn a_datagram_ring_yields_the_payload_after_the_grh_and_its_source() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::ud_queue_pair(5, caps(), 64);
    assert_eq!(qp.qp_type(), QpType::Ud);
    let mut r = rt
        .block_on(async { RecvRing::create(&qp, None, RecvRingConfig::new(4, 100)) })
        .unwrap();
    assert_eq!(r.buf_size(), 100);
    fake.complete_datagram(WcStatus::Success, 17, 0x77).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!(m.len(), 17, "byte_len counts the GRH; the message does not");
    let src = m.source().expect("a UD message has a source");
    assert_eq!(src.qpn, 0x77);
    assert_eq!(src.gid, None, "the fake wrote no GRH");
    assert_eq!(
        m.as_slice().as_ptr() as usize % 64,
        0,
        "payload on a cache line"
    );
    drop(m);
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn a_lost_datagram_is_reported_and_the_ring_goes_on() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::ud_queue_pair(5, caps(), 64);
    let mut r = rt
        .block_on(async { RecvRing::create(&qp, None, RecvRingConfig::new(4, 100)) })
        .unwrap();
    // Too long for the buffer (the device's verdict), then a short one
    // (shorter than a GRH: a device bug), then a good one.
    fake.complete_datagram(WcStatus::LocLenErr, 0, 1).unwrap();
    fake.complete_recv(WcStatus::Success, GRH_LEN as u32 - 1)
        .unwrap();
    fake.complete_datagram(WcStatus::Success, 3, 2).unwrap();
    settle(&rt);
    let e = next_now(&mut r).unwrap().unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            RecvRingError::Completion {
                status: WcStatus::LocLenErr,
                ..
            }
        ),
        "{e}"
    );
    let e = next_now(&mut r).unwrap().unwrap().unwrap_err();
    assert!(matches!(e, RecvRingError::Length { .. }), "{e}");
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!((m.len(), m.source().unwrap().qpn), (3, 2));
    drop(m);
    assert_eq!(
        fake.outstanding_recvs(),
        4,
        "every buffer went back to the device"
    );
    // A flush still ends the ring.
    rt.block_on(async { qp.close().await.unwrap() });
    assert!(matches!(
        next_now(&mut r),
        Some(Some(Err(RecvRingError::Completion {
            status: WcStatus::WrFlushErr,
            ..
        })))
    ));
    assert!(matches!(next_now(&mut r), Some(None)));
}

#[test]
fn an_rc_ring_message_has_no_source() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(6, caps(), 64);
    let mut r = rt
        .block_on(async { RecvRing::create(&qp, None, RecvRingConfig::new(2, 8)) })
        .unwrap();
    fake.complete_recv(WcStatus::Success, 8).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!((m.len(), m.source()), (8, None));
}

#[test]
fn a_ud_queue_pair_refuses_sends_without_a_peer() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::ud_queue_pair(5, caps(), 64);
    let res = rt.block_on(qp.post_send_inline(b"x", None));
    assert!(matches!(res, Err(SubmitError::Invalid { .. })), "{res:?}");
    assert_eq!(fake.outstanding_sends(), 0);
    let remote = UdEndpoint {
        endpoint: Endpoint {
            provider: ProviderKind::Soft,
            qpn: 9,
            psn: 0,
            lid: 0,
            gid: Gid::default(),
            mtu: Mtu::Mtu4096,
            addr: crate::provider::ProviderAddr::NONE,
        },
        qkey: 1,
    };
    let e = qp.ud_peer(&remote).unwrap_err();
    assert!(e.to_string().contains("address handles"), "{e}");
}

/// Two UD queue pairs on a fresh soft device (kept alive with them), and
/// the first's address handle for the second. Call inside a runtime.
fn soft_ud_pair() -> (
    crate::device::Device,
    crate::qp::QueuePair,
    crate::qp::QueuePair,
    crate::qp::UdPeer,
) {
    use crate::provider::{Context, SoftConfig, UdAttr};
    let dev = crate::device::Device::open(
        Context::open_soft(SoftConfig::default()).expect("soft device"),
    )
    .expect("device");
    let a = dev.create_ud_qp(caps(), &UdAttr::default()).expect("a");
    let b = dev.create_ud_qp(caps(), &UdAttr::default()).expect("b");
    let peer = a
        .ud_peer(&b.ud_endpoint(0).expect("b's endpoint"))
        .expect("peer");
    (dev, a, b, peer)
}

/// An inline burst after unsignaled inline sends carries their entries in
/// its signaled last WR: they stay inline entries (lending no memory), so
/// the QP lends the device nothing while only inline sends are in flight.
/// Before, the burst moved them out of the inline entries (as an op's post
/// does) and the QP looked as if it lent memory until their completion.
#[test]
fn a_burst_keeps_the_entries_of_the_unsignaled_sends_before_it_inline() {
    use crate::qp::Datagram;

    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let (_dev, a, _b, peer) = soft_ud_pair();
        for i in 0..3u8 {
            a.post_send_inline_to(&peer, &[i], None)
                .await
                .expect("inline send");
        }
        let core = &a.inner.core;
        assert_eq!(core.unsig.get(), 4, "three unsignaled sends and a reserve");
        let payloads = [[7u8], [8u8]];
        let burst: Vec<Datagram<'_>> = payloads
            .iter()
            .map(|p| Datagram {
                peer: &peer,
                data: p,
                imm: None,
            })
            .collect();
        a.post_send_inline_burst(&burst).await.expect("burst");
        assert_eq!(core.unsig.get(), 0, "the burst's last WR took them over");
        assert_eq!(core.outstanding(), 6, "3 sends, their reserve, 2 datagrams");
        assert_eq!(
            core.outstanding_with_memory(),
            0,
            "only inline sends are in flight: no memory is lent"
        );
        a.sends_idle().await;
        assert_eq!(core.inline_entries.get(), 0);
        assert!(a.inline_send_error().is_none());
    });
}

/// The burst's try form posts when there is room, reports errors, and
/// without room posts and holds nothing, but retires the unsignaled sends
/// that hold the room (as the burst's future does when it must wait).
#[test]
fn a_burst_tried_without_room_posts_nothing_and_retires_the_unsignaled_sends() {
    use crate::qp::Datagram;

    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let (_dev, a, _b, peer) = soft_ud_pair();
        let core = &a.inner.core;
        let payloads = [[1u8], [2], [3], [4], [5]];
        let burst = |k: usize| -> Vec<Datagram<'_>> {
            payloads[..k]
                .iter()
                .map(|p| Datagram {
                    peer: &peer,
                    data: p,
                    imm: None,
                })
                .collect()
        };
        let doorbells = || crate::reactor::Handle::current().stats().doorbells;

        let before = doorbells();
        assert!(matches!(
            a.try_post_send_inline_burst(&burst(2)),
            Some(Ok(()))
        ));
        assert_eq!(doorbells() - before, 1, "posted at once, one doorbell");
        assert_eq!(core.outstanding(), 2);
        a.sends_idle().await;

        // Three unsignaled sends hold 4 of the 8 entries (with their
        // reserve): a burst of 5 finds no room.
        for i in 0..3u8 {
            a.post_send_inline_to(&peer, &[i], None)
                .await
                .expect("inline send");
        }
        assert_eq!(core.unsig.get(), 4);
        let before = doorbells();
        assert!(a.try_post_send_inline_burst(&burst(5)).is_none());
        assert_eq!(
            doorbells() - before,
            1,
            "only the WR that retires the unsignaled sends"
        );
        assert_eq!(core.unsig.get(), 0, "retired");
        assert_eq!(core.outstanding(), 4, "nothing of the burst is held");
        assert!(!core.entries.sq.has_waiters() && !core.entries.send_cq.has_waiters());
        a.sends_idle().await;
        assert!(matches!(
            a.try_post_send_inline_burst(&burst(5)),
            Some(Ok(()))
        ));
        a.sends_idle().await;

        // Errors are reported, not left to a future.
        let too_long = [0u8; 4096];
        let bad = [Datagram {
            peer: &peer,
            data: &too_long,
            imm: None,
        }];
        assert!(matches!(
            a.try_post_send_inline_burst(&bad),
            Some(Err(SubmitError::Invalid { .. }))
        ));
        a.close().await.expect("close");
        assert!(matches!(
            a.try_post_send_inline_burst(&burst(1)),
            Some(Err(SubmitError::Closed { .. }))
        ));
        assert_eq!(core.outstanding(), 0);
    });
}
