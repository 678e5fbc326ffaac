//! Connections to other engines: connecting (one per pair of engines),
//! accepting, binding QPs to them, and closing them.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Interest, Token};
use smallvec::SmallVec;

use super::super::conn::Conn;
use super::super::lock;
use super::super::wire::Wire;
use super::{Engine, CONN_BASE};
use crate::provider::{QpState, QpType, WcStatus};

/// How long a QP waits for its peer's engine (the one with the lower
/// address) to connect before its own engine connects.
const CONN_GRACE: Duration = Duration::from_millis(20);

impl Engine {
    /// Binds the QP to the connection to its peer's engine (UD: the engine
    /// its next datagram goes to), connecting if needed.
    pub(crate) fn ensure_conn(&mut self, qpn: u32) {
        let Some((ud, scheduled)) = self
            .qps
            .get(&qpn)
            .map(|eq| (eq.sh.qp_type == QpType::Ud, eq.scheduled))
        else {
            return;
        };
        let addr = if ud {
            if scheduled {
                // (Its connection's fill moves it when its next datagram
                // goes elsewhere.)
                return;
            }
            let Some(addr) = self.ud_next_dest(qpn) else {
                return;
            };
            let Some(eq) = self.qps.get_mut(&qpn) else {
                return;
            };
            match eq.conn {
                Some(c) if self.conns.get(c).is_some_and(|c| c.peer == Some(addr)) => return,
                _ => eq.conn = None,
            }
            addr
        } else {
            let Some(eq) = self.qps.get_mut(&qpn) else {
                return;
            };
            if let Some(c) = eq.conn {
                if self.conns.contains(c) {
                    return;
                }
                eq.conn = None;
            }
            let Some(addr) = eq.cfg.remote_addr else {
                return;
            };
            addr
        };
        let waiting = self.conn_wait.iter().position(|(q, _)| *q == qpn);
        if let Some(&c) = self.peers.get(&addr) {
            if let Some(eq) = self.qps.get_mut(&qpn) {
                eq.conn = Some(c);
            }
            if let Some(i) = waiting {
                self.conn_wait.swap_remove(i);
            }
            return;
        }
        if addr < self.sh.addr {
            // One connection per pair of engines (requests, responses and
            // TCP's own ACKs share it): the engine with the lower address
            // connects; this one waits for it a little before it connects
            // itself (the peer may not need a connection now).
            let now = Instant::now();
            match waiting {
                Some(i) if self.conn_wait[i].1 <= now => {
                    self.conn_wait.swap_remove(i);
                }
                Some(_) => return,
                None => {
                    self.conn_wait.push((qpn, now + CONN_GRACE));
                    return;
                }
            }
        }
        match self.connect(addr) {
            Ok(c) => {
                if let Some(eq) = self.qps.get_mut(&qpn) {
                    eq.conn = Some(c);
                }
            }
            Err(e) => {
                tracing::debug!(%addr, error = %crate::report::ErrorChain(&e), "soft engine: connect failed");
                if let Some(eq) = self.qps.get_mut(&qpn) {
                    if eq.sh.qp_type == QpType::Ud {
                        self.ud_lost(qpn, addr);
                    } else if !eq.wqes.is_empty() {
                        eq.fail(Some(WcStatus::RetryExcErr));
                    }
                }
            }
        }
    }

    fn connect(&mut self, addr: std::net::SocketAddr) -> io::Result<usize> {
        let serial = self.port.serial();
        let local = self.sh.addr;
        let cid = if super::dial::is_own(local, addr) {
            let entry = self.conns.vacant_entry();
            let cid = entry.key();
            entry.insert(Conn::loopback(local, serial));
            cid
        } else {
            // (From this engine's own IP: the engine there checks the
            // claim in our HELLO against the connection's source.)
            let stream = super::dial::dial(local.ip(), addr)?;
            let me = super::dial::identity_on(local, &stream);
            let cid = self.insert_conn(stream, |w| Conn::dialed(w, me, addr, serial))?;
            self.port_dialed();
            cid
        };
        self.set_peer(addr, cid);
        Ok(cid)
    }

