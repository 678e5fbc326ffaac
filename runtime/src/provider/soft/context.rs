//! The soft device context: opens the engine thread and its listener, hands
//! out PDs, MRs, CQs, channels and QPs, and stops the engine when the last
//! handle is gone.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ah::AhTable;
use super::channel::Channel;
use super::channel::CompChannel;
use super::cq::{Cq, CqShared};
use super::engine;
use super::events::EventQueue;
use super::lock;
use super::mr::{Mr, MrEntry, MrInner, MrTable};
use super::qp::{check_caps, state_to_u8, Qp, QpHandle, QpInner, QpShared};
use super::ud::{UdCounters, UdFaults, UdShared};
use super::wire::Wire;
use crate::provider::{
    AccessFlags, AsyncEvent, DeviceAttr, Gid, LinkLayer, Mtu, PortAttr, PortState, ProviderError,
    QpCaps, QpState, QpType, Result, SoftConfig,
};

/// Deepest work queue.
pub(crate) const MAX_QP_WR: u32 = 16 * 1024;
/// Most SGEs per WR.
pub(crate) const MAX_SGE: u32 = 16;
/// Largest inline payload.
pub(crate) const MAX_INLINE: u32 = 1024;
/// Largest CQ.
pub(crate) const MAX_CQE: u32 = 1 << 20;
/// Incoming / outgoing READ+atomic depth advertised.
pub(crate) const MAX_RD_ATOM: u32 = 16;

