//! Completion channels and completion queues.

use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::device::{set_nonblocking, Context};
use super::{errno_err, ret_err};
use crate::provider::{Completion, ProviderError, Result, WcOpcode, WcStatus};

/// How many `ibv_wc` one `ibv_poll_cq` call fills (an uninitialised stack
/// array; the reactor polls 32 at a time).
const POLL_BATCH: usize = 32;

struct ChannelInner {
    ch: *mut sys::ibv_comp_channel,
    ctx: Context,
}

// SAFETY: a completion channel is an fd plus a refcount libibverbs updates
// under its own lock; it may be used from any thread.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ bound to the channel holds a CompChannel clone, so
        // none is left; destroyed once, before the context (a field).
        let ret = unsafe { sys::ibv_destroy_comp_channel(self.ch) };
        if ret != 0 {
            tracing::warn!(error = %ret_err("ibv_destroy_comp_channel", ret), "destroying completion channel");
        }
    }
}

/// A completion channel whose fd is non-blocking.
#[derive(Clone)]
pub struct CompChannel {
    inner: Arc<ChannelInner>,
}

impl CompChannel {
    pub(crate) fn create(ctx: &Context) -> Result<CompChannel> {
        // SAFETY: valid open context.
        let ch = unsafe { sys::ibv_create_comp_channel(ctx.raw()) };
        if ch.is_null() {
            return Err(errno_err("ibv_create_comp_channel"));
        }
        let channel = CompChannel {
            inner: Arc::new(ChannelInner {
                ch,
                ctx: ctx.clone(),
            }),
        };
        set_nonblocking(channel.fd(), "setting the completion channel non-blocking")?;
        Ok(channel)
    }

    /// The fd (readable when an armed CQ got a completion).
    pub fn fd(&self) -> RawFd {
        // SAFETY: valid channel; plain field.
        unsafe { (*self.inner.ch).fd }
    }

    /// Takes one CQ event (`ibv_get_cq_event`): the CQ's handle, or `None` when
    /// nothing is pending. Acknowledge it later with [`Cq::ack_events`]
    /// (dropping the last handle of a [`Cq`] acknowledges what is left).
    ///
    /// As in verbs, do not drop the last handle of a CQ on one thread while
    /// another thread takes events from its channel: an event read in between
    /// would make `ibv_destroy_cq` wait for an acknowledgement forever.
    pub fn get_event(&self) -> Result<Option<u32>> {
        let mut cq: *mut sys::ibv_cq = ptr::null_mut();
        let mut cq_ctx: *mut libc::c_void = ptr::null_mut();
        // SAFETY: valid channel and out-pointers; the fd is non-blocking, so the
        // read inside fails with EAGAIN instead of blocking.
        let ret = unsafe { sys::ibv_get_cq_event(self.inner.ch, &mut cq, &mut cq_ctx) };
        if ret != 0 {
            // SAFETY: errno of this thread, just set by the failed call.
            let code = unsafe { *libc::__errno_location() };
            if code == libc::EAGAIN || code == libc::EWOULDBLOCK {
                // Nothing pending: the common case of an edge-triggered drain.
                return Ok(None);
            }
            return Err(ProviderError::Verbs {
                call: "ibv_get_cq_event",
                source: std::io::Error::from_raw_os_error(code),
            });
        }
        // SAFETY: every CQ this provider creates has a live `CqShared` as its
        // cq_context; the CQ cannot be destroyed while this event is unacknowledged
        // (ibv_destroy_cq waits for it), so the pointer is valid.
        let shared = unsafe { &*cq_ctx.cast::<CqShared>() };
        shared.taken.fetch_add(1, Ordering::AcqRel);
        Ok(Some(shared.handle))
    }
}

/// What `cq_context` points to: the handle and the event counts that make sure
/// every event taken is acknowledged before `ibv_destroy_cq` (which would
/// otherwise wait forever).
struct CqShared {
    handle: u32,
    taken: AtomicU32,
    acked: AtomicU32,
    /// Set when an `IBV_EVENT_CQ_ERR` (overrun) async event names this CQ.
    overrun: AtomicBool,
}

