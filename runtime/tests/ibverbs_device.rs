//! ibverbs provider: device discovery, queries, MRs, async events and the
//! no-device path. Runs against a real device (the rxe VM:
//! `scripts/rxe-test.sh`); prints SKIPPED without one.
#![cfg(feature = "ibverbs")]

mod ibverbs_support;

use ibverbs_support::{device, gid_index};
use verbio_runtime::provider::{
    self, ibverbs, AccessFlags, Context, DeviceInfo, LinkLayer, PortState, ProviderError,
    ProviderKind,
};

#[test]
fn no_device_is_a_clean_error() {
    match ibverbs::devices() {
        Err(ProviderError::NoDevice { reason }) => {
            assert!(!reason.is_empty());
            // Opening by name reports the same, without crashing.
            let err = ibverbs::Context::open("rxe0").expect_err("no device to open");
            assert!(
                matches!(err, ProviderError::NoDevice { .. }),
                "unexpected {err:?}"
            );
            // The aggregate list still has the software device, and nothing else.
            let all = provider::devices().expect("devices");
            assert_eq!(all.len(), 1, "{all:?}");
            assert_eq!(all[0].kind, ProviderKind::Soft);
        }
        Err(other) => panic!("expected NoDevice, got {other:?}"),
        Ok(list) => {
            assert!(!list.is_empty(), "Ok with an empty list");
            println!("SKIPPED: no_device_is_a_clean_error: ibverbs devices present: {list:?}");
        }
    }
}

#[test]
fn unknown_name_is_device_not_found() {
    let err = Context::open(&DeviceInfo {
        name: "no_such_rdma_dev".into(),
        kind: ProviderKind::Ibverbs,
        guid: 0,
    })
    .expect_err("bogus device opened");
    match err {
        ProviderError::DeviceNotFound { name, .. } => assert_eq!(name, "no_such_rdma_dev"),
        ProviderError::NoDevice { .. } => {} // no devices at all on this host
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn queries_device_port_and_gids() {
    let Some(ctx) = device("queries_device_port_and_gids") else {
        return;
    };
    assert_eq!(ctx.kind(), ProviderKind::Ibverbs);
    let listed = provider::devices().expect("devices");
    assert!(listed
        .iter()
        .any(|d| d.name == ctx.name() && d.kind == ProviderKind::Ibverbs));

    let dev = ctx.query_device().expect("query_device");
    assert!(dev.phys_port_cnt >= 1);
    assert!(dev.max_qp > 0 && dev.max_cqe > 0 && dev.max_sge > 0);
    let port = ctx.query_port(1).expect("query_port");
    assert_eq!(port.state, PortState::Active);
    assert!(port.gid_tbl_len > 0);
    assert!(port.active_mtu <= port.max_mtu);
    assert!(
        ctx.query_port(dev.phys_port_cnt + 1).is_err(),
        "port beyond the last"
    );

    let ib = ctx.as_ibverbs().expect("ibverbs context");
    let table = ib.gid_table(1).expect("gid_table");
    assert!(!table.is_empty(), "no GIDs on port 1");
    for e in &table {
        // The table (ibv_query_gid_table) agrees with sysfs / ibv_query_gid.
        assert_eq!(
            ib.gid_type(1, e.index).expect("gid_type"),
            e.gid_type,
            "{e:?}"
        );
        assert_eq!(ctx.query_gid(1, e.index).expect("query_gid"), e.gid);
    }
    let idx = gid_index(&ctx);
    let gid = ctx.query_gid(1, u32::from(idx)).expect("query_gid");
    assert!(!gid.is_zero());
    let entry = table
        .iter()
        .find(|e| e.index == u32::from(idx))
        .expect("chosen GID index is in the table");
    assert_eq!(entry.gid, gid);
    if port.link_layer == LinkLayer::Ethernet {
        // The default prefers RoCE v2 (rxe has one at index 1: ::ffff:10.77.0.1).
        let default = ctx.default_gid_index(1).expect("default_gid_index");
        let chosen = table
            .iter()
            .find(|e| u32::from(default) == e.index)
            .unwrap();
        assert_eq!(chosen.gid_type, ibverbs::GidType::RoceV2, "{table:?}");
        if let Ok(want) = std::env::var("RXE_GID_INDEX") {
            if std::env::var(ibverbs::GID_INDEX_ENV).is_err() {
                assert_eq!(default.to_string(), want);
            }
        }
    }
    println!(
        "{}: {} fw {} ports {} link {:?} mtu {:?}; GIDs: {}",
        ctx.name(),
        ib.transport(),
        dev.fw_ver,
        dev.phys_port_cnt,
        port.link_layer,
        port.active_mtu,
        table
            .iter()
            .map(|e| format!("[{}] {} {}", e.index, e.gid, e.gid_type))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

#[test]
fn registers_memory_and_rejects_bad_regions() {
    let Some(ctx) = device("registers_memory_and_rejects_bad_regions") else {
        return;
    };
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mut mem = vec![0u8; 8192];
    // SAFETY: `mem` outlives the MR (dropped at the end of the scope after it).
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), mem.len(), AccessFlags::ALL) }.expect("reg_mr");
    assert_eq!(mr.addr(), mem.as_ptr() as u64);
    assert_eq!(mr.len(), 8192);
    assert_eq!(mr.access(), AccessFlags::ALL);
    assert_ne!(mr.lkey(), 0);
    // SAFETY: as above.
    let mr2 = unsafe { pd.reg_mr(mem.as_mut_ptr(), 4096, AccessFlags::LOCAL_WRITE) }
        .expect("second reg_mr of the same memory");
    assert_ne!(mr.lkey(), mr2.lkey());
    // Remote write without local write is invalid in verbs.
    // SAFETY: as above; the call is expected to fail.
    let err = unsafe { pd.reg_mr(mem.as_mut_ptr(), 4096, AccessFlags::REMOTE_WRITE) }
        .expect_err("REMOTE_WRITE without LOCAL_WRITE");
    match err {
        ProviderError::Verbs { call, source } => {
            assert_eq!(call, "ibv_reg_mr");
            assert!(source.raw_os_error().is_some());
        }
        other => panic!("unexpected {other:?}"),
    }
    drop(mr2);
    drop(mr);
    drop(mem);
}

#[test]
fn async_events_never_block() {
    let Some(ctx) = device("async_events_never_block") else {
        return;
    };
    let fd = ctx.async_fd();
    assert!(fd >= 0);
    // SAFETY: fcntl on the context's fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert!(flags & libc::O_NONBLOCK != 0, "async fd is blocking");
    // Nothing happened on a fresh context: returns at once.
    let t = std::time::Instant::now();
    while let Some(ev) = ctx.get_async_event().expect("get_async_event") {
        println!("async event: {ev:?}");
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
}

#[test]
fn open_device_prefers_an_active_ibverbs_port() {
    let Some(ctx) = device("open_device_prefers_an_active_ibverbs_port") else {
        return;
    };
    let by_name = provider::open_device(Some(ctx.name())).expect("open_device by name");
    assert_eq!(
        (by_name.kind(), by_name.name()),
        (ProviderKind::Ibverbs, ctx.name())
    );
    if std::env::var(provider::DEVICE_ENV).is_ok() {
        println!("SKIPPED: automatic choice: {} is set", provider::DEVICE_ENV);
        return;
    }
    // rxe0's port is active, so the automatic choice is hardware, not soft0.
    let auto = provider::open_device(None).expect("open_device(None)");
    assert_eq!(auto.kind(), ProviderKind::Ibverbs);
}
