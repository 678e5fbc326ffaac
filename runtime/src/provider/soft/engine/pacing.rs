//! No pacing on connections to engines on this host.
//!
//! The kernel paces a TCP socket (holds segments back and sends them from
//! a timer at the rate it estimates) when its congestion control asks for
//! it: BBR does, and it is the host's default on some systems (this one's:
//! `net.ipv4.tcp_congestion_control = bbr`). Its estimate comes from what
//! the connection delivered, and an engine's traffic is bursts with pauses
//! (one message at a time), so the estimate is the application's rate and
//! a packet's segments past the first MiB or so (16 of loopback's 64 KiB
//! segments) wait for the pacing timer: a 1 MiB SEND one at a time cost
//! 1.3× the CPU of one of 1020 KiB, and its least latency was 1.6× as long
//! (docs/benchmarks.md, "The step at 1 MiB").
//!
//! Between two engines on one host the bytes never leave the machine:
//! there is no link whose queue pacing would keep short. Such connections
//! therefore get a congestion control that does not pace (CUBIC, else
//! Reno, which every kernel lets any process pick). Connections to other
//! hosts keep the host's choice.
//!
//! It must be chosen before the connection is established: the kernel
//! starts pacing a socket when BBR first runs on it (at the end of the
//! handshake, which on loopback completes within `connect`) and never
//! stops, whatever congestion control it is given later. So a dialing
//! socket gets it before its `connect` ([`unpace_dial`]), and the
//! listener before any connection comes in ([`unpace_listener`]): an
//! accepted connection inherits the listener's. One accepted from another
//! host gets the host's own back ([`restore_remote`]).

use std::io;
use std::net::{IpAddr, SocketAddr};

use socket2::SockRef;

/// Congestion controls tried in turn, in order, on a same-host connection
/// whose own one paces. CUBIC needs the host's permission
/// (`net.ipv4.tcp_allowed_congestion_control`, or `CAP_NET_ADMIN`); Reno
/// is always allowed.
const UNPACED: [&str; 2] = ["cubic", "reno"];

/// True if the kernel paces a socket with congestion control `name`
/// (BBR and its versions ask for pacing; the others leave it to a
/// qdisc, and loopback has none).
fn paces(name: &[u8]) -> bool {
    name.starts_with(b"bbr")
}

/// A socket's congestion control, without the kernel's NUL padding.
fn congestion(sock: &SockRef<'_>) -> io::Result<Vec<u8>> {
    let mut name = sock.tcp_congestion()?;
    name.truncate(name.iter().position(|&b| b == 0).unwrap_or(name.len()));
    Ok(name)
}

/// True if a connection from `local` to `peer` stays on this host.
fn same_host(local: IpAddr, peer: IpAddr) -> bool {
    let p = peer.to_canonical();
    p.is_loopback() || p.is_unspecified() || p == local.to_canonical()
}

/// True if the kernel routes `to` to this host (asked by connecting a UDP
/// socket, which sends nothing: the source it picks for an address of
/// this host is that address).
fn routes_here(to: SocketAddr) -> bool {
    let ip = to.ip().to_canonical();
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    std::net::UdpSocket::bind(any)
        .and_then(|u| {
            u.connect(to)?;
            u.local_addr()
        })
        .is_ok_and(|l| same_host(l.ip(), to.ip()))
}

