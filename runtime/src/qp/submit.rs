//! Submission: [`QueuePair::submit_send`] and its kin validate a chain of
//! work requests, take queue and CQ entries (or wait for them in FIFO
//! order), post it, and return the [`Submit`] future that becomes an
//! [`Op`] once posted.

use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use super::queue_pair::SPARE_WRS;
use super::{QueuePair, SendChain};
use crate::op::{wr_id, Completable, Op, OpTable, QpEntries, QueueEntries, SubmitError, Ticket};
use crate::provider::{PostError, RecvWr, SendFlags, SendOp, SendWr, SgList, Sge};

impl QueuePair {
    /// Submits a chain of send-queue WRs as one op (one doorbell).
    ///
    /// `build` runs at once and pushes the WRs, reading buffer addresses and
    /// keys from `data` (which must own that memory at stable addresses). The
    /// runtime then overwrites each WR's `wr_id` and makes only the last WR
    /// signaled. If the send queue or the CQ lacks room, the returned future
    /// waits (FIFO) and posts when room frees up; otherwise the chain is
    /// posted before this function returns (a single WR submitted through
    /// [`submit_send_one`](Self::submit_send_one) while the runtime polls
    /// a task or the `block_on` future is posted when that poll phase ends,
    /// in one post list with the phase's other such WRs: see
    /// [`submit_send_one`](Self::submit_send_one)). The future resolves with
    /// [`Completable::complete`] (or [`Completable::fail`]).
    ///
    /// The runtime keeps `data` from this call until the chain's completion
    /// (or flush) has been polled, even if the returned future is dropped
    /// meanwhile (the data is then parked); at runtime shutdown it leaks
    /// whatever is still in flight rather than dropping it.
    ///
    /// # Safety
    ///
    /// The WRs are posted under the contract of [`Qp::post_send`](crate::provider::Qp::post_send), and the
    /// device is done with them by the time the runtime hands `data` back
    /// (to [`Completable::complete`] or [`Completable::fail`]) or drops it
    /// (a parked op's data is dropped once its completion or flush has been
    /// polled). So every SGE (address range and lkey) of every WR `build`
    /// pushes must name memory that, from this call until then, stays
    /// allocated and is accessed through no Rust reference but the
    /// device's: the device only reads the SGEs of SEND and WRITE WRs, so
    /// shared (`&`) reads of those are allowed meanwhile; memory it writes
    /// (READ destinations, atomic results) must not be referenced at all,
    /// neither by another owner of a shared buffer nor by code of `T`.
    ///
    /// The usual way to meet this: `data` owns the memory (or keeps it alive
    /// through an `Rc`/`Arc` nobody else uses meanwhile) at a heap address
    /// that does not change when `data` moves, never in a field stored
    /// inline in `data`.
    ///
    /// As for [`Qp::post_send`](crate::provider::Qp::post_send), the obligation ends early once the
    /// registration the SGE's lkey names is deregistered, and an SGE whose
    /// lkey names no live registration containing its range is exempt (the
    /// device fails the WR without touching memory).
    ///
    /// INLINE-flagged WRs are no exception: the post may happen later (when
    /// queue room frees up), so their memory must stay readable (allocated,
    /// not written) until `data` comes back; keeping it in `data` does that.
    ///
    /// Remote addresses and rkeys are not part of this contract: the peer's
    /// responder checks them.
    pub unsafe fn submit_send<T, F>(&self, mut data: T, build: F) -> Submit<T>
    where
        T: Completable,
        F: FnOnce(&mut T, &mut SendChain) -> Result<(), SubmitError>,
    {
        // Built in place: the chain is large (inline WRs), so it is never
        // moved on the way to the post.
        let mut wrs = Wrs::Send(SendChain::new());
        if let Wrs::Send(chain) = &mut wrs {
            if let Err(e) = build(&mut data, chain) {
                return Submit::ready(data.fail(e));
            }
        }
        // SAFETY: the chain was built from `data` under this function's
        // contract.
        unsafe { self.submit(data, &mut wrs) }
    }