/// State shared by every handle of one context and its engine thread.
pub(crate) struct Shared {
    pub name: String,
    pub addr: SocketAddr,
    pub gid: Gid,
    pub seed: u32,
    mrs: Mutex<MrTable>,
    pub qps: Mutex<HashMap<u32, Arc<QpShared>>>,
    /// QPs with new work or a state change, for the engine.
    pub dirty: Mutex<Vec<Arc<QpShared>>>,
    /// The engine is (about to be) asleep in its poll.
    pub sleeping: AtomicBool,
    /// The doorbell was rung ([`Shared::ring`]) since the engine last went
    /// to sleep: the engine wakes for it, later rings need no system call.
    /// Cleared by the engine before it sets `sleeping`.
    pub rung: AtomicBool,
    /// Doorbell system calls [`Shared::ring`] made (tests, diagnostics).
    pub rings: AtomicU64,
    /// Times the engine woke from its poll (tests watch it: a wake-up can
    /// be shorter than any poll of `sleeping`).
    pub wakes: AtomicU64,
    /// Loop turns the engine ran after a sleep its timer or timeout ended
    /// (not a doorbell, not input): wake-ups by time (tests, diagnostics).
    pub timer_wakes: AtomicU64,
    /// Times the engine, woken only to see whether leases ended, found
    /// them renewed and slept on without a loop turn (tests, diagnostics).
    pub lease_sleeps: AtomicU64,
    /// Times an application's renewal moved the engine's sleep for leases
    /// only later (tests, diagnostics; see `engine/lease_sleep.rs`).
    pub lease_moves: AtomicU64,
    /// The engine's sleep for leases only, which renewals move (see
    /// `engine/lease_sleep.rs`).
    pub lease_sleep: Mutex<engine::LeaseSleep>,
    /// Mirror of that sleep's wake-up, read without the lock (0: none).
    pub lease_wake_hint: AtomicU64,
    /// Times a muted socket's lease ended with data waiting on it that
    /// no application had read: that data waited for the lease's end
    /// (tests, diagnostics; see `drive.rs`).
    pub stale_leases: AtomicU64,
    /// Times the engine sent held ACKs alone (no request came to take them
    /// along) longer than `LATE_HOLD` (`engine/tx.rs`) after their hold
    /// ended: they waited for the engine to wake (tests, diagnostics).
    pub late_holds: AtomicU64,
    /// Times an application arming a CQ wrote the ACKs a receive held for
    /// its next request (none came: see `Cq::req_notify`; diagnostics).
    pub arm_flushes: AtomicU64,
    /// Times an application's receive gave its sockets back to the engine
    /// (the engine was at work; see `channel.rs`).
    pub hand_backs: AtomicU64,
    /// Requests posting threads transmitted themselves (`direct.rs`; for
    /// tests and diagnostics).
    pub direct_sends: AtomicU64,
    /// Of those, large ones whose unsent rest the posting thread left in
    /// its memory for the engine to write (for tests and diagnostics).
    pub direct_rest_in_memory: AtomicU64,
    /// Of `direct_sends`, those corked to go out with later ones
    /// (`Wire::try_write_or_cork`; tests, diagnostics).
    pub corked_sends: AtomicU64,
    /// `send`s of corked requests by a flush (`Shared::flush_corked`; tests,
    /// diagnostics).
    pub cork_flushes: AtomicU64,
    /// Connections with requests corked, for [`Shared::flush_corked`]
    /// (a connection may be listed with nothing corked any more).
    pub corked: Mutex<Vec<Arc<Wire>>>,
    /// Mirror of `!corked.is_empty()` (a hint read without the lock).
    pub corked_hint: AtomicBool,
    /// Times the engine found a connection's socket full with output left
    /// (it waits for the socket to drain then; tests, diagnostics).
    pub tx_blocked: AtomicU64,
    /// The engine's writes to its connections' sockets (`sendmsg` calls;
    /// tests, diagnostics).
    pub tx_writes: AtomicU64,
    /// The engine delivered a successful completion since it last looked
    /// (engine thread only): its application will likely post again soon.
    pub completed: AtomicBool,
    /// CQs disarmed by a completion this loop turn, whose channel events the
    /// engine raises at the end of the turn (engine thread only).
    pub fired: Mutex<Vec<Arc<CqShared>>>,
    /// CQs that overflowed: the engine moves their QPs to ERR.
    pub overflowed: Mutex<Vec<Arc<CqShared>>>,
    /// `overflowed` is not empty (both changed under the engine lock).
    pub any_overflowed: AtomicBool,
    /// While `sleeping`: when the engine wakes at the latest
    /// ([`Shared::nanos_at`]; `u64::MAX` = not before it is woken).
    pub wake_by: AtomicU64,
    /// When the engine must run a loop turn at the latest for what
    /// posting threads and applications' receives left it since its last
    /// turn (WRs transmitted directly, held ACKs, timers; the minimum of
    /// their needs, [`Shared::nanos_at`]; `u64::MAX` = nothing). A wake-up
    /// only to see whether leases ended skips its turn while this is later
    /// than the next wake-up (see `engine/run.rs`).
    pub turn_by: AtomicU64,
    /// Origin of `wake_by`.
    pub epoch: Instant,
    pub waker: mio::Waker,
    /// The engine's epoll registry (also used by applications handing a
    /// connection's socket back to the engine, see `drive.rs`).
    pub registry: mio::Registry,
    /// How long an application's poll keeps a connection's socket off the
    /// engine's watch list (`VERBIO_SOFT_LEASE_US`, default 1000; 0 = the
    /// engine alone receives).
    pub lease: Duration,
    /// Connections whose socket input an application stopped the engine
    /// from watching when it armed a CQ they feed (their socket joined the
    /// CQ's channel): the engine adds them to its muted list, to watch
    /// them again once the lease ends (see `Cq::req_notify`).
    pub app_muted: Mutex<Vec<usize>>,
    pub stop: AtomicBool,
    pub async_events: Arc<EventQueue<AsyncEvent>>,
    /// Live address handles (see `ah.rs`).
    pub ahs: Mutex<AhTable>,
    /// The connection to each remote engine, by its address (kept by the
    /// engine), for posting threads that transmit datagrams themselves.
    pub wires: Mutex<super::AddrMap<Arc<Wire>>>,
    /// UD counters and fault injection.
    pub ud: UdShared,
    next_qpn: AtomicU32,
    next_cq: AtomicU32,
    next_pd: AtomicU32,
}