/// If `sock`'s congestion control paces, gives it one that does not: the
/// one set (`None`: nothing needed changing) and the one it had.
fn unpace(sock: SockRef<'_>) -> io::Result<Option<(&'static str, Vec<u8>)>> {
    let current = congestion(&sock)?;
    if !paces(&current) {
        return Ok(None);
    }
    let mut last = None;
    for name in UNPACED {
        match sock.set_tcp_congestion(name.as_bytes()) {
            Ok(()) => return Ok(Some((name, current))),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no congestion control to try")))
}

/// A socket about to connect to `to`: unpaced if `to` is on this host
/// (see the module docs). Best effort: a socket left paced is logged.
pub(crate) fn unpace_dial(sock: &socket2::Socket, to: SocketAddr) {
    if !routes_here(to) {
        return;
    }
    match unpace(SockRef::from(sock)) {
        Ok(Some((cc, _))) => {
            tracing::debug!(%to, cc, "soft engine: a same-host connection is not paced")
        }
        Ok(None) => {}
        Err(e) => {
            tracing::debug!(%to, error = %crate::report::ErrorChain(&e), "soft engine: a same-host connection stays paced")
        }
    }
}

/// The engine's listener: unpaced before it accepts anything (see the
/// module docs). Returns the congestion control it had if it was changed,
/// for [`restore_remote`].
pub(crate) fn unpace_listener(listener: &mio::net::TcpListener) -> Option<Vec<u8>> {
    match unpace(SockRef::from(listener)) {
        Ok(Some((cc, had))) => {
            tracing::debug!(cc, "soft engine: connections from this host are not paced");
            Some(had)
        }
        Ok(None) => None,
        Err(e) => {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: connections from this host stay paced");
            None
        }
    }
}

/// An accepted connection from `peer`: one from another host gets back
/// the congestion control the listener had (`listener_had`, from
/// [`unpace_listener`]), the host's choice.
pub(crate) fn restore_remote(
    stream: &mio::net::TcpStream,
    peer: SocketAddr,
    listener_had: Option<&[u8]>,
) {
    let Some(had) = listener_had else {
        return;
    };
    let local = match stream.local_addr() {
        Ok(l) => l,
        Err(_) => return,
    };
    if same_host(local.ip(), peer.ip()) {
        return;
    }
    if let Err(e) = SockRef::from(stream).set_tcp_congestion(had) {
        tracing::debug!(%peer, error = %crate::report::ErrorChain(&e), "soft engine: a connection from another host keeps an unpaced congestion control");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use socket2::{Domain, Socket, Type};

    /// True if this process may give a socket BBR (the pacing congestion
    /// control) on this host; where it may not, nothing here paces.
    fn bbr_possible() -> bool {
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        s.set_tcp_congestion(b"bbr").is_ok()
    }

    /// A same-host connection made through `unpace_listener` and
    /// `unpace_dial` from sockets that would otherwise use BBR (as every
    /// socket does on a host whose default it is) uses a congestion control
    /// that does not pace, on both ends: the dialed socket its own, the
    /// accepted one the listener's.
    #[test]
    fn a_listener_and_a_dial_unpaced_first_give_unpaced_connections() {
        if !bbr_possible() {
            eprintln!("this process cannot give a socket BBR here: nothing paces; not run");
            return;
        }
        let l = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        l.set_tcp_congestion(b"bbr").expect("listener cc");
        l.bind(&"127.0.0.1:0".parse::<SocketAddr>().expect("literal").into())
            .expect("bind");
        l.listen(4).expect("listen");
        let to = l.local_addr().expect("addr").as_socket().expect("inet");
        let l = mio::net::TcpListener::from_std(l.into());
        assert_eq!(unpace_listener(&l).as_deref(), Some(&b"bbr"[..]));
        let d = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        d.set_tcp_congestion(b"bbr").expect("dial cc");
        unpace_dial(&d, to);
        d.connect(&to.into()).expect("connect");
        let (r, _) = {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                match l.accept() {
                    Ok(x) => break x,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(std::time::Instant::now() < deadline, "no connection came");
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    Err(e) => panic!("accept: {e}"),
                }
            }
        };
        for (end, cc) in [
            ("dialed", congestion(&SockRef::from(&d))),
            ("accepted", congestion(&SockRef::from(&r))),
        ] {
            let cc = cc.expect("cc");
            assert!(
                UNPACED.iter().any(|u| u.as_bytes() == cc.as_slice()),
                "the {end} end: {}",
                String::from_utf8_lossy(&cc)
            );
        }
    }

    /// The engines of two contexts on this host talk over connections that
    /// are not paced, whatever the host's default congestion control.
    #[test]
    fn the_connections_between_engines_on_one_host_are_not_paced() {
        use crate::provider::soft::drive::tests::{
            pair, post_recv, post_send, send_wr, spin_one, Mem,
        };
        use crate::provider::{AccessFlags, SendOp, WcStatus};
        let (a, b) = pair();
        let src = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
        let dst = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
        post_recv(&b.qp, 1, dst.sge(0, 64));
        post_send(&a.qp, send_wr(2, SendOp::Send, src.sge(0, 64)));
        assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
        assert_eq!(spin_one(&b.rcq).status, WcStatus::Success);
        let mut seen = 0;
        for side in [&a, &b] {
            let eng = crate::provider::soft::lock(side.ctx.core());
            for (_, c) in eng.conns.iter() {
                let Some(w) = &c.stream else { continue };
                let cc = congestion(&SockRef::from(&w.stream)).expect("cc");
                assert!(
                    !paces(&cc),
                    "a paced connection: {}",
                    String::from_utf8_lossy(&cc)
                );
                seen += 1;
            }
        }
        assert!(seen >= 2, "{seen} connections between the engines");
    }

    #[test]
    fn only_connections_that_stay_on_this_host_count_as_same_host() {
        let a = |s: &str| s.parse::<IpAddr>().expect("literal");
        assert!(same_host(a("127.0.0.1"), a("127.0.0.2")));
        assert!(same_host(a("10.0.0.1"), a("10.0.0.1")));
        assert!(same_host(a("::1"), a("::ffff:127.0.0.1")));
        assert!(same_host(a("::ffff:10.0.0.1"), a("10.0.0.1")));
        assert!(same_host(a("10.0.0.1"), a("0.0.0.0")));
        assert!(!same_host(a("10.0.0.1"), a("10.0.0.2")));
        assert!(!same_host(a("127.0.0.1"), a("10.0.0.2")));
        assert!(routes_here("127.0.0.5:9".parse().expect("literal")));
        assert!(!routes_here("192.0.2.1:9".parse().expect("literal")));
        assert!(paces(b"bbr") && paces(b"bbr3"));
        assert!(!paces(b"cubic") && !paces(b"reno"));
    }
}
