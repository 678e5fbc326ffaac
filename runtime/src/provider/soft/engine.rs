//! The engine thread: plays the NIC for one context. It sleeps in its own
//! mio poll when idle, takes posted WRs from dirty QPs, turns them into
//! packets on the per-peer TCP connections, answers incoming requests
//! (responder) and completes WRs from incoming responses (requester).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};
use slab::Slab;
use smallvec::SmallVec;

use super::conn::{Conn, Flush, RxDirect};
use super::context::Shared;
use super::cq::{lock, Channel, CqShared};
use super::dma::write_raw;
pub(crate) use super::eqp::{EQp, EWqe};
use super::packet::{decode_header, decode_hello, Opcode, HEADER_LEN};
use super::packet::{Header, FLAG_FIRST};
use super::qp::QpShared;
use super::responder::load_qp;
use super::wire::Wire;
use super::IdMap;
use crate::provider::{AccessFlags, AsyncElement, AsyncEvent, AsyncEventKind, QpState, WcStatus};

/// Token of the doorbell waker.
pub(crate) const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
pub(crate) const CONN_BASE: usize = 2;
/// Rounds of fill+flush per connection before looking at other events.
const SERVICE_ROUNDS: usize = 8;
/// WRITE payloads at least this big are received straight into memory.
const DIRECT_MIN: usize = 16 * 1024;

/// While posting threads transmit requests themselves, the engine wakes at
/// least this often (to time their WRs out without being rung for each).
pub(crate) const DIRECT_TICK: Duration = Duration::from_millis(10);
/// ... for this long after the last such post it learned of.
const DIRECT_AWAKE: Duration = Duration::from_secs(1);

/// How long a QP waits for its peer's engine (the one with the lower
/// address) to connect before its own engine connects.
const CONN_GRACE: Duration = Duration::from_millis(20);

/// How long the engine keeps polling after delivering a completion before
/// it sleeps (`VERBIO_SOFT_SPIN_US` overrides; 0 = sleep at once).
const DEFAULT_SPIN_US: u64 = 50;

/// How long the ACK of a message that completed a receive may wait for a
/// request to share its write (`VERBIO_SOFT_ACK_DELAY_US` overrides; 0 = never).
const DEFAULT_ACK_DELAY_US: u64 = 50;

/// How long an application's poll keeps a connection's socket off the
/// engine's watch list (see `drive.rs`).
pub(crate) const DEFAULT_LEASE_US: u64 = 1000;

pub(crate) fn env_us(name: &str, default: u64) -> Duration {
    let us = std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Duration::from_micros(us)
}

pub(crate) const PSN_MASK: u32 = 0x00ff_ffff;

pub(crate) fn psn_add(a: u32, b: u32) -> u32 {
    a.wrapping_add(b) & PSN_MASK
}

/// `a <= b` in 24-bit serial arithmetic.
pub(crate) fn psn_le(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) & PSN_MASK) < (1 << 23)
}

/// The engine's state. The engine thread holds its lock while it works and
/// releases it while it sleeps; an application polling a CQ may take it
/// (`try_lock`, never waiting) to receive itself (`drive.rs`).
pub(crate) struct Engine {
    pub sh: Arc<Shared>,
    pub listener: mio::net::TcpListener,
    pub conns: Slab<Conn>,
    pub peers: HashMap<std::net::SocketAddr, usize>,
    pub qps: IdMap<EQp>,
    pub active: Vec<usize>,
    /// Connections whose only output is held ACKs (see `Conn::ack_hold`).
    pub held: Vec<usize>,
    pub ack_delay: Duration,
    dirty_buf: Vec<Arc<QpShared>>,
    fired_buf: Vec<Arc<CqShared>>,
    /// Spare list swapped with `active` (no allocation per loop turn).
    active_buf: Vec<usize>,
    /// Posting threads transmitted recently: until then, sleep at most
    /// `DIRECT_TICK` at a time.
    direct_until: Option<Instant>,
    /// Spare list for the QPs `timers` reschedules.
    resched_buf: Vec<u32>,
    /// Per CQ handle: the connections whose packets complete its WRs
    /// (what an application polling it reads, see `drive.rs`).
    pub cq_feeds: IdMap<SmallVec<[usize; 2]>>,
    /// Connections whose socket the engine does not watch for input while
    /// an application's lease on it lasts.
    pub muted: Vec<usize>,
    /// An application's receive left the engine a timer it may sleep past
    /// (an RNR wait): it must be woken.
    pub kick: bool,
    /// While a channel's `get_event` receives: that channel (its events
    /// are queued without a signal, see `CqShared::signal`).
    pub quiet: Option<Arc<Channel>>,
    /// QPs waiting for their peer's engine to connect, until when.
    conn_wait: Vec<(u32, Instant)>,
    /// An application's receive runs (see `drive.rs`).
    pub in_app: bool,
    /// Packets applications' receives handled (for tests and diagnostics).
    pub app_packets: u64,
    /// While an application's receive runs: when it started, the time its
    /// packets are handled at (a few µs at most off; one clock read per
    /// receive instead of one per packet and step).
    pub clock: Option<Instant>,
}

