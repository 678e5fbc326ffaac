//! [`StagedNow`]: `Rdma::send_buf`'s staged message (no immediate of its
//! own) when nothing has to be waited for: a credit at hand in turn, the
//! staging gate open with nobody waiting, room in the peer's ring. It is
//! placed and its WRITE_WITH_IMM submitted before the future exists, so
//! the future is the submission and what it still holds, with no state
//! machine of the waiting kind and no allocation. The general path
//! (`staging::send_staged_from`) is boxed per message: that box, its
//! `acquire` futures and the move into it were about 1,100 of a 16 KiB
//! message's sending instructions (`docs/benchmarks.md`). [`StagedSend`]
//! is `send_buf`'s future for a staged message: a `StagedNow`, or a wait
//! for a credit alone before one, or the general path.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use verbio_runtime::buf::LocalBuf;
use verbio_runtime::Submit;

use super::error::AgentError;
use super::flow::{Acquire, Permit};
use super::rdma::Shared;
use super::staging::{send_staged_from, staged_tag, Reserve, Unreserve};
use super::wire::{MAX_STAGED_GRANT_LEN, MAX_STAGED_RETURN};
use crate::verbs::write_with_imm::WriteWithImmVerb;
use crate::verbs::Verbs;

/// A staged message's WRITE_WITH_IMM, submitted: done at its completion,
/// which gives the buffer back. Cancel-safe as the general path: dropped
/// before the WRITE is posted (it waited for send-queue room), the place
/// in the ring, the credit and what rode on it are given back and the
/// peer sees nothing; dropped after, the runtime frees the buffer at the
/// completion.
#[must_use = "a staged send does nothing unless awaited"]
pub(crate) struct StagedNow<'a> {
    s: &'a Rc<Shared>,
    write: Submit<WriteWithImmVerb<LocalBuf>>,
    /// `Some` until the WRITE is posted.
    waiting: Option<Waiting<'a>>,
}

/// What a staged WRITE not yet posted holds (given back if it never is).
/// Dropped in field order: the place goes back while the gate is still
/// held (it is the latest taken), as in the general path.
struct Waiting<'a> {
    place: Unreserve<'a>,
    ride: Riding<'a>,
    credit: Permit<'a>,
    gate: Permit<'a>,
}

impl Waiting<'_> {
    /// The WRITE is posted: everything it holds is the peer's now.
    fn posted(self) {
        let Waiting {
            credit,
            gate,
            mut place,
            mut ride,
        } = self;
        credit.spend();
        place.placed = None;
        ride.grant = 0;
        ride.returns.1 = 0;
        drop(gate);
    }
}

/// What rides in a staged WRITE's immediate: owed again if it is never
/// posted.
struct Riding<'a> {
    s: &'a Shared,
    /// Credits.
    grant: u32,
    /// The peer's messages returned (the ring bytes each took, and how
    /// many).
    returns: ([u32; MAX_STAGED_RETURN as usize], usize),
}

impl Drop for Riding<'_> {
    fn drop(&mut self) {
        let s = self.s;
        s.owed.unride(&s.granted_credits, self.grant);
        let (taken, n) = self.returns;
        if n > 0 {
            s.staging.unfreed(taken[..n].iter().copied());
        }
    }
}

impl<'a> StagedNow<'a> {
    /// Submits `buf` (longer than a piece, at most `Staging::max_len`) as
    /// a staged message (with `credit`, else one at hand in turn) if
    /// nothing has to be waited for; `Err` gives `buf` and `credit` back
    /// with nothing else taken.
    #[inline]
    pub(crate) fn start(
        s: &'a Rc<Shared>,
        buf: LocalBuf,
        credit: Option<Permit<'a>>,
    ) -> Result<Self, (LocalBuf, Option<Permit<'a>>)> {
        let st = &s.staging;
        let Ok(len) = u32::try_from(buf.len()) else {
            return Err((buf, credit));
        };
        if s.is_down() {
            return Err((buf, credit));
        }
        let credit = match credit {
            Some(c) => c,
            None => match s.send_credits.try_acquire_in_turn() {
                Some(c) => c,
                None => return Err((buf, None)),
            },
        };
        let Some(gate) = st.gate().try_acquire_in_turn() else {
            return Err((buf, Some(credit)));
        };
        let Reserve::Placed(placed) = st.reserve_now(len, len <= MAX_STAGED_GRANT_LEN) else {
            return Err((buf, Some(credit)));
        };
        let place = Unreserve {
            staging: st,
            placed: Some(placed),
        };
        let Some(remote) = st.remote_for(&placed, len) else {
            drop(place);
            return Err((buf, Some(credit)));
        };
        let posted = Cell::new(false);
        let (tag, ride, returns) = staged_tag(s, len, placed.restart, &posted);
        let write = s.qp.write_with_imm(buf, remote, tag);
        if write.wr_id().is_some() {
            posted.set(true);
            credit.spend();
            let mut place = place;
            place.placed = None;
            drop(gate);
            drop(ride);
            drop(returns);
            return Ok(StagedNow {
                s,
                write,
                waiting: None,
            });
        }
        // Waiting for send-queue room (or refused, seen at the first poll).
        let waiting = Waiting {
            place,
            ride: Riding {
                s,
                grant: ride.map_or(0, |r| r.detach()),
                returns: returns.map_or(([0; MAX_STAGED_RETURN as usize], 0), |r| r.detach()),
            },
            credit,
            gate,
        };
        Ok(StagedNow {
            s,
            write,
            waiting: Some(waiting),
        })
    }
}

