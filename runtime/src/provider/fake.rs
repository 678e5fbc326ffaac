//! A test-only provider (feature `test-util`), the way mio's `sys/shell`
//! is a backend: a queue pair that records what is posted and a CQ that
//! delivers the completions the test produces, so ops, verbs and the
//! reactor can be unit-tested without any device. The runtime uses it like
//! any provider: `provider::Qp` and `provider::Cq` have a fake variant only
//! when the feature is on, and the reactor polls the fake CQ as it polls a
//! real one.
//!
//! The fake follows the verbs rules the runtime relies on: it refuses a post
//! that would overrun its queues (`QueueFull`), a successful completion of a
//! signaled send retires every earlier unsignaled WR, and moving to ERR
//! flushes every outstanding WR (signaled or not) with `WR_FLUSH_ERR`, as
//! does any post made while in ERR. It never reads or writes the memory the
//! posted SGEs name (it keeps only wr_ids, flags and opcodes).
//!
//! Provider objects are `Send + Sync`; the fake's state is not (it is as
//! cheap as the runtime it measures). So a fake lives in a registry of the
//! thread that made it, until that thread ends, and its provider handles
//! ([`Qp`], [`Cq`]) point at it and name that thread: used from another
//! thread (or after the registry is gone) they fail (`Unsupported`). The
//! check is one read of a thread-local number, and the fake is reached
//! without a lookup.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod fifo;
mod send_queue;

use fifo::Fifo;
use send_queue::SendQueue;

use crate::provider::{
    Completion, Endpoint, InitAttr, PostError, ProviderError, QpCaps, QpState, QpType, RecvWr,
    RtrAttr, RtsAttr, SendFlags, SendWr, UdAttr, WcOpcode, WcStatus, GRH_LEN,
};

/// A recording QP; see the module docs.
pub struct FakeQp {
    /// Where its completions go.
    cq: Rc<FakeCq>,
    qp_num: u32,
    caps: QpCaps,
    sends: RefCell<SendQueue>,
    recvs: RefCell<VecDeque<u64>>,
    in_err: Cell<bool>,
    flush_on_err: Cell<bool>,
    doorbells: Cell<usize>,
    max_sends: Cell<usize>,
    fail_next: RefCell<Option<(usize, ProviderError)>>,
    /// `fail_next.is_some()` (the post path checks it without a borrow).
    fail_armed: Cell<bool>,
    err_transitions: Cell<usize>,
}

impl FakeQp {
    /// A fake QP number `qp_num` with queue sizes `caps`, completing on `cq`.
    pub(crate) fn new(qp_num: u32, caps: QpCaps, cq: Rc<FakeCq>) -> Rc<FakeQp> {
        Rc::new(FakeQp {
            cq,
            qp_num,
            caps,
            sends: RefCell::new(SendQueue::default()),
            recvs: RefCell::new(VecDeque::new()),
            in_err: Cell::new(false),
            flush_on_err: Cell::new(true),
            doorbells: Cell::new(0),
            max_sends: Cell::new(0),
            fail_next: RefCell::new(None),
            fail_armed: Cell::new(false),
            err_transitions: Cell::new(0),
        })
    }

