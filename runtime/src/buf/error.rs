//! Errors of the buffer module.

use std::fmt;

use crate::provider::{AccessFlags, ProviderError};

/// Why a buffer operation was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BufError {
    /// A range did not fit the buffer.
    #[error("{what}: range {start}..{end} is out of bounds for a buffer of {len} bytes")]
    OutOfBounds {
        /// The operation (`"slice"`, `"sge"`, `"read_into"`, ...).
        what: &'static str,
        /// Requested start (saturated at `usize::MAX` if it overflowed).
        start: usize,
        /// Requested end, exclusive (saturated at `usize::MAX` if it overflowed).
        end: usize,
        /// The length the range had to fit in.
        len: usize,
    },
    /// An address is not aligned as the operation requires.
    #[error("{what}: address {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// The operation.
        what: &'static str,
        /// The address.
        addr: u64,
        /// The required alignment.
        align: usize,
    },
    /// A length does not fit what the device or pool can describe.
    #[error("{what}: {len} bytes is more than the maximum of {max}")]
    TooLarge {
        /// The operation.
        what: &'static str,
        /// Requested length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The buffer has no bytes to register.
    #[error("{what}: cannot register an empty buffer")]
    Empty {
        /// The operation.
        what: &'static str,
    },
    /// The requested access flags are not allowed for this kind of registration.
    #[error("{what}: access {requested:?} not allowed ({reason})")]
    AccessNotAllowed {
        /// The operation.
        what: &'static str,
        /// The flags asked for.
        requested: AccessFlags,
        /// Why they are refused.
        reason: &'static str,
    },
    /// A pool configuration is inconsistent.
    #[error("invalid pool configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: &'static str,
    },
    /// Memory could not be allocated.
    #[error("{what}: could not allocate {len} bytes")]
    Alloc {
        /// The operation.
        what: &'static str,
        /// Requested size.
        len: usize,
    },
    /// Registering memory with the device failed.
    #[error("{what}: registering {len} bytes failed")]
    Register {
        /// The operation.
        what: &'static str,
        /// Size of the registration.
        len: usize,
        /// The provider's error.
        #[source]
        source: ProviderError,
    },
}

/// A refused operation that took a buffer by value: the error and the buffer,
/// handed back unchanged.
pub struct Rejected<B> {
    /// Why it was refused.
    pub error: BufError,
    /// The buffer, as it was passed in.
    pub buf: B,
}

impl<B> Rejected<B> {
    pub(crate) fn new(error: BufError, buf: B) -> Self {
        Rejected { error, buf }
    }
    /// Gives the buffer back, dropping the error.
    pub fn into_inner(self) -> B {
        self.buf
    }
}

impl<B> fmt::Debug for Rejected<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

/// Reads as the error it carries (the buffer adds nothing to report).
impl<B> fmt::Display for Rejected<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

/// Transparent: the carried error's own source, so a chain report does not
/// print the error twice.
impl<B> std::error::Error for Rejected<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl<B> From<Rejected<B>> for BufError {
    fn from(r: Rejected<B>) -> BufError {
        r.error
    }
}

/// Resolves a `RangeBounds` against `len`, without overflow or panics.
pub(crate) fn resolve_range(
    what: &'static str,
    range: impl std::ops::RangeBounds<usize>,
    len: usize,
) -> Result<(usize, usize), BufError> {
    use std::ops::Bound;
    let start = match range.start_bound() {
        Bound::Included(&n) => Some(n),
        Bound::Excluded(&n) => n.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&n) => n.checked_add(1),
        Bound::Excluded(&n) => Some(n),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        (s, e) => Err(BufError::OutOfBounds {
            what,
            start: s.unwrap_or(usize::MAX),
            end: e.unwrap_or(usize::MAX),
            len,
        }),
    }
}

/// Checks `off..off + n` against `len` without overflow.
pub(crate) fn check_span(
    what: &'static str,
    off: usize,
    n: usize,
    len: usize,
) -> Result<(), BufError> {
    match off.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        end => Err(BufError::OutOfBounds {
            what,
            start: off,
            end: end.unwrap_or(usize::MAX),
            len,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_resolve_or_fail_without_panics() {
        assert_eq!(resolve_range("t", .., 10).unwrap(), (0, 10));
        assert_eq!(resolve_range("t", 2..5, 10).unwrap(), (2, 5));
        assert_eq!(resolve_range("t", 2..=5, 10).unwrap(), (2, 6));
        assert_eq!(resolve_range("t", 10.., 10).unwrap(), (10, 10));
        assert!(resolve_range(
            "t",
            (std::ops::Bound::Included(5), std::ops::Bound::Excluded(4)),
            10
        )
        .is_err());
        assert!(resolve_range("t", 0..11, 10).is_err());
        assert!(resolve_range("t", ..=usize::MAX, 10).is_err());
        let e = resolve_range(
            "t",
            (
                std::ops::Bound::Excluded(usize::MAX),
                std::ops::Bound::Unbounded,
            ),
            10,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            BufError::OutOfBounds {
                start: usize::MAX,
                ..
            }
        ));
        assert!(check_span("t", usize::MAX, 2, 10).is_err());
        assert!(check_span("t", 8, 2, 10).is_ok());
        assert!(check_span("t", 9, 2, 10).is_err());
    }
}
