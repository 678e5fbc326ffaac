//! The engine's port, where other engines connect: admitting connections
//! (caps per engine and per source IP, a back-off when `accept` fails),
//! proving which engine a connection belongs to, and closing connections
//! whose handshake or idleness outlived their deadline.
//!
//! Proof of an address. A connection this engine accepted announces its
//! engine's listener address in its HELLO. The claim is refused unless the
//! claimed IP is the connection's source IP; then this engine dials the
//! claimed address (a "verifier" connection) and asks the engine listening
//! there (VERIFY) whether the connection from that source address and port
//! to this engine's listener is its own. Only the engine that made the
//! connection answers yes (a TCP connection's addresses are unique), so a
//! program that connects first and claims another engine's address is
//! refused, and the real engine's connection is proven independently. Until
//! then the connection's packets wait (in its socket) and nothing is sent
//! on it but this engine's HELLO. A connection this engine dialed is taken
//! to reach the engine it dialed once that engine's HELLO names the dialed
//! address.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::super::conn::{Auth, Conn, BIG_BUF_KEEP};
use super::super::handshake::{encode, next_message, Message};
use super::Engine;
use crate::accept_error::{
    classify as classify_accept_error, ErrorClass as AcceptErrorClass, ACCEPT_BACKOFF_MAX,
    ACCEPT_BACKOFF_MIN,
};
use crate::provider::{QpState, QpType, SoftConfig};

/// Logs a peer's refusal: a warning at most once a second (with how many
/// were logged at debug level only since the last one), every one at debug
/// level, so a flood of bad peers cannot flood the log.
macro_rules! refusal {
    ($port:expr, $($field:tt)*) => {
        match $port.may_warn() {
            Some(quiet) => tracing::warn!(quiet_since_last = quiet, $($field)*),
            None => tracing::debug!($($field)*),
        }
    };
}

/// How often a peer's refusal is a warning.
const WARN_EVERY: Duration = Duration::from_secs(1);

/// The limits of an engine's port (from [`SoftConfig`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PortLimits {
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    /// The bound on noticing a dead peer engine (see `liveness.rs`).
    pub peer_timeout: Duration,
}

impl PortLimits {
    pub fn of(config: &SoftConfig) -> PortLimits {
        PortLimits {
            handshake_timeout: config.handshake_timeout,
            idle_timeout: config.idle_timeout,
            max_connections: config.max_connections,
            max_connections_per_ip: config.max_connections_per_ip,
            peer_timeout: config.peer_timeout,
        }
    }
}

/// What an engine's port holds and what it refused (see
/// [`Context::port_stats`](super::super::Context::port_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortStats {
    /// Open connections to other engines (accepted and dialed).
    pub connections: usize,
    /// Of those, connections whose engine is not proven yet.
    pub unproven: usize,
    /// Bytes of receive and transmit buffer the connections hold.
    pub buffered_bytes: usize,
    /// Connections refused at once: the caps per engine or per IP.
    pub refused: u64,
    /// Connections closed for a bad handshake: malformed or unexpected
    /// packets before the proof, a claim of an address that is not theirs.
    pub bad_handshakes: u64,
    /// Connections closed because their handshake outlived its deadline.
    pub handshake_timeouts: u64,
    /// Proven connections closed after their idle deadline.
    pub idle_closed: u64,
    /// Packets dropped because they named a QP whose peer is another
    /// engine than the connection's (or, for a payload still arriving, no
    /// QP at all: dropped as it arrives, never buffered).
    pub foreign_packets: u64,
    /// Failed `accept` calls (EMFILE, ENFILE, ENOMEM, ...).
    pub accept_errors: u64,
}

/// The port's state, part of the engine's.
pub(crate) struct Port {
    limits: PortLimits,
    /// Accepted connections open per source IP.
    per_ip: HashMap<IpAddr, usize>,
    accepted: usize,
    /// Refusals of the current burst were logged.
    cap_logged: bool,
    /// `accept` failed: when to try again.
    accept_retry: Option<Instant>,
    accept_backoff: Duration,
    /// Failures of the current burst.
    accept_failures: u64,
    /// When the next connection's deadline may fall.
    next_sweep: Option<Instant>,
    next_serial: u64,
    /// Connections proven since the last loop turn: their waiting input is
    /// handled then.
    resume: Vec<usize>,
    stats: PortStats,
    /// When a refusal was last a warning, and how many were not since.
    warned: Option<Instant>,
    quiet: u64,
}

