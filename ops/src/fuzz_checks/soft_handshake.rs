//! Checks for the soft RDMA device's handshake before a peer engine is
//! proven (HELLO, VERIFY, VERIFY_REPLY), which is private to the device: the
//! property check and the seeds live in `verbio_runtime::provider::soft`
//! (its `fuzzing` feature).

use verbio_runtime::provider::soft::{
    check_soft_handshake, soft_handshake_seeds, SOFT_HANDSHAKE_HEADER_LEN,
    SOFT_HANDSHAKE_LEN_OFFSET,
};

use super::{LenField, Seed};

/// The first packet header's payload length: `u32` at offset 5 (after the
/// byte naming the side), counting what follows the 56-byte header.
pub const LEN_FIELD: LenField = LenField {
    offset: SOFT_HANDSHAKE_LEN_OFFSET,
    width: 4,
    counted_from: SOFT_HANDSHAKE_HEADER_LEN,
};

/// Runs the engine's handshake cutter over `data` (its first byte names
/// the side: dialed, accepted or verifier) and checks it buffers no more
/// than a handshake packet, agrees with itself however the bytes are split,
/// and cuts messages that re-encode to their bytes. Returns whether a
/// message was cut.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    check_soft_handshake(data)
}

/// Valid handshakes of every side.
pub fn seeds() -> Vec<Seed> {
    soft_handshake_seeds()
        .into_iter()
        .map(|(name, bytes)| Seed::new(name, bytes))
        .collect()
}