    /// Registers a new connection's socket and inserts the connection
    /// `make` builds around it.
    pub(super) fn insert_conn(
        &mut self,
        mut stream: mio::net::TcpStream,
        make: impl FnOnce(Arc<Wire>) -> Conn,
    ) -> io::Result<usize> {
        let bound = self.peer_timeout();
        let entry = self.conns.vacant_entry();
        let cid = entry.key();
        self.sh.registry.register(
            &mut stream,
            Token(cid + CONN_BASE),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        if let Err(e) = super::liveness::keep_alive(&stream, bound) {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: no TCP keepalive on a connection");
        }
        let conn = make(Arc::new(Wire::new(stream, Token(cid + CONN_BASE))));
        if conn.connected {
            if let Some(w) = &conn.stream {
                let _ = w.stream.set_nodelay(true);
            }
        }
        entry.insert(conn);
        Ok(cid)
    }

    pub(super) fn on_writable(&mut self, cid: usize) {
        let Some(conn) = self.conns.get_mut(cid) else {
            return;
        };
        if !conn.connected {
            let Some(wire) = &conn.stream else {
                return;
            };
            let stream = &wire.stream;
            match stream.take_error() {
                Ok(Some(e)) | Err(e) => {
                    tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: connect failed");
                    self.close(cid);
                    return;
                }
                Ok(None) => {}
            }
            match stream.peer_addr() {
                Ok(_) => {
                    let _ = stream.set_nodelay(true);
                    conn.connected = true;
                }
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return,
                Err(_) => {
                    self.close(cid);
                    return;
                }
            }
        }
        self.activate(cid);
    }

    /// Makes `cid` the connection to the engine at `addr` (if it has none).
    pub(crate) fn set_peer(&mut self, addr: std::net::SocketAddr, cid: usize) {
        if self.peers.contains_key(&addr)
            || !self.conns.get(cid).is_some_and(|c| c.dialed || c.proven())
        {
            return;
        }
        self.peers.insert(addr, cid);
        if let Some(w) = self.conns.get(cid).and_then(|c| c.stream.clone()) {
            lock(&self.sh.wires).insert(addr, w);
        }
    }

    /// Closes a connection: requester QPs bound to it fail with
    /// RETRY_EXC_ERR; UD QPs lose the datagrams queued for its engine. If
    /// it was the connection to its peer engine, every RC QP whose peer is
    /// there moves to ERR (see `liveness.rs`).
    pub fn close(&mut self, cid: usize) {
        if !self.conns.contains(cid) {
            return;
        }
        let lost_peer = self.conns[cid]
            .peer
            .filter(|p| self.peers.get(p) == Some(&cid))
            .map(|p| (p, self.conns[cid].proven()));
        let conn = self.conns.remove(cid);
        self.forget_feeds(cid, &conn);
        self.port_closed(&conn);
        if let Some(wire) = &conn.stream {
            let fd = wire.fd();
            let _ = self.sh.registry.deregister(&mut mio::unix::SourceFd(&fd));
            wire.close();
        }
        self.peers.retain(|_, c| *c != cid);
        if let Some(w) = &conn.stream {
            lock(&self.sh.wires).retain(|_, x| !Arc::ptr_eq(x, w));
        }
        tracing::debug!(peer = ?conn.peer, "soft engine: connection closed");
        let mut ud: SmallVec<[u32; 4]> = SmallVec::new();
        for (qpn, eq) in self.qps.iter_mut() {
            if eq.conn == Some(cid) {
                eq.conn = None;
                eq.scheduled = false;
                eq.stop_direct(&mut lock(&eq.sh.clone().inner));
                if eq.sh.qp_type == QpType::Ud {
                    ud.push(*qpn);
                } else if !eq.wqes.is_empty() && eq.sh.state() == QpState::Rts {
                    eq.fail(Some(WcStatus::RetryExcErr));
                }
            }
        }
        if let Some((peer, proven)) = lost_peer {
            self.fail_qps_of(peer, proven);
        }
        for qpn in ud {
            if let Some(addr) = conn.peer {
                self.ud_lost(qpn, addr);
            }
            self.ensure_conn(qpn);
            self.schedule(qpn);
        }
    }

    /// QPs waiting for their peer's connection: bound once it is there
    /// (or connecting themselves once the wait is over).
    pub(super) fn retry_conn_waits(&mut self) {
        if self.conn_wait.is_empty() {
            return;
        }
        let Engine { conn_wait, qps, .. } = self;
        conn_wait.retain(|(q, _)| qps.get(q).is_some_and(|eq| eq.conn.is_none()));
        let list: SmallVec<[u32; 8]> = self.conn_wait.iter().map(|(q, _)| *q).collect();
        for qpn in list {
            self.ensure_conn(qpn);
            self.schedule(qpn);
        }
    }
}