/// The canonical form of an IP (IPv4-mapped IPv6 as IPv4).
fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// The same engine address (IPv4 and IPv4-mapped IPv6 are the same).
pub(crate) fn same_addr(a: SocketAddr, b: SocketAddr) -> bool {
    canonical(a.ip()) == canonical(b.ip()) && a.port() == b.port()
}

/// May a connection from `src` claim an engine address with IP `claimed`?
/// Only from that IP (an engine listening on the unspecified address is
/// reached on, and connects from, a loopback address).
fn may_claim(claimed: IpAddr, src: IpAddr) -> bool {
    let (claimed, src) = (canonical(claimed), canonical(src));
    claimed == src || (claimed.is_unspecified() && src.is_loopback())
}

impl Port {
    pub fn new(limits: PortLimits) -> Port {
        Port {
            limits,
            per_ip: HashMap::new(),
            accepted: 0,
            cap_logged: false,
            accept_retry: None,
            accept_backoff: ACCEPT_BACKOFF_MIN,
            accept_failures: 0,
            next_sweep: None,
            next_serial: 1,
            resume: Vec::new(),
            stats: PortStats::default(),
            warned: None,
            quiet: 0,
        }
    }

    /// A serial for a new connection.
    pub fn serial(&mut self) -> u64 {
        self.next_serial += 1;
        self.next_serial
    }

    /// The port needs the engine awake by this time (a deadline, a retry of
    /// `accept`).
    pub fn wake_at(&self) -> Option<Instant> {
        match (self.next_sweep, self.accept_retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub(super) fn sweep_by(&mut self, t: Instant) {
        self.next_sweep = Some(self.next_sweep.map_or(t, |s| s.min(t)));
    }

    /// May a refusal be a warning now? `Some(n)`: yes, and `n` were not
    /// since the last one.
    pub fn may_warn(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .warned
            .is_some_and(|t| now.duration_since(t) < WARN_EVERY)
        {
            self.quiet += 1;
            return None;
        }
        self.warned = Some(now);
        Some(std::mem::take(&mut self.quiet))
    }

    /// A packet for a QP of another engine was dropped.
    pub fn foreign_packet(&mut self) {
        self.stats.foreign_packets += 1;
    }
}

/// Outcome of one handshake message.
enum Step {
    /// Go on.
    Go,
    /// Refuse the connection (a bad handshake).
    Refuse,
    /// The connection did its job; close it.
    Finished,
}

/// Outcome of reading handshake packets.
pub(super) enum Handshake {
    /// Proven now: what follows is ordinary traffic.
    Proven,
    /// Wait (for more bytes, or for the proof).
    Wait,
    /// Close the connection.
    Close,
}

impl Engine {
    /// Accepts what waits on the listener, within the caps. A failing
    /// `accept` (out of file descriptors or memory) pauses accepting, with
    /// a growing pause, instead of stopping the engine; the first failure
    /// of a burst is logged, and the recovery.
    pub(super) fn accept_all(&mut self) {
        let now = Instant::now();
        if self.port.accept_retry.is_some_and(|t| now < t) {
            return;
        }
        self.port.accept_retry = None;
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    if self.port.accept_failures > 0 {
                        tracing::info!(
                            failures = self.port.accept_failures,
                            "soft engine: accepting connections again"
                        );
                        self.port.accept_failures = 0;
                        self.port.accept_backoff = ACCEPT_BACKOFF_MIN;
                    }
                    self.admit(stream, from, now);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // The connection failed in the backlog: the next one.
                Err(e) if classify_accept_error(&e) == AcceptErrorClass::Connection => {}
                // Out of descriptors or memory (or, never expected, the
                // listener itself broken): the connections wait in the
                // backlog; retry after a pause (a timer: the listener is
                // edge-triggered, no new readiness comes for them).
                Err(e) => {
                    self.port.stats.accept_errors += 1;
                    if self.port.accept_failures == 0 {
                        tracing::warn!(
                            error = %crate::report::ErrorChain(&e),
                            "soft engine: accept failed; retrying with a growing pause (up to {:?}) until it works",
                            ACCEPT_BACKOFF_MAX
                        );
                    }
                    self.port.accept_failures += 1;
                    let pause = self.port.accept_backoff;
                    self.port.accept_backoff = (pause * 2).min(ACCEPT_BACKOFF_MAX);
                    self.port.accept_retry = Some(now + pause);
                    return;
                }
            }
        }
    }