    /// [`submit_send`](Self::submit_send) for a single WR, the common case:
    /// `build` fills one WR in place (its `wr_id` and SIGNALED flag are set
    /// by the runtime), which is posted without a chain around it.
    ///
    /// Doorbell batching (on by default on the software device, off on
    /// libibverbs devices; see [`set_doorbell_batching`](Self::set_doorbell_batching)):
    /// called while the runtime polls its tasks or the
    /// `block_on` future (a poll phase), the WR is not posted at once but
    /// when the phase ends (before the reactor polls its CQs or sleeps),
    /// with every other single WR of the phase for the same QP in one post
    /// list: one `ibv_post_send` and one doorbell for the ops the tasks of
    /// one reactor turn submitted (a list goes out early once 8 WRs wait,
    /// so the device is not left idle through a long phase). The op is in flight from this
    /// call on (data owned, entries taken); send-queue order is kept (any
    /// other post to the QP posts the waiting WRs first). If the provider
    /// refuses the list, the refused WR's op fails with
    /// [`SubmitError::Post`] and the ops after it with
    /// [`SubmitError::PostBatchAborted`]. Outside a poll phase (a future
    /// polled by another executor) the WR is posted before this returns.
    ///
    /// # Safety
    ///
    /// The contract of [`submit_send`](Self::submit_send), for the WR
    /// `build` fills.
    #[inline(always)]
    pub unsafe fn submit_send_one<T, F>(&self, mut data: T, build: F) -> Submit<T>
    where
        T: Completable,
        F: FnOnce(&mut T, &mut SendWr) -> Result<(), SubmitError>,
    {
        let mut wr = SendWr {
            wr_id: 0,
            sg_list: SgList::new(),
            op: SendOp::Send,
            flags: SendFlags::NONE,
        };
        if let Err(e) = build(&mut data, &mut wr) {
            return Submit::ready(data.fail(e));
        }
        match OneWr::from_send_wr(wr) {
            // SAFETY: the WR was built from `data` under this function's
            // contract; `OneWr` names the same SGE.
            Ok(one) => unsafe { self.submit_one(data, one) },
            // SAFETY: as above.
            Err(wr) => unsafe { self.submit_chain_of_one(data, wr) },
        }
    }

    /// [`submit_send_one`](Self::submit_send_one) of a WR with several
    /// SGEs: a chain of one.
    ///
    /// # Safety
    ///
    /// The contract of [`submit_send`](Self::submit_send), for `wr`.
    #[cold]
    #[inline(never)]
    unsafe fn submit_chain_of_one<T: Completable>(&self, data: T, wr: SendWr) -> Submit<T> {
        let mut wrs = Wrs::Send(smallvec::smallvec![wr]);
        // SAFETY: forwarded contract of this function.
        unsafe { self.submit(data, &mut wrs) }
    }

    /// [`submit_send_one`](Self::submit_send_one) of a WR given by its
    /// parts (the entries of `lend.rs`, which take the SGE from `data`
    /// first): the WR is written once, where it goes (the QP's deferred
    /// list, or the stack of a direct post), not built on the stack and
    /// copied; no `SendWr` exists on the common path before that.
    ///
    /// # Safety
    ///
    /// The contract of [`submit_send`](Self::submit_send), for the WR `wr`
    /// describes (its SGE names memory `data` keeps).
    #[inline(always)]
    pub(super) unsafe fn submit_one<T: Completable>(&self, data: T, wr: OneWr) -> Submit<T> {
        if let Err(e) = self.check_one(&wr) {
            return Submit::from_state(State::Ready(refused(Some(data), e)));
        }
        let (queue, cq) = self.inner.core.entries.pools(false);
        if !queue.try_acquire(1) {
            return Submit::from_state(self.wait_one(data, &wr, false));
        }
        if !cq.try_acquire(1) {
            return Submit::from_state(self.wait_one(data, &wr, true));
        }
        let ops = self.inner.handle.ops();
        // SAFETY: forwarded contract of this function; on success `data`
        // moves into the op at once (below).
        match unsafe { self.post_one(ops, &wr) } {
            Ok(first) => Submit::from_state(State::InFlight(Op::posted(ops, first, data))),
            Err(e) => Submit::from_state(State::Ready(refused(Some(data), e))),
        }
    }

    /// [`check`](Self::check) of a single WR given by its parts.
    #[inline(always)]
    fn check_one(&self, wr: &OneWr) -> Result<(), SubmitError> {
        if self.inner.core.sends_ok.get() {
            // Neither closed nor faulted, and a WR of one SGE fits.
            return Ok(());
        }
        self.check_one_slow(wr)
    }

    /// [`check_one`](Self::check_one) of a QP that is closed, faulted, or
    /// takes no chain of one or no SGE.
    #[cold]
    #[inline(never)]
    fn check_one_slow(&self, wr: &OneWr) -> Result<(), SubmitError> {
        self.check_open()?;
        let inner = &*self.inner;
        let sges = usize::from(wr.sge.is_some());
        if sges > inner.caps.max_send_sge as usize && !wr.flags.contains(SendFlags::INLINE) {
            return Err(SubmitError::TooManySges {
                qp_num: inner.core.qp_num,
                queue: "send",
                sges,
                max: inner.caps.max_send_sge,
            });
        }
        if inner.max_send_chain == 0 {
            return Err(self.chain_length("send", 1));
        }
        Ok(())
    }