impl Shared {
    pub fn mrs(&self) -> MutexGuard<'_, MrTable> {
        lock(&self.mrs)
    }

    /// Puts `qp` on the dirty list (once) and rings the doorbell.
    pub fn notify(&self, qp: &Arc<QpShared>) {
        if !qp.dirty.swap(true, Ordering::AcqRel) {
            lock(&self.dirty).push(qp.clone());
        }
        self.ring();
    }

    /// Nanoseconds from `epoch` to `t`.
    pub fn nanos_at(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant `nanos` after `epoch`.
    pub fn instant_at(&self, nanos: u64) -> Instant {
        self.epoch + Duration::from_nanos(nanos)
    }

    /// After a posting thread transmitted a WR of `qp` itself: the engine
    /// takes the WR over when it next looks at `qp` (it must do so before the
    /// WR's ACK timeout, `timeout`) or at once if `now` (it has bytes to
    /// write). Rings the doorbell only if the engine would not wake in time.
    /// `at`: when the WR was written.
    pub fn notify_direct(
        &self,
        qp: &Arc<QpShared>,
        now: bool,
        timeout: Option<Duration>,
        at: Instant,
    ) {
        if !qp.dirty.swap(true, Ordering::AcqRel) {
            lock(&self.dirty).push(qp.clone());
        }
        let need = timeout.map(|t| self.nanos_at(at + t));
        if let Some(n) = need {
            self.turn_by.fetch_min(n, Ordering::SeqCst);
        }
        fence(Ordering::SeqCst);
        if !self.sleeping.load(Ordering::SeqCst) {
            return;
        }
        let late = match need {
            _ if now => true,
            None => false,
            Some(need) => self.wake_by.load(Ordering::SeqCst) > need,
        };
        if late {
            if let Err(e) = self.waker.wake() {
                tracing::error!(error = %crate::report::ErrorChain(&e), "soft engine waker failed");
            }
        }
    }

    /// An application stopped the engine from watching connection `cid`'s
    /// input until `lease_until` (its socket joined a channel's set): the
    /// engine must learn of it, and wake by then to watch it again should
    /// the lease end (it is rung if it sleeps longer).
    pub fn app_muted(&self, cid: usize, lease_until: u64) {
        lock(&self.app_muted).push(cid);
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) && self.wake_by.load(Ordering::SeqCst) > lease_until
        {
            if let Err(e) = self.waker.wake() {
                tracing::error!(error = %crate::report::ErrorChain(&e), "soft engine waker failed");
            }
        }
    }

    /// A poster corked a request on `wire`, which had none corked: lists it
    /// for [`flush_corked`](Self::flush_corked).
    pub fn note_corked(&self, wire: &Arc<Wire>) {
        lock(&self.corked).push(wire.clone());
        self.corked_hint.store(true, Ordering::Release);
    }

    /// Writes the requests posters corked (`Wire::try_write_or_cork`):
    /// called where a burst of posts ends (an application's poll or arming
    /// of a CQ) and at the end of every receive, the engine's or an
    /// application's (the ACKs of the requests in flight behind which they
    /// were corked bring one), so a corked request waits at most for the
    /// ACK of one sent before it. One atomic load when nothing is corked.
    pub fn flush_corked(&self) {
        if !self.corked_hint.load(Ordering::Acquire) {
            return;
        }
        let wires = {
            let mut l = lock(&self.corked);
            self.corked_hint.store(false, Ordering::Release);
            std::mem::take(&mut *l)
        };
        for w in &wires {
            match w.flush_corked() {
                None => continue,
                Some(super::wire::DirectWrite::Spilled) => self.ring(),
                Some(super::wire::DirectWrite::Sent) => {}
            }
            self.cork_flushes.fetch_add(1, Ordering::Relaxed);
        }
        // (Keeps the list's allocation.)
        let mut wires = wires;
        wires.clear();
        let mut l = lock(&self.corked);
        if l.is_empty() {
            *l = wires;
        }
    }

    /// Wakes the engine, with a syscall only if it sleeps.
    ///
    /// At most one ring per sleep of the engine makes the syscall: the
    /// posts that follow before it wakes (a window of 128 SENDs goes as 16
    /// lists of `DEFER_MAX`, each ringing) would write the `eventfd` again
    /// for the same wake-up.
    pub fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) && !self.rung.swap(true, Ordering::SeqCst) {
            self.rings.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.waker.wake() {
                tracing::error!(error = %crate::report::ErrorChain(&e), "soft engine waker failed");
            }
        }
    }
}

