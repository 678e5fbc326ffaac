//! Serving a listening socket through resource exhaustion and floods: an
//! accept that backs off instead of failing ([`AcceptBackoff`]), and caps on
//! the connections a listener holds before they have proven anything
//! ([`PendingLimits`]). Both listeners of verbio (the soft device's
//! connection manager and the TCP endpoint handshake) use them.
//!
//! `accept(2)` errors fall in three groups (see its Linux man page):
//!
//! - **the connection's own**: `ECONNABORTED`, `EPROTO`, `EPERM` (a
//!   firewall), and the network errors Linux passes on from the new socket
//!   (`ENETDOWN`, `ENOPROTOOPT`, `EHOSTDOWN`, `ENONET`, `EHOSTUNREACH`,
//!   `EOPNOTSUPP`, `ENETUNREACH`), `ECONNRESET`: that connection is gone;
//!   accept again at once;
//! - **resources**: `EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM` (and `ENOSPC`
//!   from registering the socket with epoll), or anything unknown: the
//!   connection stays in the kernel's backlog; try again after a pause that
//!   doubles from 10 ms to 1 s. (The listening socket is edge-triggered: no
//!   new readiness comes for a connection already queued, so the retry
//!   must be a timer, not a wait for readiness);
//! - **the listener's own**: `EBADF`, `EINVAL` (not listening), `ENOTSOCK`,
//!   `EFAULT`: returned; nothing will change them.
//!
//! Each burst of errors is logged once (`warn` when it starts, `info` with
//! the count and duration when an accept succeeds again).

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::net::{TcpListener, TcpStream};
use super::timer::{sleep, Sleep};
use crate::accept_error::{classify, ErrorClass, ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN};

/// Connection errors skipped in one poll before yielding (each one takes a
/// connection off the backlog, so the loop ends anyway).
const SKIPS_PER_POLL: usize = 64;

/// A burst of accept errors under way.
struct Burst {
    started: Instant,
    errors: u64,
}

/// Accepts on a [`TcpListener`], riding out resource errors (`EMFILE`,
/// `ENFILE`, `ENOMEM`, ...) with a growing pause and skipping connections
/// that failed before they were accepted (`ECONNABORTED`, ...): only an
/// error of the listening socket itself is returned. See the module
/// documentation for the groups of errors.
pub struct AcceptBackoff {
    what: &'static str,
    pause: Duration,
    retry: Option<Pin<Box<Sleep>>>,
    burst: Option<Burst>,
}

impl std::fmt::Debug for AcceptBackoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceptBackoff")
            .field("what", &self.what)
            .field("backing_off", &self.retry.is_some())
            .field("pause", &self.pause)
            .finish()
    }
}

impl AcceptBackoff {
    /// Backoff state for the listener named `what` in logs.
    pub fn new(what: &'static str) -> AcceptBackoff {
        AcceptBackoff {
            what,
            pause: ACCEPT_BACKOFF_MIN,
            retry: None,
            burst: None,
        }
    }

    /// Whether it is pausing after a resource error.
    pub fn backing_off(&self) -> bool {
        self.retry.is_some()
    }

    /// The next connection; `Pending` while none is waiting or while it
    /// pauses after a resource error (`cx` is woken when the pause ends).
    /// `Ready(Err)` only for an error of the listening socket itself.
    pub fn poll_accept(
        &mut self,
        listener: &TcpListener,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<(TcpStream, SocketAddr)>> {
        if let Some(retry) = self.retry.as_mut() {
            if retry.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.retry = None;
        }
        for _ in 0..SKIPS_PER_POLL {
            let accepting = pin!(listener.accept());
            let e = match accepting.poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(conn)) => {
                    self.end_burst();
                    return Poll::Ready(Ok(conn));
                }
                Poll::Ready(Err(e)) => e,
            };
            match classify(&e) {
                ErrorClass::Connection => {
                    tracing::debug!(listener = self.what, error = %e, "a connection failed before it was accepted; accepting the next");
                }
                ErrorClass::Listener => return Poll::Ready(Err(e)),
                ErrorClass::Resources => {
                    self.start_or_count_burst(&e);
                    let mut retry = Box::pin(sleep(self.pause));
                    self.pause = (self.pause * 2).min(ACCEPT_BACKOFF_MAX);
                    // Registers the timer (it cannot have fired yet).
                    if retry.as_mut().poll(cx).is_ready() {
                        continue;
                    }
                    self.retry = Some(retry);
                    return Poll::Pending;
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The next connection, as [`poll_accept`](Self::poll_accept).
    pub async fn accept(&mut self, listener: &TcpListener) -> io::Result<(TcpStream, SocketAddr)> {
        std::future::poll_fn(|cx| self.poll_accept(listener, cx)).await
    }

    fn start_or_count_burst(&mut self, e: &io::Error) {
        match &mut self.burst {
            Some(b) => b.errors += 1,
            None => {
                tracing::warn!(
                    listener = self.what,
                    error = %e,
                    "accept failed for lack of resources; retrying with backoff (logged once per burst)"
                );
                self.burst = Some(Burst {
                    started: Instant::now(),
                    errors: 1,
                });
            }
        }
    }

    fn end_burst(&mut self) {
        self.pause = ACCEPT_BACKOFF_MIN;
        if let Some(b) = self.burst.take() {
            tracing::info!(
                listener = self.what,
                failed_accepts = b.errors,
                lasted = ?b.started.elapsed(),
                "accepting again"
            );
        }
    }
}

/// Why [`PendingLimits::admit`] refused a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PendingRefusal {
    /// The listener holds its maximum of pending connections.
    #[error("{limit} connections are pending, the listener's limit")]
    Listener {
        /// The limit.
        limit: usize,
    },
    /// The peer's address holds its maximum of pending connections.
    #[error("{limit} connections from {source_ip} are pending, the limit per address")]
    Source {
        /// The peer's address.
        source_ip: IpAddr,
        /// The limit.
        limit: usize,
    },
}

/// Warns at most once per this interval about refusals (with a count).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

struct Counts {
    total: usize,
    per_source: HashMap<IpAddr, usize>,
    last_warning: Option<Instant>,
    unlogged_refusals: u64,
}

/// Caps on the connections a listener holds before they have proven
/// anything (sent a valid request): at most `max_pending` in all and
/// `max_per_source` from one IP address (IPv4-mapped IPv6 addresses count
/// as their IPv4 address). A slot is held by the [`PendingSlot`] that
/// [`admit`](Self::admit) returns, until it is dropped. The map of sources
/// holds only addresses with a slot, so its size is bounded by
/// `max_pending`. Refusals are logged at `warn`, at most once per 10 s
/// with the count since the last warning.
#[derive(Clone)]
pub struct PendingLimits {
    what: &'static str,
    max_pending: usize,
    max_per_source: usize,
    counts: Rc<RefCell<Counts>>,
}

impl std::fmt::Debug for PendingLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingLimits")
            .field("what", &self.what)
            .field("max_pending", &self.max_pending)
            .field("max_per_source", &self.max_per_source)
            .field("pending", &self.pending())
            .finish()
    }
}