    fn completion(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, len: u32) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            byte_len: if status.is_success() { len } else { 0 },
            imm_data: None,
            qp_num: self.qp_num,
            ..Completion::EMPTY
        }
    }

    /// The armed failure of [`fail_next_post`](Self::fail_next_post), if any.
    #[cold]
    fn take_failure(&self) -> Option<(usize, ProviderError)> {
        self.fail_armed.set(false);
        self.fail_next.borrow_mut().take()
    }

    /// `ibv_post_send`: records the WRs (no memory is touched).
    pub(crate) fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        if self.fail_armed.get() {
            if let Some((posted, error)) = self.take_failure() {
                self.sends
                    .borrow_mut()
                    .extend(&wrs[..posted.min(wrs.len())]);
                return Err(PostError { posted, error });
            }
        }
        self.doorbells.set(self.doorbells.get() + 1);
        let mut q = self.sends.borrow_mut();
        let room = (self.caps.max_send_wr as usize).saturating_sub(q.len());
        if wrs.len() <= room && !self.in_err.get() {
            // The common case: the whole list fits, nothing is flushed.
            q.extend(wrs);
        } else {
            for (i, wr) in wrs.iter().enumerate() {
                if q.len() >= self.caps.max_send_wr as usize {
                    return Err(self.send_queue_full(i));
                }
                if self.in_err.get() {
                    let op = wr.op.completion_opcode();
                    self.cq
                        .push(self.completion(wr.wr_id, WcStatus::WrFlushErr, op, 0));
                } else {
                    q.extend(std::slice::from_ref(wr));
                }
            }
        }
        self.max_sends.set(self.max_sends.get().max(q.len()));
        Ok(())
    }

    /// The send queue overflowed after `posted` WRs of a list.
    #[cold]
    fn send_queue_full(&self, posted: usize) -> PostError {
        PostError {
            posted,
            error: ProviderError::QueueFull {
                qp_num: self.qp_num,
                queue: "send",
                depth: self.caps.max_send_wr,
            },
        }
    }

    /// `ibv_post_recv`: records the WRs.
    pub(crate) fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        if self.fail_armed.get() {
            if let Some((posted, error)) = self.take_failure() {
                return Err(PostError { posted, error });
            }
        }
        self.doorbells.set(self.doorbells.get() + 1);
        let mut q = self.recvs.borrow_mut();
        for (i, wr) in wrs.iter().enumerate() {
            if q.len() >= self.caps.max_recv_wr as usize {
                return Err(PostError {
                    posted: i,
                    error: ProviderError::QueueFull {
                        qp_num: self.qp_num,
                        queue: "receive",
                        depth: self.caps.max_recv_wr,
                    },
                });
            }
            if self.in_err.get() {
                self.cq
                    .push(self.completion(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0));
            } else {
                q.push_back(wr.wr_id);
            }
        }
        Ok(())
    }

    /// Moves the fake to ERR (what the device does after an error
    /// completion): every outstanding WR is flushed with `WR_FLUSH_ERR`
    /// (unless [`set_flush_on_err(false)`](Self::set_flush_on_err)), and so is
    /// every later post.
    pub fn modify_to_err(&self) -> Result<(), ProviderError> {
        self.in_err.set(true);
        self.err_transitions.set(self.err_transitions.get() + 1);
        if !self.flush_on_err.get() {
            return Ok(());
        }
        let sends = self.sends.borrow_mut().take_all();
        for (id, _, op) in sends {
            self.cq
                .push(self.completion(id, WcStatus::WrFlushErr, op, 0));
        }
        let recvs: Vec<_> = self.recvs.borrow_mut().drain(..).collect();
        for id in recvs {
            self.cq
                .push(self.completion(id, WcStatus::WrFlushErr, WcOpcode::Recv, 0));
        }
        Ok(())
    }

    /// Completes the oldest outstanding send. With `Success`, every WR up to
    /// and including the next signaled one retires and one completion (of the
    /// signaled WR) is produced; with an error status only the oldest WR
    /// completes (with that status). Returns the completed wr_id.
    pub fn complete_send(&self, status: WcStatus, byte_len: u32) -> Option<u64> {
        let mut q = self.sends.borrow_mut();
        let done = if status.is_success() {
            q.retire_to_signaled()?
        } else {
            q.pop_front()?
        };
        drop(q);
        self.cq
            .push(self.completion(done.0, status, done.2, byte_len));
        Some(done.0)
    }

    /// Completes every outstanding send that [`complete_send`](Self::complete_send)
    /// would complete if called until it returns `None` (with `Success`,
    /// trailing unsignaled WRs stay on the queue), in one call; returns how
    /// many completions it produced.
    pub fn complete_sends(&self, status: WcStatus, byte_len: u32) -> usize {
        let mut q = self.sends.borrow_mut();
        let success = status.is_success();
        // With success, unsignaled WRs retire with the next signaled one:
        // everything up to the newest signaled WR goes.
        let end = if success {
            q.through_last_signaled()
        } else {
            q.len()
        };
        if end == 0 {
            return 0;
        }
        let mut cq = self.cq.queue.borrow_mut();
        let before = cq.len();
        let qp_num = self.qp_num;
        let byte_len = if success { byte_len } else { 0 };
        cq.extend(
            q.front(end)
                .iter()
                .filter(|&&(_, f, _)| !success || f.contains(SendFlags::SIGNALED))
                .map(|&(wr_id, _, opcode)| Completion {
                    wr_id,
                    status,
                    opcode,
                    byte_len,
                    qp_num,
                    ..Completion::EMPTY
                }),
        );
        q.retire_front(end);
        cq.len() - before
    }

    /// Completes the oldest posted receive with `status` and `byte_len`.
    pub fn complete_recv(&self, status: WcStatus, byte_len: u32) -> Option<u64> {
        let id = self.recvs.borrow_mut().pop_front()?;
        self.cq
            .push(self.completion(id, status, WcOpcode::Recv, byte_len));
        Some(id)
    }

    /// Completes the oldest posted receive successfully with `byte_len`
    /// bytes and immediate data `imm`.
    pub fn complete_recv_imm(&self, byte_len: u32, imm: u32) -> Option<u64> {
        let id = self.recvs.borrow_mut().pop_front()?;
        let mut c = self.completion(id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, byte_len);
        c.imm_data = Some(imm);
        self.cq.push(c);
        Some(id)
    }

    /// UD: completes the oldest posted receive with a datagram of
    /// `payload_len` bytes (after the GRH) from QP `src_qp`. The fake
    /// writes no memory: the GRH area keeps what it held.
    pub fn complete_datagram(
        &self,
        status: WcStatus,
        payload_len: u32,
        src_qp: u32,
    ) -> Option<u64> {
        let id = self.recvs.borrow_mut().pop_front()?;
        let byte_len = GRH_LEN as u32 + payload_len;
        let mut c = self.completion(id, status, WcOpcode::Recv, byte_len);
        c.src_qp = src_qp;
        c.grh = true;
        self.cq.push(c);
        Some(id)
    }

    /// Send WRs on the queue (posted, not retired).
    pub fn outstanding_sends(&self) -> usize {
        self.sends.borrow().len()
    }

    /// Receive WRs on the queue.
    pub fn outstanding_recvs(&self) -> usize {
        self.recvs.borrow().len()
    }

    /// The (wr_id, flags) of the outstanding sends, oldest first.
    pub fn posted_sends(&self) -> Vec<(u64, SendFlags)> {
        self.sends
            .borrow()
            .iter()
            .map(|(i, f, _)| (*i, *f))
            .collect()
    }

    /// Highest number of sends ever outstanding at once.
    pub fn max_outstanding_sends(&self) -> usize {
        self.max_sends.get()
    }

    /// Successful post calls (doorbells).
    pub fn doorbells(&self) -> usize {
        self.doorbells.get()
    }

    /// How many times the QP was moved to ERR.
    pub fn err_transitions(&self) -> usize {
        self.err_transitions.get()
    }

    /// With `false`, moving to ERR flushes nothing (a device that never
    /// answers: to test the runtime's bounded shutdown).
    pub fn set_flush_on_err(&self, on: bool) {
        self.flush_on_err.set(on);
    }

    /// Delivers `c` as if the fake's CQ had produced it (any wr_id, any QP
    /// number: e.g. a reserved wr_id, or a stale one).
    pub fn inject(&self, c: Completion) {
        self.cq.push(c);
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// Queue sizes.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// True once moved to ERR.
    pub fn in_err(&self) -> bool {
        self.in_err.get()
    }

    /// Makes the next post fail after accepting `posted` WRs.
    pub fn fail_next_post(&self, posted: usize, error: ProviderError) {
        *self.fail_next.borrow_mut() = Some((posted, error));
        self.fail_armed.set(true);
    }
}