    /// [`wait_for_entries`](Self::wait_for_entries) of a single WR given
    /// by its parts: built now, as a waiting submission keeps it.
    #[cold]
    #[inline(never)]
    fn wait_one<T: Completable>(&self, data: T, wr: &OneWr, queue_held: bool) -> State<T> {
        let mut wrs = Wrs::One(*wr);
        self.wait_for_entries(data, &mut wrs, 1, queue_held)
    }

    /// [`post`](Self::post) of a single WR given by its parts, one queue and
    /// one CQ entry taken: deferred to the poll phase's end when batching,
    /// else posted now. The same contract.
    #[inline(always)]
    unsafe fn post_one(&self, ops: &OpTable, wr: &OneWr) -> Result<u64, SubmitError> {
        let core = &self.inner.core;
        let defer = self.defers_now();
        let ordered = if defer {
            core.order_deferred()
        } else {
            core.order_sends(ops, true)
        };
        let absorbed = ordered.absorbed;
        let Some(first) = ops.insert(0, &core.entries, false, 1 + absorbed) else {
            return Err(self.table_full(false, 1, absorbed));
        };
        if defer {
            if core.defer_one(ordered, wr, first) {
                core.flush_deferred(ops);
            }
            return Ok(first);
        }
        let wr = wr.send_wr(first);
        // SAFETY: as in `post_chain`, for the single WR.
        let res = unsafe { core.post_sends(ordered, std::slice::from_ref(&wr)) };
        self.posted(first, absorbed, res)
    }

    /// Submits one receive WR as an op. `build` fills its scatter list from
    /// `data`; the runtime sets the wr_id. Waits for receive-queue and CQ
    /// entries like [`submit_send`](Self::submit_send), and keeps `data`
    /// until the completion (or flush) has been polled.
    ///
    /// # Safety
    ///
    /// As for [`submit_send`](Self::submit_send), under the contract of
    /// [`Qp::post_recv`](crate::provider::Qp::post_recv): every SGE (address range and lkey) `build` pushes
    /// must name memory that, from this call until the runtime hands `data`
    /// back (to [`Completable::complete`] or [`Completable::fail`]) or drops
    /// it, stays allocated and is not accessed through Rust references at
    /// all (the device writes it), neither by another owner of a shared
    /// buffer nor by code of `T`. The usual way: `data` owns that memory at
    /// a heap address that does not change when `data` moves. The same
    /// exemptions apply (deregistered registration, lkey naming no live
    /// registration containing the range).
    pub unsafe fn submit_recv<T, F>(&self, mut data: T, build: F) -> Submit<T>
    where
        T: Completable,
        F: FnOnce(&mut T, &mut SgList) -> Result<(), SubmitError>,
    {
        let mut wrs = Wrs::Recv(RecvWr {
            wr_id: 0,
            sg_list: SgList::new(),
        });
        if let Wrs::Recv(wr) = &mut wrs {
            if let Err(e) = build(&mut data, &mut wr.sg_list) {
                return Submit::ready(data.fail(e));
            }
        }
        // SAFETY: the scatter list was built from `data` under this
        // function's contract.
        unsafe { self.submit(data, &mut wrs) }
    }

