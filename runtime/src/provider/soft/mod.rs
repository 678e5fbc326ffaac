//! The software RDMA device: a faithful RC and UD "NIC" in pure Rust.
//!
//! Each opened [`Context`] runs one engine thread (`engine/`) that plays the
//! NIC. It sleeps in its own mio poll when idle; the post path only queues
//! WRs on the QP and rings a doorbell (a `mio::Waker`), with a syscall only
//! when the engine sleeps. After delivering a completion (its application
//! will likely post again at once) the engine keeps polling until that post
//! comes, for at most `VERBIO_SOFT_SPIN_US` µs (default 50, 0 = sleep at
//! once); waiting for the network it sleeps at once (arriving data wakes it,
//! and on a small machine an idle CPU serves the woken threads better).
//! The engine owns a TCP listener and one connection per remote engine
//! (TCP_NODELAY; of two engines, the one with the lower address connects,
//! so requests, responses and TCP's own ACKs of both directions share one
//! socket); QPs of the same device talk through an internal loopback
//! connection without sockets.
//!
//! One exception to "the engine does all the work": while the engine has
//! nothing left to send for a QP and nothing to write on its connection,
//! `post_send` of a SEND or WRITE of one packet (up to 1 MiB) encodes it and
//! writes it to the socket on the posting thread (`direct.rs`, `wire.rs`),
//! together with any ACKs the engine holds back for a request to ride with;
//! the engine takes the WR over for completion, RNR retries and timeouts
//! when it next looks at the QP, and is rung only if it would not wake in
//! time for the WR's ACK timeout (while posting threads transmit, it wakes at
//! least every 10 ms). This saves a thread hand-off per request; the price is
//! the encoding, a copy of the payload and a `send` on the posting thread.
//!
//! The other exception, on the receive side (`drive.rs`): an application
//! that busy-polls a CQ (polls it empty again without arming it) reads the
//! sockets of the CQ's connections itself in its poll, under the engine
//! lock if the engine is not at work, and runs the engine's own receive
//! code (placement, completions, ACKs and responses). The engine stops
//! watching such a socket's input while the application's lease on it lasts
//! (about 1 ms, renewed by every poll), and watches it again when the lease
//! ends or the application arms a CQ without a completion channel. With
//! both, a ping-pong between busy-polling applications needs no engine
//! thread at all: one thread hand-off per message, as with plain TCP.
//!
//! A sleeping application receives itself too (`channel.rs`): the
//! completion channel's fd is an epoll fd over the channel's eventfd and,
//! from the arming of a CQ on it, the sockets feeding that CQ; arming
//! renews the lease on them, and the engine stops watching their input.
//! The packet wakes the application (only), and its
//! `get_event` runs the same receive (try-lock on the engine) and returns
//! the event if that completed the armed CQ. If the engine is at work, or
//! writes to the connection (a bulk transfer), the socket goes back to the
//! engine and leaves the channel's set; an expired lease hands it back too.
//!
//! UD (`ud/`): UD QPs send `SendTo` datagrams of at most one MTU (4096
//! bytes; larger ones, and RC operations, fail at post) to the UD QP an
//! address handle (`ah.rs`: the destination engine's address, resolved per
//! datagram in the context's table while a clone lives; a dead one fails
//! the WR `LOC_QP_OP_ERR` and the QP, as on rxe) and a QPN name. Datagrams
//! share the RC connections (or the loopback one), one packet each, sent by
//! the engine or the posting thread (as above), completed once the packet
//! left; no ACKs, no retries. The receiver drops and counts a datagram with
//! no QP, a non-UD QP or one not in RTR/RTS, the wrong Q_Key, or no posted
//! receive (as rxe); otherwise it writes the GRH as rxe does for RoCE v2
//! (20 zero bytes and the IPv4 header between the two engines' addresses,
//! an IPv6 header for IPv6 engines) and the payload into the next receive,
//! or completes it `LOC_LEN_ERR` if it is too small. The context counts
//! datagrams ([`Context::ud_counters`]) and can drop and duplicate a
//! seeded fraction of those it sends ([`Context::set_ud_faults`], tests).
//! Not implemented: multicast, GSI, controlled Q_Keys, P_Keys.
//!
//! Files: `context.rs` (device, PD, limits), `ah.rs` (address handles),
//! `ud/` (datagrams: sending, receiving, the GRH, counters and faults), `mr.rs` (MR table: the engine
//! holds its lock while it touches registered memory, so deregistration takes
//! effect at once), `cq.rs` (CQs), `channel.rs` (the completion channel),
//! `events.rs` (eventfd-backed event queues: CQ and async events),
//! `qp.rs` (state machine, post path), `direct.rs` and `wire.rs` (the
//! posting thread's transmission), `drive.rs` (the polling thread's
//! receive), `engine/` (loop, QP intake, connections, rx, tx, timers),
//! `eqp.rs` (the engine's per-QP state, completions, flushing),
//! `requester.rs` / `responder.rs` (the two halves of RC), `conn/` (per-peer
//! buffers), `dma.rs` (every device access to registered memory, and why
//! none races the application's), `packet.rs`
//! (the versioned wire format; `packet::decode` never panics), `fuzz_check.rs`
//! (its property check, for the fuzz target; feature `fuzzing`).
//!
//! Completion-channel events are raised once per engine loop turn, after
//! all of that turn's completions are queued (like a NIC's interrupt
//! moderation), and outside every lock the woken consumer takes.
//!
//! Data path: SEND/WRITE payloads are cut into segments of up to 1 MiB; a
//! segment inside one SGE is written to the socket straight from registered
//! memory (`sendmsg`, no copy), and a WRITE, SEND or READ response segment
//! still arriving is read straight into the target MR, the receive WR's
//! SGEs or the READ's (`readv`; a SEND's receive WR is taken when its
//! first segment's header arrives). A posting thread's write of a lone
//! large payload leaves what the socket did not take in memory for the
//! engine (no copy either). Small, inline and multi-SGE payloads are copied
//! (64 KiB segments), and a READ response's last 4 KiB. Consecutive ACKs of one QP are
//! coalesced, and the ACK of a message that completed a receive may wait
//! (`VERBIO_SOFT_ACK_DELAY_US`, default 50, at most the spin time) for the
//! answer the receiving application usually posts at once, so both leave in
//! one write and wake the peer once. If a QP fails while a payload is still being sent from its
//! memory, the unsent rest is copied out first, so no completion ever reports
//! memory as free while the engine may still read it.
//!
//! Semantics follow RC hardware (DESIGN.md §2.1). Where rxe and the verbs
//! spec differ: a SEND longer than the posted RECV completes `REM_OP_ERR` at
//! the requester (as on rxe; mlx5 reports `REM_INV_REQ_ERR`) and
//! `LOC_LEN_ERR` at the responder (spec); a bad local key completes
//! `LOC_PROT_ERR` (spec; rxe `LOC_QP_OP_ERR`). The transport is TCP, so
//! nothing is retransmitted on an ACK timeout: timeouts only count towards
//! `retry_cnt` (a lost or silent peer, then `RETRY_EXC_ERR`), a closed
//! connection fails the QPs that use it at once, and an RNR NAK makes the
//! requester go back to the NAKed PSN after the responder's `min_rnr_timer`.
//! Unsignaled WRs free their send-queue slot when acknowledged.