/// The fake's completion queue: what the test produced, in order.
pub(crate) struct FakeCq {
    queue: RefCell<Fifo<Completion>>,
}

impl FakeCq {
    fn new() -> FakeCq {
        FakeCq {
            queue: RefCell::new(Fifo::default()),
        }
    }

    fn push(&self, c: Completion) {
        self.queue.borrow_mut().push(c);
    }
}

/// The fakes of one thread: it keeps them alive until the thread ends.
struct Registry {
    qps: RefCell<Vec<Rc<FakeQp>>>,
    cqs: RefCell<Vec<Rc<FakeCq>>>,
}

/// The value of [`THREAD`] once this thread's registry is gone: no handle
/// names it.
const GONE: u64 = u64::MAX;

impl Drop for Registry {
    fn drop(&mut self) {
        // Before the fakes are freed: from now on every handle of this
        // thread fails its check.
        THREAD.set(GONE);
    }
}

/// This thread's number, unique in the process (given on first use).
fn this_thread() -> u64 {
    match THREAD.get() {
        0 => {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            THREAD.set(id);
            id
        }
        id => id,
    }
}

thread_local! {
    static FAKES: Registry = const {
        Registry {
            qps: RefCell::new(Vec::new()),
            cqs: RefCell::new(Vec::new()),
        }
    };
    /// This thread's number for the handles' check: 0 until the thread
    /// makes its first fake, [`GONE`] once its registry is dropped. A
    /// `Cell` without drop glue: reading it is one load, at any time.
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

#[cold]
fn off_thread(what: &'static str) -> ProviderError {
    ProviderError::Unsupported {
        provider: "fake",
        what,
    }
}

/// The provider handle of a fake QP (see the module docs).
#[derive(Clone, Debug)]
pub struct Qp {
    /// The fake, kept alive by the registry of thread `thread`; read only
    /// on that thread, while its registry lives ([`Qp::with`]).
    fake: NonNull<FakeQp>,
    thread: u64,
    qp_num: u32,
    caps: QpCaps,
    qp_type: QpType,
}

/// The provider handle of a fake CQ.
#[derive(Clone, Debug)]
pub struct Cq {
    /// As [`Qp::fake`].
    cq: NonNull<FakeCq>,
    thread: u64,
    handle: u32,
    capacity: u32,
}

// SAFETY: the pointers are dereferenced only on the thread that made them, while its registry keeps the fakes alive (checked in `Qp::with` and `Cq::poll`).
unsafe impl Send for Qp {}
// SAFETY: as for `Send`: no access from another thread.
unsafe impl Sync for Qp {}
// SAFETY: as for `Qp`.
unsafe impl Send for Cq {}
// SAFETY: as for `Qp`.
unsafe impl Sync for Cq {}

/// A fake completion channel: an eventfd that never becomes readable. The
/// fake's completions are produced on the runtime's own thread, which polls
/// its CQs once more after arming them, so no wake-up is ever needed.
#[derive(Clone, Debug)]
pub struct CompChannel {
    fd: Arc<OwnedFd>,
}

/// Creates a fake QP number `qp_num` with queue sizes `caps` and a fake CQ
/// of `cq_capacity` entries that its completions go to, registered on this
/// thread. Returns the provider handles and the fake.
pub(crate) fn create(
    qp_num: u32,
    qp_type: QpType,
    caps: QpCaps,
    cq_capacity: u32,
) -> std::io::Result<(Qp, Cq, CompChannel, Rc<FakeQp>)> {
    let cq = Rc::new(FakeCq::new());
    let fake = FakeQp::new(qp_num, caps, cq.clone());
    let cq_ptr = NonNull::from(&*cq);
    let qp_ptr = NonNull::from(&*fake);
    let cq_key = FAKES.with(|r| {
        let mut cqs = r.cqs.borrow_mut();
        cqs.push(cq);
        r.qps.borrow_mut().push(fake.clone());
        cqs.len() - 1
    });
    let thread = this_thread();
    // SAFETY: eventfd has no memory preconditions; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok((
        Qp {
            fake: qp_ptr,
            thread,
            qp_num,
            caps,
            qp_type,
        },
        Cq {
            cq: cq_ptr,
            thread,
            handle: cq_key as u32,
            capacity: cq_capacity,
        },
        CompChannel { fd: Arc::new(fd) },
        fake,
    ))
}

