//! The memory-region methods of [`Rdma`]: local regions, requests for the
//! peer's memory, one-sided verbs on grants, atomics, hand-overs.

use std::rc::Rc;

use std::cell::Cell;
use std::ops::RangeBounds;

use futures::channel::oneshot;
use std::time::Duration;
use verbio_runtime::buf::{IoBuf, LocalBuf, Slice};
use verbio_runtime::provider::AccessFlags;
use verbio_runtime::timeout;

use super::backlog::{local_mr_charge, SMALL_ITEM_CHARGE};
use super::error::AgentError;
use super::exposed::Exposed;
use super::mr::{bounds, LocalMr, RemoteMr};
use super::rdma::{posted_spends, until_posted, Rdma};
use super::wire::{imm_is_agents, HandOverKind, Message, MrToken};
use crate::verbs::{RemoteBuf, Verbs};

impl Rdma {
    /// Registered memory of `len` zeroed bytes for local use; handed over
    /// with [`Rdma::send_local_mr`], the peer gets the builder's
    /// `max_access`.
    pub fn alloc_local_mr(&self, len: usize) -> Result<LocalMr, AgentError> {
        self.alloc_local_mr_with_access(len, self.shared.config.max_access)
    }

    /// [`Rdma::alloc_local_mr`] with the remote access a peer gets if the
    /// region is handed over with [`Rdma::send_local_mr`] (capped by the
    /// builder's `max_access`). Local use is the same whatever `access`.
    pub fn alloc_local_mr_with_access(
        &self,
        len: usize,
        access: AccessFlags,
    ) -> Result<LocalMr, AgentError> {
        let buf = self
            .shared
            .pool
            .alloc_zeroed(len)
            .map_err(|source| AgentError::Buf {
                stage: "allocating a local memory region",
                source,
            })?;
        Ok(LocalMr { buf, access })
    }

    /// Registered memory of `len` bytes whose contents are unspecified: the
    /// bytes are not zeroed, so they may hold what the pool block held
    /// before (earlier data of this connection's pool). Never uninitialized
    /// memory (pool chunks are zeroed when registered), so unlike
    /// async-rdma's this is a safe fn. Use it when every byte is written
    /// before it is read or sent.
    pub fn alloc_local_mr_uninit(&self, len: usize) -> Result<LocalMr, AgentError> {
        self.alloc_local_mr_uninit_with_access(len, self.shared.config.max_access)
    }

    /// [`Rdma::alloc_local_mr_uninit`] with the access a peer gets on a
    /// hand-over (see [`Rdma::alloc_local_mr_with_access`]).
    pub fn alloc_local_mr_uninit_with_access(
        &self,
        len: usize,
        access: AccessFlags,
    ) -> Result<LocalMr, AgentError> {
        let stage = "allocating a local memory region";
        let mut buf = self
            .shared
            .pool
            .alloc(len)
            .map_err(|source| AgentError::Buf { stage, source })?;
        buf.set_len(len)
            .map_err(|source| AgentError::Buf { stage, source })?;
        Ok(LocalMr { buf, access })
    }

    /// Asks the peer for `len` bytes it grants with read, write and atomic
    /// access (capped by the peer's maximum); fails after the request timeout.
    pub async fn request_remote_mr(&self, len: usize) -> Result<RemoteMr, AgentError> {
        self.request_remote_mr_with(
            len,
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
        )
        .await
    }

    /// [`Rdma::request_remote_mr`] with the access to ask for.
    pub async fn request_remote_mr_with(
        &self,
        len: usize,
        access: AccessFlags,
    ) -> Result<RemoteMr, AgentError> {
        self.request(len, access, None).await
    }

    /// [`Rdma::request_remote_mr`] whose grant lives `timeout` (async-rdma's
    /// name: its timeout is the region's lifetime). The peer revokes the
    /// grant at its deadline (sooner if its own `token_lifetime` is
    /// shorter): after it, RDMA on the region fails (and, as any remote
    /// access error, takes the connection down) and a hand-back is refused.
    /// The answer itself must come within the builder's `request_timeout`.
    pub async fn request_remote_mr_with_timeout(
        &self,
        len: usize,
        timeout: Duration,
    ) -> Result<RemoteMr, AgentError> {
        self.request_remote_mr_with_lifetime(
            len,
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
            timeout,
        )
        .await
    }

