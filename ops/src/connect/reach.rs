//! The loopback check of the handshake: a software-device peer whose engine
//! listens on a loopback address can only be reached from its own host.

use std::net::{IpAddr, SocketAddr};

use verbio_runtime::provider::Endpoint;

use super::error::HandshakeError;

/// True if `peer` (the other side of a TCP connection whose local end is
/// `local`) is on this host: a loopback address, or this host's own address.
pub fn peer_is_local(peer: IpAddr, local: IpAddr) -> bool {
    let canonical = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (peer, local) = (canonical(peer), canonical(local));
    peer.is_loopback() || peer == local
}

/// `local` as the peer across a TCP connection whose local end is `tcp`
/// is told it: a software-device engine bound to the unspecified address
/// is announced at `tcp`'s IP (the one this host uses towards that peer,
/// so also the source of the engine's own connections to it) with the
/// engine's port. Anything else is announced as it is.
pub fn advertised(local: Endpoint, tcp: SocketAddr) -> Endpoint {
    local.announced_over(tcp)
}

/// Refuses `remote` (announced by the peer at `peer` over a TCP connection
/// whose local end is `local`) if it is a software-device endpoint on a
/// loopback address while the peer is on another host.
pub fn check_engine_reachable(
    remote: &Endpoint,
    peer: SocketAddr,
    local: SocketAddr,
) -> Result<(), HandshakeError> {
    match remote.addr.to_socket() {
        Some(engine) if engine.ip().is_loopback() && !peer_is_local(peer.ip(), local.ip()) => {
            tracing::warn!(%engine, %peer, "soft peer announced a loopback engine from another host");
            Err(HandshakeError::UnreachableEngine {
                engine,
                host: peer.ip(),
            })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verbio_runtime::provider::{Gid, Mtu, ProviderKind};

    fn soft(engine: &str) -> Endpoint {
        Endpoint {
            provider: ProviderKind::Soft,
            qpn: 5,
            psn: 1,
            lid: 0,
            gid: Gid([0; 16]),
            mtu: Mtu::Mtu1024,
            addr: engine.parse::<SocketAddr>().unwrap().into(),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_engine_on_the_unspecified_address_is_announced_at_the_handshakes_ip() {
        let tcp = addr("10.0.0.1:40000");
        assert_eq!(
            advertised(soft("0.0.0.0:4791"), tcp).addr.to_socket(),
            Some(addr("10.0.0.1:4791"))
        );
        assert_eq!(
            advertised(soft("[::]:4791"), addr("[::ffff:10.0.0.1]:1"))
                .addr
                .to_socket(),
            Some(addr("10.0.0.1:4791"))
        );
        assert_eq!(
            advertised(soft("[::]:4791"), addr("[fd00::1]:1"))
                .addr
                .to_socket(),
            Some(addr("[fd00::1]:4791"))
        );
        // An IPv4-only engine over IPv6: left as it is (the peer refuses it).
        assert_eq!(
            advertised(soft("0.0.0.0:4791"), addr("[fd00::1]:1"))
                .addr
                .to_socket(),
            Some(addr("0.0.0.0:4791"))
        );
        // A bound engine is announced as it is.
        assert_eq!(
            advertised(soft("10.0.0.9:4791"), tcp).addr.to_socket(),
            Some(addr("10.0.0.9:4791"))
        );
        // What is announced passes the checks a peer makes.
        crate::connect::handshake::validate(&advertised(soft("0.0.0.0:4791"), tcp)).unwrap();
    }

    #[test]
    fn a_loopback_engine_is_refused_only_from_another_host() {
        let lo = soft("127.0.0.1:4791");
        let here = addr("10.0.0.1:7000");
        let e = check_engine_reachable(&lo, addr("10.0.0.2:5000"), here).unwrap_err();
        assert!(
            matches!(e, HandshakeError::UnreachableEngine { host, .. } if host == addr("10.0.0.2:1").ip()),
            "{e}"
        );
        assert!(e.to_string().contains("127.0.0.1:4791"), "{e}");
        // Same host: over loopback, or over this host's own address.
        check_engine_reachable(&lo, addr("127.0.0.1:5000"), addr("127.0.0.1:7000")).unwrap();
        check_engine_reachable(&lo, addr("10.0.0.1:5000"), here).unwrap();
        check_engine_reachable(&lo, addr("[::ffff:10.0.0.1]:5000"), here).unwrap();
        check_engine_reachable(&soft("[::1]:4791"), addr("[::1]:5000"), addr("[::1]:1")).unwrap();
        assert!(check_engine_reachable(
            &soft("[::1]:4791"),
            addr("[fe80::2]:5000"),
            addr("[fe80::1]:1")
        )
        .is_err());
        // A routable engine, or a hardware endpoint, is never refused here.
        check_engine_reachable(&soft("10.0.0.2:4791"), addr("10.0.0.2:5000"), here).unwrap();
        let hw = Endpoint {
            provider: ProviderKind::Ibverbs,
            addr: verbio_runtime::provider::ProviderAddr::NONE,
            ..lo
        };
        check_engine_reachable(&hw, addr("10.0.0.2:5000"), here).unwrap();
    }
}