impl Qp {
    /// Runs `f` on the fake, if this is its thread.
    #[inline(always)]
    fn with<R>(
        &self,
        what: &'static str,
        f: impl FnOnce(&FakeQp) -> R,
    ) -> Result<R, ProviderError> {
        if THREAD.get() != self.thread {
            return Err(off_thread(what));
        }
        // SAFETY: on the fake's own thread, whose registry still holds it
        // (it marks THREAD gone before freeing the fakes).
        Ok(f(unsafe { self.fake.as_ref() }))
    }

    pub(crate) fn qp_num(&self) -> u32 {
        self.qp_num
    }

    pub(crate) fn caps(&self) -> QpCaps {
        self.caps
    }

    pub(crate) fn state(&self) -> QpState {
        match self.with("state", FakeQp::in_err) {
            Ok(false) => QpState::Rts,
            _ => QpState::Err,
        }
    }

    pub(crate) fn endpoint(&self, _gid_index: u8) -> Result<Endpoint, ProviderError> {
        Err(off_thread("endpoint (a fake QP has no address)"))
    }

    pub(crate) fn modify_to_init(&self, _attr: &InitAttr) -> Result<(), ProviderError> {
        Err(off_thread("modify_to_init (a fake QP is always ready)"))
    }

    pub(crate) fn modify_to_rtr(&self, _attr: &RtrAttr) -> Result<(), ProviderError> {
        Err(off_thread("modify_to_rtr (a fake QP is always ready)"))
    }