pub(crate) struct CtxInner {
    shared: Arc<Shared>,
    /// The engine's state: locked by the engine thread while it works (not
    /// while it sleeps) and by applications driving receives (`drive.rs`).
    core: Arc<Mutex<engine::Engine>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        let sh = &self.shared;
        tracing::debug!(
            device = %sh.name,
            wakes = sh.wakes.load(Ordering::Relaxed),
            rings = sh.rings.load(Ordering::Relaxed),
            timer_wakes = sh.timer_wakes.load(Ordering::Relaxed),
            lease_sleeps = sh.lease_sleeps.load(Ordering::Relaxed),
            lease_moves = sh.lease_moves.load(Ordering::Relaxed),
            stale_leases = sh.stale_leases.load(Ordering::Relaxed),
            hand_backs = sh.hand_backs.load(Ordering::Relaxed),
            late_holds = sh.late_holds.load(Ordering::Relaxed),
            arm_flushes = sh.arm_flushes.load(Ordering::Relaxed),
            direct_sends = sh.direct_sends.load(Ordering::Relaxed),
            direct_rest_in_memory = sh.direct_rest_in_memory.load(Ordering::Relaxed),
            corked_sends = sh.corked_sends.load(Ordering::Relaxed),
            cork_flushes = sh.cork_flushes.load(Ordering::Relaxed),
            tx_blocked = sh.tx_blocked.load(Ordering::Relaxed),
            tx_writes = sh.tx_writes.load(Ordering::Relaxed),
            "soft engine counters"
        );
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.shared.waker.wake() {
            tracing::error!(error = %crate::report::ErrorChain(&e), "cannot wake the soft engine to stop it");
        }
        if let Some(t) = lock(&self.thread).take() {
            if t.join().is_err() {
                tracing::error!("soft engine thread panicked");
            }
        }
    }
}

/// An opened soft device: owns the engine thread.
#[derive(Clone)]
pub struct Context(Arc<CtxInner>);

/// The GID of the engine listening on `ip`: IPv4 mapped into IPv6, or the
/// IPv6 address.
pub(crate) fn gid_of(ip: IpAddr) -> Gid {
    match ip {
        IpAddr::V4(v4) => Gid(v4.to_ipv6_mapped().octets()),
        IpAddr::V6(v6) => Gid(v6.octets()),
    }
}

fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> ProviderError {
    move |source| ProviderError::Io { context, source }
}

impl Context {
    pub(crate) fn shared(&self) -> &Shared {
        &self.0.shared
    }

    /// The engine's state, for an application that drives receives.
    pub(crate) fn core(&self) -> &Mutex<engine::Engine> {
        &self.0.core
    }

