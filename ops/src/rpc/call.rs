//! [`Call`]: the future of one call ([`Rpc::call`](super::Rpc::call),
//! [`Rpc::call_owned`](super::Rpc::call_owned)), written out by hand: a
//! small call polls it twice (the start, then the result), and the two
//! nested `async fn` state machines it replaces moved their state and
//! guards on every poll (about 230 instructions per call against this
//! one's 60-odd).

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::buf::MsgBuf;
use super::dispatcher::Engine;
use super::engine::client_calls::Req;
use super::error::RpcError;
use super::transport::Transport;

/// The request a call sends: borrowed and copied into the session's slot,
/// or a buffer of its own the slot takes (`None` once taken).
pub(crate) enum CallReq<'a> {
    Copy(&'a [u8]),
    Owned(Option<Vec<u8>>),
}

/// Where a call is.
#[derive(Clone, Copy)]
enum Stage {
    /// Not started; `queued`: waiting for a free slot of its session (a
    /// drop hands its turn on).
    Start { queued: bool },
    /// Started in slot `slot` with request number `req_num`, waiting for
    /// its result (a drop abandons the slot).
    InFlight { slot: usize, req_num: u64 },
    /// Over: its result was returned.
    Done,
}

/// The future of one call: starts it in a free slot of its session
/// (sending what the credits allow), then waits for its result. Dropped
/// while waiting for a slot, it hands the turn on; dropped before its
/// result, it abandons the call (the slot frees when the call ends).
pub(crate) struct Call<'a, T: Transport> {
    engine: &'a RefCell<Engine<T>>,
    sid: u32,
    req_type: u8,
    req: CallReq<'a>,
    stage: Stage,
}

impl<'a, T: Transport> Call<'a, T> {
    pub(crate) fn new(
        engine: &'a RefCell<Engine<T>>,
        sid: u32,
        req_type: u8,
        req: CallReq<'a>,
    ) -> Self {
        Call {
            engine,
            sid,
            req_type,
            req,
            stage: Stage::Start { queued: false },
        }
    }
}

impl<T: Transport> Future for Call<'_, T> {
    type Output = Result<MsgBuf, RpcError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match this.stage {
            Stage::Start { .. } => {
                let mut req = match &mut this.req {
                    CallReq::Copy(data) => Req::Copy(data),
                    CallReq::Owned(buf) => Req::Owned(buf),
                };
                let started =
                    this.engine
                        .borrow_mut()
                        .start_call(this.sid, this.req_type, &mut req, cx);
                match started {
                    Poll::Ready(Ok((slot, req_num))) => {
                        // The start registered this task's waker in the
                        // slot, and no answer can have come since (only
                        // the dispatcher takes packets): yields without
                        // looking.
                        this.stage = Stage::InFlight { slot, req_num };
                        Poll::Pending
                    }
                    Poll::Ready(Err(e)) => {
                        this.stage = Stage::Done;
                        Poll::Ready(Err(e))
                    }
                    Poll::Pending => {
                        this.stage = Stage::Start { queued: true };
                        Poll::Pending
                    }
                }
            }
            Stage::InFlight { slot, req_num } => {
                let out = this
                    .engine
                    .borrow_mut()
                    .core
                    .poll_call(this.sid, slot, req_num, cx);
                this.stage = if out.is_ready() {
                    Stage::Done
                } else {
                    Stage::InFlight { slot, req_num }
                };
                out
            }
            // As an `async fn`'s future would.
            Stage::Done => panic!("rpc: a call's future polled after it completed"),
        }
    }
}

impl<T: Transport> Drop for Call<'_, T> {
    fn drop(&mut self) {
        match self.stage {
            Stage::Start { queued: true } => {
                if let Ok(mut e) = self.engine.try_borrow_mut() {
                    e.core.pass_slot_turn(self.sid);
                }
            }
            Stage::InFlight { slot, req_num } => {
                if let Ok(mut e) = self.engine.try_borrow_mut() {
                    e.core.abandon(self.sid, slot, req_num);
                }
            }
            Stage::Start { queued: false } | Stage::Done => {}
        }
    }
}