    pub(crate) fn modify_to_rts(&self, _attr: &RtsAttr) -> Result<(), ProviderError> {
        Err(off_thread("modify_to_rts (a fake QP is always ready)"))
    }

    pub(crate) fn modify_to_err(&self) -> Result<(), ProviderError> {
        self.with("modify_to_err", FakeQp::modify_to_err)?
    }

    pub(crate) fn modify_to_reset(&self) -> Result<(), ProviderError> {
        Err(off_thread("modify_to_reset"))
    }

    pub(crate) fn qp_type(&self) -> QpType {
        self.qp_type
    }

    pub(crate) fn modify_ud_to_rts(&self, _attr: &UdAttr) -> Result<(), ProviderError> {
        Err(off_thread("modify_ud_to_rts"))
    }

    /// # Safety
    ///
    /// None needed: the fake touches no memory. `unsafe` to match the
    /// contract's signature.
    #[inline(always)]
    pub(crate) unsafe fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        match self.with("post_send", |f| f.post_send(wrs)) {
            Ok(r) => r,
            Err(error) => Err(PostError { posted: 0, error }),
        }
    }

    /// # Safety
    ///
    /// None needed: the fake touches no memory.
    pub(crate) unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        match self.with("post_recv", |f| f.post_recv(wrs)) {
            Ok(r) => r,
            Err(error) => Err(PostError { posted: 0, error }),
        }
    }
}

impl Cq {
    pub(crate) fn handle(&self) -> u32 {
        self.handle
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Nothing to arm: see [`CompChannel`].
    pub(crate) fn req_notify(&self, _solicited_only: bool) -> Result<(), ProviderError> {
        Ok(())
    }

    #[inline(always)]
    pub(crate) fn poll(&self, out: &mut [Completion]) -> Result<usize, ProviderError> {
        if THREAD.get() != self.thread {
            return Err(off_thread("poll"));
        }
        // SAFETY: as in `Qp::with`.
        let cq = unsafe { self.cq.as_ref() };
        let n = cq.queue.borrow_mut().take_into(out);
        Ok(n)
    }

    pub(crate) fn ack_events(&self, _n: u32) {}
}

impl CompChannel {
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub(crate) fn get_event(&self) -> Result<Option<u32>, ProviderError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{SendOp, SgList};

    fn fake() -> Rc<FakeQp> {
        let cq = Rc::new(FakeCq::new());
        let caps = QpCaps {
            max_send_wr: 16,
            ..QpCaps::default()
        };
        FakeQp::new(7, caps, cq)
    }

    fn wr(wr_id: u64, signaled: bool) -> SendWr {
        SendWr {
            wr_id,
            sg_list: SgList::new(),
            op: SendOp::Send,
            flags: if signaled {
                SendFlags::SIGNALED
            } else {
                SendFlags::NONE
            },
        }
    }

    fn drained(f: &FakeQp) -> Vec<(u64, WcStatus)> {
        f.cq.queue
            .borrow_mut()
            .take_all()
            .into_iter()
            .map(|c| (c.wr_id, c.status))
            .collect()
    }

