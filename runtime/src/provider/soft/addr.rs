//! The software device's endpoint address: the socket address of the
//! engine that owns the QP, stored with [`ProviderAddr::socket`]. What
//! makes one a peer can connect to, and how an engine bound to the
//! unspecified address is announced.

use std::net::{IpAddr, SocketAddr};

use crate::provider::addr::{invalid, InvalidEndpoint};
use crate::provider::{Endpoint, ProviderAddr};

/// A soft-device endpoint carries its engine's socket address, with a port
/// and an IP one can connect to.
pub(crate) fn check_endpoint(ep: &Endpoint) -> Result<(), InvalidEndpoint> {
    if ep.addr.is_empty() {
        return invalid("addr", 0, "a soft-device endpoint needs its engine address");
    }
    let Some(a) = ep.addr.to_socket() else {
        return invalid(
            "addr",
            ep.addr.len() as u64,
            "not a socket address (family 4 or 6, port, IP)",
        );
    };
    if a.port() == 0 {
        return invalid("addr.port", 0, "engine port 0");
    }
    let broadcast = matches!(a.ip(), IpAddr::V4(v4) if v4.is_broadcast());
    if a.ip().is_unspecified() || broadcast {
        return invalid("addr.ip", 0, "engine address cannot be connected to");
    }
    Ok(())
}

/// `addr` as announced over a TCP connection whose local end is `tcp`: an
/// engine bound to the unspecified address at `tcp`'s IP (the one this
/// host uses towards that peer, so also the source the engine dials it
/// from and the IP it claims there) with the engine's port. Anything else,
/// and an IPv4-only engine over IPv6, as it is.
pub(crate) fn announced_addr(addr: ProviderAddr, tcp: SocketAddr) -> ProviderAddr {
    let Some(engine) = addr.to_socket().filter(|a| a.ip().is_unspecified()) else {
        return addr;
    };
    let ip = tcp.ip().to_canonical();
    // (An engine on 0.0.0.0 takes IPv4 only; one on `::` takes both.)
    if engine.is_ipv4() && !ip.is_ipv4() {
        return addr;
    }
    ProviderAddr::socket(SocketAddr::new(ip, engine.port()))
}
