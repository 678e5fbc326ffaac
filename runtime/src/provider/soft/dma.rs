//! The engine's "DMA": copies between registered memory and packets.
//!
//! # Why the copies are race-free
//!
//! Registered memory is shared between the device and the application, and
//! the device's copies run on Rust threads (the engine, a polling
//! application's receive, a posting thread's transmission). Rust's memory
//! model makes two unsynchronized plain accesses to the same bytes, one a
//! write, undefined behaviour even where the protocol tolerates torn data,
//! so the device must be ordered with every other Rust access:
//!
//! - Every device access goes through a [`Span`], which only the MR table
//!   hands out ([`MrTable::local`], [`MrTable::remote`]) and which borrows
//!   the table: it can only be used while the table's lock is held. So the
//!   device's own accesses are serialized by that mutex (including the
//!   system calls that read or write a span's memory, and the remote
//!   atomics).
//! - Memory the application owns (its buffers, posted in a WR) is accessed
//!   by the application only before it posts and after it polled the
//!   completion; the post and the completion pass through mutexes (the QP's
//!   queue, the CQ), so those accesses happen before or after the device's:
//!   no race.
//! - Memory a peer may access at any moment (`RemoteAccessRegion`) is read
//!   and written by the application only inside `Mr::with_memory`, which
//!   takes the same MR-table lock: every pair of accesses is ordered by the
//!   mutex, whatever their sizes and alignments. (Large copies take the lock
//!   once per chunk, so the device is never held up long; a peer's data
//!   arriving meanwhile still shows as a mix of old and new bytes, as with a
//!   NIC: the lock removes the undefined behaviour, not the torn view.)
//!
//! The kernel writing or reading registered memory in a system call is not a
//! Rust access; those calls run under the lock too, through a span.

use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;

use smallvec::SmallVec;

use super::mr::MrTable;
use crate::provider::Sge;

/// `len` bytes of registered memory found in the MR table.
///
/// # Invariant
///
/// `ptr..ptr + len` lies inside a registration of the [`MrTable`] borrowed
/// for `'t`, so while the span lives the table's lock is held: the memory is
/// valid (deregistration waits for the lock) and no other Rust thread
/// accesses it (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span<'t> {
    ptr: *mut u8,
    len: usize,
    _table: PhantomData<&'t MrTable>,
}

impl<'t> Span<'t> {
    /// # Safety
    ///
    /// `ptr..ptr + len` lies inside a registration of the table borrowed for
    /// `'t` (which holds the table's lock).
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> Span<'t> {
        Span {
            ptr,
            len,
            _table: PhantomData,
        }
    }

    /// The first byte, for system calls made while the span lives.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Copies `data` to the start of the span (at most `len` bytes).
    pub(crate) fn write(&self, data: &[u8]) {
        debug_assert!(data.len() <= self.len);
        let n = data.len().min(self.len);
        // SAFETY: `Span`'s invariant; `n` fits both.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, n) }
    }

    /// Copies the start of the span into `dst` (at most `len` bytes).
    pub(crate) fn read_into(&self, dst: &mut [u8]) {
        debug_assert!(dst.len() <= self.len);
        let n = dst.len().min(self.len);
        // SAFETY: `Span`'s invariant; `n` fits both.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst.as_mut_ptr(), n) }
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends the span's bytes from `from` on to `out` (nothing if `from`
    /// is past its end).
    pub(crate) fn append_from(&self, from: usize, out: &mut Vec<u8>) {
        let n = self.len.saturating_sub(from);
        out.reserve(n);
        let at = out.len();
        // SAFETY: `Span`'s invariant; `from + n <= len`; `out` has `n`
        // spare bytes (reserved), now initialized.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(from.min(self.len)),
                out.as_mut_ptr().add(at),
                n,
            );
            out.set_len(at + n);
        }
    }

    /// Appends the whole span to `out`.
    pub(crate) fn append_to(&self, out: &mut Vec<u8>) {
        out.reserve(self.len);
        let at = out.len();
        // SAFETY: `Span`'s invariant; `out` has `len` spare bytes (reserved), now initialized.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr().add(at), self.len);
            out.set_len(at + self.len);
        }
    }

    /// The span's first 8 bytes as an atomic word (`None` unless 8-byte
    /// aligned and at least 8 bytes long), for remote atomics.
    pub(crate) fn atomic_u64(&self) -> Option<&'t AtomicU64> {
        if self.len < 8 || (self.ptr as usize) & 7 != 0 {
            return None;
        }
        // SAFETY: `Span`'s invariant (valid for `'t`); aligned, 8 bytes (checked).
        Some(unsafe { AtomicU64::from_ptr(self.ptr.cast()) })
    }
}

/// The part of `sges` covering message bytes `[off, off + len)`, as
/// `(sge, address, length)` pieces.
fn pieces(sges: &[Sge], off: u64, len: u64) -> impl Iterator<Item = (&Sge, u64, u64, u64)> {
    let end = off + len;
    let mut pos = 0u64;
    sges.iter().filter_map(move |s| {
        let s_start = pos;
        let s_end = pos + u64::from(s.length);
        pos = s_end;
        if s_end <= off || s_start >= end || s.length == 0 {
            return None;
        }
        let a = off.max(s_start);
        let b = end.min(s_end);
        // (sge, address, length, offset of the piece within [off, off+len))
        Some((s, s.addr + (a - s_start), b - a, a - off))
    })
}

