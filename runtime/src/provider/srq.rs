//! [`Srq`]: the public handle of a shared receive queue, and the
//! [`Pd`] calls that create one and the RC QPs that take their receives
//! from it.

#[cfg(feature = "ibverbs")]
use super::ibverbs;
use super::soft;
use super::Cq;
use super::{
    CqImp, Pd, PdImp, PostError, ProtectionDomain, ProviderError, Qp, QpCaps, QpImp, RecvWr,
    Result, SharedReceiveQueue, SrqAttr,
};

#[derive(Clone)]
enum SrqImp {
    Soft(soft::Srq),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Srq),
}

/// A shared receive queue (`ibv_srq`): one queue of receive WRs feeding
/// every QP created on it ([`Pd::create_qp_with_srq`]). Dropping the last
/// clone (and every QP on it) destroys it; WRs still posted then complete
/// never.
#[derive(Clone)]
pub struct Srq {
    imp: SrqImp,
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Srq")
            .field("handle", &self.handle())
            .finish()
    }
}

impl Pd {
    /// Creates a shared receive queue of `attr.max_wr` WRs of up to
    /// `attr.max_sge` SGEs each; a nonzero `attr.srq_limit` arms the limit
    /// event at once (as rxe does).
    pub fn create_srq(&self, attr: &SrqAttr) -> Result<Srq> {
        let imp = match &self.imp {
            PdImp::Soft(p) => SrqImp::Soft(ProtectionDomain::create_srq(p, attr)?),
            #[cfg(feature = "ibverbs")]
            PdImp::Ibverbs(p) => SrqImp::Ibverbs(ProtectionDomain::create_srq(p, attr)?),
        };
        Ok(Srq { imp })
    }

    /// Creates an RC queue pair in RESET state whose receives come from
    /// `srq`: its own receive queue has no room
    /// ([`Qp::post_recv`] is refused, the receive sizes of `caps` are
    /// ignored), and a message arriving on it takes the oldest WR of the
    /// SRQ (answering RNR if there is none). Its receive completions name
    /// it in [`Completion::qp_num`](super::Completion::qp_num).
    pub fn create_qp_with_srq(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        srq: &Srq,
    ) -> Result<Qp> {
        let imp = match (&self.imp, &send_cq.imp, &recv_cq.imp, &srq.imp) {
            (PdImp::Soft(p), CqImp::Soft(s), CqImp::Soft(r), SrqImp::Soft(q)) => {
                QpImp::Soft(ProtectionDomain::create_qp_with_srq(p, s, r, caps, q)?)
            }
            #[cfg(feature = "ibverbs")]
            (PdImp::Ibverbs(p), CqImp::Ibverbs(s), CqImp::Ibverbs(r), SrqImp::Ibverbs(q)) => {
                QpImp::Ibverbs(ProtectionDomain::create_qp_with_srq(p, s, r, caps, q)?)
            }
            #[allow(unreachable_patterns)]
            _ => {
                return Err(ProviderError::InvalidArgument {
                    call: "create_qp_with_srq",
                    what: "objects from different providers".to_string(),
                })
            }
        };
        Ok(Qp { imp })
    }
}

impl Srq {
    /// The handle its async events name
    /// ([`AsyncElement::Srq`](super::AsyncElement::Srq)).
    pub fn handle(&self) -> u32 {
        dispatch!(SrqImp, &self.imp, |q| SharedReceiveQueue::handle(q))
    }

    /// Its sizes and the limit now armed (`ibv_query_srq`; the limit reads
    /// 0 once the event fired).
    pub fn attr(&self) -> Result<SrqAttr> {
        dispatch!(SrqImp, &self.imp, |q| SharedReceiveQueue::attr(q))
    }

    /// Arms the limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): the
    /// first message that leaves fewer than `limit` WRs posted raises
    /// [`AsyncEventKind::SrqLimitReached`](super::AsyncEventKind::SrqLimitReached)
    /// once; 0 disarms. Refused above `max_wr`.
    pub fn modify_limit(&self, limit: u32) -> Result<()> {
        dispatch!(SrqImp, &self.imp, |q| SharedReceiveQueue::modify_limit(
            q, limit
        ))
    }

    /// Posts a list of receive WRs with one doorbell; the QPs on the SRQ
    /// take them in posting order.
    ///
    /// On failure, [`PostError::posted`] counts the leading WRs that were
    /// accepted; the device never touches the memory of the others.
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_recv`]: for every SGE of every posted
    /// WR, from this call until the device is done with the WR, the range
    /// `[addr, addr + length)` stays allocated and in place, no Rust
    /// reference to any byte of it is used and nothing but the device
    /// writes it. The device is done with a WR once its completion has
    /// been polled (from the receive CQ of whichever QP the message came in
    /// on), or once the registration its SGEs' `lkey` names has been
    /// deregistered (every [`Mr`](super::Mr) handle of it dropped). A WR
    /// still posted when the SRQ is destroyed never completes: only the
    /// deregistration ends the device's access then.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        // SAFETY: forwarded contract of this function.
        dispatch!(SrqImp, &self.imp, |q| unsafe {
            SharedReceiveQueue::post_recv(q, wrs)
        })
    }
}
