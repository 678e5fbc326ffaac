//! The engine's "DMA": copies between registered memory and packets, through
//! raw pointers validated against the MR table (whose lock the caller holds).

use super::mr::MrTable;
use crate::provider::Sge;

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
        let Some(p) = mrs.local(s.lkey, pd, addr, n, false) else {
            out.truncate(start);
            return false;
        };
        let at = out.len();
        // SAFETY: `p..p+n` lies in a registration found under the MR-table
        // lock the caller holds, so the memory is valid (reg_mr contract);
        // `out` has at least `n` spare bytes reserved above.
        unsafe {
            std::ptr::copy_nonoverlapping(p, out.as_mut_ptr().add(at), n as usize);
            out.set_len(at + n as usize);
        }
    }
    true
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
        if let Some(p) = mrs.local(s.lkey, pd, addr, n, true) {
            // SAFETY: validated registration under the caller's MR-table lock
            // (memory valid and writable per reg_mr); `data[at..at+n]` is in
            // bounds because the pieces partition `[0, len)`.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr().add(at as usize), p, n as usize);
            }
        }
    }
    true
}

/// Copies `data` to a validated remote-access pointer.
///
/// # Safety
/// `p` must point to `data.len()` writable bytes of a registration found
/// under the MR-table lock, which the caller still holds.
pub(crate) unsafe fn write_raw(p: *mut u8, data: &[u8]) {
    // SAFETY: per this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) }
}

/// Appends `len` bytes read from a validated pointer to `out`.
///
/// # Safety
/// `p` must point to `len` readable bytes of a registration found under the
/// MR-table lock, which the caller still holds.
pub(crate) unsafe fn read_raw(p: *const u8, len: usize, out: &mut Vec<u8>) {
    out.reserve(len);
    let at = out.len();
    // SAFETY: per this function's contract; `out` has `len` spare bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(p, out.as_mut_ptr().add(at), len);
        out.set_len(at + len);
    }
}