impl PendingLimits {
    /// Caps for the listener named `what` in logs (each at least 1).
    pub fn new(what: &'static str, max_pending: usize, max_per_source: usize) -> PendingLimits {
        PendingLimits {
            what,
            max_pending: max_pending.max(1),
            max_per_source: max_per_source.max(1),
            counts: Rc::new(RefCell::new(Counts {
                total: 0,
                per_source: HashMap::new(),
                last_warning: None,
                unlogged_refusals: 0,
            })),
        }
    }

    /// Connections holding a slot.
    pub fn pending(&self) -> usize {
        self.counts.borrow().total
    }

    /// Whether another connection may be taken at all (check before
    /// accepting: a full listener leaves new connections in the kernel's
    /// backlog).
    pub fn has_room(&self) -> bool {
        self.pending() < self.max_pending
    }

    /// Logs (rate-limited) that the listener stopped accepting because it
    /// is full.
    pub fn note_full(&self) {
        self.note_refusal(&PendingRefusal::Listener {
            limit: self.max_pending,
        });
    }

    /// Whether [`admit`](Self::admit) would give `peer` a slot now (not
    /// logged).
    pub fn would_admit(&self, peer: SocketAddr) -> bool {
        let ip = peer.ip().to_canonical();
        let c = self.counts.borrow();
        c.total < self.max_pending
            && c.per_source.get(&ip).copied().unwrap_or(0) < self.max_per_source
    }

    /// A slot for a connection from `peer`, or why there is none (logged).
    pub fn admit(&self, peer: SocketAddr) -> Result<PendingSlot, PendingRefusal> {
        let ip = peer.ip().to_canonical();
        let refusal = {
            let mut c = self.counts.borrow_mut();
            let from_source = c.per_source.get(&ip).copied().unwrap_or(0);
            if c.total >= self.max_pending {
                Some(PendingRefusal::Listener {
                    limit: self.max_pending,
                })
            } else if from_source >= self.max_per_source {
                Some(PendingRefusal::Source {
                    source_ip: ip,
                    limit: self.max_per_source,
                })
            } else {
                c.total += 1;
                c.per_source.insert(ip, from_source + 1);
                None
            }
        };
        match refusal {
            Some(r) => {
                self.note_refusal(&r);
                Err(r)
            }
            None => Ok(PendingSlot {
                counts: self.counts.clone(),
                ip,
            }),
        }
    }

    fn note_refusal(&self, r: &PendingRefusal) {
        let mut c = self.counts.borrow_mut();
        c.unlogged_refusals += 1;
        let now = Instant::now();
        if c.last_warning
            .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        let action = match r {
            PendingRefusal::Listener { .. } => "new connections wait in the kernel's backlog",
            PendingRefusal::Source { .. } => "refusing its new connections",
        };
        tracing::warn!(
            listener = self.what,
            times = c.unlogged_refusals,
            "{r}: {action} (logged at most every {REFUSAL_LOG_INTERVAL:?})"
        );
        c.last_warning = Some(now);
        c.unlogged_refusals = 0;
    }
}

/// One pending connection's place under a [`PendingLimits`]; dropping it
/// frees the place.
pub struct PendingSlot {
    counts: Rc<RefCell<Counts>>,
    ip: IpAddr,
}

impl std::fmt::Debug for PendingSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSlot").field("ip", &self.ip).finish()
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut c = self.counts.borrow_mut();
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_source.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_source.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests;