impl Engine {
    /// The engine of a new context (the listener is registered here).
    pub fn new(sh: Arc<Shared>, mut listener: mio::net::TcpListener) -> io::Result<Engine> {
        sh.registry
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(Engine {
            // Held ACKs wait only while the engine polls anyway (a sleeping
            // engine's timer is too coarse for them).
            ack_delay: env_us("VERBIO_SOFT_ACK_DELAY_US", DEFAULT_ACK_DELAY_US)
                .min(env_us("VERBIO_SOFT_SPIN_US", DEFAULT_SPIN_US)),
            sh,
            listener,
            conns: Slab::new(),
            peers: HashMap::new(),
            qps: IdMap::default(),
            active: Vec::new(),
            held: Vec::new(),
            dirty_buf: Vec::new(),
            fired_buf: Vec::new(),
            active_buf: Vec::new(),
            direct_until: None,
            resched_buf: Vec::new(),
            cq_feeds: IdMap::default(),
            muted: Vec::new(),
            kick: false,
            quiet: None,
            conn_wait: Vec::new(),
            in_app: false,
            app_packets: 0,
            clock: None,
        })
    }
}

/// How many leases in a row a sleeping engine lets pass without its loop
/// turn while applications hold its lock (then it waits for the lock: its
/// timers must run).
pub(crate) const LEASE_SKIPS: u32 = 4;

/// How the engine sleeps after a loop turn.
struct Sleep {
    /// How long (`None`: until woken).
    timeout: Option<Duration>,
    /// Yield the CPU first.
    yield_first: bool,
    /// Only to see whether leases ended (see `run`).
    lease_wake: bool,
}

/// Engine thread body: works under the engine lock, sleeps in `poll`
/// without it.
///
/// Woken only to see whether leases ended, the engine does not wait for
/// its lock if an application holds it: that application is receiving,
/// and renewing its leases; the engine sleeps another lease instead (it
/// is rung for anything else, or wakes within a lease anyway), up to
/// `LEASE_SKIPS` times in a row.
pub(crate) fn run(core: Arc<Mutex<Engine>>, mut poll: Poll) {
    let mut events = Events::with_capacity(256);
    let spin = env_us("VERBIO_SOFT_SPIN_US", DEFAULT_SPIN_US);
    // When the last completion was delivered, while no post followed.
    let mut spin_from: Option<Instant> = None;
    let mut eng = lock(&core);
    loop {
        eng.handle_events(&events);
        let Some(Sleep {
            mut timeout,
            yield_first,
            lease_wake,
        }) = eng.turn(&mut spin_from, spin)
        else {
            tracing::debug!(addr = %eng.sh.addr, "soft engine stopped");
            return;
        };
        let sh = eng.sh.clone();
        drop(eng);
        if yield_first {
            std::thread::yield_now();
        }
        let mut skips = 0;
        let (res, guard) = loop {
            let res = poll.poll(&mut events, timeout);
            if !(lease_wake && res.is_ok() && events.is_empty()) || skips == LEASE_SKIPS {
                break (res, lock(&core));
            }
            skips += 1;
            match core.try_lock() {
                Err(TryLockError::WouldBlock) => {
                    // Posting threads ring if they need us earlier (those
                    // that did not, as we were to wake by now, wait at most
                    // a lease more: their WRs' timeouts are detected that
                    // much later at worst). Everything else rings anyway.
                    timeout = Some(sh.lease);
                    let wake_by = sh.nanos_at(Instant::now() + sh.lease);
                    sh.wake_by.store(wake_by, Ordering::SeqCst);
                }
                Ok(g) => break (res, g),
                Err(TryLockError::Poisoned(p)) => break (res, p.into_inner()),
            }
        };
        eng = guard;
        eng.sh.sleeping.store(false, Ordering::SeqCst);
        if let Err(e) = res {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "soft engine: poll failed");
                return;
            }
            events.clear();
        }
    }
}

