//! Shared helpers for provider-level tests: open a device, register buffers,
//! connect two RC QPs, and poll CQs with bounded waits.
#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::time::{Duration, Instant};

use verbio_runtime::provider::*;

/// How long a test waits for anything before failing.
pub const WAIT: Duration = Duration::from_secs(10);

/// Opens a fresh soft device on an ephemeral loopback port.
pub fn open_test_context() -> Context {
    Context::open_soft(SoftConfig::default()).expect("open soft device")
}

/// A zeroed, 8-byte aligned, registered buffer. The device may write it at
/// any time, so it is only read and written through copies.
pub struct RegBuf {
    mr: Option<Mr>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain heap memory accessed through raw-pointer copies.
unsafe impl Send for RegBuf {}
// SAFETY: as above; concurrent device access is the point of registration.
unsafe impl Sync for RegBuf {}

impl RegBuf {
    /// Allocates and registers `len` bytes (at least 8).
    pub fn new(pd: &Pd, len: usize, access: AccessFlags) -> RegBuf {
        let layout = Layout::from_size_align(len.max(8), 8).expect("layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        // SAFETY: the memory lives until Drop, which deregisters first.
        let mr = unsafe { pd.reg_mr(ptr, len, access) }.expect("reg_mr");
        RegBuf {
            mr: Some(mr),
            ptr,
            len,
        }
    }
    /// The registration.
    pub fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("registered")
    }
    /// Deregisters now (the memory stays allocated).
    pub fn dereg(&mut self) {
        self.mr = None;
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr().rkey()
    }
    /// An SGE over `[off, off + len)`.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr() + off as u64,
            length: len as u32,
            lkey: self.mr.as_ref().map_or(0, |m| m.lkey()),
        }
    }
    /// Copies the contents out.
    pub fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: `ptr` is valid for `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr(), self.len) };
        v
    }
    /// Copies `data` in at `off`.
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: in bounds (checked above).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
    /// Reads a native-endian u64 at `off`.
    pub fn u64_at(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.read()[off..off + 8]);
        u64::from_ne_bytes(b)
    }
    /// Fills with a pattern derived from `seed`.
    pub fn fill_pattern(&self, seed: u8) -> Vec<u8> {
        let data: Vec<u8> = (0..self.len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        self.write(0, &data);
        data
    }
}

impl Drop for RegBuf {
    fn drop(&mut self) {
        self.mr = None;
        let layout = Layout::from_size_align(self.len.max(8), 8).expect("layout");
        // SAFETY: allocated in `new` with this layout; deregistered above.
        unsafe { dealloc(self.ptr, layout) };
    }
}

/// Options for [`connect_pair`].
#[derive(Clone, Debug)]
pub struct PairOpts {
    /// Caps of both QPs.
    pub caps: QpCaps,
    /// Remote access both QPs allow.
    pub access: AccessFlags,
    /// RTS attributes of both QPs.
    pub rts: RtsAttr,
    /// RNR timer both responders advertise.
    pub min_rnr_timer: u8,
    /// CQ sizes.
    pub cqe: u32,
}

impl Default for PairOpts {
    fn default() -> Self {
        PairOpts {
            caps: QpCaps::default(),
            access: InitAttr::default().access,
            rts: RtsAttr::default(),
            min_rnr_timer: 1,
            cqe: 1024,
        }
    }
}

/// One end of a connected pair.
pub struct Side {
    /// Its device.
    pub ctx: Context,
    /// Its PD.
    pub pd: Pd,
    /// Send CQ.
    pub scq: Cq,
    /// Receive CQ.
    pub rcq: Cq,
    /// The QP.
    pub qp: Qp,
}

impl Side {
    /// A registered buffer in this side's PD.
    pub fn buf(&self, len: usize, access: AccessFlags) -> RegBuf {
        RegBuf::new(&self.pd, len, access)
    }
}

/// Creates a QP (RESET) with its own CQs.
pub fn make_side(ctx: &Context, opts: &PairOpts) -> Side {
    let pd = ctx.alloc_pd().expect("pd");
    let scq = ctx.create_cq(opts.cqe, None).expect("cq");
    let rcq = ctx.create_cq(opts.cqe, None).expect("cq");
    let qp = pd.create_qp(&scq, &rcq, opts.caps).expect("qp");
    Side {
        ctx: ctx.clone(),
        pd,
        scq,
        rcq,
        qp,
    }
}

/// Drives `qp` RESET → INIT → RTR → RTS towards `remote`.
pub fn bring_up(qp: &Qp, remote: Endpoint, opts: &PairOpts) {
    qp.modify_to_init(&InitAttr {
        access: opts.access,
        ..InitAttr::default()
    })
    .expect("init");
    qp.modify_to_rtr(&RtrAttr {
        remote,
        path_mtu: Mtu::Mtu4096,
        min_rnr_timer: opts.min_rnr_timer,
        max_dest_rd_atomic: 16,
        sgid_index: 0,
        hop_limit: 64,
    })
    .expect("rtr");
    qp.modify_to_rts(&opts.rts).expect("rts");
}

/// Two connected RC QPs, on `ctx_a` and `ctx_b` (which may be the same device).
pub fn connect_pair(ctx_a: &Context, ctx_b: &Context, opts: &PairOpts) -> (Side, Side) {
    let a = make_side(ctx_a, opts);
    let b = make_side(ctx_b, opts);
    let ea = a.qp.endpoint(0).expect("endpoint");
    let eb = b.qp.endpoint(0).expect("endpoint");
    bring_up(&a.qp, eb, opts);
    bring_up(&b.qp, ea, opts);
    (a, b)
}

/// Two connected QPs on two fresh devices with default options.
pub fn pair() -> (Side, Side) {
    let (ca, cb) = (open_test_context(), open_test_context());
    connect_pair(&ca, &cb, &PairOpts::default())
}

/// A send WR.
pub fn wr(wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) -> SendWr {
    SendWr {
        wr_id,
        sg_list: sges.iter().copied().collect(),
        op,
        flags,
    }
}

/// A receive WR.
pub fn rwr(wr_id: u64, sges: &[Sge]) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: sges.iter().copied().collect(),
    }
}

/// Polls until `n` completions arrived; panics after `timeout`.
pub fn poll_n_within(cq: &Cq, n: usize, timeout: Duration) -> Vec<Completion> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    let mut buf = [Completion::EMPTY; 32];
    while out.len() < n {
        let want = (n - out.len()).min(buf.len());
        let got = cq.poll(&mut buf[..want]).expect("poll");
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out: {} of {n} completions: {out:?}",
                out.len()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    out
}

/// Polls until `n` completions arrived (bounded by [`WAIT`]).
pub fn poll_n(cq: &Cq, n: usize) -> Vec<Completion> {
    poll_n_within(cq, n, WAIT)
}

/// Polls one completion.
pub fn poll_one(cq: &Cq) -> Completion {
    poll_n(cq, 1)[0]
}

/// Asserts that no completion arrives within `dur`.
pub fn expect_none(cq: &Cq, dur: Duration) {
    let deadline = Instant::now() + dur;
    let mut buf = [Completion::EMPTY; 4];
    while Instant::now() < deadline {
        let got = cq.poll(&mut buf).expect("poll");
        assert_eq!(got, 0, "unexpected completion: {:?}", &buf[..got]);
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits until the QP reports `state`.
pub fn wait_state(qp: &Qp, state: QpState) {
    let deadline = Instant::now() + WAIT;
    while qp.state() != state {
        assert!(Instant::now() < deadline, "QP stuck in {:?}", qp.state());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Local-write access.
pub const LW: AccessFlags = AccessFlags::LOCAL_WRITE;
