//! The I/O side of the reactor: `mio::Poll` and what it sleeps on. One
//! file per job: `cqs.rs` (CQs, their arming and draining into the op
//! table), `queues.rs` (routing reserved completions to the QPs and rings
//! registered as [`WorkQueue`]s, the poll phase, shutdown), `io.rs`
//! (sockets), `async_events.rs` (device async-event fds). This file holds
//! the state and the sleep.

mod async_events;
mod cqs;
mod io;
mod queues;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use mio::{Events, Registry, Token};
use slab::Slab;

use super::work_queue::WorkQueue;
use super::RuntimeError;
use crate::op::OpTable;
use crate::provider::Completion;
use async_events::AsyncEntry;
use cqs::CqEntry;
pub(crate) use io::Direction;
use io::IoEntry;

/// Token of the cross-thread waker.
pub(crate) const WAKER_TOKEN: Token = Token(usize::MAX);
/// Completion channels use tokens `CHANNEL_BASE + cq key`.
const CHANNEL_BASE: usize = 1 << (usize::BITS - 2);
/// Async-event fds use tokens `ASYNC_BASE + key`.
const ASYNC_BASE: usize = CHANNEL_BASE + (1 << (usize::BITS - 3));
/// Async events kept per device until someone takes them.
const ASYNC_QUEUE: usize = 64;

/// Receives completions of reserved wr_ids.
pub(crate) type ReservedHandler = Box<dyn FnMut(Completion)>;

pub(crate) struct Driver {
    poll: RefCell<mio::Poll>,
    events: RefCell<Events>,
    registry: Registry,
    pub(crate) ops: Rc<OpTable>,
    cqs: RefCell<Slab<CqEntry>>,
    asyncs: RefCell<Slab<AsyncEntry>>,
    io: RefCell<Slab<IoEntry>>,
    /// Queue pairs, named by the key in inline wr_ids; kept until dropped
    /// and drained.
    qps: RefCell<Slab<Rc<dyn WorkQueue>>>,
    /// Receive rings, named by ring wr_ids; kept until dropped and drained.
    rings: RefCell<Slab<Rc<dyn WorkQueue>>>,
    /// Queue pairs dropped by their owner and still draining.
    draining: Cell<usize>,
    /// A poll phase is running: single send WRs wait for its end
    /// (`qp/deferred.rs`).
    batching: Cell<bool>,
    /// Queues to tell when the poll phase ends.
    phase_waiters: RefCell<Vec<Rc<dyn WorkQueue>>>,
    /// Where CQs are polled into; borrowed by `drain_cqs` throughout, so a
    /// nested call (from user code its completions run) polls no CQ.
    batch: RefCell<Vec<Completion>>,
    /// One past the highest CQ key ever registered.
    cq_bound: Cell<usize>,
    /// CQs registered whose channel is no edge-triggered source.
    level_channels: Cell<usize>,
    ack_batch: u32,
    pub(crate) reserved_handler: RefCell<Option<ReservedHandler>>,
}

impl Drop for Driver {
    fn drop(&mut self) {
        // An op future points at the table without a reference count (see
        // `Op`): while one holds its data, its slot is live. A table with
        // live slots (the runtime went away under ops still in flight, or
        // completed and never collected) is leaked, like the buffers the
        // runtime leaks at shutdown.
        if self.ops.len() > 0 {
            std::mem::forget(Rc::clone(&self.ops));
        }
    }
}

impl Driver {
    pub(crate) fn new(
        poll: mio::Poll,
        events: usize,
        op_slots: usize,
        cq_batch: usize,
    ) -> Result<Driver, RuntimeError> {
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|source| RuntimeError::Io {
                context: "cloning the mio registry",
                source,
            })?;
        Ok(Driver {
            poll: RefCell::new(poll),
            events: RefCell::new(Events::with_capacity(events.max(16))),
            registry,
            ops: Rc::new(OpTable::with_capacity(op_slots)),
            cqs: RefCell::new(Slab::new()),
            asyncs: RefCell::new(Slab::new()),
            io: RefCell::new(Slab::new()),
            qps: RefCell::new(Slab::new()),
            rings: RefCell::new(Slab::new()),
            draining: Cell::new(0),
            batching: Cell::new(false),
            phase_waiters: RefCell::new(Vec::new()),
            batch: RefCell::new(vec![Completion::EMPTY; cq_batch.max(1)]),
            cq_bound: Cell::new(0),
            level_channels: Cell::new(0),
            ack_batch: 16,
            reserved_handler: RefCell::new(None),
        })
    }

    /// Events taken per epoll call.
    pub(crate) fn event_capacity(&self) -> usize {
        self.events.borrow().capacity()
    }

    pub(crate) fn poll_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.poll.borrow().as_raw_fd()
    }

    // ---- sleeping --------------------------------------------------------

    /// Waits in epoll for up to `timeout` (`None` = forever), then dispatches
    /// the events. Returns the number of events.
    pub(crate) fn poll_io(&self, timeout: Option<Duration>) -> std::io::Result<usize> {
        self.poll_io_then(timeout, || {})
    }

    /// [`poll_io`](Self::poll_io), calling `awake` once epoll has returned
    /// and before any event is dispatched (the reactor marks itself awake
    /// there, so the wakes the dispatch makes on this thread kick nothing).
    pub(crate) fn poll_io_then(
        &self,
        timeout: Option<Duration>,
        awake: impl FnOnce(),
    ) -> std::io::Result<usize> {
        let mut events = self.events.borrow_mut();
        let polled = self.poll.borrow_mut().poll(&mut events, timeout);
        awake();
        match polled {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(0),
            Err(e) => return Err(e),
        }
        let mut n = 0;
        for ev in events.iter() {
            n += 1;
            let t = ev.token();
            if t == WAKER_TOKEN {
                continue;
            }
            if t.0 >= ASYNC_BASE {
                self.async_ready(t.0 - ASYNC_BASE);
            } else if t.0 >= CHANNEL_BASE {
                self.channel_ready(t.0 - CHANNEL_BASE);
            } else {
                self.io_ready(t.0, ev);
            }
        }
        Ok(n)
    }

    /// Shutdown: forgets every socket registration and CQ (their owners may
    /// outlive the runtime; their later deregistration is harmless).
    pub(crate) fn clear(&self) {
        let io: Vec<IoEntry> = self.io.borrow_mut().drain().collect();
        drop(io);
        let keys: Vec<usize> = self.cqs.borrow().iter().map(|(k, _)| k).collect();
        for k in keys {
            self.deregister_cq(k);
        }
        let keys: Vec<usize> = self.asyncs.borrow().iter().map(|(k, _)| k).collect();
        for k in keys {
            self.deregister_async(k);
        }
        let handler = self.reserved_handler.borrow_mut().take();
        drop(handler);
    }
}