    /// True if both handles name the same opened device.
    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Opens a device: binds the listener and starts the engine thread.
    pub fn open(config: SoftConfig) -> Result<Context> {
        let std_listener =
            std::net::TcpListener::bind(config.bind).map_err(io_err("soft device: bind"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(io_err("soft device: set_nonblocking"))?;
        let addr = std_listener
            .local_addr()
            .map_err(io_err("soft device: local_addr"))?;
        let listener = mio::net::TcpListener::from_std(std_listener);
        let poll = mio::Poll::new().map_err(io_err("soft device: epoll"))?;
        let waker = mio::Waker::new(poll.registry(), engine::WAKER)
            .map_err(io_err("soft device: waker"))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(io_err("soft device: epoll registry"))?;
        let mut h = RandomState::new().build_hasher();
        h.write_u64(u64::from(addr.port()));
        let seed = h.finish() as u32;
        let shared = Arc::new(Shared {
            name: config.name.clone(),
            addr,
            gid: gid_of(addr.ip()),
            seed,
            mrs: Mutex::new(MrTable::default()),
            qps: Mutex::new(HashMap::new()),
            dirty: Mutex::new(Vec::new()),
            sleeping: AtomicBool::new(false),
            rung: AtomicBool::new(false),
            rings: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
            timer_wakes: AtomicU64::new(0),
            lease_sleeps: AtomicU64::new(0),
            lease_moves: AtomicU64::new(0),
            lease_sleep: Mutex::new(engine::LeaseSleep::default()),
            lease_wake_hint: AtomicU64::new(0),
            stale_leases: AtomicU64::new(0),
            hand_backs: AtomicU64::new(0),
            late_holds: AtomicU64::new(0),
            arm_flushes: AtomicU64::new(0),
            direct_sends: AtomicU64::new(0),
            direct_rest_in_memory: AtomicU64::new(0),
            corked_sends: AtomicU64::new(0),
            cork_flushes: AtomicU64::new(0),
            corked: Mutex::new(Vec::new()),
            corked_hint: AtomicBool::new(false),
            tx_blocked: AtomicU64::new(0),
            tx_writes: AtomicU64::new(0),
            completed: AtomicBool::new(false),
            fired: Mutex::new(Vec::new()),
            overflowed: Mutex::new(Vec::new()),
            any_overflowed: AtomicBool::new(false),
            wake_by: AtomicU64::new(u64::MAX),
            turn_by: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
            waker,
            registry,
            lease: engine::env_us("VERBIO_SOFT_LEASE_US", engine::DEFAULT_LEASE_US),
            app_muted: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            async_events: Arc::new(EventQueue::new()?),
            ahs: Mutex::new(AhTable::default()),
            wires: Mutex::new(super::AddrMap::default()),
            ud: UdShared::default(),
            next_qpn: AtomicU32::new(0x100 + (seed & 0xffff)),
            next_cq: AtomicU32::new(1),
            next_pd: AtomicU32::new(1),
        });
        let core = Arc::new(Mutex::new(
            engine::Engine::new(shared.clone(), listener, engine::PortLimits::of(&config))
                .map_err(io_err("soft device: register listener"))?,
        ));
        let eng_core = core.clone();
        let thread = std::thread::Builder::new()
            .name(format!("verbio-soft-{}", addr.port()))
            .spawn(move || engine::run(eng_core, poll))
            .map_err(io_err("soft device: spawn engine"))?;
        tracing::debug!(%addr, name = %config.name, "soft device opened");
        Ok(Context(Arc::new(CtxInner {
            shared,
            core,
            thread: Mutex::new(Some(thread)),
        })))
    }

    /// What the engine's port holds now (connections, buffer bytes) and
    /// what it refused so far (see `docs/soft-device.md`, "The engine's
    /// port"). Takes the engine's lock: it waits for the engine's current
    /// loop turn.
    pub fn port_stats(&self) -> engine::PortStats {
        lock(&self.0.core).port_stats()
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.shared().name
    }

    /// Device attributes (the limits this device enforces).
    pub fn query_device(&self) -> Result<DeviceAttr> {
        Ok(DeviceAttr {
            fw_ver: concat!("verbio-soft ", env!("CARGO_PKG_VERSION")).to_string(),
            node_guid: (u64::from(self.shared().seed) << 16) | 0x5f7,
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 1,
            max_mr_size: 1 << 40,
            max_qp: 1 << 16,
            max_qp_wr: MAX_QP_WR,
            max_sge: MAX_SGE,
            max_cq: 1 << 16,
            max_cqe: MAX_CQE,
            max_mr: 1 << 20,
            max_pd: 1 << 16,
            max_qp_rd_atom: MAX_RD_ATOM,
            max_qp_init_rd_atom: MAX_RD_ATOM,
            phys_port_cnt: 1,
        })
    }

    /// Port attributes: port 1 only, always active, Ethernet, MTU 4096.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(ProviderError::InvalidArgument {
                call: "query_port",
                what: format!("port {port} (the soft device has port 1 only)"),
            });
        }
        Ok(PortAttr {
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu4096,
            lid: 0,
            gid_tbl_len: 1,
            link_layer: LinkLayer::Ethernet,
        })
    }

    /// GID 0 of port 1: the engine's IP (IPv4 mapped into IPv6).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        if port != 1 || index != 0 {
            return Err(ProviderError::InvalidArgument {
                call: "query_gid",
                what: format!("port {port} index {index}"),
            });
        }
        Ok(self.shared().gid)
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        let id = self.shared().next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(Pd(Arc::new(PdInner {
            ctx: self.clone(),
            id,
        })))
    }

    /// Creates a completion channel (an eventfd).
    pub fn create_comp_channel(&self) -> Result<CompChannel> {
        Ok(CompChannel {
            shared: Arc::new(Channel::new()?),
            _ctx: self.clone(),
        })
    }

    /// Creates a CQ with room for `cqe` completions.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompChannel>) -> Result<Cq> {
        if channel.is_some_and(|c| !c._ctx.same(self)) {
            return Err(ProviderError::InvalidArgument {
                call: "create_cq",
                what: "completion channel of another device context".into(),
            });
        }
        if cqe == 0 || cqe > MAX_CQE {
            return Err(ProviderError::InvalidArgument {
                call: "create_cq",
                what: format!("{cqe} entries (1..={MAX_CQE})"),
            });
        }
        let handle = self.shared().next_cq.fetch_add(1, Ordering::Relaxed);
        Ok(Cq {
            shared: Arc::new(CqShared::new(
                handle,
                cqe,
                channel.map(|c| c.shared.clone()),
                self.shared().async_events.clone(),
            )),
            _channel: channel.cloned(),
            _ctx: self.clone(),
        })
    }

    /// The async-event eventfd.
    pub fn async_fd(&self) -> RawFd {
        self.shared().async_events.fd()
    }

    /// Takes the next async event.
    pub fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
        Ok(self.shared().async_events.pop())
    }

    /// The engine's listener address.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared().addr
    }

    /// The device's UD counters: datagrams sent, delivered, dropped (by
    /// reason), duplicated and lost.
    pub fn ud_counters(&self) -> UdCounters {
        self.shared().ud.counters()
    }

    /// Fault injection for tests: from now on, the datagrams this device
    /// transmits are dropped or duplicated as `faults` says (`None` ends
    /// it). Refused if the fractions are not in 0..=1 or sum above 1.
    pub fn set_ud_faults(&self, faults: Option<UdFaults>) -> Result<()> {
        self.shared()
            .ud
            .set_faults(faults)
            .map_err(|what| ProviderError::InvalidArgument {
                call: "set_ud_faults",
                what,
            })
    }
}