    /// [`Rdma::request_remote_mr_with`] whose grant lives `lifetime` (see
    /// [`Rdma::request_remote_mr_with_timeout`]); a lifetime below 1 ms is
    /// asked as 1 ms, one beyond `u32::MAX` ms as that.
    pub async fn request_remote_mr_with_lifetime(
        &self,
        len: usize,
        access: AccessFlags,
        lifetime: Duration,
    ) -> Result<RemoteMr, AgentError> {
        self.request(len, access, Some(lifetime)).await
    }

    async fn request(
        &self,
        len: usize,
        access: AccessFlags,
        lifetime: Option<Duration>,
    ) -> Result<RemoteMr, AgentError> {
        let s = &self.shared;
        let req_id = s.next_req_id.get() + 1;
        s.next_req_id.set(req_id);
        let (tx, rx) = oneshot::channel();
        s.requests.borrow_mut().insert(req_id, tx);
        let msg = Message::AllocRequest {
            req_id,
            len: len as u64,
            align: 8,
            access: access.bits(),
            lifetime_ms: lifetime.map_or(0, lifetime_ms),
        };
        let limit = s.config.request_timeout;
        let asked = async {
            s.send_message(&msg, true).await?;
            rx.await.map_err(|_| s.closed_error())
        };
        let answer = match timeout(limit, asked).await {
            Ok(a) => a,
            Err(_) => Err(AgentError::Timeout {
                what: "memory request",
                after: limit,
            }),
        };
        s.requests.borrow_mut().remove(&req_id);
        match answer? {
            Ok(token) => Ok(RemoteMr::new(token, Rc::downgrade(s))),
            Err(code) => Err(AgentError::Refused {
                what: "memory request",
                code,
            }),
        }
    }

    fn check_fits(what: &'static str, need: u64, have: u64) -> Result<(), AgentError> {
        if need > have {
            return Err(AgentError::OutOfBounds { what, need, have });
        }
        Ok(())
    }

    /// RDMA WRITE of all of `local` to the start of `remote`.
    pub async fn write(
        &self,
        local: LocalMr,
        remote: &RemoteMr,
    ) -> (Result<(), AgentError>, LocalMr) {
        if let Err(e) = Self::check_fits("write", local.len() as u64, remote.len) {
            return (Err(e), local);
        }
        let target = RemoteBuf::new(
            remote.remote_buf().addr(),
            local.len() as u64,
            remote.remote_buf().rkey(),
        );
        let access = local.access;
        let (r, buf) = self.shared.qp.write(local.buf, target).await;
        (self.shared.verb_result(r), LocalMr { buf, access })
    }

    /// RDMA WRITE with immediate: the peer's [`Rdma::receive_write_imm`]
    /// gets `imm` (spends a credit: it consumes a receive buffer there).
    pub async fn write_with_imm(
        &self,
        local: LocalMr,
        remote: &RemoteMr,
        imm: u32,
    ) -> (Result<(), AgentError>, LocalMr) {
        if let Err(e) = Self::check_fits("write_with_imm", local.len() as u64, remote.len) {
            return (Err(e), local);
        }
        let target = RemoteBuf::new(
            remote.remote_buf().addr(),
            local.len() as u64,
            remote.remote_buf().rkey(),
        );
        if imm_is_agents(imm) {
            return self.write_then_imm(local, target, imm).await;
        }
        let credit = match self.shared.send_credits.acquire().await {
            Ok(c) => c,
            Err(_) => return (Err(self.shared.closed_error()), local),
        };
        // The credit is spent once the WRITE is posted; dropped before, it
        // goes back (the peer never sees the immediate).
        let access = local.access;
        let sub = self.shared.qp.write_with_imm(local.buf, target, imm);
        let (r, buf) = posted_spends(sub, Some(credit), &Cell::new(false)).await;
        (self.shared.verb_result(r), LocalMr { buf, access })
    }