    /// The QP takes submissions: not closed, no inline send failed.
    #[inline(always)]
    fn check_open(&self) -> Result<(), SubmitError> {
        let core = &self.inner.core;
        if core.closed.get() {
            return Err(SubmitError::Closed {
                qp_num: core.qp_num,
            });
        }
        match core.fault_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Validates a chain before it takes entries; returns its length.
    #[inline(always)]
    fn check(&self, wrs: &Wrs) -> Result<u32, SubmitError> {
        self.check_open()?;
        let inner = &*self.inner;
        match wrs {
            Wrs::Send(c) => {
                let len = c.len();
                if len == 0 || len > inner.max_send_chain {
                    return Err(self.chain_length("send", len));
                }
                let max_sge = inner.caps.max_send_sge as usize;
                // INLINE WRs are copied at post time: their SGE count is free.
                for wr in c.iter() {
                    if wr.sg_list.len() > max_sge && !wr.flags.contains(SendFlags::INLINE) {
                        return Err(SubmitError::TooManySges {
                            qp_num: inner.core.qp_num,
                            queue: "send",
                            sges: wr.sg_list.len(),
                            max: inner.caps.max_send_sge,
                        });
                    }
                }
                Ok(len as u32)
            }
            Wrs::One(wr) => self.check_one(wr).map(|()| 1),
            Wrs::Recv(r) => {
                if inner.max_recv_chain == 0 {
                    return Err(self.chain_length("receive", 1));
                }
                if r.sg_list.len() > inner.caps.max_recv_sge as usize {
                    return Err(SubmitError::TooManySges {
                        qp_num: inner.core.qp_num,
                        queue: "receive",
                        sges: r.sg_list.len(),
                        max: inner.caps.max_recv_sge,
                    });
                }
                Ok(1)
            }
        }
    }

    #[cold]
    fn chain_length(&self, queue: &'static str, len: usize) -> SubmitError {
        let core = &self.inner.core;
        let (depth, cq_cap) = if queue == "send" {
            (core.entries.sq.capacity(), core.entries.send_cq.capacity())
        } else {
            (core.entries.rq.capacity(), core.entries.recv_cq.capacity())
        };
        SubmitError::ChainLength {
            qp_num: core.qp_num,
            queue,
            len,
            depth: depth.min(cq_cap),
        }
    }

    /// # Safety
    ///
    /// `wrs` name memory kept by `data` under the contract of
    /// [`submit_send`](Self::submit_send) / [`submit_recv`](Self::submit_recv).
    ///
    /// `data` is moved once, into the returned future: each outcome
    /// (posted, refused, waiting for entries) builds its `Submit` in one
    /// expression, which the compiler builds right in the caller's return
    /// slot (no `Submit` is built first and copied out). The post itself
    /// ([`post`](Self::post)) never touches `data`; it is moved into its
    /// op right after a successful post, with no code that can unwind in
    /// between, so it is owned by the op while the device may use it.
    #[inline(always)]
    unsafe fn submit<T: Completable>(&self, data: T, wrs: &mut Wrs) -> Submit<T> {
        let n = match self.check(wrs) {
            Ok(n) => n,
            Err(e) => return Submit::from_state(State::Ready(refused(Some(data), e))),
        };
        let (queue, cq) = self.entries_for(wrs);
        if !queue.try_acquire(n) {
            return Submit::from_state(self.wait_for_entries(data, wrs, n, false));
        }
        if !cq.try_acquire(n) {
            return Submit::from_state(self.wait_for_entries(data, wrs, n, true));
        }
        // SAFETY: forwarded contract of this function; on success `data`
        // moves into the op at once (below).
        match unsafe { self.post(wrs, n) } {
            Ok(first) => Submit::from_state(State::InFlight(Op::posted(
                self.inner.handle.ops(),
                first,
                data,
            ))),
            Err(e) => Submit::from_state(State::Ready(refused(Some(data), e))),
        }
    }

    /// A submission that must wait for entries (`queue_held`: it already
    /// holds its queue entries, and waits for the CQ's).
    #[cold]
    #[inline(never)]
    fn wait_for_entries<T: Completable>(
        &self,
        data: T,
        wrs: &mut Wrs,
        n: u32,
        queue_held: bool,
    ) -> State<T> {
        if queue_held {
            // Unsignaled inline sends of any QP may hold CQ entries.
            self.inner.handle.driver().release_hoarded_entries();
        } else if !matches!(wrs, Wrs::Recv(_)) {
            self.inner.core.retire_unsignaled();
        }
        State::Queued(Queued {
            qp: self.clone(),
            data: Some(data),
            wait: Some(self.boxed(wrs, n, queue_held)),
        })
    }

    /// Moves `wrs` into a (recycled) box with the rest of a waiting
    /// submission's state, for a submission that must wait.
    fn boxed(&self, wrs: &mut Wrs, n: u32, queue_held: bool) -> Box<Waiting> {
        let spare = self.inner.spare_wrs.borrow_mut().pop();
        let mut b = spare.unwrap_or_else(|| {
            Box::new(Waiting {
                wrs: Wrs::Recv(RecvWr {
                    wr_id: 0,
                    sg_list: SgList::new(),
                }),
                recv: false,
                n: 0,
                queue_held: false,
                queue_ticket: None,
                cq_ticket: None,
            })
        });
        std::mem::swap(&mut b.wrs, wrs);
        b.recv = matches!(b.wrs, Wrs::Recv(_));
        b.n = n;
        b.queue_held = queue_held;
        b.queue_ticket = None;
        b.cq_ticket = None;
        b
    }

    /// Gives a WR box back for reuse (its old contents are dropped later,
    /// when it is reused, or now if the pool is full).
    fn recycle(&self, b: Box<Waiting>) {
        let mut spare = self.inner.spare_wrs.borrow_mut();
        if spare.len() < SPARE_WRS {
            spare.push(b);
        } else {
            drop(spare);
            drop(b);
        }
    }

    #[inline(always)]
    fn entries_for(&self, wrs: &Wrs) -> (&QueueEntries, &QueueEntries) {
        self.inner.core.entries.pools(matches!(wrs, Wrs::Recv(_)))
    }

    /// Posts `wrs` with `n` queue and CQ entries already taken, in a new
    /// slot of the op table that takes the entries over. Returns the first
    /// WR's wr_id on success or on a partial post (the slot then reports
    /// the post error once the posted part has flushed): the op is in
    /// flight. On failure nothing was posted and the slot and entries are
    /// given back.
    ///
    /// # Safety
    ///
    /// `wrs` name memory kept by some op data under the contract of
    /// [`submit_send`](Self::submit_send) / [`submit_recv`](Self::submit_recv).
    /// On `Ok`, the caller moves that data into an [`Op`] of the returned
    /// wr_id before anything that can unwind, which keeps (parks, or at
    /// shutdown leaks) it until the completion or flush; so the provider's
    /// post contract holds.
    #[inline(always)]
    unsafe fn post(&self, wrs: &mut Wrs, n: u32) -> Result<u64, SubmitError> {
        let ops = self.inner.handle.ops();
        match wrs {
            // SAFETY: forwarded contract of this function.
            Wrs::One(wr) => unsafe { self.post_one(ops, wr) },
            // SAFETY: forwarded contract of this function.
            Wrs::Send(chain) => unsafe { self.post_chain(ops, chain, n) },
            // SAFETY: forwarded contract of this function.
            Wrs::Recv(wr) => unsafe { self.post_recv_wr(ops, wr) },
        }
    }

    /// [`post`](Self::post) of a chain of `n` send WRs: only the last one
    /// signaled. The same contract.
    #[inline(always)]
    unsafe fn post_chain(
        &self,
        ops: &OpTable,
        chain: &mut SendChain,
        n: u32,
    ) -> Result<u64, SubmitError> {
        let core = &self.inner.core;
        // The last WR is signaled: it takes over the entries of the
        // unsignaled inline sends before it, its completion implies theirs.
        let ordered = core.order_sends(ops, true);
        let absorbed = ordered.absorbed;
        let Some(first) = ops.insert((n - 1) as u16, &core.entries, false, n + absorbed) else {
            return Err(self.table_full(false, n, absorbed));
        };
        let last = chain.len() - 1;
        for (i, wr) in chain.iter_mut().enumerate() {
            wr.wr_id = wr_id::with_index(first, i as u16);
            if i == last {
                wr.flags |= SendFlags::SIGNALED;
            } else {
                wr.flags = unsignaled(wr.flags);
            }
        }
        // SAFETY: the chain's memory is kept by op data that the caller
        // moves into the op of this wr_id on success (this function's
        // contract), which holds it until the completion of the last
        // (signaled) WR has been polled.
        let res = unsafe { core.post_sends(ordered, chain) };
        self.posted(first, absorbed, res)
    }

    /// [`post`](Self::post) of a receive WR. The same contract.
    #[inline(always)]
    unsafe fn post_recv_wr(&self, ops: &OpTable, wr: &mut RecvWr) -> Result<u64, SubmitError> {
        let core = &self.inner.core;
        let Some(first) = ops.insert(0, &core.entries, true, 1) else {
            return Err(self.table_full(true, 1, 0));
        };
        wr.wr_id = first;
        // SAFETY: the receive WR's scatter list names memory kept by op
        // data that the caller moves into the op of this wr_id on success.
        let res = unsafe { core.post_recv(std::slice::from_ref(wr)) };
        self.posted(first, 0, res)
    }

    /// The outcome of the post of op `first` (which took over `absorbed`
    /// inline-send entries): in flight on success or after a partial post.
    #[inline(always)]
    fn posted(
        &self,
        first: u64,
        absorbed: u32,
        res: Result<(), PostError>,
    ) -> Result<u64, SubmitError> {
        match res {
            Ok(()) => Ok(first),
            Err(e) => match self.post_failed((first & wr_id::KEY_MASK) as usize, absorbed, e) {
                // Part of the chain is on the queue: the op is in flight.
                None => Ok(first),
                Some(e) => Err(e),
            },
        }
    }

    /// True if a single send WR submitted now waits for the end of the
    /// poll phase (one runs, and doorbell batching is on for this QP); the
    /// QP is then listed for that end.
    #[inline(always)]
    fn defers_now(&self) -> bool {
        let core = &self.inner.core;
        // Listed in this phase: both held when it was listed, and the
        // phase's end (`phase_ended`) and turning batching off clear it.
        if core.listed_in_phase.get() {
            return true;
        }
        let driver = self.inner.handle.driver();
        if driver.batching() && core.batch_posts.get() {
            core.listed_in_phase.set(true);
            driver.note_phase_end(core.clone());
            return true;
        }
        false
    }

    /// The op table is full: gives back the `n` entries taken for an op
    /// that will not be posted, on the receive side with `recv` (the
    /// `absorbed` inline ones stay held, by the QP again).
    #[cold]
    #[inline(never)]
    fn table_full(&self, recv: bool, n: u32, absorbed: u32) -> SubmitError {
        let core = &self.inner.core;
        core.unabsorb(absorbed);
        let (queue, cq) = core.entries.pools(recv);
        queue.release(n);
        cq.release(n);
        SubmitError::SlabFull {
            limit: wr_id::MAX_OPS,
        }
    }

    /// The provider refused (part of) the chain of op `key`. If nothing was
    /// posted, the slot and the entries are given back and the error is
    /// returned (for the op's data); after a partial post the slot reports
    /// the error once the posted part has flushed, and `None` is returned.
    #[cold]
    #[inline(never)]
    fn post_failed(&self, key: usize, absorbed: u32, e: PostError) -> Option<SubmitError> {
        let core = &self.inner.core;
        let ops = self.inner.handle.ops();
        match e {
            e if e.posted == 0 => {
                if let Some(mut entry) = ops.remove_unposted(key) {
                    entry.n -= absorbed;
                    drop(entry);
                }
                core.unabsorb(absorbed);
                Some(SubmitError::Post {
                    qp_num: core.qp_num,
                    source: e,
                })
            }
            e => {
                // Part of the chain is on the queue, unsignaled: flush it so
                // its buffers come back, and report the post error then.
                tracing::warn!(qp = core.qp_num, posted = e.posted, error = %crate::report::ErrorChain(&e), "partial post: moving QP to ERR");
                let posted = e.posted;
                ops.set_partial(
                    key,
                    posted,
                    SubmitError::Post {
                        qp_num: core.qp_num,
                        source: e,
                    },
                );
                if let Err(err) = core.shut(ops) {
                    tracing::warn!(qp = core.qp_num, error = %crate::report::ErrorChain(&err), "modify_to_err after partial post failed");
                }
                None
            }
        }
    }
}

/// A submission refused before anything was posted: its data goes to
/// [`Completable::fail`], whose output is returned (for `State::Ready`).
#[cold]
#[inline(never)]
fn refused<T: Completable>(data: Option<T>, e: SubmitError) -> Option<Box<T::Output>> {
    data.map(|data| Box::new(data.fail(e)))
}

/// `flags` without SIGNALED.
#[inline(always)]
fn unsignaled(flags: SendFlags) -> SendFlags {
    flags.intersection(SendFlags::FENCE | SendFlags::SOLICITED | SendFlags::INLINE)
}

/// A single send WR by its parts ([`QueuePair::submit_one`]).
#[derive(Clone, Copy)]
pub(crate) struct OneWr {
    pub(crate) op: SendOp,
    /// The only SGE, `None` for none (a zero-length gather).
    pub(crate) sge: Option<Sge>,
    /// INLINE, FENCE, SOLICITED (SIGNALED is set by the runtime).
    pub(crate) flags: SendFlags,
}

impl OneWr {
    /// The single WR `wr` by its parts, or `wr` back if it has more than
    /// one SGE (it then goes as a chain of one).
    #[inline(always)]
    fn from_send_wr(wr: SendWr) -> Result<OneWr, SendWr> {
        match wr.sg_list.len() {
            0 | 1 => Ok(OneWr {
                op: wr.op,
                sge: wr.sg_list.first().copied(),
                flags: unsignaled(wr.flags),
            }),
            _ => Err(wr),
        }
    }

