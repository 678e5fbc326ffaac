//! Dialing another engine from this engine's own IP address: the engine
//! there accepts a connection claiming an address only from that address's
//! IP (see `port.rs`), so on a host with several addresses the kernel must
//! not pick another source address.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;

use socket2::{Domain, SockAddr, Socket, Type};

/// A non-blocking TCP connect to `to`, from `local` (port 0) when `local`
/// is a specific address of `to`'s family (else from what the kernel
/// picks). The connection completes later (the socket turns writable).
pub(crate) fn dial(local: IpAddr, to: SocketAddr) -> io::Result<mio::net::TcpStream> {
    let bind_to = match (local, to) {
        (l, _) if l.is_unspecified() => None,
        (IpAddr::V4(l), SocketAddr::V4(_)) => Some(SocketAddr::new(IpAddr::V4(l), 0)),
        (IpAddr::V6(l), SocketAddr::V6(_)) => Some(SocketAddr::new(IpAddr::V6(l), 0)),
        _ => None,
    };
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    // (Before `connect`: see `pacing.rs`.)
    super::pacing::unpace_dial(&socket, to);
    if let Some(from) = bind_to {
        let one: libc::c_int = 1;
        // Best effort: the port is picked at connect time, together with the
        // destination (a bound port 0 would reserve a port for every
        // destination). Without it (old kernels) bind picks one.
        // SAFETY: `one` is a live c_int of the size passed; the socket is open.
        unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        socket.bind(&SockAddr::from(from))?;
    }
    match socket.connect(&SockAddr::from(to)) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(mio::net::TcpStream::from_std(socket.into()))
}

/// This engine's address as the peer across `stream` knows it: the bound
/// address, or, when the engine is bound to the unspecified address, the
/// connection's local IP (the one this host uses towards that peer) with
/// the engine's port. What a HELLO or VERIFY on `stream` claims.
pub(crate) fn identity_on(bound: SocketAddr, stream: &mio::net::TcpStream) -> SocketAddr {
    if !bound.ip().is_unspecified() {
        return bound;
    }
    match stream.local_addr() {
        Ok(l) => SocketAddr::new(l.ip().to_canonical(), bound.port()),
        Err(_) => bound,
    }
}

/// A peer engine's address as one to connect to: the unspecified address
/// (an engine on this host bound to it, named in an endpoint exchanged
/// without a handshake) is this host's loopback address of that family,
/// the address its connections then come from and claim.
pub(crate) fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        IpAddr::V6(v6) if v6.is_unspecified() => {
            SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    }
}

/// Is `addr` this engine's own address (`bound`)? An engine bound to the
/// unspecified address is also itself on loopback.
pub(crate) fn is_own(bound: SocketAddr, addr: SocketAddr) -> bool {
    let (b, a) = (bound.ip().to_canonical(), addr.ip().to_canonical());
    bound.port() == addr.port() && (a == b || (b.is_unspecified() && a.is_loopback()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dial_leaves_from_the_given_address() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let to = l.local_addr().expect("addr");
        let s = dial("127.0.0.1".parse().expect("literal"), to).expect("dial");
        let (_, from) = l.accept().expect("accept");
        assert_eq!(from.ip(), "127.0.0.1".parse::<IpAddr>().expect("literal"));
        // (Another loopback address, where the kernel would have picked
        // 127.0.0.1.)
        let s2 = dial("127.0.0.2".parse().expect("literal"), to).expect("dial");
        let (_, from2) = l.accept().expect("accept");
        assert_eq!(from2.ip(), "127.0.0.2".parse::<IpAddr>().expect("literal"));
        drop((s, s2));
        let refused = dial(
            "127.0.0.1".parse().expect("literal"),
            "127.0.0.1:1".parse().unwrap(),
        );
        // A refused connect is reported later (the socket is non-blocking)
        // or at once; either way it is not a panic.
        drop(refused);
    }

    #[test]
    fn an_engine_on_the_unspecified_address_is_known_by_each_connections_own_ip() {
        let l = std::net::TcpListener::bind("127.0.0.2:0").expect("bind");
        let to = l.local_addr().expect("addr");
        let s = dial("0.0.0.0".parse().expect("literal"), to).expect("dial");
        let any: SocketAddr = "0.0.0.0:4791".parse().expect("literal");
        // (Loopback towards 127.0.0.2: the kernel's source is 127.0.0.1.)
        let seen = identity_on(any, &s);
        assert_eq!(seen.port(), 4791);
        assert!(
            seen.ip().is_loopback() && !seen.ip().is_unspecified(),
            "{seen}"
        );
        let (_, from) = l.accept().expect("accept");
        assert_eq!(seen.ip(), from.ip(), "the claim is the dial's source IP");
        // A bound engine is known by its address whatever the connection.
        let bound: SocketAddr = "127.0.0.3:4791".parse().expect("literal");
        assert_eq!(identity_on(bound, &s), bound);
    }

    #[test]
    fn the_unspecified_address_is_reached_on_loopback_and_is_our_own() {
        let a = |s: &str| s.parse::<SocketAddr>().expect("literal");
        assert_eq!(reachable(a("0.0.0.0:7")), a("127.0.0.1:7"));
        assert_eq!(reachable(a("[::]:7")), a("[::1]:7"));
        assert_eq!(reachable(a("10.0.0.1:7")), a("10.0.0.1:7"));
        assert!(is_own(a("0.0.0.0:7"), a("127.0.0.1:7")));
        assert!(is_own(a("10.0.0.1:7"), a("[::ffff:10.0.0.1]:7")));
        assert!(!is_own(a("0.0.0.0:7"), a("127.0.0.1:8")));
        assert!(!is_own(a("0.0.0.0:7"), a("10.0.0.1:7")));
        assert!(!is_own(a("127.0.0.1:7"), a("127.0.0.2:7")));
    }
}