    /// [`Rdma::write_with_imm`] of an immediate whose top byte is that of
    /// the agent's staged messages ([`STAGED_IMM_TAG`](super::wire::STAGED_IMM_TAG)): a plain WRITE,
    /// then the immediate in a `WriteImm` SEND (RC delivers it after the
    /// WRITE's bytes), which the peer treats as the WRITE_WITH_IMM's.
    /// Dropped once the WRITE is posted and before the SEND is, the bytes
    /// may be written but the peer gets no immediate.
    async fn write_then_imm(
        &self,
        local: LocalMr,
        target: RemoteBuf,
        imm: u32,
    ) -> (Result<(), AgentError>, LocalMr) {
        let access = local.access;
        let s = &self.shared;
        let sub = s.qp.write(local.buf, target);
        let (r, buf) = match until_posted(sub, None, &Cell::new(false)).await {
            Ok(in_flight) => {
                let told = s.send_message(&Message::WriteImm { imm }, true).await;
                let (r, buf) = in_flight.await;
                (s.verb_result(r.map(drop)).and(told), buf)
            }
            // Refused.
            Err((Err(e), buf)) => (Err(s.verb_error(e)), buf),
            // Done already.
            Err((Ok(_), buf)) => {
                let told = s.send_message(&Message::WriteImm { imm }, true).await;
                (told, buf)
            }
        };
        (r, LocalMr { buf, access })
    }

    /// RDMA READ of all of `remote` into the start of `local`.
    pub async fn read(
        &self,
        local: LocalMr,
        remote: &RemoteMr,
    ) -> (Result<(), AgentError>, LocalMr) {
        if let Err(e) = Self::check_fits("read", remote.len, local.len() as u64) {
            return (Err(e), local);
        }
        let access = local.access;
        let (r, buf) = self.shared.qp.read(local.buf, remote.remote_buf()).await;
        (self.shared.verb_result(r), LocalMr { buf, access })
    }

    /// RDMA WRITE of `local[range]` to the start of `remote` (a view made
    /// with [`RemoteMr::get`] targets any part of a grant). A range outside
    /// `local`, or longer than `remote`, is refused with
    /// [`AgentError::OutOfBounds`] before anything is posted; `local` comes
    /// back whole either way.
    pub async fn write_range(
        &self,
        local: LocalMr,
        range: impl RangeBounds<usize>,
        remote: &RemoteMr,
    ) -> (Result<(), AgentError>, LocalMr) {
        let access = local.access;
        let part = match range_part(local, range, remote.len, Direction::ToRemote) {
            Ok(p) => p,
            Err((err, local)) => return (Err(err), local),
        };
        let target = RemoteBuf::new(
            remote.remote_buf().addr(),
            part.len() as u64,
            remote.remote_buf().rkey(),
        );
        let (r, part) = self.shared.qp.write(part, target).await;
        (
            self.shared.verb_result(r),
            LocalMr {
                buf: part.into_inner(),
                access,
            },
        )
    }

    /// RDMA READ of all of `remote` into the start of `local[range]`. A
    /// range outside `local`, or shorter than `remote`, is refused with
    /// [`AgentError::OutOfBounds`] before anything is posted; the bytes of
    /// `local` outside the range are left as they were.
    pub async fn read_range(
        &self,
        local: LocalMr,
        range: impl RangeBounds<usize>,
        remote: &RemoteMr,
    ) -> (Result<(), AgentError>, LocalMr) {
        let access = local.access;
        let part = match range_part(local, range, remote.len, Direction::FromRemote) {
            Ok(p) => p,
            Err((err, local)) => return (Err(err), local),
        };
        let (r, part) = self.shared.qp.read(part, remote.remote_buf()).await;
        (
            self.shared.verb_result(r),
            LocalMr {
                buf: part.into_inner(),
                access,
            },
        )
    }

    fn word_buf(&self) -> Result<LocalBuf, AgentError> {
        self.shared.pool.alloc(8).map_err(|source| AgentError::Buf {
            stage: "allocating an atomic result buffer",
            source,
        })
    }

    /// An atomic's target, checked before anything is posted: a view
    /// that is not 8 bytes at an 8-byte aligned address fails the call
    /// ([`Error::BadAtomicTarget`](crate::Error::BadAtomicTarget)), not
    /// the connection.
    fn atomic_target(op: &'static str, remote: &RemoteMr) -> Result<RemoteBuf, AgentError> {
        let target = remote.remote_buf();
        if target.len() != 8 || target.addr() & 7 != 0 {
            return Err(AgentError::Verb(crate::Error::BadAtomicTarget {
                op,
                addr: target.addr(),
                len: target.len(),
            }));
        }
        Ok(target)
    }