    /// `complete_sends` does what `complete_send` called until `None` does:
    /// unsignaled WRs retire with the next signaled one, trailing ones stay;
    /// an error status completes every WR.
    #[test]
    fn complete_sends_matches_complete_send_in_a_loop() {
        let signaled = [false, true, true, false, false, true, false];
        for status in [WcStatus::Success, WcStatus::RemAccessErr] {
            let (one, all) = (fake(), fake());
            let wrs: Vec<SendWr> = (0..signaled.len())
                .map(|i| wr(i as u64, signaled[i]))
                .collect();
            one.post_send(&wrs).expect("post");
            all.post_send(&wrs).expect("post");
            let mut looped = 0;
            while one.complete_send(status, 64).is_some() {
                looped += 1;
            }
            assert_eq!(all.complete_sends(status, 64), looped);
            assert_eq!(drained(&all), drained(&one));
            assert_eq!(all.posted_sends(), one.posted_sends());
        }
        // The success case left the trailing unsignaled WR, the error case nothing.
        let f = fake();
        f.post_send(&[wr(1, true), wr(2, false)]).expect("post");
        assert_eq!(f.complete_sends(WcStatus::Success, 0), 1);
        assert_eq!(f.outstanding_sends(), 1);
    }

    /// After a flush, only WRs posted since count: unsignaled ones alone
    /// complete nothing, a signaled one retires them.
    #[test]
    fn completes_only_what_a_signaled_wr_posted_since_the_flush_retires() {
        let f = fake();
        f.post_send(&[wr(1, true)]).expect("post");
        f.modify_to_err().expect("to ERR");
        assert_eq!(drained(&f), vec![(1, WcStatus::WrFlushErr)]);
        f.in_err.set(false);
        f.post_send(&[wr(2, false), wr(3, false)]).expect("post");
        assert_eq!(f.complete_sends(WcStatus::Success, 0), 0);
        assert_eq!(f.complete_send(WcStatus::Success, 0), None);
        f.post_send(&[wr(4, true)]).expect("post");
        assert_eq!(f.complete_send(WcStatus::Success, 0), Some(4));
        assert_eq!(f.outstanding_sends(), 0);
    }

    /// A list that overflows the send queue posts what fits and reports it.
    #[test]
    fn post_send_past_the_queue_depth_posts_what_fits() {
        let f = fake();
        let wrs: Vec<SendWr> = (0..20).map(|i| wr(i, true)).collect();
        let e = f.post_send(&wrs).expect_err("overflow");
        assert_eq!(e.posted, 16);
        assert!(matches!(
            e.error,
            ProviderError::QueueFull { depth: 16, .. }
        ));
        assert_eq!(f.outstanding_sends(), 16);
    }

    /// The handles reach their fake on its own thread only: from another
    /// thread every call fails, and the fake is untouched.
    #[test]
    fn handles_fail_off_their_thread() {
        let caps = QpCaps {
            max_send_wr: 4,
            ..QpCaps::default()
        };
        let (qp, cq, _ch, fake) = create(9, QpType::Rc, caps, 16).expect("fake");
        // SAFETY: the fake touches no memory.
        unsafe { qp.post_send(&[wr(1, true)]) }.expect("post on its thread");
        let (qp2, cq2) = (qp.clone(), cq.clone());
        std::thread::spawn(move || {
            // SAFETY: as above.
            let e = unsafe { qp2.post_send(&[wr(2, true)]) }.expect_err("post off its thread");
            assert_eq!(e.posted, 0);
            assert!(
                matches!(e.error, ProviderError::Unsupported { .. }),
                "{e:?}"
            );
            let mut out = [Completion::EMPTY; 4];
            assert!(matches!(
                cq2.poll(&mut out),
                Err(ProviderError::Unsupported { .. })
            ));
            assert_eq!(qp2.state(), QpState::Err);
        })
        .join()
        .expect("other thread");
        assert_eq!(qp.state(), QpState::Rts);
        fake.complete_sends(WcStatus::Success, 0);
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(cq.poll(&mut out).expect("poll"), 1);
        assert_eq!(out[0].wr_id, 1);
    }
}
