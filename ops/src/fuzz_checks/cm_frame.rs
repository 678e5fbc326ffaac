//! Checks for the software device's connection-manager frames, whose codec
//! is private to `verbio_runtime::cm`: the property check and the seeds live
//! there (its `fuzzing` feature).

use verbio_runtime::cm::{
    check_cm_frame, cm_frame_seeds, CM_FRAME_HEADER_LEN, CM_FRAME_LEN_LOW_BYTE,
};

use super::{LenField, Seed};

/// The header's body length is a big-endian `u16` at offset 6; a repair of
/// its low byte (offset 7, one byte) fits every body under 256 bytes.
pub const LEN_FIELD: LenField = LenField {
    offset: CM_FRAME_LEN_LOW_BYTE,
    width: 1,
    counted_from: CM_FRAME_HEADER_LEN,
};

/// Decodes `data` as one whole frame as the listener does; whatever decodes
/// must re-encode to the very same bytes. Returns whether `data` decoded.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    check_cm_frame(data)
}

/// One valid frame of every type.
pub fn seeds() -> Vec<Seed> {
    cm_frame_seeds()
        .into_iter()
        .map(|(name, bytes)| Seed::new(name, bytes))
        .collect()
}