    /// 64-bit compare-and-swap on `remote` (an 8-byte, 8-aligned view;
    /// another view fails the call, not the connection); returns the
    /// previous value.
    pub async fn compare_and_swap(
        &self,
        remote: &RemoteMr,
        compare: u64,
        swap: u64,
    ) -> Result<u64, AgentError> {
        let target = Self::atomic_target("compare_and_swap", remote)?;
        let buf = self.word_buf()?;
        let (r, _) = self
            .shared
            .qp
            .compare_and_swap(buf, target, compare, swap)
            .await;
        self.shared.verb_result(r)
    }

    /// 64-bit fetch-and-add on `remote` (an 8-byte, 8-aligned view, as
    /// for [`compare_and_swap`](Self::compare_and_swap)); returns the
    /// previous value.
    pub async fn fetch_and_add(&self, remote: &RemoteMr, add: u64) -> Result<u64, AgentError> {
        let target = Self::atomic_target("fetch_and_add", remote)?;
        let buf = self.word_buf()?;
        let (r, _) = self.shared.qp.fetch_and_add(buf, target, add).await;
        self.shared.verb_result(r)
    }

    /// Gives up a grant: the owner revokes it (dropping the last view of a
    /// [`RemoteMr`] does the same in the background).
    pub async fn release(&self, remote: RemoteMr) -> Result<(), AgentError> {
        remote.held.done.set(true);
        let token_id = remote.held.token.token_id;
        self.shared
            .send_message(&Message::Release { token_id }, true)
            .await
    }

    /// Hands a grant back to its owner, who revokes it and gets the memory
    /// with [`Rdma::receive_local_mr`] (tag 0).
    pub async fn send_remote_mr(&self, remote: RemoteMr) -> Result<(), AgentError> {
        self.send_remote_mr_with_tag(remote, 0).await
    }

    /// [`Rdma::send_remote_mr`] with a user `tag` that travels with the
    /// hand-back: the owner matches it with
    /// [`Rdma::receive_local_mr_with_tag`] or reads it with
    /// [`Rdma::receive_local_mr_tagged`].
    pub async fn send_remote_mr_with_tag(
        &self,
        remote: RemoteMr,
        tag: u64,
    ) -> Result<(), AgentError> {
        remote.held.done.set(true);
        let msg = Message::HandOver {
            kind: HandOverKind::Remote,
            tag,
            token: remote.held.token,
        };
        self.shared.send_message(&msg, true).await
    }

    /// The next grant the peer handed over ([`Rdma::send_local_mr`] there),
    /// whatever its tag.
    pub async fn receive_remote_mr(&self) -> Result<RemoteMr, AgentError> {
        Ok(self.receive_remote_mr_tagged().await?.0)
    }

    /// The next grant the peer handed over, with the tag it was sent with.
    pub async fn receive_remote_mr_tagged(&self) -> Result<(RemoteMr, u64), AgentError> {
        self.next_remote_mr(None).await
    }

    /// The next grant the peer handed over with `tag` (grants with other
    /// tags stay queued for their own receivers).
    pub async fn receive_remote_mr_with_tag(&self, tag: u64) -> Result<RemoteMr, AgentError> {
        Ok(self.next_remote_mr(Some(tag)).await?.0)
    }

    async fn next_remote_mr(&self, want: Option<u64>) -> Result<(RemoteMr, u64), AgentError> {
        match self.shared.remote_mrs.recv(want).await {
            Some((tag, token)) => {
                self.shared.taken(SMALL_ITEM_CHARGE);
                Ok((RemoteMr::new(token, Rc::downgrade(&self.shared)), tag))
            }
            None => Err(self.shared.closed_error()),
        }
    }

    /// Grants the peer access to `mem` (a `Vec<u8>` or a [`LocalMr`]) in
    /// a registration of its own, for the builder's token lifetime; the
    /// peer gets it with [`Rdma::receive_remote_mr`] (tag 0). Returns the
    /// token. A `Vec<u8>` is granted the builder's `max_access`; a
    /// [`LocalMr`] its [`access`](LocalMr::access) capped by that. A
    /// `LocalMr`'s bytes are copied into the grant (its pool buffer is
    /// registered for local access only) and the buffer goes back to the
    /// pool; the peer's hand-back returns the grant's memory as a
    /// `Vec<u8>` ([`Rdma::receive_local_mr`]).
    pub async fn send_local_mr(&self, mem: impl GrantMem) -> Result<MrToken, AgentError> {
        self.send_local_mr_with_tag(mem, 0).await
    }

