//! [`RemoteBuf`]: a descriptor of memory in the peer (address, length, rkey).

use std::ops::{Bound, RangeBounds};

use verbio_runtime::buf::{IoBufMut, RemoteAccessRegion};

use crate::error::Error;

/// Memory a peer granted: `[addr, addr + len)` under remote key `rkey`.
///
/// Plain data (the peer enforces access); sub-ranges are bounds-checked
/// here so an out-of-range request fails locally with a clear error rather
/// than as a `REM_ACCESS_ERR` that also breaks the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteBuf {
    addr: u64,
    len: u64,
    rkey: u32,
}

impl RemoteBuf {
    /// A descriptor of `len` bytes at `addr` with `rkey`, as the peer announced it.
    pub const fn new(addr: u64, len: u64, rkey: u32) -> RemoteBuf {
        RemoteBuf { addr, len, rkey }
    }

    /// Start address in the peer.
    pub const fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// True if the descriptor covers no byte.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remote key.
    pub const fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The sub-range `range` (offsets relative to this descriptor).
    pub fn slice(&self, range: impl RangeBounds<u64>) -> Result<RemoteBuf, Error> {
        let start = match range.start_bound() {
            Bound::Included(&s) => Some(s),
            Bound::Excluded(&s) => s.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => Some(self.len),
        };
        match (start, end) {
            (Some(s), Some(e)) if s <= e && e <= self.len => Ok(RemoteBuf {
                addr: self.addr + s,
                len: e - s,
                rkey: self.rkey,
            }),
            (s, e) => {
                let s = s.unwrap_or(u64::MAX);
                Err(Error::RemoteOutOfBounds {
                    op: "RemoteBuf::slice",
                    offset: s,
                    len: e.unwrap_or(u64::MAX).saturating_sub(s),
                    remote_len: self.len,
                })
            }
        }
    }

    /// `len` bytes at `offset` (relative to this descriptor).
    pub fn at(&self, offset: u64, len: u64) -> Result<RemoteBuf, Error> {
        match offset.checked_add(len) {
            Some(end) => self.slice(offset..end),
            None => Err(Error::RemoteOutOfBounds {
                op: "RemoteBuf::at",
                offset,
                len,
                remote_len: self.len,
            }),
        }
    }

    /// The 8-byte word at `offset`, for atomics (alignment is checked by the verb).
    pub fn word(&self, offset: u64) -> Result<RemoteBuf, Error> {
        self.at(offset, 8)
    }

    /// Checks that `need` bytes fit, for the verb `op`.
    pub(crate) fn check_fits(&self, op: &'static str, need: usize) -> Result<(), Error> {
        if need as u64 > self.len {
            return Err(Error::RemoteOutOfBounds {
                op,
                offset: 0,
                len: need as u64,
                remote_len: self.len,
            });
        }
        Ok(())
    }
}

impl<B: IoBufMut> From<&RemoteAccessRegion<B>> for RemoteBuf {
    /// The descriptor of a region this side granted (to send to the peer,
    /// or to target it from a loopback QP).
    fn from(r: &RemoteAccessRegion<B>) -> RemoteBuf {
        RemoteBuf::new(r.addr(), r.len() as u64, r.rkey())
    }
}
