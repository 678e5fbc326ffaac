use super::*;

fn os(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

#[test]
fn accept_errors_are_sorted_into_connection_resources_and_listener() {
    for code in [
        libc::ECONNABORTED,
        libc::EPROTO,
        libc::EPERM,
        libc::ENETUNREACH,
    ] {
        assert_eq!(classify(&os(code)), ErrorClass::Connection, "{code}");
    }
    for code in [
        libc::EMFILE,
        libc::ENFILE,
        libc::ENOBUFS,
        libc::ENOMEM,
        libc::ENOSPC,
    ] {
        assert_eq!(classify(&os(code)), ErrorClass::Resources, "{code}");
    }
    for code in [libc::EBADF, libc::EINVAL, libc::ENOTSOCK] {
        assert_eq!(classify(&os(code)), ErrorClass::Listener, "{code}");
    }
    assert_eq!(
        classify(&io::Error::other("unknown")),
        ErrorClass::Resources
    );
}

fn peer(ip: &str) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), 5000)
}

#[test]
fn pending_limits_cap_the_total_and_each_source() {
    let limits = PendingLimits::new("test", 3, 2);
    let a1 = limits.admit(peer("10.0.0.1")).expect("first from a");
    let a2 = limits.admit(peer("10.0.0.1")).expect("second from a");
    assert_eq!(
        limits.admit(peer("10.0.0.1")).unwrap_err(),
        PendingRefusal::Source {
            source_ip: "10.0.0.1".parse().unwrap(),
            limit: 2
        }
    );
    // An IPv4-mapped IPv6 address is the same source.
    assert!(matches!(
        limits.admit(peer("::ffff:10.0.0.1")),
        Err(PendingRefusal::Source { .. })
    ));
    let b1 = limits.admit(peer("10.0.0.2")).expect("first from b");
    assert!(!limits.has_room());
    assert_eq!(
        limits.admit(peer("10.0.0.3")).unwrap_err(),
        PendingRefusal::Listener { limit: 3 }
    );
    drop(a1);
    assert!(limits.has_room());
    let a3 = limits.admit(peer("10.0.0.1")).expect("a slot freed");
    drop((a2, a3, b1));
    assert_eq!(limits.pending(), 0);
    assert!(
        limits.counts.borrow().per_source.is_empty(),
        "no source kept without a slot"
    );
}