    /// [`Rdma::send_local_mr`] whose grant lives `timeout` (async-rdma's
    /// name: its timeout is the region's lifetime) instead of the builder's
    /// token lifetime. This side revokes the grant at that deadline: the
    /// peer's RDMA on it fails after it, and its hand-back is refused.
    pub async fn send_local_mr_with_timeout(
        &self,
        mem: impl GrantMem,
        timeout: Duration,
    ) -> Result<MrToken, AgentError> {
        self.hand_over_local(mem, 0, timeout).await
    }

    /// [`Rdma::send_local_mr`] with a user `tag` that travels with the
    /// grant: the peer matches it with [`Rdma::receive_remote_mr_with_tag`]
    /// or reads it with [`Rdma::receive_remote_mr_tagged`].
    pub async fn send_local_mr_with_tag(
        &self,
        mem: impl GrantMem,
        tag: u64,
    ) -> Result<MrToken, AgentError> {
        self.hand_over_local(mem, tag, self.shared.config.token_lifetime)
            .await
    }

    async fn hand_over_local(
        &self,
        mem: impl GrantMem,
        tag: u64,
        lifetime: Duration,
    ) -> Result<MrToken, AgentError> {
        let s = &self.shared;
        let (mem, access) = mem.into_grant();
        let access = access.unwrap_or(s.config.max_access) & s.config.max_access & REMOTE_ACCESS;
        if access.is_empty() {
            return Err(AgentError::Refused {
                what: "granting memory",
                code: super::wire::RefuseCode::AccessDenied,
            });
        }
        let (token, deadline) = if s.shares_pd() {
            let exposed = Exposed::new(s, mem, access, "registering memory for the peer")
                .await
                .map_err(|(e, _)| e)?;
            s.grants.insert(exposed, lifetime)
        } else {
            s.grants
                .grant(&s.pd.0, mem, access, lifetime)
                .map_err(|code| AgentError::Refused {
                    what: "granting memory",
                    code,
                })?
        };
        super::task::expire_at(s, token.token_id, deadline);
        let msg = Message::HandOver {
            kind: HandOverKind::Local,
            tag,
            token,
        };
        // Cancelled (or failed) before the hand-over was posted, the peer
        // never learns of the grant: revoke it now rather than at its
        // deadline. Once posted, the peer gets it and owns its lifetime.
        let posted = Cell::new(false);
        let _unsent = RevokeUnsent {
            rdma: self,
            token_id: token.token_id,
            posted: &posted,
        };
        s.send_message_noting(&msg, true, &posted).await?;
        Ok(token)
    }

    /// The next grant of this side's memory the peer handed back (any
    /// tag): revoked first, so the bytes are plain memory again.
    pub async fn receive_local_mr(&self) -> Result<Vec<u8>, AgentError> {
        Ok(self.receive_local_mr_tagged().await?.0)
    }

    /// The next hand-back of this side's memory, with its tag.
    pub async fn receive_local_mr_tagged(&self) -> Result<(Vec<u8>, u64), AgentError> {
        self.next_local_mr(None).await
    }

    /// The next hand-back of this side's memory with `tag` (hand-backs with
    /// other tags stay queued for their own receivers).
    pub async fn receive_local_mr_with_tag(&self, tag: u64) -> Result<Vec<u8>, AgentError> {
        Ok(self.next_local_mr(Some(tag)).await?.0)
    }

    async fn next_local_mr(&self, want: Option<u64>) -> Result<(Vec<u8>, u64), AgentError> {
        match self.shared.local_mrs.recv(want).await {
            Some((tag, mem)) => {
                self.shared.taken(local_mr_charge(&mem));
                Ok((mem, tag))
            }
            None => Err(self.shared.closed_error()),
        }
    }

    /// Test hook: a [`RemoteMr`] for an arbitrary (e.g. forged) `token`,
    /// to show the owner's refusal through this API. Dropping it sends no
    /// release. Not for production use.
    #[doc(hidden)]
    pub fn remote_mr_from_token_unchecked(&self, token: MrToken) -> RemoteMr {
        let mr = RemoteMr::new(token, Rc::downgrade(&self.shared));
        mr.held.done.set(true);
        mr
    }

    /// Grants of this side's memory the peer may still access.
    pub fn live_grants(&self) -> usize {
        self.shared.grants.len() + self.shared.window_grants.as_ref().map_or(0, |w| w.len())
    }
}

/// Every remote access bit.
const REMOTE_ACCESS: AccessFlags = AccessFlags::from_bits_truncate(
    AccessFlags::REMOTE_READ.bits()
        | AccessFlags::REMOTE_WRITE.bits()
        | AccessFlags::REMOTE_ATOMIC.bits(),
);