    /// The WR, signaled, with `wr_id`.
    #[inline(always)]
    pub(crate) fn send_wr(&self, wr_id: u64) -> SendWr {
        let sg_list = match self.sge {
            Some(sge) => SgList::from_buf_and_len([sge], 1),
            None => SgList::new(),
        };
        SendWr {
            wr_id,
            sg_list,
            op: self.op,
            flags: self.flags | SendFlags::SIGNALED,
        }
    }
}

// The chain is built and posted in place; a waiting submission keeps it in
// a box recycled through the QP's spare list (no allocation per op).
#[allow(clippy::large_enum_variant)]
enum Wrs {
    Send(SendChain),
    /// A single WR ([`QueuePair::submit_send_one`] and the entries of
    /// `lend.rs`): the one single-WR form, posted by `post_one`.
    One(OneWr),
    Recv(RecvWr),
}

/// What a submission waiting for entries keeps besides its data: boxed
/// (and the box recycled), so that a `Queued` is no larger than an
/// in-flight `Op` and every `Submit` stays small.
pub(super) struct Waiting {
    wrs: Wrs,
    recv: bool,
    n: u32,
    queue_held: bool,
    queue_ticket: Option<Ticket>,
    cq_ticket: Option<Ticket>,
}

impl Waiting {
    fn entries(&self, qp: &QueuePair) -> Rc<QpEntries> {
        qp.inner.core.entries.clone()
    }

