//! A client call ends: its credits go back to the session, its caller is
//! woken (or, abandoned, its slot freed at once); a session whose peer
//! stopped answering ends all its calls.

use crate::rpc::error::{RpcError, SessionId};
use crate::rpc::session::{CallState, Session, SessionState, SESSION_SLOTS};

/// Ends the call of slot `i` with `result`, returning the credits it holds.
pub(crate) fn complete<P>(s: &mut Session<P>, i: usize, result: Result<(), RpcError>) {
    let slot = &mut s.client[i];
    s.credits += slot.in_flight();
    slot.num_tx = slot.num_rx;
    slot.answered = 0;
    slot.state = CallState::Done(result);
    s.active &= !(1 << i);
    if slot.abandoned {
        free_slot(s, i);
    } else if let Some(w) = &slot.waker {
        // Kept: the slot's next call, made by the same task as a rule,
        // registers the same waker again (no clone, no drop per call).
        w.wake_by_ref();
    }
}

/// [`complete`] with `Ok` (a small call's response): inline.
#[inline(always)]
pub(crate) fn complete_ok<P>(s: &mut Session<P>, i: usize) {
    let slot = &mut s.client[i];
    s.credits += slot.in_flight();
    slot.num_tx = slot.num_rx;
    slot.answered = 0;
    slot.state = CallState::Done(Ok(()));
    s.active &= !(1 << i);
    if slot.abandoned {
        free_slot(s, i);
    } else if let Some(w) = &slot.waker {
        w.wake_by_ref();
    }
}

/// Ends the call of slot `i` of session `s` (numbered `sid`) with
/// [`RpcError::ResponseTooLarge`] if its response, `len` bytes, is larger
/// than `max`; whether it did.
#[inline]
pub(crate) fn fail_too_large<P>(
    s: &mut Session<P>,
    sid: u32,
    i: usize,
    req_num: u64,
    len: usize,
    max: usize,
) -> bool {
    if len <= max {
        return false;
    }
    let session = SessionId(sid);
    complete(
        s,
        i,
        Err(RpcError::ResponseTooLarge {
            session,
            req_num,
            len,
            max,
        }),
    );
    true
}

/// Makes slot `i` free for the next call (with the next request number).
#[inline]
pub(crate) fn free_slot<P>(s: &mut Session<P>, i: usize) {
    let slot = &mut s.client[i];
    slot.state = CallState::Free;
    slot.abandoned = false;
    slot.req_num += SESSION_SLOTS as u64;
    if let Some(w) = s.slot_waiters.pop_front() {
        w.wake();
    }
}

/// The peer stopped answering request `req_num` in slot `failed`: that call
/// fails with a timeout, the session's other calls with `SessionFailed`.
pub(crate) fn fail_session<P>(
    s: &mut Session<P>,
    sid: u32,
    failed: usize,
    req_num: u64,
    retries: u32,
) {
    let session = SessionId(sid);
    s.state = SessionState::Failed;
    for i in 0..SESSION_SLOTS {
        if !matches!(s.client[i].state, CallState::Active) {
            continue;
        }
        let e = if i == failed {
            RpcError::Timeout {
                session,
                req_num,
                retries,
            }
        } else {
            RpcError::SessionFailed { session }
        };
        complete(s, i, Err(e));
    }
    s.wake_all();
}