/// True if every SGE is a valid local region (LOCAL_WRITE if `write`).
pub(crate) fn check_local(sges: &[Sge], pd: u32, mrs: &MrTable, write: bool) -> bool {
    sges.iter().all(|s| {
        s.length == 0
            || mrs
                .local(s.lkey, pd, s.addr, u64::from(s.length), write)
                .is_some()
    })
}

/// Appends message bytes `[off, off + len)` gathered from `sges` to `out`.
/// False if an SGE is not (or no longer) registered.
pub(crate) fn gather(
    sges: &[Sge],
    pd: u32,
    mrs: &MrTable,
    off: u64,
    len: u64,
    out: &mut Vec<u8>,
) -> bool {
    let start = out.len();
    out.reserve(len as usize);
    for (s, addr, n, _) in pieces(sges, off, len) {
        let Some(span) = mrs.local(s.lkey, pd, addr, n, false) else {
            out.truncate(start);
            return false;
        };
        span.append_to(out);
    }
    true
}

/// The registered memory holding message bytes `[off, off + len)` of
/// `sges`, in order, to be written to a socket without copying; `None` if
/// an SGE is not (or no longer) a registered region.
pub(crate) fn spans<'t>(
    sges: &[Sge],
    pd: u32,
    mrs: &'t MrTable,
    off: u64,
    len: u64,
) -> Option<SmallVec<[Span<'t>; 4]>> {
    pieces(sges, off, len)
        .map(|(s, addr, n, _)| mrs.local(s.lkey, pd, addr, n, false))
        .collect()
}

/// The registered, locally writable memory holding message bytes `[off,
/// off + len)` of `sges`, in order, for the kernel to write into; `None` if
/// the range exceeds the SGEs or an SGE is not (or no longer) a registered,
/// locally writable region.
pub(crate) fn writable_spans<'t>(
    sges: &[Sge],
    pd: u32,
    mrs: &'t MrTable,
    off: u64,
    len: u64,
) -> Option<SmallVec<[Span<'t>; 4]>> {
    let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
    if off.checked_add(len)? > total {
        return None;
    }
    pieces(sges, off, len)
        .map(|(s, addr, n, _)| mrs.local(s.lkey, pd, addr, n, true))
        .collect()
}

/// Writes `data` to message bytes `[off, off + data.len())` of `sges`.
/// False (and nothing written) if the range exceeds the SGEs or an SGE is not
/// a registered, locally writable region.
pub(crate) fn scatter(sges: &[Sge], pd: u32, mrs: &MrTable, off: u64, data: &[u8]) -> bool {
    let len = data.len() as u64;
    let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
    match off.checked_add(len) {
        Some(end) if end <= total => {}
        _ => return false,
    }
    let ok = pieces(sges, off, len)
        .all(|(s, addr, n, _)| mrs.local(s.lkey, pd, addr, n, true).is_some());
    if !ok {
        return false;
    }
    for (s, addr, n, at) in pieces(sges, off, len) {
        if let Some(span) = mrs.local(s.lkey, pd, addr, n, true) {
            // (The pieces partition `[0, len)`.)
            span.write(&data[at as usize..(at + n) as usize]);
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::super::mr::MrEntry;
    use super::*;
    use crate::provider::AccessFlags;

    /// Spans of every offset and length up to 65 bytes (aligned and not,
    /// touching both ends of the registration) copy exactly their bytes.
    #[test]
    fn spans_copy_exactly_their_bytes() {
        let mut mem: Vec<u8> = (0..80u8).collect();
        let base = mem.as_mut_ptr() as u64;
        let mut table = MrTable::default();
        let entry = MrEntry {
            pd: 1,
            addr: base,
            len: 80,
            access: AccessFlags::LOCAL_WRITE,
        };
        let (lkey, _) = table.insert(entry, 7);
        for off in 0..=15u64 {
            for len in 0..=65u64 {
                let span = table.local(lkey, 1, base + off, len, true).unwrap();
                let mut got = vec![0xee];
                span.append_to(&mut got);
                let want: Vec<u8> = (off as u8..(off + len) as u8).collect();
                assert_eq!(got[1..], want[..], "off {off} len {len}");
                let fill: Vec<u8> = (0..len as u8).map(|b| b ^ 0x80).collect();
                span.write(&fill);
                let mut back = vec![0; len as usize];
                span.read_into(&mut back);
                assert_eq!(back, fill);
                span.write(&want);
            }
        }
        assert!(
            table.local(lkey, 1, base + 16, 65, true).is_none(),
            "past the end"
        );
        assert!(
            table.local(lkey, 1, base - 1, 2, true).is_none(),
            "before the start"
        );
        assert!(table.local(lkey, 2, base, 1, true).is_none(), "other PD");
        let aligned = (base + 7) & !7;
        let word = table.local(lkey, 1, aligned, 8, true).unwrap();
        let a = word.atomic_u64().expect("aligned");
        a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let short = table.local(lkey, 1, aligned, 7, true).unwrap();
        assert!(short.atomic_u64().is_none(), "shorter than a word");
        let skew = table.local(lkey, 1, aligned + 1, 8, true).unwrap();
        assert!(skew.atomic_u64().is_none(), "misaligned");
        drop(table);
        let at = (aligned - base) as usize;
        assert_eq!(mem[at], at as u8 + 1);
    }
}