    /// Gives back whatever this waiting submission holds.
    fn abandon(&mut self, qp: &QueuePair) {
        let pools = self.entries(qp);
        let (queue, cq) = pools.pools(self.recv);
        queue.cancel(&mut self.queue_ticket);
        cq.cancel(&mut self.cq_ticket);
        if self.queue_held {
            self.queue_held = false;
            queue.release(self.n);
        }
    }

    /// [`poll_entries`](Self::poll_entries) without waiting: true if
    /// both are held now (the post takes them over); else it keeps its
    /// place in line, and its waker, as it was.
    fn try_entries(&mut self, qp: &QueuePair) -> bool {
        let pools = self.entries(qp);
        let (queue, cq) = pools.pools(self.recv);
        if !self.queue_held {
            if !queue.try_acquire_in_turn(self.n, &mut self.queue_ticket) {
                return false;
            }
            self.queue_held = true;
        }
        if !cq.try_acquire_in_turn(self.n, &mut self.cq_ticket) {
            return false;
        }
        self.queue_held = false;
        true
    }

    fn poll_entries(&mut self, qp: &QueuePair, cx: &mut Context<'_>) -> Poll<()> {
        let pools = self.entries(qp);
        let (queue, cq) = pools.pools(self.recv);
        if !self.queue_held {
            if queue
                .poll_acquire(self.n, &mut self.queue_ticket, cx)
                .is_pending()
            {
                return Poll::Pending;
            }
            self.queue_held = true;
        }
        if cq
            .poll_acquire(self.n, &mut self.cq_ticket, cx)
            .is_pending()
        {
            return Poll::Pending;
        }
        // Both held from here on; the post takes them over.
        self.queue_held = false;
        Poll::Ready(())
    }
}

struct Queued<T> {
    qp: QueuePair,
    /// `Some` until posted or failed.
    data: Option<T>,
    /// `Some` until posted or failed; given back to the QP's spare list.
    /// (Once taken, nothing is held: the entries passed to the post, or
    /// were given back.)
    wait: Option<Box<Waiting>>,
}

impl<T> Drop for Queued<T> {
    fn drop(&mut self) {
        if let Some(mut b) = self.wait.take() {
            b.abandon(&self.qp);
            self.qp.recycle(b);
        }
    }
}

// An explicit tag: cheaper to test (and to drop) than a niche nested in
// the output type. A whole word: a byte left 7 bytes of padding before the
// op, which moves of a `Submit` copied piece by piece.
#[repr(u64)]
enum State<T: Completable> {
    /// Waiting for queue or CQ entries.
    Queued(Queued<T>),
    InFlight(Op<T>),
    /// Boxed: only refusals and failures get here, and the output (which
    /// holds the op's buffers and an error) would make every `Submit`
    /// larger and slower to move.
    Ready(Option<Box<T::Output>>),
}

/// The future of a submission: waits for queue entries if needed, then for
/// the op's completion. Dropping it before the post frees `T` at once;
/// dropping it after parks `T` until the device is done.
#[must_use = "dropping a submission before it is posted cancels it"]
pub struct Submit<T: Completable> {
    /// Dropped by hand ([`Drop`] below): the future of a completed op, the
    /// common case, then drops nothing, with no call (the state's drop
    /// glue is an out-of-line call). Assign through `*` (which
    /// drops the old state), never replace the `ManuallyDrop` itself.
    state: ManuallyDrop<State<T>>,
}

impl<T: Completable> Submit<T> {
    #[inline(always)]
    fn from_state(state: State<T>) -> Submit<T> {
        Submit {
            state: ManuallyDrop::new(state),
        }
    }