impl Engine {
    /// Handles what the last `poll` reported.
    fn handle_events(&mut self, events: &Events) {
        let now = Instant::now();
        for ev in events.iter() {
            match ev.token() {
                WAKER => {}
                LISTENER => self.accept_all(),
                Token(t) => {
                    let cid = t - CONN_BASE;
                    if ev.is_writable() {
                        self.on_writable(cid);
                    }
                    if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                        // An application drives this connection: stop
                        // watching its input until the lease ends.
                        if ev.is_readable() && !self.sh.lease.is_zero() {
                            self.mute(cid, now);
                        }
                        self.on_readable(cid, ev.is_read_closed() || ev.is_error());
                    }
                }
            }
        }
        // What arrived completed WRs: their consumers are woken at the
        // turn's end, once per CQ, after the answers (ACKs) were written
        // or parked for the consumers' own writes (an answer posted before
        // that would have to queue behind them).
    }

    /// One loop turn: the work that does not wait. Returns how to sleep,
    /// `None` to stop.
    fn turn(&mut self, spin_from: &mut Option<Instant>, spin: Duration) -> Option<Sleep> {
        if self.sh.stop.load(Ordering::SeqCst) {
            // Best effort: queued responses leave before the sockets close.
            for cid in std::mem::take(&mut self.held) {
                self.activate(cid);
            }
            self.service_active(true);
            self.raise_events();
            return None;
        }
        // (The engine is awake: an application's receive need not ring it.)
        self.kick = false;
        let posted = self.service_dirty();
        let now = Instant::now();
        if posted {
            // The post the spin waited for came: what follows is the
            // network's turn.
            *spin_from = None;
        }
        if self.sh.completed.swap(false, Ordering::Relaxed) {
            *spin_from = Some(now);
        }
        if self.sh.direct_seen.swap(false, Ordering::Relaxed) {
            self.direct_until = Some(now + DIRECT_AWAKE);
        }
        self.timers(now);
        self.retry_conn_waits();
        self.adopt_app_muted();
        self.expire_leases(now);
        let mut held = std::mem::take(&mut self.held);
        for cid in held.drain(..) {
            self.activate(cid);
        }
        self.held = held;
        let busy = self.service_active(false);
        // (Overflows of this turn and of the last turn's events.)
        self.fail_overflowed();
        self.raise_events();
        let awaiting_post = spin_from.is_some_and(|t| now.duration_since(t) < spin);
        let mut yield_first = false;
        let mut lease_wake = false;
        let mut timeout = if busy {
            Some(Duration::ZERO)
        } else if awaiting_post || self.awaits_post_for_held(now) {
            // A completion was just delivered and its application has
            // not posted since: it is likely to post at once, so stay
            // awake a little (no doorbell syscall and wakeup for that
            // post; held ACKs wait for it), but let other threads run.
            // Waiting for the network needs no spinning: data arriving
            // wakes the poll (and an idle CPU is worth more to the woken
            // threads on a small machine).
            yield_first = true;
            Some(Duration::ZERO)
        } else {
            let (deadline, lease_only) = self.next_deadline(now);
            lease_wake = lease_only;
            deadline.map(|d| d.saturating_duration_since(now))
        };
        if timeout != Some(Duration::ZERO) {
            // Posting threads that transmit themselves ring only if we
            // would not wake in time to time their WRs out.
            let wake_by = timeout.map_or(u64::MAX, |t| self.sh.nanos_at(now + t));
            self.sh.wake_by.store(wake_by, Ordering::SeqCst);
            self.sh.sleeping.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            // (Work queued before `sleeping` was seen: no one rang for it.)
            if !lock(&self.sh.dirty).is_empty()
                || !lock(&self.sh.app_muted).is_empty()
                || self.sh.stop.load(Ordering::SeqCst)
            {
                timeout = Some(Duration::ZERO);
            }
        }
        Some(Sleep {
            timeout,
            yield_first,
            lease_wake,
        })
    }

    /// True if ACKs the engine holds wait for a post it should stay awake
    /// for: ACKs held by its own receive. Those an application's receive
    /// held (on a connection it drives, see `drive.rs`) wait for that
    /// application's post, which takes them along without the engine; the
    /// engine sleeps until their hold ends (the receive rang it if it would
    /// sleep much longer), and does not keep its lock busy meanwhile, which
    /// would make the application's next receive wait for it.
    pub(crate) fn awaits_post_for_held(&self, now: Instant) -> bool {
        let t = self.sh.nanos_at(now);
        self.held.iter().any(|&cid| {
            self.conns.get(cid).is_some_and(|c| match &c.stream {
                Some(w) => w.lease_until() <= t,
                None => true,
            })
        })
    }

    /// The time (see `clock`).
    pub(crate) fn now(&self) -> Instant {
        self.clock.unwrap_or_else(Instant::now)
    }

    /// Raises the channel events of the CQs that completions disarmed.
    pub(crate) fn raise_events(&mut self) {
        let mut list = std::mem::take(&mut self.fired_buf);
        std::mem::swap(&mut list, &mut *lock(&self.sh.fired));
        for cq in list.drain(..) {
            cq.signal(self.quiet.as_deref());
        }
        self.fired_buf = list;
    }

    /// Moves every QP of a CQ that overflowed to ERR, with a QP fatal
    /// async event each (after the CQ's own error event), as RC hardware
    /// does: the completions of its WRs could not be reported any more.
    pub(crate) fn fail_overflowed(&mut self) {
        // (Pushed to under the engine lock, which we hold.)
        if !self.sh.any_overflowed.swap(false, Ordering::Relaxed) {
            return;
        }
        let list = std::mem::take(&mut *lock(&self.sh.overflowed));
        for cq in list {
            let qps: Vec<Arc<QpShared>> = lock(&self.sh.qps)
                .values()
                .filter(|q| Arc::ptr_eq(&q.send_cq, &cq) || Arc::ptr_eq(&q.recv_cq, &cq))
                .cloned()
                .collect();
            for qp in qps {
                if qp.destroyed.load(Ordering::Acquire) || qp.state() == QpState::Err {
                    continue;
                }
                let eq = self
                    .qps
                    .entry(qp.qpn)
                    .or_insert_with(|| EQp::new(qp.clone(), self.sh.clone()));
                if !Arc::ptr_eq(&eq.sh, &qp) {
                    *eq = EQp::new(qp.clone(), self.sh.clone());
                }
                eq.refresh(&mut lock(&qp.inner));
                tracing::debug!(
                    qpn = qp.qpn,
                    cq = cq.handle,
                    "soft engine: CQ overflow, QP to ERR"
                );
                eq.fail(None);
                self.sh.async_events.push(AsyncEvent {
                    kind: AsyncEventKind::QpFatal,
                    element: AsyncElement::Qp(qp.qpn),
                });
            }
        }
    }

    /// Services QPs the application touched. True if there were any.
    fn service_dirty(&mut self) -> bool {
        let mut list = std::mem::take(&mut self.dirty_buf);
        std::mem::swap(&mut list, &mut *lock(&self.sh.dirty));
        let any = !list.is_empty();
        for qp in list.drain(..) {
            qp.dirty.store(false, Ordering::SeqCst);
            self.sync_qp(qp);
        }
        self.dirty_buf = list;
        any
    }

    /// Looks at a QP the application touched: new WRs, state changes, destruction.
    fn sync_qp(&mut self, qp: Arc<QpShared>) {
        let qpn = qp.qpn;
        if qp.destroyed.load(Ordering::Acquire) {
            if let Some(eq) = self.qps.get(&qpn) {
                if Arc::ptr_eq(&eq.sh, &qp) {
                    self.qps.remove(&qpn);
                }
            }
            return;
        }
        let eq = self
            .qps
            .entry(qpn)
            .or_insert_with(|| EQp::new(qp.clone(), self.sh.clone()));
        if !Arc::ptr_eq(&eq.sh, &qp) {
            *eq = EQp::new(qp.clone(), self.sh.clone());
        }
        let mut inner = lock(&qp.inner);
        let state = eq.refresh(&mut inner);
        match state {
            QpState::Err => {
                eq.flush(&mut inner);
                return;
            }
            QpState::Rts => {
                if !inner.sq.is_empty() {
                    eq.stop_direct(&mut inner);
                }
                let cap = inner.sq.len();
                eq.wqes.extend(inner.sq.drain(..cap).map(|w| EWqe {
                    w,
                    first_psn: 0,
                    last_psn: 0,
                    error: None,
                }));
            }
            QpState::Rtr => {}
            _ => return,
        }
        drop(inner);
        self.ensure_conn(qpn);
        self.schedule(qpn);
    }

    /// Puts a requester QP on its connection's sender list.
    pub fn schedule(&mut self, qpn: u32) {
        let Some(eq) = self.qps.get_mut(&qpn) else {
            return;
        };
        if eq.scheduled || eq.send_idx >= eq.wqes.len() {
            return;
        }
        let Some(cid) = eq.conn else {
            return;
        };
        let Some(conn) = self.conns.get_mut(cid) else {
            return;
        };
        eq.scheduled = true;
        conn.claim();
        conn.senders.push_back(qpn);
        if !conn.active {
            conn.active = true;
            self.active.push(cid);
        }
    }

    pub fn activate(&mut self, cid: usize) {
        if let Some(conn) = self.conns.get_mut(cid) {
            if !conn.active {
                conn.active = true;
                self.active.push(cid);
            }
        }
    }

    /// Binds the QP to the connection to its peer's engine, connecting if needed.
    fn ensure_conn(&mut self, qpn: u32) {
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
        let waiting = self.conn_wait.iter().position(|(q, _)| *q == qpn);
        if let Some(&c) = self.peers.get(&addr) {
            eq.conn = Some(c);
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
                tracing::debug!(%addr, error = %e, "soft engine: connect failed");
                if let Some(eq) = self.qps.get_mut(&qpn) {
                    if !eq.wqes.is_empty() {
                        eq.fail(Some(WcStatus::RetryExcErr));
                    }
                }
            }
        }
    }

    fn connect(&mut self, addr: std::net::SocketAddr) -> io::Result<usize> {
        let cid = if addr == self.sh.addr {
            let entry = self.conns.vacant_entry();
            let cid = entry.key();
            entry.insert(Conn::new(None, self.sh.addr, true));
            cid
        } else {
            let stream = mio::net::TcpStream::connect(addr)?;
            self.insert_conn(stream, false)?
        };
        if let Some(c) = self.conns.get_mut(cid) {
            c.peer = Some(addr);
        }
        self.peers.insert(addr, cid);
        Ok(cid)
    }

    fn insert_conn(
        &mut self,
        mut stream: mio::net::TcpStream,
        connected: bool,
    ) -> io::Result<usize> {
        let entry = self.conns.vacant_entry();
        let cid = entry.key();
        self.sh.registry.register(
            &mut stream,
            Token(cid + CONN_BASE),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        if connected {
            let _ = stream.set_nodelay(true);
        }
        let wire = Arc::new(Wire::new(stream, Token(cid + CONN_BASE)));
        entry.insert(Conn::new(Some(wire), self.sh.addr, connected));
        Ok(cid)
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    tracing::trace!(%from, "soft engine: accepted");
                    match self.insert_conn(stream, true) {
                        Ok(cid) => self.activate(cid),
                        Err(e) => tracing::warn!(error = %e, "soft engine: register failed"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(error = %e, "soft engine: accept failed");
                    return;
                }
            }
        }
    }

    fn on_writable(&mut self, cid: usize) {
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
                    tracing::debug!(error = %e, "soft engine: connect failed");
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

    /// Reads and handles what arrived. Edge-triggered: a short read means the
    /// socket is drained (new data raises a new event), except when the peer
    /// also closed (`drain`), where we read on until end of stream.
    pub(crate) fn on_readable(&mut self, cid: usize, drain: bool) {
        loop {
            let Some(conn) = self.conns.get_mut(cid) else {
                return;
            };
            if conn.rx_direct.is_some() {
                let res = {
                    let mrs = self.sh.mrs();
                    conn.read_direct(&mrs)
                };
                match res {
                    Ok((0, _)) => {
                        self.close(cid);
                        return;
                    }
                    Ok((_, full)) => {
                        let done = conn.rx_direct.as_ref().is_some_and(|d| d.remaining == 0);
                        if done {
                            if let Some(d) = conn.rx_direct.take() {
                                self.on_request(cid, &d.hdr, &[], Some(!d.broken));
                            }
                            self.activate(cid);
                            continue;
                        }
                        if !full && !drain {
                            return;
                        }
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, "soft engine: read failed");
                        self.close(cid);
                        return;
                    }
                }
            }
            match conn.read_some() {
                Ok((0, _)) => {
                    self.close(cid);
                    return;
                }
                Ok((_, full)) => {
                    if !self.process_rx(cid) {
                        self.close(cid);
                        return;
                    }
                    // What the packets produced (ACKs, data) goes out in
                    // this loop turn.
                    self.activate(cid);
                    if !full && !drain {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(error = %e, "soft engine: read failed");
                    self.close(cid);
                    return;
                }
            }
        }
    }

    /// Handles every complete packet in the receive buffer. False = protocol
    /// violation, drop the connection.
    fn process_rx(&mut self, cid: usize) -> bool {
        let Some(conn) = self.conns.get_mut(cid) else {
            return false;
        };
        // Responses go out before anything a poster would write now.
        conn.claim();
        let rx = std::mem::take(&mut conn.rx);
        let (mut start, end) = (conn.rx_start, conn.rx_end);
        let mut ok = true;
        let mut need = 0;
        let mut direct = None;
        while end - start >= HEADER_LEN {
            let hdr = match decode_header(&rx[start..end]) {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "soft engine: bad packet, closing connection");
                    ok = false;
                    break;
                }
            };
            let total = HEADER_LEN + hdr.payload_len as usize;
            if end - start < total {
                let got_hello = self.conns.get(cid).is_some_and(|c| c.got_hello);
                if got_hello && hdr.payload_len as usize >= DIRECT_MIN {
                    direct = self.direct_target(&hdr);
                }
                if let Some(d) = &mut direct {
                    // Place the bytes already here; read the rest straight
                    // into the registered memory.
                    let have = &rx[start + HEADER_LEN..end];
                    let mrs = self.sh.mrs();
                    match mrs.remote(
                        hdr.rkey,
                        d.pd,
                        d.addr,
                        have.len() as u64,
                        AccessFlags::REMOTE_WRITE,
                    ) {
                        // SAFETY: validated for `have.len()` writable bytes
                        // under the MR-table lock we hold.
                        Ok(p) => unsafe { write_raw(p, have) },
                        Err(_) => d.broken = true,
                    }
                    d.addr += have.len() as u64;
                    d.remaining -= have.len();
                    start = end;
                } else {
                    need = total;
                }
                break;
            }
            let payload = &rx[start + HEADER_LEN..start + total];
            start += total;
            let got_hello = self.conns.get(cid).is_some_and(|c| c.got_hello);
            if !got_hello {
                if hdr.opcode != Opcode::Hello {
                    tracing::warn!("soft engine: connection did not start with HELLO");
                    ok = false;
                    break;
                }
                match decode_hello(payload) {
                    Ok(addr) => {
                        if let Some(c) = self.conns.get_mut(cid) {
                            c.got_hello = true;
                            if c.peer.is_none() {
                                c.peer = Some(addr);
                            }
                        }
                        self.peers.entry(addr).or_insert(cid);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "soft engine: bad HELLO");
                        ok = false;
                        break;
                    }
                }
                continue;
            }
            self.handle_packet(cid, &hdr, payload);
        }
        if let Some(conn) = self.conns.get_mut(cid) {
            if start == end {
                start = 0;
                conn.rx_end = 0;
            }
            conn.rx = rx;
            conn.rx_start = start;
            conn.rx_need = need;
            conn.rx_direct = direct;
        }
        ok
    }

    /// Checks whether a WRITE segment whose payload is still arriving can be
    /// received straight into its target (the request will succeed).
    fn direct_target(&mut self, hdr: &Header) -> Option<RxDirect> {
        if !matches!(hdr.opcode, Opcode::Write | Opcode::WriteImm) {
            return None;
        }
        let (eq, st) = load_qp(&mut self.qps, &self.sh, hdr.dst_qpn)?;
        if !matches!(st, QpState::Rtr | QpState::Rts)
            || !eq.configured
            || hdr.src_qpn != eq.cfg.remote_qpn
            || hdr.psn != eq.epsn
            || !eq.cfg.access.contains(AccessFlags::REMOTE_WRITE)
        {
            return None;
        }
        let first = hdr.flags & FLAG_FIRST != 0;
        if first && hdr.opcode == Opcode::WriteImm && lock(&eq.sh.inner).rq.is_empty() {
            return None;
        }
        let pd = eq.sh.pd;
        let (from, len) = if first {
            (hdr.addr, hdr.arg0)
        } else {
            (hdr.addr + hdr.arg1, u64::from(hdr.payload_len))
        };
        self.sh
            .mrs()
            .remote(hdr.rkey, pd, from, len, AccessFlags::REMOTE_WRITE)
            .ok()?;
        Some(RxDirect {
            qp: eq.sh.clone(),
            hdr: *hdr,
            pd,
            addr: hdr.addr + hdr.arg1,
            remaining: hdr.payload_len as usize,
            broken: false,
        })
    }

    fn handle_packet(&mut self, cid: usize, hdr: &Header, payload: &[u8]) {
        if self.in_app {
            self.app_packets += 1;
        }
        match hdr.opcode {
            Opcode::Hello => {}
            op if op.is_request() => self.on_request(cid, hdr, payload, None),
            _ => self.on_response(cid, hdr, payload),
        }
    }

    /// Fills and flushes every active connection. True if some still has
    /// work that can proceed now. `force`: held ACKs go out too.
    pub(crate) fn service_active(&mut self, force: bool) -> bool {
        let mut list = std::mem::take(&mut self.active_buf);
        std::mem::swap(&mut list, &mut self.active);
        let mut busy = false;
        let now = self.now();
        for cid in list.drain(..) {
            if let Some(c) = self.conns.get_mut(cid) {
                c.active = false;
                if !force && c.holding(now) {
                    if c.park_acks() {
                        self.held.push(cid);
                    } else {
                        // A posting thread took the ACKs along.
                        c.ack_hold = None;
                    }
                    continue;
                }
                c.ack_hold = None;
            } else {
                continue;
            }
            if self.service_conn(cid) {
                busy = true;
                self.activate(cid);
            }
        }
        self.active_buf = list;
        busy
    }

    /// Generates and writes packets for one connection. True if it stopped
    /// with work left that does not wait for the socket.
    fn service_conn(&mut self, cid: usize) -> bool {
        let Some(conn) = self.conns.get(cid) else {
            return false;
        };
        conn.claim();
        let more = self.service_conn_rounds(cid);
        if let Some(conn) = self.conns.get(cid) {
            conn.settle();
        }
        more
    }

    fn service_conn_rounds(&mut self, cid: usize) -> bool {
        for _ in 0..SERVICE_ROUNDS {
            self.fill_tx(cid);
            let Some(conn) = self.conns.get_mut(cid) else {
                return false;
            };
            let res = {
                let mrs = self.sh.mrs();
                conn.flush(&mrs)
            };
            if !conn.broken.is_empty() {
                let broken = std::mem::take(&mut conn.broken);
                for qpn in broken {
                    if let Some(eq) = self.qps.get_mut(&qpn) {
                        eq.fail(Some(WcStatus::LocProtErr));
                    }
                }
            }
            match res {
                Flush::Closed => {
                    self.close(cid);
                    return false;
                }
                Flush::Blocked => return false,
                Flush::Done => {}
            }
            let lo = self.conns.get(cid).is_some_and(|c| c.is_loopback());
            if lo && !self.process_rx(cid) {
                tracing::error!("soft engine: loopback produced an invalid packet");
                self.close(cid);
                return false;
            }
            let conn = &self.conns[cid];
            if conn.resp.is_empty() && conn.senders.is_empty() {
                return false;
            }
        }
        true
    }

    /// Closes a connection: requester QPs bound to it fail with RETRY_EXC_ERR.
    pub fn close(&mut self, cid: usize) {
        if !self.conns.contains(cid) {
            return;
        }
        let conn = self.conns.remove(cid);
        self.forget_feeds(cid, &conn);
        if let Some(wire) = &conn.stream {
            let fd = wire.fd();
            let _ = self.sh.registry.deregister(&mut mio::unix::SourceFd(&fd));
            wire.close();
        }
        self.peers.retain(|_, c| *c != cid);
        tracing::debug!(peer = ?conn.peer, "soft engine: connection closed");
        for eq in self.qps.values_mut() {
            if eq.conn == Some(cid) {
                eq.conn = None;
                eq.scheduled = false;
                eq.stop_direct(&mut lock(&eq.sh.clone().inner));
                if !eq.wqes.is_empty() && eq.sh.state() == QpState::Rts {
                    eq.fail(Some(WcStatus::RetryExcErr));
                }
            }
        }
    }

    /// QPs waiting for their peer's connection: bound once it is there
    /// (or connecting themselves once the wait is over).
    fn retry_conn_waits(&mut self) {
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

    fn timers(&mut self, now: Instant) {
        let mut resched = std::mem::take(&mut self.resched_buf);
        for (qpn, eq) in self.qps.iter_mut() {
            if let Some(t) = eq.rnr_until {
                if t <= now {
                    eq.rnr_until = None;
                    resched.push(*qpn);
                }
            }
            if let Some(t) = eq.ack_deadline {
                if t <= now {
                    if eq.retries_left == 0 {
                        tracing::debug!(qpn, "soft engine: ACK timeout, retries exhausted");
                        eq.fail(Some(WcStatus::RetryExcErr));
                    } else {
                        eq.retries_left -= 1;
                        eq.ack_deadline = eq.ack_timeout().map(|d| now + d);
                    }
                }
            }
        }
        for qpn in resched.drain(..) {
            self.ensure_conn(qpn);
            self.schedule(qpn);
        }
        self.resched_buf = resched;
    }

    /// When the engine must wake next, and whether only to see if leases
    /// ended (the first deadline is a lease's, before every other one).
    fn next_deadline(&mut self, now: Instant) -> (Option<Instant>, bool) {
        let held = self
            .held
            .iter()
            .filter_map(|&cid| self.conns.get(cid).and_then(|c| c.ack_hold));
        // While posting threads transmit, wake now and then, so that their
        // posts need not ring the doorbell for the WRs' timeouts.
        if self.direct_until.is_some_and(|t| t <= now) {
            self.direct_until = None;
        }
        let tick = self.direct_until.map(|_| now + DIRECT_TICK);
        let lease = self.lease_deadline();
        let conn_wait = self.conn_wait.iter().map(|(_, t)| *t).min();
        let other = self
            .qps
            .values()
            .flat_map(|eq| [eq.rnr_until, eq.ack_deadline])
            .flatten()
            .chain(held)
            .chain(tick)
            .chain(conn_wait)
            .min();
        match (lease, other) {
            (Some(l), Some(o)) if l < o => (Some(l), true),
            (Some(l), None) => (Some(l), true),
            (l, o) => (l.into_iter().chain(o).min(), false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_add(5, PSN_MASK), 4);
        assert!(psn_le(PSN_MASK - 2, 3));
        assert!(!psn_le(3, PSN_MASK - 2));
        assert!(psn_le(7, 7));
        assert!(psn_le(0, (1 << 23) - 1));
        assert!(!psn_le(0, 1 << 23));
    }
}
