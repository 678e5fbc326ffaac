//! Errors of the provider contract.

use std::io;

use super::types::{QpState, WcStatus};

/// Result type of provider calls.
pub type Result<T, E = ProviderError> = std::result::Result<T, E>;

/// An error from a provider (software device or libibverbs).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// No RDMA device (libibverbs missing, or it lists none).
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// Why none was found.
        reason: String,
    },
    /// A device with that name does not exist.
    #[error("no RDMA device named {name:?}; {known}")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The devices that do exist (or why none can open), for the user
        /// to pick from.
        known: String,
    },
    /// A verbs call failed.
    #[error("{call} failed")]
    Verbs {
        /// The libibverbs function, e.g. `"ibv_reg_mr"`.
        call: &'static str,
        /// errno as an io::Error.
        #[source]
        source: io::Error,
    },
    /// An argument was out of range for this device or object.
    #[error("invalid argument to {call}: {what}")]
    InvalidArgument {
        /// The contract call.
        call: &'static str,
        /// What was wrong.
        what: String,
    },
    /// A work queue is full (`ENOMEM` from `ibv_post_*`).
    #[error("{queue} queue of QP {qp_num} is full ({depth} WRs outstanding)")]
    QueueFull {
        /// QP number.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
    },
    /// A QP transition or post not allowed in the QP's current state.
    #[error("QP {qp_num}: {op} not allowed in state {state:?}")]
    InvalidQpState {
        /// QP number.
        qp_num: u32,
        /// What was attempted.
        op: &'static str,
        /// The state the QP was in.
        state: QpState,
    },
    /// The CQ overflowed: completions were lost, the CQ is in error.
    #[error("completion queue {cq} overflowed (capacity {capacity}): completions were lost")]
    CqOverflow {
        /// CQ handle.
        cq: u32,
        /// Its capacity.
        capacity: u32,
    },
    /// The device context is gone (engine thread ended, device removed).
    #[error("device {device} is no longer usable: {reason}")]
    DeviceLost {
        /// Device name.
        device: String,
        /// Why.
        reason: String,
    },
    /// Registering memory failed with `ENOMEM`, which on Linux almost
    /// always means the locked-memory limit (`RLIMIT_MEMLOCK`, `ulimit -l`)
    /// is too low for the registration. The message names the limit and
    /// how to raise it.
    #[error("{call} of {len} bytes failed: {hint}")]
    MemlockLimit {
        /// The verbs call (`"ibv_reg_mr"`).
        call: &'static str,
        /// Bytes being registered.
        len: usize,
        /// The current limit and what to do.
        hint: String,
        /// The `ENOMEM` error.
        #[source]
        source: io::Error,
    },
    /// An operating-system call failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The provider does not implement the feature.
    #[error("not supported by the {provider} provider: {what}")]
    Unsupported {
        /// Provider name.
        provider: &'static str,
        /// The missing feature.
        what: &'static str,
    },
}

/// A failed post list: the first `posted` WRs were accepted, the one at index
/// `posted` failed with `error`, the rest were not looked at (verbs `bad_wr`).
#[derive(Debug, thiserror::Error)]
#[error("post failed at work request {posted}")]
pub struct PostError {
    /// How many WRs of the list were posted.
    pub posted: usize,
    /// Why the next one was refused.
    #[source]
    pub error: ProviderError,
}

/// A completion that did not succeed, for callers that turn a status into an error.
#[derive(Debug, Clone, Copy, thiserror::Error, PartialEq, Eq)]
#[error("work request {wr_id:#x} on QP {qp_num} completed with {status}")]
pub struct CompletionError {
    /// The WR.
    pub wr_id: u64,
    /// Its QP.
    pub qp_num: u32,
    /// The failure status.
    pub status: WcStatus,
}

/// An `rlim_t` as `u64` (`rlim_t` is 32 bits on some targets).
#[allow(clippy::unnecessary_cast)]
fn rlim(v: libc::rlim_t) -> u64 {
    v as u64
}