    /// Drops a state that is not a completed op (waiting for entries,
    /// in flight: parks the data, ready: an unclaimed output).
    #[inline(never)]
    fn drop_state(&mut self) {
        // SAFETY: called once, from `drop`: the state is never used again.
        unsafe { ManuallyDrop::drop(&mut self.state) }
    }
}

impl<T: Completable> Drop for Submit<T> {
    #[inline(always)]
    fn drop(&mut self) {
        if let State::InFlight(op) = &*self.state {
            if op.is_done() {
                // A done op owns nothing (its data was taken, its table
                // is not reference-counted): nothing to drop.
                return;
            }
        }
        self.drop_state();
    }
}

// `Submit` never pins its contents: `T` is plain owned state.
impl<T: Completable> Unpin for Submit<T> {}

impl<T: Completable> Submit<T> {
    /// A submission that already has its result (validation failed). The
    /// output is boxed (an error path: it keeps the common `Submit` small).
    #[cold]
    pub fn ready(output: T::Output) -> Submit<T> {
        Submit::from_state(State::Ready(Some(Box::new(output))))
    }

    /// True while waiting for queue or CQ entries (not posted yet).
    pub fn is_queued(&self) -> bool {
        matches!(*self.state, State::Queued(_))
    }

    /// The wr_id of the first WR, once posted.
    pub fn wr_id(&self) -> Option<u64> {
        match &*self.state {
            State::InFlight(op) => Some(op.wr_id()),
            _ => None,
        }
    }
}

impl<T: Completable> Future for Submit<T> {
    type Output = T::Output;

