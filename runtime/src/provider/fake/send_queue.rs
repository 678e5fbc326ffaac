//! The fake QP's send queue: the WRs posted and not retired yet, oldest
//! first. Every WR gets a sequence number when posted, and the queue keeps
//! the number after its newest signaled WR, so that finding the WRs a
//! signaled completion retires costs no scan.

use super::fifo::Fifo;
use crate::provider::{SendFlags, SendWr, WcOpcode};

/// One posted send WR: its wr_id, flags and the opcode its completion reports.
pub(super) type Posted = (u64, SendFlags, WcOpcode);

fn signaled(flags: SendFlags) -> bool {
    flags.contains(SendFlags::SIGNALED)
}

/// See the module docs.
#[derive(Default)]
pub(super) struct SendQueue {
    wrs: Fifo<Posted>,
    /// WRs ever removed from the front: the oldest WR's sequence number.
    retired: u64,
    /// The sequence number after the newest signaled WR ever posted.
    signaled_end: u64,
}

impl SendQueue {
    pub(super) fn len(&self) -> usize {
        self.wrs.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Posted> {
        self.wrs.as_slice().iter()
    }

    /// Appends `wrs`.
    pub(super) fn extend(&mut self, wrs: &[SendWr]) {
        let first = self.retired + self.wrs.len() as u64;
        if let Some(i) = wrs.iter().rposition(|wr| signaled(wr.flags)) {
            self.signaled_end = first + i as u64 + 1;
        }
        if let [wr] = wrs {
            // (One WR, the most common list: no loop.)
            self.wrs
                .push((wr.wr_id, wr.flags, wr.op.completion_opcode()));
        } else {
            self.wrs.extend(
                wrs.iter()
                    .map(|wr| (wr.wr_id, wr.flags, wr.op.completion_opcode())),
            );
        }
    }

    /// Removes the oldest WR.
    pub(super) fn pop_front(&mut self) -> Option<Posted> {
        let wr = self.wrs.pop_front()?;
        self.retired += 1;
        Some(wr)
    }

    /// How many of the oldest WRs end with the newest signaled one (0 if
    /// none is signaled).
    pub(super) fn through_last_signaled(&self) -> usize {
        self.signaled_end.saturating_sub(self.retired) as usize
    }

    /// Retires the WRs up to and including the oldest signaled one (the
    /// unsignaled ones before it complete with it, silently); returns it.
    pub(super) fn retire_to_signaled(&mut self) -> Option<Posted> {
        if self.through_last_signaled() == 0 {
            return None;
        }
        while let Some(wr) = self.pop_front() {
            if signaled(wr.1) {
                return Some(wr);
            }
        }
        None
    }

    /// The oldest `n` WRs (`n <= len()`).
    pub(super) fn front(&self, n: usize) -> &[Posted] {
        &self.wrs.as_slice()[..n]
    }

    /// Removes the oldest `n` WRs (`n <= len()`).
    pub(super) fn retire_front(&mut self, n: usize) {
        self.wrs.advance(n);
        self.retired += n as u64;
    }

    /// Removes every WR.
    pub(super) fn take_all(&mut self) -> Vec<Posted> {
        self.retired += self.wrs.len() as u64;
        self.wrs.take_all()
    }
}