/// Records a `CQ_ERR` (overrun) async event for `cq`; returns its handle (0 for NULL).
///
/// # Safety
///
/// `cq` must be NULL or a live CQ created by [`Cq::create`] (an async event's
/// CQ stays alive until the event is acknowledged).
pub(crate) unsafe fn note_cq_error(cq: *mut sys::ibv_cq) -> u32 {
    if cq.is_null() {
        return 0;
    }
    // SAFETY: per the contract, cq_context points to the CQ's live CqShared.
    let shared = unsafe { (*cq).cq_context.cast::<CqShared>() };
    if shared.is_null() {
        return 0;
    }
    // SAFETY: as above.
    let shared = unsafe { &*shared };
    shared.overrun.store(true, Ordering::Release);
    shared.handle
}

struct CqInner {
    cq: *mut sys::ibv_cq,
    capacity: u32,
    // Field order: dropped after `cq` is destroyed in Drop.
    shared: Box<CqShared>,
    _channel: Option<CompChannel>,
    ctx: Context,
}

// SAFETY: ibv_poll_cq/req_notify/ack are thread-safe in libibverbs (providers
// lock the CQ); the counters are atomic; nothing else is mutated.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        let taken = self.shared.taken.load(Ordering::Acquire);
        let acked = self.shared.acked.load(Ordering::Acquire);
        let missing = taken.wrapping_sub(acked);
        if missing != 0 {
            tracing::debug!(
                cq = self.shared.handle,
                missing,
                "acknowledging CQ events before destroying the CQ"
            );
            // SAFETY: valid CQ; acknowledges events that were taken but not acked.
            unsafe { sys::ibv_ack_cq_events(self.cq, missing) };
        }
        // SAFETY: every QP using this CQ holds a Cq clone, so none is left;
        // destroyed once, before the channel and context (fields).
        let ret = unsafe { sys::ibv_destroy_cq(self.cq) };
        if ret != 0 {
            tracing::warn!(error = %ret_err("ibv_destroy_cq", ret), "destroying CQ");
        }
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq {
    inner: Arc<CqInner>,
}

impl Cq {
    pub(crate) fn create(ctx: &Context, cqe: u32, channel: Option<&CompChannel>) -> Result<Cq> {
        let cqe_c = libc::c_int::try_from(cqe).map_err(|_| ProviderError::InvalidArgument {
            call: "create_cq",
            what: format!("{cqe} CQ entries"),
        })?;
        if let Some(ch) = channel {
            if !Arc::ptr_eq(&ch.inner.ctx.inner, &ctx.inner) {
                return Err(ProviderError::InvalidArgument {
                    call: "create_cq",
                    what: "completion channel of another device context".into(),
                });
            }
        }
        let shared = Box::new(CqShared {
            handle: ctx.next_cq_handle(),
            taken: AtomicU32::new(0),
            acked: AtomicU32::new(0),
            overrun: AtomicBool::new(false),
        });
        let ch = channel.map_or(ptr::null_mut(), |c| c.inner.ch);
        // SAFETY: valid context and channel (same context); cq_context points to
        // the boxed CqShared that lives as long as the CQ (freed after destroy).
        let cq = unsafe {
            sys::ibv_create_cq(
                ctx.raw(),
                cqe_c,
                ptr::addr_of!(*shared).cast_mut().cast(),
                ch,
                0,
            )
        };
        if cq.is_null() {
            return Err(errno_err("ibv_create_cq"));
        }
        // SAFETY: valid CQ just created.
        let capacity = u32::try_from(unsafe { (*cq).cqe }).unwrap_or(cqe);
        Ok(Cq {
            inner: Arc::new(CqInner {
                cq,
                capacity,
                shared,
                _channel: channel.cloned(),
                ctx: ctx.clone(),
            }),
        })
    }

    pub(crate) fn raw(&self) -> *mut sys::ibv_cq {
        self.inner.cq
    }

    pub(crate) fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Handle unique within the context (what the channel's `get_event` returns).
    pub fn handle(&self) -> u32 {
        self.inner.shared.handle
    }

    /// Entries the CQ holds (as reported by the device, at least the requested).
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// Arms the CQ (`ibv_req_notify_cq`).
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: valid CQ.
        let ret = unsafe { sys::ibv_req_notify_cq(self.inner.cq, i32::from(solicited_only)) };
        if ret != 0 {
            return Err(ret_err("ibv_req_notify_cq", ret));
        }
        Ok(())
    }

