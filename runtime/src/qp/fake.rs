//! The fake queue pair (feature `test-util`, re-exported by
//! `crate::testing`): a queue pair backend that records what
//! is posted and produces synthetic completions, so ops and verbs can be
//! unit-tested without any device.
//!
//! The fake follows the verbs rules the runtime relies on: it refuses a post
//! that would overrun its queues (`QueueFull`), a successful completion of a
//! signaled send retires every earlier unsignaled WR, and moving to ERR
//! flushes every outstanding WR (signaled or not) with `WR_FLUSH_ERR`, as
//! does any post made while in ERR.
//!
//! The fake never reads or writes the memory the posted SGEs name (it keeps
//! only wr_ids, flags and opcodes), so submitting to a fake QP lends no
//! memory to anything: the `unsafe` contract of
//! [`QueuePair::submit_send`]/[`QueuePair::submit_recv`] has nothing to
//! protect there.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;

use super::{Backend, QueuePair};
use crate::op::Credits;
use crate::provider::{
    Completion, PostError, ProviderError, QpCaps, RecvWr, SendFlags, SendWr, WcOpcode, WcStatus,
};
use crate::reactor::Handle;

/// A recording QP; see the module docs.
pub struct FakeQp {
    handle: Handle,
    qp_num: u32,
    caps: QpCaps,
    sends: RefCell<VecDeque<(u64, SendFlags, WcOpcode)>>,
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
    /// A fake QP number `qp_num` with queue sizes `caps`, bound to the current runtime.
    ///
    /// # Panics
    ///
    /// If no runtime exists on this thread.
    pub fn new(qp_num: u32, caps: QpCaps) -> Rc<FakeQp> {
        Rc::new(FakeQp {
            handle: Handle::current(),
            qp_num,
            caps,
            sends: RefCell::new(VecDeque::new()),
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

    /// A [`QueuePair`] over a new fake, with its own CQ of `cq_capacity` entries.
    pub fn queue_pair(qp_num: u32, caps: QpCaps, cq_capacity: u32) -> (QueuePair, Rc<FakeQp>) {
        let fake = FakeQp::new(qp_num, caps);
        let cq = Rc::new(Credits::new(cq_capacity));
        let qp = QueuePair::from_backend(
            Handle::current(),
            Backend::Fake(fake.clone()),
            qp_num,
            caps,
            cq.clone(),
            cq,
            None,
        );
        (qp, fake)
    }

    fn completion(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, len: u32) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            byte_len: if status.is_success() { len } else { 0 },
            imm_data: None,
            qp_num: self.qp_num,
            vendor_err: 0,
        }
    }

    /// The armed failure of [`fail_next_post`](Self::fail_next_post), if any.
    #[cold]
    fn take_failure(&self) -> Option<(usize, ProviderError)> {
        self.fail_armed.set(false);
        self.fail_next.borrow_mut().take()
    }

    pub(crate) fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        if self.fail_armed.get() {
            if let Some((posted, error)) = self.take_failure() {
                let mut q = self.sends.borrow_mut();
                for wr in wrs.iter().take(posted) {
                    q.push_back((wr.wr_id, wr.flags, wr.op.completion_opcode()));
                }
                return Err(PostError { posted, error });
            }
        }
        self.doorbells.set(self.doorbells.get() + 1);
        let mut q = self.sends.borrow_mut();
        for (i, wr) in wrs.iter().enumerate() {
            if q.len() >= self.caps.max_send_wr as usize {
                return Err(PostError {
                    posted: i,
                    error: ProviderError::QueueFull {
                        qp_num: self.qp_num,
                        queue: "send",
                        depth: self.caps.max_send_wr,
                    },
                });
            }
            if self.in_err.get() {
                let op = wr.op.completion_opcode();
                self.handle.inject_completion(self.completion(
                    wr.wr_id,
                    WcStatus::WrFlushErr,
                    op,
                    0,
                ));
            } else {
                q.push_back((wr.wr_id, wr.flags, wr.op.completion_opcode()));
            }
        }
        self.max_sends.set(self.max_sends.get().max(q.len()));
        Ok(())
    }

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
                self.handle.inject_completion(self.completion(
                    wr.wr_id,
                    WcStatus::WrFlushErr,
                    WcOpcode::Recv,
                    0,
                ));
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
        let sends: Vec<_> = self.sends.borrow_mut().drain(..).collect();
        for (id, _, op) in sends {
            self.handle
                .inject_completion(self.completion(id, WcStatus::WrFlushErr, op, 0));
        }
        let recvs: Vec<_> = self.recvs.borrow_mut().drain(..).collect();
        for id in recvs {
            self.handle.inject_completion(self.completion(
                id,
                WcStatus::WrFlushErr,
                WcOpcode::Recv,
                0,
            ));
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
            // Mostly the oldest WR is the signaled one: no scan then.
            match q.front() {
                None => return None,
                Some((_, f, _)) if f.contains(SendFlags::SIGNALED) => q.pop_front()?,
                Some(_) => {
                    let pos = q
                        .iter()
                        .position(|(_, f, _)| f.contains(SendFlags::SIGNALED))?;
                    let mut last = None;
                    for _ in 0..=pos {
                        last = q.pop_front();
                    }
                    last?
                }
            }
        } else {
            q.pop_front()?
        };
        drop(q);
        self.handle
            .inject_completion(self.completion(done.0, status, done.2, byte_len));
        Some(done.0)
    }

    /// Completes the oldest posted receive with `status` and `byte_len`.
    pub fn complete_recv(&self, status: WcStatus, byte_len: u32) -> Option<u64> {
        let id = self.recvs.borrow_mut().pop_front()?;
        self.handle
            .inject_completion(self.completion(id, status, WcOpcode::Recv, byte_len));
        Some(id)
    }

    /// Completes the oldest posted receive successfully with `byte_len`
    /// bytes and immediate data `imm`.
    pub fn complete_recv_imm(&self, byte_len: u32, imm: u32) -> Option<u64> {
        let id = self.recvs.borrow_mut().pop_front()?;
        let mut c = self.completion(id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, byte_len);
        c.imm_data = Some(imm);
        self.handle.inject_completion(c);
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

    /// Makes the next post fail after accepting `posted` WRs.
    pub fn fail_next_post(&self, posted: usize, error: ProviderError) {
        *self.fail_next.borrow_mut() = Some((posted, error));
        self.fail_armed.set(true);
    }
}