pub(crate) struct PdInner {
    ctx: Context,
    id: u32,
}

/// A protection domain of the soft device.
#[derive(Clone)]
pub struct Pd(Arc<PdInner>);

impl Pd {
    /// Registers memory.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must stay valid until the last clone of the
    /// returned [`Mr`] is dropped; the engine reads and writes it (per
    /// `access`) at any time meanwhile, like a NIC's DMA.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        let needs_local_write = access.contains(AccessFlags::REMOTE_WRITE)
            || access.contains(AccessFlags::REMOTE_ATOMIC);
        if needs_local_write && !access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(ProviderError::InvalidArgument {
                call: "reg_mr",
                what: format!("{access:?}: remote write/atomic need LOCAL_WRITE"),
            });
        }
        if (addr as u64).checked_add(len as u64).is_none() {
            return Err(ProviderError::InvalidArgument {
                call: "reg_mr",
                what: "region wraps the address space".into(),
            });
        }
        let entry = MrEntry {
            pd: self.0.id,
            addr: addr as u64,
            len: len as u64,
            access,
        };
        let sh = self.0.ctx.shared();
        let (lkey, rkey) = sh.mrs().insert(entry, sh.seed);
        Ok(Mr(Arc::new(MrInner {
            ctx: self.0.ctx.clone(),
            lkey,
            rkey,
            entry,
        })))
    }

    /// Allocates a type 2 memory window, unbound.
    pub fn alloc_mw(&self) -> Result<super::Mw> {
        let sh = self.0.ctx.shared();
        let mut mrs = sh.mrs();
        let index = mrs.next_window_index(sh.seed);
        let key = (index ^ sh.seed) as u8;
        mrs.windows.insert(self.0.id, index, key);
        drop(mrs);
        Ok(super::Mw(Arc::new(super::mw::MwInner {
            ctx: self.0.ctx.clone(),
            index,
        })))
    }

    /// Creates a UD QP in RESET.
    pub fn create_ud_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        self.new_qp(send_cq, recv_cq, caps, QpType::Ud, None)
    }

    /// Creates an address handle.
    pub fn create_ah(&self, attr: &crate::provider::AhAttr) -> Result<super::Ah> {
        super::Ah::create(&self.0.ctx, self.0.id, attr)
    }

    /// Creates a shared receive queue (`srq.rs`).
    pub fn create_srq(&self, attr: &crate::provider::SrqAttr) -> Result<super::Srq> {
        super::Srq::create(self, self.0.ctx.shared().async_events.clone(), attr)
    }

    /// Creates an RC QP in RESET whose receives come from `srq`.
    pub fn create_qp_with_srq(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        srq: &super::Srq,
    ) -> Result<Qp> {
        if !srq.pd().0.ctx.same(&self.0.ctx) {
            return Err(ProviderError::InvalidArgument {
                call: "create_qp",
                what: "SRQ of another device context".into(),
            });
        }
        self.new_qp(send_cq, recv_cq, caps, QpType::Rc, Some(srq))
    }

    /// Creates an RC QP in RESET.
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        self.new_qp(send_cq, recv_cq, caps, QpType::Rc, None)
    }

    fn new_qp(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        qp_type: QpType,
        srq: Option<&super::Srq>,
    ) -> Result<Qp> {
        let mut caps = check_caps(&caps)?;
        if srq.is_some() {
            // The receive queue is the SRQ's (ibv_create_qp ignores the
            // receive sizes then).
            caps.max_recv_wr = 0;
            caps.max_recv_sge = 0;
        }
        if !send_cq._ctx.same(&self.0.ctx) || !recv_cq._ctx.same(&self.0.ctx) {
            return Err(ProviderError::InvalidArgument {
                call: "create_qp",
                what: "CQ of another device context".into(),
            });
        }
        let sh = self.0.ctx.shared();
        let qpn = loop {
            let n = sh.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
            if n != 0 && !lock(&sh.qps).contains_key(&n) {
                break n;
            }
        };
        let psn = (sh.seed.rotate_left(7) ^ qpn.wrapping_mul(0x9E37_79B1)) & 0x00ff_ffff;
        let shared = Arc::new(QpShared {
            qpn,
            pd: self.0.id,
            psn,
            qp_type,
            ud_psn: AtomicU32::new(0),
            caps,
            send_cq: send_cq.shared.clone(),
            recv_cq: recv_cq.shared.clone(),
            state: AtomicU8::new(state_to_u8(QpState::Reset)),
            inner: Mutex::new(QpInner {
                state: QpState::Reset,
                cfg: Default::default(),
                gen: 0,
                epoch: 0,
                // Grown as WRs are posted (bounded by the caps), not
                // allocated at their depth: an idle QP of 128 + 128 WRs
                // held 36 KiB of queue it never used (issue 31).
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_outstanding: 0,
                rq_outstanding: 0,
                direct: None,
                ud_direct: false,
                sent: VecDeque::new(),
            }),
            dirty: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
            direct_hint: AtomicBool::new(false),
            srq: srq.map(|s| s.shared().clone()),
        });
        lock(&sh.qps).insert(qpn, shared.clone());
        Ok(Qp(Arc::new(QpHandle {
            shared,
            ctx: self.0.ctx.clone(),
            _pd: self.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
        })))
    }
}

#[cfg(test)]
#[path = "context_tests.rs"]
mod tests;