mod addr;
mod ah;
mod channel;
mod conn;
mod context;
mod cq;
mod direct;
mod dma;
mod drive;
mod engine;
mod eqp;
mod events;
#[cfg(test)]
mod fake_peer_tests;
#[cfg(feature = "fuzzing")]
mod fuzz_check;
mod handshake;
#[cfg(test)]
mod liveness_tests;
mod mr;
mod mw;
mod packet;
#[cfg(test)]
mod port_tests;
mod qp;
#[cfg(test)]
mod read_resp_tests;
mod requester;
mod responder;
#[cfg(test)]
mod rnr_mid_send_tests;
mod srq;
mod ud;
mod wire;

pub(crate) use addr::{announced_addr, check_endpoint};
pub use ah::Ah;
pub use channel::CompChannel;
pub use context::{Context, Pd};
pub use cq::Cq;
pub use engine::PortStats;
pub use mr::Mr;
pub use mw::Mw;
pub use qp::Qp;
pub use srq::Srq;
pub use ud::{UdCounters, UdFaults};

#[cfg(feature = "fuzzing")]
pub use fuzz_check::{
    check_soft_handshake, check_soft_packet, soft_handshake_seeds, soft_packet_seeds,
    SOFT_HANDSHAKE_HEADER_LEN, SOFT_HANDSHAKE_LEN_OFFSET, SOFT_PACKET_HEADER_LEN,
    SOFT_PACKET_LEN_OFFSET,
};

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

use super::{DeviceInfo, ProviderKind};

/// A hash map keyed by one of the device's own 32-bit numbers (QPNs, CQ
/// handles, memory keys), looked up for every packet: hashed with one
/// multiplication instead of SipHash. The keys are allocated locally (a peer
/// can look keys up, not add them), so there is no flooding to defend
/// against.
pub(crate) type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// The hasher of [`IdMap`].
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(ID_MUL);
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(ID_MUL);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(ID_MUL);
    }

    fn finish(&self) -> u64 {
        // (The table indexes by the low bits: fold the well-mixed high
        // ones in.)
        self.0 ^ (self.0 >> 32)
    }
}