    #[inline(always)]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = &mut *self;
        // The common case first, in a small frame: posted, in flight.
        if let State::InFlight(op) = &mut *this.state {
            return Pin::new(op).poll(cx);
        }
        this.poll_slow(cx)
    }
}

impl<T: Completable> Submit<T> {
    /// [`Submit::poll`] when not in flight: waiting for entries, or ready.
    #[inline(never)]
    fn poll_slow(&mut self, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = self;
        loop {
            match &mut *this.state {
                State::InFlight(op) => return Pin::new(op).poll(cx),
                State::Ready(out) => {
                    return match out.take() {
                        Some(o) => Poll::Ready(*o),
                        None => {
                            tracing::error!("submission polled after completion");
                            Poll::Pending
                        }
                    };
                }
                State::Queued(q) => {
                    let closed = q.qp.inner.core.closed.get();
                    let Some(w) = q.wait.as_deref_mut() else {
                        // Invariant: `Some` while the state is Queued.
                        return Poll::Pending;
                    };
                    if !closed && w.poll_entries(&q.qp, cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.post_queued(closed);
                }
            }
        }
    }
}

impl<T: Completable> Submit<T> {
    /// A queued submission whose entries are held (or whose QP closed):
    /// posts it (in flight, or refused), or fails it as closed.
    fn post_queued(&mut self, closed: bool) {
        let State::Queued(q) = &mut *self.state else {
            return;
        };
        let qp = q.qp.clone();
        let (Some(data), Some(mut w)) = (q.data.take(), q.wait.take()) else {
            // Invariant: both are `Some` while the state is Queued.
            return;
        };
        if closed {
            w.abandon(&qp);
            *self.state = State::Ready(Some(Box::new(data.fail(SubmitError::Closed {
                qp_num: qp.qp_num(),
            }))));
        } else {
            // SAFETY: a `Queued` is only created by `submit`, whose caller
            // vouched for the WRs and `data` under the `submit_*`
            // contract; both were kept together since, and on success
            // `data` moves into the op at once.
            *self.state = match unsafe { qp.post(&mut w.wrs, w.n) } {
                Ok(first) => State::InFlight(Op::posted(qp.inner.handle.ops(), first, data)),
                Err(e) => State::Ready(refused(Some(data), e)),
            };
        }
        qp.recycle(w);
    }

    /// The try form of the wait for queue entries, for a caller with no
    /// task context at hand: a submission that waits for them
    /// ([`is_queued`](Self::is_queued)) is posted now if its turn has come
    /// (nothing waits before it) and the send (or receive) queue and its CQ
    /// have room; if its QP closed, it fails as its poll would. Never
    /// registers a waker: one that waits keeps its place in line and the
    /// waker of its last poll. True once it no longer waits (posted,
    /// refused or failed; also for one that never waited).
    pub fn try_post(&mut self) -> bool {
        let State::Queued(q) = &mut *self.state else {
            return true;
        };
        let closed = q.qp.inner.core.closed.get();
        let Some(w) = q.wait.as_deref_mut() else {
            // Invariant: `Some` while the state is Queued.
            return false;
        };
        if !closed && !w.try_entries(&q.qp) {
            return false;
        }
        self.post_queued(closed);
        true
    }

    /// The try form of awaiting the output, for a caller that only wants
    /// the op's data back once the device is done with it (a buffer to
    /// reuse): the output if the op's completion has arrived, or if the
    /// submission was refused. `None` while it waits for entries or is in
    /// flight. Never registers a waker (a waker from an earlier poll
    /// stays); after `Some`, the submission is spent, as after a `Ready`.
    pub fn try_take(&mut self) -> Option<T::Output> {
        match &mut *self.state {
            State::InFlight(op) if op.is_completed() => {
                // A completed op's poll returns `Ready` without looking at
                // the waker.
                match Pin::new(op).poll(&mut Context::from_waker(Waker::noop())) {
                    Poll::Ready(out) => Some(out),
                    Poll::Pending => None,
                }
            }
            State::Ready(out) => out.take().map(|o| *o),
            _ => None,
        }
    }
}
