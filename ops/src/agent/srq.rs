//! [`SrqHub`]: the receive side a listener's connections share when the
//! builder asks for it ([`RdmaBuilder::shared_receive_queue`]): one shared
//! receive queue of the device, filled by one receive ring, every
//! connection's QP created on it. A dispatcher task hands each message to
//! the connection whose QP it came in on ([`SrqRoute`]); the connection's
//! agent reads it in place and drops it, which gives the buffer back to
//! the SRQ. Receive memory is the ring's, whatever the number of
//! connections.
//!
//! The QPs on the SRQ share the device's protection domain (a receive is
//! checked against the PD of the QP it lands on), so the connections'
//! memory is not isolated from each other by protection domains as it is
//! without an SRQ.
//!
//! [`RdmaBuilder::shared_receive_queue`]: super::RdmaBuilder::shared_receive_queue

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

use futures::channel::mpsc;

use verbio_runtime::{
    spawn, Device, JoinHandle, RecvRing, RecvRingConfig, RingMsg, SharedRecvQueue,
};

use super::error::AgentError;

type Routes = RefCell<HashMap<u32, mpsc::UnboundedSender<RingMsg>>>;

/// A listener's shared receive queue and its dispatcher.
pub(crate) struct SrqHub {
    srq: SharedRecvQueue,
    routes: Rc<Routes>,
    dispatcher: RefCell<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SrqHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrqHub")
            .field("srq", &self.srq)
            .field("connections", &self.routes.borrow().len())
            .finish()
    }
}

impl Drop for SrqHub {
    fn drop(&mut self) {
        if let Some(task) = self.dispatcher.borrow_mut().take() {
            task.abort();
        }
    }
}

impl SrqHub {
    /// An SRQ of `depth` buffers of `buf_size` bytes on `device`, posted,
    /// with its dispatcher running. Reposts when fewer than a quarter are
    /// posted go out at once (the SRQ limit).
    pub(crate) fn start(
        device: &Device,
        depth: u32,
        buf_size: usize,
    ) -> Result<SrqHub, AgentError> {
        let srq = device
            .create_srq(depth)
            .map_err(|source| AgentError::Device {
                stage: "creating the shared receive queue",
                source,
            })?;
        let config = RecvRingConfig::new(depth, buf_size).srq_limit((depth / 4).max(1));
        let ring =
            RecvRing::on_srq(&srq, device.pd(), config).map_err(AgentError::SharedReceiveRing)?;
        let routes: Rc<Routes> = Rc::new(RefCell::new(HashMap::new()));
        let task = spawn(dispatch(ring, Rc::downgrade(&routes)));
        Ok(SrqHub {
            srq,
            routes,
            dispatcher: RefCell::new(Some(task)),
        })
    }

    /// The shared receive queue the connections' QPs are created on.
    pub(crate) fn srq(&self) -> &SharedRecvQueue {
        &self.srq
    }

    /// Routes the messages of QP `qp_num` to the returned route, which
    /// keeps the hub (its SRQ and dispatcher) running while it lives.
    pub(crate) fn route(hub: &Rc<SrqHub>, qp_num: u32) -> SrqRoute {
        let (tx, rx) = mpsc::unbounded();
        hub.routes.borrow_mut().insert(qp_num, tx);
        SrqRoute {
            qp_num,
            rx: RefCell::new(Some(rx)),
            hub: hub.clone(),
        }
    }
}

/// Hands each message to its connection; messages of QPs without a route
/// (closed connections) go back to the SRQ at once.
async fn dispatch(mut ring: RecvRing, routes: Weak<Routes>) {
    while let Some(msg) = ring.next().await {
        let Some(routes) = routes.upgrade() else {
            return;
        };
        match msg {
            Ok(m) => {
                let tx = routes.borrow().get(&m.qp_num()).cloned();
                if let Some(tx) = tx {
                    // A closed route drops the message: the buffer is reposted.
                    let _ = tx.unbounded_send(m);
                }
            }
            // A failed receive ends only its QP's connection (which sees
            // its QP fail); the buffer went back to the SRQ.
            Err(e) => {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "shared receive failed")
            }
        }
    }
}

/// One connection's share of the hub: its messages, in arrival order.
pub(crate) struct SrqRoute {
    qp_num: u32,
    rx: RefCell<Option<mpsc::UnboundedReceiver<RingMsg>>>,
    hub: Rc<SrqHub>,
}

impl std::fmt::Debug for SrqRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrqRoute")
            .field("qp_num", &self.qp_num)
            .finish()
    }
}

impl SrqRoute {
    /// The messages (once: the agent task takes them).
    pub(crate) fn take_messages(&self) -> Option<mpsc::UnboundedReceiver<RingMsg>> {
        self.rx.borrow_mut().take()
    }

    /// No more messages for this connection: the stream ends after those
    /// already routed.
    pub(crate) fn close(&self) {
        self.hub.routes.borrow_mut().remove(&self.qp_num);
    }
}

impl Drop for SrqRoute {
    fn drop(&mut self) {
        self.close();
    }
}