    /// Polls up to `out.len()` completions (`ibv_poll_cq` into an
    /// uninitialised stack array of 32, converted in place into
    /// `out`; a longer `out` takes more calls only while the CQ has more).
    /// An empty poll is one overrun check and one `ibv_poll_cq`.
    ///
    /// Fails with [`ProviderError::CqOverflow`] once the device reported an
    /// overrun of this CQ (an `IBV_EVENT_CQ_ERR` async event, seen by
    /// [`Context::get_async_event`]).
    #[inline]
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        if self.inner.shared.overrun.load(Ordering::Acquire) {
            return Err(self.overrun_error());
        }
        let got = match self.poll_into(out) {
            Ok(got) => got,
            Err(ret) => return Err(poll_error(ret)),
        };
        if got == POLL_BATCH && out.len() > POLL_BATCH {
            return Ok(self.poll_more(out, got));
        }
        Ok(got)
    }

    /// One `ibv_poll_cq` of up to `min(out.len(), POLL_BATCH)` entries,
    /// converted into `out`; `Err` carries the failed call's return value.
    #[inline(always)]
    fn poll_into(&self, out: &mut [Completion]) -> std::result::Result<usize, i32> {
        let want = out.len().min(POLL_BATCH);
        let mut wcs = [MaybeUninit::<sys::ibv_wc>::uninit(); POLL_BATCH];
        // SAFETY: valid CQ; `wcs` has room for want <= POLL_BATCH entries.
        let got = unsafe { sys::ibv_poll_cq(self.inner.cq, want as i32, wcs.as_mut_ptr().cast()) };
        if got <= 0 {
            return if got == 0 { Ok(0) } else { Err(got) };
        }
        let got = (got as usize).min(want);
        for (slot, wc) in out[..got].iter_mut().zip(&wcs[..got]) {
            // SAFETY: the first `got` entries were written by ibv_poll_cq.
            *slot = convert_wc(unsafe { wc.assume_init_ref() });
        }
        Ok(got)
    }

    /// The rest of a [`Cq::poll`] whose first batch (`done` entries) was full.
    #[inline(never)]
    fn poll_more(&self, out: &mut [Completion], mut done: usize) -> usize {
        while done < out.len() {
            let want = (out.len() - done).min(POLL_BATCH);
            match self.poll_into(&mut out[done..]) {
                Ok(got) => {
                    done += got;
                    if got < want {
                        break;
                    }
                }
                // Hand out what was polled; the error shows on the next call.
                Err(_) => break,
            }
        }
        done
    }

    #[cold]
    fn overrun_error(&self) -> ProviderError {
        ProviderError::CqOverflow {
            cq: self.inner.shared.handle,
            capacity: self.inner.capacity,
        }
    }

    /// Acknowledges `n` events taken for this CQ (`ibv_ack_cq_events`). More
    /// than were taken is clamped (over-acknowledging would hang destruction).
    pub fn ack_events(&self, n: u32) {
        let shared = &self.inner.shared;
        let mut acked = shared.acked.load(Ordering::Acquire);
        let n = loop {
            let taken = shared.taken.load(Ordering::Acquire);
            let n = n.min(taken.wrapping_sub(acked));
            if n == 0 {
                return;
            }
            match shared.acked.compare_exchange(
                acked,
                acked.wrapping_add(n),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break n,
                Err(now) => acked = now,
            }
        };
        // SAFETY: valid CQ; `n` events were taken and not yet acknowledged.
        unsafe { sys::ibv_ack_cq_events(self.inner.cq, n) };
    }
}

#[cold]
#[inline(never)]
fn poll_error(ret: i32) -> ProviderError {
    ret_err("ibv_poll_cq", ret)
}

#[inline(always)]
fn convert_wc(wc: &sys::ibv_wc) -> Completion {
    let status = WcStatus::from_raw(wc.status);
    let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    let with_inv = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_INV.0 != 0;
    Completion {
        wr_id: wc.wr_id,
        status,
        // Error completions leave the opcode unspecified.
        opcode: WcOpcode::from_raw(wc.opcode).unwrap_or(WcOpcode::Send),
        byte_len: wc.byte_len,
        imm_data: if with_inv {
            // SAFETY: both union members are u32; WITH_INV says this one is
            // meant.
            Some(unsafe { wc.imm_data_invalidated_rkey_union.invalidated_rkey })
        } else {
            // SAFETY: as above; WITH_IMM says this one is meant.
            with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }))
        },
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
        src_qp: wc.src_qp,
        slid: wc.slid,
        grh: wc.wc_flags & sys::ibv_wc_flags::IBV_WC_GRH.0 != 0,
        with_inv,
    }
}