    /// Takes an accepted connection in, or closes it at once if a cap is
    /// reached.
    fn admit(&mut self, stream: mio::net::TcpStream, from: SocketAddr, now: Instant) {
        let ip = canonical(from.ip());
        let lim = self.port.limits;
        let per_ip = self.port.per_ip.get(&ip).copied().unwrap_or(0);
        if self.port.accepted >= lim.max_connections || per_ip >= lim.max_connections_per_ip {
            self.port.stats.refused += 1;
            if !self.port.cap_logged {
                self.port.cap_logged = true;
                tracing::warn!(
                    %ip,
                    from_ip = per_ip,
                    total = self.port.accepted,
                    max_connections = lim.max_connections,
                    max_connections_per_ip = lim.max_connections_per_ip,
                    "soft engine: connection limit reached, refusing connections (logged once per burst)"
                );
            }
            // (Dropping the stream closes it.)
            return;
        }
        self.port.cap_logged = false;
        let serial = self.port.serial();
        let local = super::dial::identity_on(self.sh.addr, &stream);
        super::pacing::restore_remote(&stream, from, self.listener_cc.as_deref());
        match self.insert_conn(stream, |w| Conn::accepted(w, local, from, serial)) {
            Ok(cid) => {
                tracing::trace!(%from, "soft engine: accepted");
                *self.port.per_ip.entry(ip).or_insert(0) += 1;
                self.port.accepted += 1;
                self.port.sweep_by(now + lim.handshake_timeout);
                self.activate(cid);
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::ErrorChain(&e), "soft engine: register failed")
            }
        }
    }

    /// The bound on noticing a dead peer engine (see `liveness.rs`).
    pub(super) fn peer_timeout(&self) -> Duration {
        self.port.limits.peer_timeout
    }

    /// A connection was dialed: its handshake has a deadline.
    pub(super) fn port_dialed(&mut self) {
        self.port
            .sweep_by(Instant::now() + self.port.limits.handshake_timeout);
    }

    /// Forgets a closed connection's share of the caps; a verifier's end
    /// (before its answer) fails the connection it was to prove.
    pub(super) fn port_closed(&mut self, conn: &Conn) {
        if let Some(src) = conn.src {
            let ip = canonical(src.ip());
            if let Some(n) = self.port.per_ip.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.port.per_ip.remove(&ip);
                }
            }
            self.port.accepted -= 1;
        }
        if let Auth::Verifier { of, serial } = conn.auth {
            let waiting = self
                .conns
                .get(of)
                .is_some_and(|c| c.serial == serial && c.auth == Auth::Proving);
            if waiting {
                refusal!(self.port,
                    claimed = ?conn.peer,
                    "soft engine: the engine at a claimed address could not be asked; closing the claiming connection"
                );
                self.port.stats.bad_handshakes += 1;
                self.close(of);
            }
        }
    }

    /// Reads the handshake packets of an unproven connection from its
    /// receive buffer.
    pub(super) fn handshake_rx(&mut self, cid: usize) -> Handshake {
        let Some(conn) = self.conns.get_mut(cid) else {
            return Handshake::Close;
        };
        let rx = std::mem::take(&mut conn.rx);
        let (mut start, end) = (conn.rx_start, conn.rx_end);
        let mut out = Handshake::Wait;
        loop {
            let Some(conn) = self.conns.get(cid) else {
                out = Handshake::Close;
                break;
            };
            if conn.proven() {
                out = Handshake::Proven;
                break;
            }
            if conn.auth == Auth::Proving {
                break;
            }
            let Some(expect) = conn.auth.expect(conn.got_hello) else {
                // Answered: nothing may follow.
                if start < end {
                    tracing::debug!("soft engine: bytes after a VERIFY, closing");
                    self.port.stats.bad_handshakes += 1;
                    out = Handshake::Close;
                }
                break;
            };
            let src = conn.src.or(conn.peer);
            match next_message(expect, &rx[start..end]) {
                Ok(None) => break,
                Ok(Some((msg, used))) => {
                    start += used;
                    match self.on_handshake(cid, msg) {
                        Step::Go => {}
                        Step::Refuse => {
                            self.port.stats.bad_handshakes += 1;
                            out = Handshake::Close;
                            break;
                        }
                        Step::Finished => {
                            out = Handshake::Close;
                            break;
                        }
                    }
                }
                Err(e) => {
                    refusal!(self.port,
                        src = ?src,
                        error = %crate::report::ErrorChain(&e),
                        "soft engine: bad handshake, closing connection"
                    );
                    self.port.stats.bad_handshakes += 1;
                    out = Handshake::Close;
                    break;
                }
            }
        }
        if let Some(conn) = self.conns.get_mut(cid) {
            if start == end {
                start = 0;
                conn.rx_end = 0;
            }
            conn.rx = rx;
            conn.rx_start = start;
            conn.rx_need = 0;
            if matches!(out, Handshake::Proven) {
                // (Grows the buffers now that `rx` is back.)
                conn.prove();
            }
        }
        out
    }

    /// Handles one handshake message.
    fn on_handshake(&mut self, cid: usize, msg: Message) -> Step {
        let Some(conn) = self.conns.get_mut(cid) else {
            return Step::Refuse;
        };
        match (conn.auth, msg) {
            (Auth::Dialed, Message::Hello(addr)) => {
                if !conn.peer.is_some_and(|p| same_addr(p, addr)) {
                    refusal!(self.port, dialed = ?conn.peer, hello = %addr, "soft engine: the dialed engine announces another address, closing");
                    return Step::Refuse;
                }
                conn.got_hello = true;
                conn.auth = Auth::Proven;
                self.port
                    .sweep_by(Instant::now() + self.port.limits.idle_timeout);
                Step::Go
            }
            (Auth::Accepted, Message::Hello(addr)) => {
                if self.on_claim(cid, addr) {
                    Step::Go
                } else {
                    Step::Refuse
                }
            }
            (Auth::Accepted, Message::Verify { asker, src }) => {
                let yes = self.answer_verify(cid, asker, src);
                let Some(conn) = self.conns.get_mut(cid) else {
                    return Step::Refuse;
                };
                conn.tx
                    .extend_from_slice(&encode(Message::VerifyReply(yes)));
                conn.auth = Auth::Answered;
                self.activate(cid);
                Step::Go
            }
            (Auth::Verifier { .. }, Message::Hello(addr)) if !conn.got_hello => {
                if !conn.peer.is_some_and(|p| same_addr(p, addr)) {
                    refusal!(self.port, dialed = ?conn.peer, hello = %addr, "soft engine: the engine asked announces another address");
                    return Step::Refuse;
                }
                conn.got_hello = true;
                Step::Go
            }
            (Auth::Verifier { of, serial }, Message::VerifyReply(yes)) => {
                let claimed = conn.peer;
                let waiting = self
                    .conns
                    .get(of)
                    .is_some_and(|c| c.serial == serial && c.auth == Auth::Proving);
                if waiting {
                    if yes {
                        self.proved(of);
                    } else {
                        refusal!(self.port,
                            claimed = ?claimed,
                            src = ?self.conns.get(of).and_then(|c| c.src),
                            "soft engine: the engine at the claimed address disowns the connection, closing it"
                        );
                        self.port.stats.bad_handshakes += 1;
                        self.close(of);
                    }
                }
                // The verifier's job is done (closing it is not an error).
                if let Some(c) = self.conns.get_mut(cid) {
                    c.auth = Auth::Answered;
                }
                Step::Finished
            }
            (auth, msg) => {
                refusal!(
                    self.port,
                    ?auth,
                    ?msg,
                    "soft engine: unexpected handshake packet"
                );
                Step::Refuse
            }
        }
    }

    /// An accepted connection's HELLO claims `addr`: checked against its
    /// source, then asked of the engine at `addr`.
    fn on_claim(&mut self, cid: usize, addr: SocketAddr) -> bool {
        let Some(conn) = self.conns.get_mut(cid) else {
            return false;
        };
        let Some(src) = conn.src else {
            return false;
        };
        if super::dial::is_own(self.sh.addr, addr) {
            refusal!(self.port, %src, "soft engine: a connection claims this engine's own address, closing");
            return false;
        }
        if !may_claim(addr.ip(), src.ip()) {
            refusal!(self.port, %src, claimed = %addr, "soft engine: a connection claims an address of another host, closing");
            return false;
        }
        conn.got_hello = true;
        conn.claimed = Some(addr);
        conn.auth = Auth::Proving;
        let of = (cid, conn.serial);
        let serial = self.port.serial();
        let stream = match super::dial::dial(self.sh.addr.ip(), addr) {
            Ok(s) => s,
            Err(e) => {
                refusal!(self.port, claimed = %addr, error = %crate::report::ErrorChain(&e), "soft engine: cannot ask the engine at a claimed address, closing the claiming connection");
                return false;
            }
        };
        let asker = super::dial::identity_on(self.sh.addr, &stream);
        match self.insert_conn(stream, |w| Conn::verifier(w, asker, addr, src, of, serial)) {
            Ok(v) => {
                let now = Instant::now();
                self.port.sweep_by(now + self.port.limits.handshake_timeout);
                self.activate(v);
                true
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::ErrorChain(&e), "soft engine: register failed");
                false
            }
        }
    }

    /// Is the connection from `src` to `asker` one this engine dialed?
    /// Answered only to `asker` itself (the VERIFY must come from its IP).
    fn answer_verify(&self, cid: usize, asker: SocketAddr, src: SocketAddr) -> bool {
        let Some(from) = self.conns.get(cid).and_then(|c| c.src) else {
            return false;
        };
        if !may_claim(asker.ip(), from.ip()) {
            return false;
        }
        self.conns.iter().any(|(_, c)| {
            c.dialed
                && !matches!(c.auth, Auth::Verifier { .. })
                && c.peer.is_some_and(|p| same_addr(p, asker))
                && c.stream
                    .as_ref()
                    .and_then(|w| w.stream.local_addr().ok())
                    .is_some_and(|l| same_addr(l, src))
        })
    }

    /// The engine at connection `cid`'s claimed address owned it: the
    /// connection is that engine's.
    fn proved(&mut self, cid: usize) {
        let Some(conn) = self.conns.get_mut(cid) else {
            return;
        };
        let Some(addr) = conn.claimed.take() else {
            return;
        };
        conn.peer = Some(addr);
        conn.prove();
        tracing::debug!(peer = %addr, "soft engine: connection proven");
        self.set_peer(addr, cid);
        self.port.resume.push(cid);
        self.port
            .sweep_by(Instant::now() + self.port.limits.idle_timeout);
    }

    /// Handles the input that waited for connections proven since.
    pub(super) fn resume_proven(&mut self) {
        while let Some(cid) = self.port.resume.pop() {
            if !self.conns.get(cid).is_some_and(|c| c.proven()) {
                continue;
            }
            if !self.process_rx(cid) {
                self.close(cid);
                continue;
            }
            self.activate(cid);
            self.on_readable(cid, false);
        }
    }

    /// Closes connections past their deadline: unproven ones after the
    /// handshake timeout, proven ones no QP of this engine uses after the
    /// idle timeout without input; plans the next look.
    pub(super) fn sweep_port(&mut self, now: Instant) {
        if self.port.accept_retry.is_some_and(|t| t <= now) {
            self.accept_all();
        }
        if self.port.next_sweep.is_none_or(|t| now < t) {
            return;
        }
        let lim = self.port.limits;
        let mut next: Option<Instant> = None;
        let mut expired: Vec<(usize, bool)> = Vec::new();
        let used = self.conns_in_use();
        for (cid, c) in self.conns.iter_mut() {
            if c.is_loopback() {
                continue;
            }
            if c.big_buffers() {
                // Unused since the last look: back to the usual size.
                let used = std::mem::take(&mut c.big_buf_used);
                if used || c.shrink_idle_buffers() {
                    let t = now + BIG_BUF_KEEP;
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
            if c.rx_seen {
                c.rx_seen = false;
                c.last_rx = now;
            }
            let (deadline, handshake) = if !c.proven() {
                (c.opened + lim.handshake_timeout, true)
            } else if used.contains(&cid) {
                // (Looked at again in a while: its QPs may go.)
                (now + lim.idle_timeout, false)
            } else {
                (c.last_rx + lim.idle_timeout, false)
            };
            if deadline <= now {
                expired.push((cid, handshake));
            } else {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        self.port.next_sweep = next;
        for (cid, handshake) in expired {
            let Some(c) = self.conns.get(cid) else {
                continue;
            };
            if handshake {
                self.port.stats.handshake_timeouts += 1;
                tracing::debug!(src = ?c.src, peer = ?c.peer, auth = ?c.auth, "soft engine: handshake deadline passed, closing");
            } else {
                self.port.stats.idle_closed += 1;
                tracing::debug!(peer = ?c.peer, "soft engine: idle connection closed");
            }
            self.close(cid);
        }
    }

    /// Connections some QP of this engine uses or has work on: bound to a
    /// QP, the peer of an RC QP, or with output or a payload in progress.
    fn conns_in_use(&self) -> Vec<usize> {
        let mut used: Vec<usize> = self.qps.values().filter_map(|eq| eq.conn).collect();
        for (cid, c) in self.conns.iter() {
            let busy = c.tx_pending() > 0
                || c.tx_mem.is_some()
                || c.rx_direct.is_some()
                || !c.resp.is_empty()
                || !c.senders.is_empty();
            let peer_of_qp = c.peer.is_some_and(|p| {
                self.qps.values().any(|eq| {
                    eq.sh.qp_type == QpType::Rc
                        && eq.sh.state() != QpState::Err
                        && eq.cfg.remote_addr.is_some_and(|a| same_addr(a, p))
                })
            });
            if busy || peer_of_qp {
                used.push(cid);
            }
        }
        used
    }

    /// What the port holds and refused.
    pub(crate) fn port_stats(&self) -> PortStats {
        let mut s = self.port.stats;
        for (_, c) in self.conns.iter() {
            if c.is_loopback() {
                continue;
            }
            s.connections += 1;
            if !c.proven() {
                s.unproven += 1;
            }
            s.buffered_bytes += c.buffered();
        }
        s
    }

    /// Is connection `cid` the one of the peer engine of the QP `qpn`
    /// names (or, for a UD QP, any proven engine's)? `None`: there is no
    /// such QP.
    pub(crate) fn peer_of_qp(&mut self, cid: usize, qpn: u32) -> Option<bool> {
        let Some(peer) = self
            .conns
            .get(cid)
            .filter(|c| c.proven())
            .and_then(|c| c.peer)
        else {
            return Some(false);
        };
        let from_peer = |eq: &super::EQp| {
            eq.sh.qp_type == QpType::Ud || eq.cfg.remote_addr.is_some_and(|a| same_addr(a, peer))
        };
        // (The engine's view of the QP is usually current: one lookup per
        // packet. Otherwise the QP changed since, e.g. it just got its
        // peer: look again with the application's view.)
        if self.qps.get(&qpn).is_some_and(from_peer) {
            return Some(true);
        }
        super::super::responder::load_qp(&mut self.qps, &self.sh, qpn).map(|(eq, _)| from_peer(eq))
    }

    /// May a packet on connection `cid` for QP `qpn` be handled (see
    /// [`peer_of_qp`](Self::peer_of_qp); a QP that does not exist is the
    /// handlers' to report)?
    pub(crate) fn sent_by_peer_of(&mut self, cid: usize, qpn: u32) -> bool {
        self.peer_of_qp(cid, qpn).unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_a_warning_at_most_once_a_second() {
        let mut port = Port::new(PortLimits::of(&SoftConfig::default()));
        assert_eq!(port.may_warn(), Some(0));
        assert_eq!(port.may_warn(), None);
        assert_eq!(port.may_warn(), None);
        // A second later: a warning again, counting the quiet ones.
        port.warned = port.warned.and_then(|t| t.checked_sub(WARN_EVERY));
        assert_eq!(port.may_warn(), Some(2));
        assert_eq!(port.may_warn(), None);
    }

    #[test]
    fn claims_are_allowed_from_their_own_ip_only() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("literal");
        assert!(may_claim(ip("10.0.0.1"), ip("10.0.0.1")));
        assert!(may_claim(ip("10.0.0.1"), ip("::ffff:10.0.0.1")));
        assert!(!may_claim(ip("10.0.0.1"), ip("10.0.0.2")));
        assert!(!may_claim(ip("127.0.0.1"), ip("127.0.0.2")));
        assert!(may_claim(ip("0.0.0.0"), ip("127.0.0.1")));
        assert!(!may_claim(ip("0.0.0.0"), ip("10.0.0.2")));
        let a: SocketAddr = "10.0.0.1:5".parse().expect("literal");
        let b: SocketAddr = "[::ffff:10.0.0.1]:5".parse().expect("literal");
        assert!(same_addr(a, b));
        assert!(!same_addr(a, "10.0.0.1:6".parse().expect("literal")));
    }
}
