//! What applications hand the engine through their QPs: new WRs, state
//! changes, destruction; and QPs failed by their CQ's overflow.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::super::lock;
use super::super::qp::QpShared;
use super::{EQp, EWqe, Engine};
use crate::provider::{AsyncElement, AsyncEvent, AsyncEventKind, QpState, QpType};

impl Engine {
    /// Moves every QP of a CQ that overflowed to ERR, with a QP fatal
    /// async event each (after the CQ's own error event), as RC hardware
    /// does: the completions of its WRs could not be reported any more.
    pub(crate) fn fail_overflowed(&mut self) {
        // (Pushed to under the engine lock, which we hold.)
        if !self.sh.any_overflowed.swap(false, Ordering::Relaxed) {
            return;
        }
        let list = std::mem::take(&mut *lock(&self.sh.overflowed));
        for cq in list {
            let qps: Vec<Arc<QpShared>> = lock(&self.sh.qps)
                .values()
                .filter(|q| Arc::ptr_eq(&q.send_cq, &cq) || Arc::ptr_eq(&q.recv_cq, &cq))
                .cloned()
                .collect();
            for qp in qps {
                if qp.destroyed.load(Ordering::Acquire) || qp.state() == QpState::Err {
                    continue;
                }
                let eq = self
                    .qps
                    .entry(qp.qpn)
                    .or_insert_with(|| EQp::new(qp.clone(), self.sh.clone()));
                if !Arc::ptr_eq(&eq.sh, &qp) {
                    *eq = EQp::new(qp.clone(), self.sh.clone());
                }
                eq.refresh(&mut lock(&qp.inner));
                tracing::debug!(
                    qpn = qp.qpn,
                    cq = cq.handle,
                    "soft engine: CQ overflow, QP to ERR"
                );
                eq.fail(None);
                self.sh.async_events.push(AsyncEvent {
                    kind: AsyncEventKind::QpFatal,
                    element: AsyncElement::Qp(qp.qpn),
                });
            }
        }
    }

    /// Services QPs the application touched. True if there were any.
    pub(super) fn service_dirty(&mut self) -> bool {
        let mut list = std::mem::take(&mut self.dirty_buf);
        std::mem::swap(&mut list, &mut *lock(&self.sh.dirty));
        let any = !list.is_empty();
        for qp in list.drain(..) {
            qp.dirty.store(false, Ordering::SeqCst);
            let qpn = qp.qpn;
            self.sync_qp(qp);
            self.note_timer(qpn);
        }
        self.dirty_buf = list;
        any
    }

    /// Looks at a QP the application touched: new WRs, state changes, destruction.
    fn sync_qp(&mut self, qp: Arc<QpShared>) {
        let qpn = qp.qpn;
        if qp.destroyed.load(Ordering::Acquire) {
            if let Some(eq) = self.qps.get(&qpn) {
                if Arc::ptr_eq(&eq.sh, &qp) {
                    self.qps.remove(&qpn);
                }
            }
            return;
        }
        let eq = self
            .qps
            .entry(qpn)
            .or_insert_with(|| EQp::new(qp.clone(), self.sh.clone()));
        if !Arc::ptr_eq(&eq.sh, &qp) {
            *eq = EQp::new(qp.clone(), self.sh.clone());
        }
        let mut inner = lock(&qp.inner);
        let state = eq.refresh(&mut inner);
        match state {
            QpState::Err => {
                eq.flush(&mut inner);
                return;
            }
            QpState::Rts => {
                if !inner.sq.is_empty() {
                    eq.stop_direct(&mut inner);
                }
                let cap = inner.sq.len();
                eq.wqes.extend(inner.sq.drain(..cap).map(|w| EWqe {
                    w,
                    first_psn: 0,
                    last_psn: 0,
                    error: None,
                    executed: false,
                }));
                if eq.sh.qp_type == QpType::Ud && eq.wqes.is_empty() {
                    eq.allow_ud_direct(&mut inner);
                }
            }
            QpState::Rtr if eq.sh.qp_type == QpType::Rc => {}
            _ => return,
        }
        drop(inner);
        self.ensure_conn(qpn);
        self.schedule(qpn);
    }
}