impl Future for StagedNow<'_> {
    type Output = (Result<(), AgentError>, LocalBuf);

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let out = Pin::new(&mut this.write).poll(cx);
        if this.waiting.is_some() && this.write.wr_id().is_some() {
            if let Some(w) = this.waiting.take() {
                w.posted();
            }
        }
        let Poll::Ready((r, buf)) = out else {
            return Poll::Pending;
        };
        // Never posted (refused): what it held is given back.
        drop(this.waiting.take());
        Poll::Ready((this.s.verb_result(r.map(drop)), buf))
    }
}

/// The general staged path's future, boxed.
type General<'a> = Pin<Box<dyn Future<Output = (Result<(), AgentError>, LocalBuf)> + 'a>>;

/// `Rdma::send_buf`'s staged message (longer than a piece, at most
/// `Staging::max_len`): a [`StagedNow`] when nothing has to be waited for;
/// a credit to wait for alone (a window of sends beyond the peer's
/// credits) is awaited with the small [`Acquire`] and the message then
/// started the same way; any other wait (the ring's gate, room in the
/// ring) takes the general path, boxed. A hand-written state machine, so
/// that no `StagedNow` is held twice in the frame: as an `async fn`, the
/// `match` temporaries around its two awaits made `send_buf`'s future
/// 928 bytes in the debug build (`tests/agent_messages.rs` holds it to
/// 768; a `FuturesUnordered` of sends copies it into each box). Dropped
/// while waiting, what it holds is given back as [`StagedNow`]'s and the
/// general path's drops do.
#[must_use = "a staged send does nothing unless awaited"]
pub(crate) struct StagedSend<'a> {
    s: &'a Rc<Shared>,
    state: SendState<'a>,
}

enum SendState<'a> {
    Now(StagedNow<'a>),
    /// Waiting for a credit (the buffer is `Some` until it comes).
    Credit(Acquire<'a>, Option<LocalBuf>),
    General(General<'a>),
    /// Its output was taken.
    Done,
}

impl<'a> StagedSend<'a> {
    /// Starts sending `buf` (see [`StagedSend`]): submitted now unless a
    /// credit, the gate or room has to be waited for.
    #[inline]
    pub(crate) fn new(s: &'a Rc<Shared>, buf: LocalBuf) -> Self {
        let state = match StagedNow::start(s, buf, None) {
            Ok(now) => SendState::Now(now),
            Err((buf, Some(credit))) => SendState::General(general(s, buf, credit)),
            Err((buf, None)) => SendState::Credit(s.send_credits.acquire_noting_wait(), Some(buf)),
        };
        StagedSend { s, state }
    }
}

/// The general (boxed) path for `buf` with `credit` taken.
#[cold]
fn general<'a>(s: &'a Rc<Shared>, buf: LocalBuf, credit: Permit<'a>) -> General<'a> {
    Box::pin(send_staged_from(s, buf, None, Some(credit)))
}

impl Future for StagedSend<'_> {
    type Output = (Result<(), AgentError>, LocalBuf);

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                SendState::Now(now) => {
                    let out = std::task::ready!(Pin::new(now).poll(cx));
                    this.state = SendState::Done;
                    return Poll::Ready(out);
                }
                SendState::Credit(acquire, buf) => {
                    let r = std::task::ready!(Pin::new(acquire).poll(cx));
                    let Some(buf) = buf.take() else {
                        // Invariant: `Some` while waiting for the credit.
                        return Poll::Pending;
                    };
                    let s = this.s;
                    let Ok((credit, _held_back)) = r else {
                        this.state = SendState::Done;
                        return Poll::Ready((Err(s.closed_error()), buf));
                    };
                    this.state = match StagedNow::start(s, buf, Some(credit)) {
                        Ok(now) => SendState::Now(now),
                        Err((buf, credit)) => match credit {
                            Some(credit) => SendState::General(general(s, buf, credit)),
                            // Invariant: a credit given is given back.
                            None => {
                                SendState::Credit(s.send_credits.acquire_noting_wait(), Some(buf))
                            }
                        },
                    };
                }
                SendState::General(f) => {
                    let out = std::task::ready!(f.as_mut().poll(cx));
                    this.state = SendState::Done;
                    return Poll::Ready(out);
                }
                SendState::Done => {
                    tracing::error!("staged send polled after completion");
                    return Poll::Pending;
                }
            }
        }
    }
}
