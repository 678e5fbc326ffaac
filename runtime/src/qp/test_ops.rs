//! Test fixtures shared by the unit tests of submissions on the fake QP
//! (`deferred_tests.rs`, `one_tests.rs`, `submit_try_tests.rs`).

use std::rc::Rc;

use crate::op::{Completable, SubmitError};
use crate::provider::{Completion, QpCaps, SendOp, Sge};
use crate::qp::{QueuePair, Submit};

/// A fake QP's capacities: `send` send WRs, 8 receive WRs.
pub(super) fn caps(send: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: 8,
        ..QpCaps::default()
    }
}

/// An op's data that holds a token, to observe when the runtime drops or
/// returns it; its output is the completion (or the error).
pub(super) struct Probe(#[allow(dead_code)] pub(super) Rc<()>);

impl Completable for Probe {
    type Output = Result<Completion, SubmitError>;
    fn complete(self, c: Completion) -> Self::Output {
        Ok(c)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        Err(e)
    }
}

/// A single-WR WRITE (one fake SGE; the fake QP never touches memory).
pub(super) fn write_one(qp: &QueuePair, token: &Rc<()>) -> Submit<Probe> {
    // SAFETY: the fake QP never reads or writes the memory SGEs name.
    unsafe {
        qp.submit_send_one(Probe(token.clone()), move |_, wr| {
            wr.sg_list.push(Sge {
                addr: 0x1000,
                length: 64,
                lkey: 1,
            });
            wr.op = SendOp::Write {
                remote_addr: 0x2000,
                rkey: 2,
            };
            Ok(())
        })
    }
}