/// A requested grant lifetime in whole milliseconds for the wire (0 means
/// "the owner's default", so at least 1).
fn lifetime_ms(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
}

/// Memory [`Rdma::send_local_mr`] can grant to the peer: a `Vec<u8>` or a
/// [`LocalMr`]. Sealed.
pub trait GrantMem: sealed::Sealed {
    /// The bytes to register for the grant, and the access to grant
    /// (`None`: the builder's `max_access`).
    #[doc(hidden)]
    fn into_grant(self) -> (Vec<u8>, Option<AccessFlags>);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for Vec<u8> {}
    impl Sealed for super::LocalMr {}
}

impl GrantMem for Vec<u8> {
    fn into_grant(self) -> (Vec<u8>, Option<AccessFlags>) {
        (self, None)
    }
}

impl GrantMem for LocalMr {
    fn into_grant(self) -> (Vec<u8>, Option<AccessFlags>) {
        (self.buf.to_vec(), Some(self.access))
    }
}

/// Which way a `*_range` transfer moves data, which decides what must fit
/// in what.
#[derive(Clone, Copy)]
enum Direction {
    /// `write_range`: the local part must fit in the remote region.
    ToRemote,
    /// `read_range`: the remote region must fit in the local part.
    FromRemote,
}

/// The part `range` of `local` for a `*_range` transfer with a remote
/// region of `remote_len` bytes, checked before anything is posted; on a
/// refusal `local` comes back whole with the error.
// The error hands the caller's region back by value (as `BufResult` does);
// it is the cold path, so its size costs nothing on success.
#[allow(clippy::result_large_err)]
fn range_part(
    local: LocalMr,
    range: impl RangeBounds<usize>,
    remote_len: u64,
    dir: Direction,
) -> Result<Slice<LocalBuf>, (AgentError, LocalMr)> {
    let (op, what, stage) = match dir {
        Direction::ToRemote => (
            "write_range",
            "write_range: local range",
            "write_range: slicing the local region",
        ),
        Direction::FromRemote => (
            "read_range",
            "read_range: local range",
            "read_range: slicing the local region",
        ),
    };
    let (s, e) = match local_range(&local, range, what) {
        Ok(r) => r,
        Err(err) => return Err((err, local)),
    };
    let part_len = (e - s) as u64;
    let (need, have) = match dir {
        Direction::ToRemote => (part_len, remote_len),
        Direction::FromRemote => (remote_len, part_len),
    };
    if let Err(err) = Rdma::check_fits(op, need, have) {
        return Err((err, local));
    }
    let access = local.access;
    local.buf.slice(s..e).map_err(|rejected| {
        (
            AgentError::Buf {
                stage,
                source: rejected.error,
            },
            LocalMr {
                buf: rejected.buf,
                access,
            },
        )
    })
}

fn local_range(
    local: &LocalMr,
    range: impl RangeBounds<usize>,
    what: &'static str,
) -> Result<(usize, usize), AgentError> {
    use std::ops::Bound;
    let have = local.len() as u64;
    bounds(
        (range.start_bound().cloned(), range.end_bound().cloned()),
        local.len(),
    )
    .ok_or_else(|| {
        // The furthest byte the range names, for the message.
        let end = match range.end_bound() {
            Bound::Included(&e) => (e as u64).saturating_add(1),
            Bound::Excluded(&e) => e as u64,
            Bound::Unbounded => have,
        };
        let start = match range.start_bound() {
            Bound::Included(&s) => s as u64,
            Bound::Excluded(&s) => (s as u64).saturating_add(1),
            Bound::Unbounded => 0,
        };
        AgentError::OutOfBounds {
            what,
            need: end.max(start),
            have,
        }
    })
}

/// Revokes a grant whose hand-over was never posted.
struct RevokeUnsent<'a> {
    rdma: &'a Rdma,
    token_id: u64,
    posted: &'a Cell<bool>,
}

impl Drop for RevokeUnsent<'_> {
    fn drop(&mut self) {
        let unsent = !self.posted.get();
        if unsent
            && self
                .rdma
                .shared
                .grants
                .revoke(self.token_id, None)
                .is_some()
        {
            tracing::debug!(
                token_id = self.token_id,
                "hand-over not sent: grant revoked"
            );
        }
    }
}
