//! Shared helpers of the ibverbs provider tests: device choice (skip when
//! there is none), registered buffers, a loopback RC pair, bounded CQ waits.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use verbio_runtime::provider::{
    ibverbs, AccessFlags, CompChannel, Completion, Context, Cq, DeviceInfo, InitAttr, Mr, Pd,
    ProviderKind, Qp, QpCaps, RtrAttr, RtsAttr, SgList, Sge,
};

/// Every wait in these tests is bounded by this (the VM is emulated and slow).
pub const WAIT: Duration = Duration::from_secs(20);

/// Opens the test device: `VERBIO_TEST_DEVICE`, else the first ibverbs device;
/// prints `SKIPPED: ...` and returns `None` when there is none.
pub fn device(test: &str) -> Option<Context> {
    let name = match std::env::var("VERBIO_TEST_DEVICE") {
        Ok(n) if !n.is_empty() => n,
        _ => match ibverbs::devices() {
            Ok(list) if !list.is_empty() => list[0].name.clone(),
            Ok(_) => {
                println!("SKIPPED: {test}: no ibverbs device (set VERBIO_TEST_DEVICE or run scripts/rxe-test.sh)");
                return None;
            }
            Err(e) => {
                println!("SKIPPED: {test}: {e} (run scripts/rxe-test.sh for the rxe VM)");
                return None;
            }
        },
    };
    let ctx = Context::open(&DeviceInfo {
        name: name.clone(),
        kind: ProviderKind::Ibverbs,
        guid: 0,
    })
    .unwrap_or_else(|e| panic!("opening test device {name}: {e}"));
    Some(ctx)
}

/// GID index for the loopback connection: `RXE_GID_INDEX` (set in the rxe VM)
/// or the provider's default.
pub fn gid_index(ctx: &Context) -> u8 {
    match std::env::var("RXE_GID_INDEX") {
        Ok(v) => v.parse().expect("RXE_GID_INDEX is a number"),
        Err(_) => ctx.default_gid_index(1).expect("default GID index"),
    }
}

/// A registered, 8-byte aligned buffer.
///
/// Why posting WRs over Bufs upholds the `unsafe` contract of
/// `Qp::post_send`/`post_recv` (the `// SAFETY:` comments at the posts in
/// these tests refer here): the tests write a Buf (`fill`, `set_word`) only
/// while no WR uses it, and read it (`bytes`, `word`) only after polling the
/// completions that end the device's access (or, for memory the device only
/// reads, with shared reads meanwhile). Its memory is heap memory that does
/// not move and outlives the registration (`mr` is dropped first), so a WR
/// still outstanding when a test fails loses its access before the memory is
/// freed; SGEs with bad lkeys or ranges (error tests) are never accessed.
pub struct Buf {
    // Declared first: deregistered before `mem` is freed.
    pub mr: Mr,
    mem: Box<[u64]>,
}

impl Buf {
    pub fn new(pd: &Pd, len: usize, access: AccessFlags) -> Buf {
        let mut mem = vec![0u64; len.div_ceil(8)].into_boxed_slice();
        // SAFETY: the boxed slice's heap memory does not move, and `mr` (never
        // cloned out of the Buf) is dropped before it (field order).
        let mr = unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), len, access) }.expect("reg_mr");
        Buf { mr, mem }
    }
    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: read after the completion that ends the device's access.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr().cast(), self.mr.len()) }
    }
    pub fn fill(&mut self, f: impl Fn(usize) -> u8) {
        let len = self.mr.len();
        // SAFETY: no work request touches the buffer while the test fills it.
        let s = unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr().cast::<u8>(), len) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = f(i);
        }
    }
    pub fn word(&self, i: usize) -> u64 {
        // SAFETY: as `bytes`.
        unsafe { std::ptr::read_volatile(self.mem.as_ptr().add(i)) }
    }
    pub fn set_word(&mut self, i: usize, v: u64) {
        self.mem[i] = v;
    }
    pub fn sge(&self, offset: usize, len: u32) -> SgList {
        let mut l = SgList::new();
        l.push(Sge {
            addr: self.addr() + offset as u64,
            length: len,
            lkey: self.mr.lkey(),
        });
        l
    }
}

/// Two RC QPs of one device connected to each other (loopback through the
/// device), each with its own CQ, both CQs on one completion channel.
pub struct Pair {
    pub ctx: Context,
    pub pd: Pd,
    pub channel: CompChannel,
    pub cq_a: Cq,
    pub cq_b: Cq,
    pub a: Qp,
    pub b: Qp,
}

pub fn pair(ctx: Context) -> Pair {
    pair_cfg(ctx, PairCfg::default())
}

/// [`pair`] with `cqe_a` entries in A's CQ.
pub fn pair_with(ctx: Context, cqe_a: u32) -> Pair {
    pair_cfg(
        ctx,
        PairCfg {
            cqe_a,
            ..PairCfg::default()
        },
    )
}

/// Knobs of [`pair_cfg`].
pub struct PairCfg {
    pub cqe_a: u32,
    pub caps: QpCaps,
    /// Responder's RNR NAK timer (both QPs).
    pub min_rnr_timer: u8,
    /// Requester's attributes (both QPs).
    pub rts: RtsAttr,
}

impl Default for PairCfg {
    fn default() -> Self {
        PairCfg {
            cqe_a: 64,
            caps: QpCaps::default(),
            min_rnr_timer: 12,
            rts: RtsAttr {
                timeout: 14,
                retry_cnt: 6,
                rnr_retry: 6,
                max_rd_atomic: 16,
            },
        }
    }
}

pub fn pair_cfg(ctx: Context, cfg: PairCfg) -> Pair {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let channel = ctx.create_comp_channel().expect("create_comp_channel");
    let cq_a = ctx
        .create_cq(cfg.cqe_a, Some(&channel))
        .expect("create_cq a");
    let cq_b = ctx.create_cq(64, Some(&channel)).expect("create_cq b");
    let a = pd.create_qp(&cq_a, &cq_a, cfg.caps).expect("create_qp a");
    let b = pd.create_qp(&cq_b, &cq_b, cfg.caps).expect("create_qp b");
    let gid = gid_index(&ctx);
    for q in [&a, &b] {
        q.modify_to_init(&InitAttr::default()).expect("INIT");
    }
    let ea = a.endpoint(gid).expect("endpoint a");
    let eb = b.endpoint(gid).expect("endpoint b");
    for (q, remote, local) in [(&a, eb, ea), (&b, ea, eb)] {
        q.modify_to_rtr(&RtrAttr {
            remote,
            path_mtu: local.mtu.min(remote.mtu),
            min_rnr_timer: cfg.min_rnr_timer,
            max_dest_rd_atomic: 16,
            sgid_index: gid,
            hop_limit: 64,
        })
        .expect("RTR");
        q.modify_to_rts(&cfg.rts).expect("RTS");
    }
    Pair {
        ctx,
        pd,
        channel,
        cq_a,
        cq_b,
        a,
        b,
    }
}

/// Polls `cq` until `n` completions arrived; panics after [`WAIT`].
pub fn wait(cq: &Cq, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    let mut buf = [Completion::EMPTY; 8];
    while got.len() < n {
        let k = cq.poll(&mut buf).expect("poll");
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} completions, got {got:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    got
}