/// Formats an `RLIMIT_MEMLOCK` value in bytes (`RLIM_INFINITY` as
/// "unlimited").
fn fmt_limit(v: u64) -> String {
    if v == rlim(libc::RLIM_INFINITY) {
        "unlimited".to_string()
    } else if v >= 1 << 20 && v & 1023 == 0 {
        format!("{} KiB ({} MiB)", v / 1024, v >> 20)
    } else if v & 1023 == 0 {
        format!("{} KiB", v / 1024)
    } else {
        format!("{v} bytes")
    }
}

/// The hint for `ENOMEM` from memory registration, given the current soft
/// and hard `RLIMIT_MEMLOCK` (`None` if unknown): the limit, and to raise
/// `ulimit -l` (or the systemd / container / limits.conf setting behind it).
pub(crate) fn memlock_hint(soft: Option<u64>, hard: Option<u64>) -> String {
    let limit = match (soft, hard) {
        (Some(s), Some(h)) => format!("{} (hard limit {})", fmt_limit(s), fmt_limit(h)),
        (Some(s), None) => fmt_limit(s),
        _ => "unknown (getrlimit failed)".to_string(),
    };
    let unlimited = soft == Some(rlim(libc::RLIM_INFINITY));
    let advice = if unlimited {
        "the limit is not the cause: the device or the host is out of memory"
    } else {
        "raise it with `ulimit -l unlimited` (or LimitMEMLOCK=infinity for a systemd \
         service, --ulimit memlock=-1 for a container, memlock in \
         /etc/security/limits.conf)"
    };
    format!(
        "out of memory; the locked-memory limit (RLIMIT_MEMLOCK, ulimit -l) is {limit}: {advice}"
    )
}

/// The current soft and hard `RLIMIT_MEMLOCK`, `None` if unreadable.
fn memlock_limits() -> Option<(u64, u64)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the call to fill.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    (rc == 0).then_some((rlim(r.rlim_cur), rlim(r.rlim_max)))
}

impl ProviderError {
    /// The error for a failed memory registration (`call` of `len` bytes)
    /// with OS error `source`: [`ProviderError::MemlockLimit`] with the
    /// current limit for `ENOMEM`, [`ProviderError::Verbs`] otherwise.
    pub fn registration(call: &'static str, len: usize, source: io::Error) -> ProviderError {
        if source.raw_os_error() != Some(libc::ENOMEM) {
            return ProviderError::Verbs { call, source };
        }
        let limits = memlock_limits();
        ProviderError::MemlockLimit {
            call,
            len,
            hint: memlock_hint(limits.map(|l| l.0), limits.map(|l| l.1)),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memlock_hint_names_the_limit_and_the_fix() {
        let h = memlock_hint(Some(64 << 10), Some(64 << 10));
        assert!(h.contains("64 KiB (hard limit 64 KiB)"), "{h}");
        assert!(h.contains("ulimit -l"), "{h}");
        let h = memlock_hint(Some(8 << 20), Some(rlim(libc::RLIM_INFINITY)));
        assert!(h.contains("8192 KiB (8 MiB) (hard limit unlimited)"), "{h}");
        let h = memlock_hint(
            Some(rlim(libc::RLIM_INFINITY)),
            Some(rlim(libc::RLIM_INFINITY)),
        );
        assert!(h.contains("not the cause"), "{h}");
        assert!(memlock_hint(None, None).contains("unknown"));
        assert_eq!(fmt_limit(1000), "1000 bytes");
    }

    #[test]
    fn enomem_from_registration_says_to_raise_the_limit() {
        let e = ProviderError::registration(
            "ibv_reg_mr",
            1 << 20,
            io::Error::from_raw_os_error(libc::ENOMEM),
        );
        let text = e.to_string();
        assert!(
            matches!(e, ProviderError::MemlockLimit { len: 1048576, .. }),
            "{text}"
        );
        assert!(
            text.starts_with("ibv_reg_mr of 1048576 bytes failed: out of memory"),
            "{text}"
        );
        assert!(text.contains("RLIMIT_MEMLOCK"), "{text}");
        // This process's real limit is in the message.
        let (soft, _) = memlock_limits().expect("getrlimit");
        assert!(text.contains(&fmt_limit(soft)), "{text}");
        let other = ProviderError::registration(
            "ibv_reg_mr",
            4096,
            io::Error::from_raw_os_error(libc::EINVAL),
        );
        assert!(matches!(other, ProviderError::Verbs { .. }));
    }
}