const ID_MUL: u64 = 0x9E37_79B9_7F4A_7C15;

/// A hash map keyed by a peer engine's address, looked up for every
/// datagram a posting thread sends (`ud/direct.rs`) and every QP's
/// connection the engine finds: hashed with [`IdHasher`]'s multiplication
/// from a per-map random key instead of SipHash (about 350 instructions
/// per lookup). Its keys are the addresses of connections the port
/// admitted (their number is capped, `engine/port.rs`), and the random key
/// keeps a peer from choosing addresses that collide.
pub(crate) type AddrMap<V> = HashMap<std::net::SocketAddr, V, AddrHash>;

/// The keyed hasher builder of [`AddrMap`].
#[derive(Clone)]
pub(crate) struct AddrHash(u64);

impl Default for AddrHash {
    fn default() -> AddrHash {
        use std::hash::BuildHasher;
        AddrHash(std::collections::hash_map::RandomState::new().hash_one(0u64) | 1)
    }
}

impl std::hash::BuildHasher for AddrHash {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(self.0)
    }
}

/// Locks a mutex, recovering from poisoning (the data stays consistent:
/// every critical section leaves it valid before anything can panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn device_info() -> DeviceInfo {
    DeviceInfo {
        name: "soft0".into(),
        kind: ProviderKind::Soft,
        guid: 0,
    }
}

/// True if `fd` is readable now (a zero-timeout `poll`): the tests of the
/// device's pollable fds use it, and the engine at a lease's end.
pub(crate) fn fd_readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

/// An outer poller watching one fd edge-triggered, as the runtime's mio
/// poll watches a completion channel's fd (tests of the device's pollable
/// fds: an edge-triggered watcher must be told of every event behind it).
#[cfg(test)]
pub(crate) struct EdgeWatch(std::os::fd::OwnedFd);

#[cfg(test)]
impl EdgeWatch {
    /// Watches `fd` (`EPOLLIN | EPOLLET`).
    pub(crate) fn new(fd: std::os::fd::RawFd) -> EdgeWatch {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: epoll_create1 has no memory-safety preconditions.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(raw >= 0, "epoll_create1");
        // SAFETY: `raw` is a fresh fd we own.
        let ep = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: 1,
        };
        // SAFETY: `ev` is a live epoll_event; both fds are open.
        let rc = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        assert_eq!(rc, 0, "epoll_ctl");
        EdgeWatch(ep)
    }

    /// The readiness reports waiting now (0 or 1: one fd), taken.
    pub(crate) fn edges(&self) -> usize {
        use std::os::fd::AsRawFd;
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: `evs` is a live array of 4 epoll_events; no wait.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), evs.as_mut_ptr(), 4, 0) };
        assert!(n >= 0, "epoll_wait");
        n as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_maps_keep_distinct_keys_apart() {
        let mut m = IdMap::default();
        for k in (0..4096u32).map(|i| i.wrapping_mul(0x0101_0101) ^ 0x100) {
            m.insert(k, k);
        }
        assert_eq!(m.len(), 4096);
        assert!(m.iter().all(|(k, v)| k == v));
        assert_eq!(m.get(&0x100), Some(&0x100));
        assert_eq!(m.get(&7), None);
    }

    #[test]
    fn addr_maps_keep_distinct_addresses_apart_under_a_key_of_their_own() {
        use std::hash::BuildHasher;
        use std::net::SocketAddr;
        let mut m = AddrMap::default();
        let addrs: Vec<SocketAddr> = (0..4096u32)
            .map(|i| {
                let ip = std::net::Ipv4Addr::from(0x7f00_0001 + (i >> 8));
                SocketAddr::from((ip, 40_000 + (i & 0xff) as u16))
            })
            .chain(["[::1]:40000".parse().expect("v6")])
            .collect();
        for (i, a) in addrs.iter().enumerate() {
            m.insert(*a, i);
        }
        assert_eq!(m.len(), addrs.len());
        assert!(addrs.iter().enumerate().all(|(i, a)| m.get(a) == Some(&i)));
        let other: SocketAddr = "127.0.0.1:1".parse().expect("v4");
        assert_eq!(m.get(&other), None);
        // Two maps hash one address apart (each its own random key).
        let (a, b) = (AddrHash::default(), AddrHash::default());
        assert_ne!(a.hash_one(other), b.hash_one(other));
    }
}
