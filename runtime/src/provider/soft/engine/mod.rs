//! The engine thread: plays the NIC for one context. It sleeps in its own
//! mio poll when idle, takes posted WRs from dirty QPs, turns them into
//! packets on the per-peer TCP connections, answers incoming requests
//! (responder) and completes WRs from incoming responses (requester).
//!
//! This file holds the engine's state; the work is split by job: `run.rs`
//! (the thread's loop and sleep), `qps.rs` (what applications post and
//! change on their QPs), `conns.rs` (connections to other engines), `rx.rs`
//! (reading and cutting packets), `tx.rs` (filling and flushing
//! connections), `timers.rs` (the deadline queue: RNR waits, ACK timeouts; next wake-up),
//! `lease_sleep.rs` (a sleep for leases only, which renewals move later),
//! `liveness.rs` (dead peers, and when an ACK timeout counts), `pacing.rs`
//! (no kernel pacing between engines on one host) and
//! `psn.rs` (sequence-number arithmetic). The RC protocol itself lives in
//! `../requester.rs` and `../responder.rs`, the application-driven receive
//! in `../drive.rs`.

mod conns;
pub(crate) mod dial;
mod fine_timer;
mod lease_sleep;
mod liveness;
mod pacing;
#[macro_use]
mod port;
mod psn;
mod qps;
mod run;
mod rx;
mod timers;
mod tx;

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Interest, Token};
use slab::Slab;
use smallvec::SmallVec;

use super::channel::Channel;
use super::conn::Conn;
use super::context::Shared;
use super::cq::CqShared;
pub(crate) use super::eqp::{EQp, EWqe};
use super::qp::QpShared;
use super::IdMap;
pub(crate) use lease_sleep::LeaseSleep;
pub(crate) use port::PortLimits;
pub use port::PortStats;
pub(crate) use psn::{psn_add, psn_le, PSN_MASK};
pub(crate) use run::run;
#[cfg(test)]
pub(crate) use run::LEASE_SKIPS;

/// Token of the doorbell waker.
pub(crate) const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
pub(crate) const CONN_BASE: usize = 2;

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

/// The engine's state. The engine thread holds its lock while it works and
/// releases it while it sleeps; an application polling a CQ may take it
/// (`try_lock`, never waiting) to receive itself (`drive.rs`).
pub(crate) struct Engine {
    pub sh: Arc<Shared>,
    pub listener: mio::net::TcpListener,
    /// The congestion control the listener had before it was made not to
    /// pace (`pacing.rs`): connections from other hosts get it back.
    pub listener_cc: Option<Vec<u8>>,
    pub conns: Slab<Conn>,
    pub peers: super::AddrMap<usize>,
    pub qps: IdMap<EQp>,
    pub active: Vec<usize>,
    /// Connections whose only output is held ACKs (see `Conn::ack_hold`).
    pub held: Vec<usize>,
    pub ack_delay: Duration,
    dirty_buf: Vec<Arc<QpShared>>,
    fired_buf: Vec<Arc<CqShared>>,
    /// Spare list swapped with `active` (no allocation per loop turn).
    active_buf: Vec<usize>,
    /// Spare list for the QPs `timers` reschedules.
    resched_buf: Vec<u32>,
    /// The QPs' deadlines in time order (see `timers.rs`).
    pub deadlines: timers::Deadlines,
    /// Spare list for the QPs whose deadline came.
    due_buf: Vec<u32>,
    /// QPs waiting for a probe's answer (see `liveness.rs`).
    probing: Vec<u32>,
    /// Per CQ handle: the connections whose packets complete its WRs
    /// (what an application polling it reads, see `drive.rs`).
    pub cq_feeds: IdMap<SmallVec<[usize; 2]>>,
    /// Connections whose socket the engine does not watch for input while
    /// an application's lease on it lasts.
    pub muted: Vec<usize>,
    /// Spare list of the muted connections' sockets a sleep for leases
    /// looks at (see `run.rs`).
    pub lease_wires: Vec<Arc<super::wire::Wire>>,
    /// Swapped with the applications' muted list on adoption, so both
    /// keep their capacity (an application's mute allocates nothing).
    pub adopted: Vec<usize>,
    /// An application's receive left the engine a timer it may sleep past
    /// (an RNR wait): it must be woken.
    pub kick: bool,
    /// While a channel's `get_event` receives: that channel (its events
    /// are queued without a signal, see `CqShared::signal`).
    pub quiet: Option<Arc<Channel>>,
    /// QPs waiting for their peer's engine to connect, until when.
    conn_wait: Vec<(u32, Instant)>,
    /// When the oldest unanswered probe reaches `peer_timeout` (see
    /// `liveness.rs`).
    probe_check: Option<Instant>,
    /// An application's receive runs (see `drive.rs`).
    pub in_app: bool,
    /// Packets applications' receives handled (for tests and diagnostics).
    pub app_packets: u64,
    /// While an application's receive runs: when it started, the time its
    /// packets are handled at (a few µs at most off; one clock read per
    /// receive instead of one per packet and step).
    pub clock: Option<Instant>,
    /// The port other engines connect to: caps, proofs, deadlines.
    port: port::Port,
}

impl Engine {
    /// The engine of a new context (the listener is registered here).
    pub fn new(
        sh: Arc<Shared>,
        mut listener: mio::net::TcpListener,
        limits: PortLimits,
    ) -> io::Result<Engine> {
        sh.registry
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let listener_cc = pacing::unpace_listener(&listener);
        Ok(Engine {
            // Held ACKs wait only while the engine polls anyway (a sleeping
            // engine's timer is too coarse for them).
            ack_delay: env_us("VERBIO_SOFT_ACK_DELAY_US", DEFAULT_ACK_DELAY_US)
                .min(env_us("VERBIO_SOFT_SPIN_US", DEFAULT_SPIN_US)),
            sh,
            listener,
            listener_cc,
            conns: Slab::new(),
            peers: super::AddrMap::default(),
            qps: IdMap::default(),
            active: Vec::new(),
            held: Vec::new(),
            dirty_buf: Vec::new(),
            fired_buf: Vec::new(),
            active_buf: Vec::new(),
            resched_buf: Vec::new(),
            deadlines: timers::Deadlines::default(),
            due_buf: Vec::new(),
            probing: Vec::new(),
            cq_feeds: IdMap::default(),
            muted: Vec::new(),
            lease_wires: Vec::new(),
            adopted: Vec::new(),
            kick: false,
            quiet: None,
            conn_wait: Vec::new(),
            probe_check: None,
            in_app: false,
            app_packets: 0,
            clock: None,
            port: port::Port::new(limits),
        })
    }
}
