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

#[cfg(test)]
mod tests {
    use std::ops::Bound;

    use super::*;

    const R: RemoteBuf = RemoteBuf::new(0x1000, 100, 7);

    #[test]
    fn sub_ranges_are_bounds_checked() {
        assert_eq!(R.slice(..).unwrap(), R);
        assert_eq!(R.slice(10..20).unwrap(), RemoteBuf::new(0x100a, 10, 7));
        assert_eq!(R.slice(10..=19).unwrap(), RemoteBuf::new(0x100a, 10, 7));
        assert_eq!(R.slice(90..).unwrap(), RemoteBuf::new(0x1000 + 90, 10, 7));
        assert_eq!(R.slice(100..).unwrap().len(), 0);
        assert_eq!(
            R.slice((Bound::Excluded(9), Bound::Included(10))).unwrap(),
            RemoteBuf::new(0x100a, 1, 7)
        );
        assert!(R.slice(..101).is_err());
        assert!(R.slice(101..).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = R.slice(20..10);
        assert!(reversed.is_err());
        assert!(R.slice(..=u64::MAX).is_err());
        assert!(R
            .slice((Bound::Excluded(u64::MAX), Bound::Unbounded))
            .is_err());
        assert!(R.at(96, 8).is_err());
        assert_eq!(R.word(8).unwrap(), RemoteBuf::new(0x1008, 8, 7));
        match R.at(95, 10) {
            Err(Error::RemoteOutOfBounds {
                offset,
                len,
                remote_len,
                ..
            }) => assert_eq!((offset, len, remote_len), (95, 10, 100)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn nested_slices_stay_inside_the_parent() {
        let inner = R.slice(50..80).unwrap();
        assert_eq!(inner.slice(0..30).unwrap().addr(), 0x1000 + 50);
        assert!(inner.slice(0..31).is_err());
        assert!(inner.check_fits("write", 30).is_ok());
        assert!(inner.check_fits("write", 31).is_err());
    }
}
