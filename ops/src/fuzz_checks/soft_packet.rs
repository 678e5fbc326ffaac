//! Checks for the soft RDMA device's packet codec, which is private to the
//! device: the property check and the seeds live in
//! `verbio_runtime::provider::soft` (its `fuzzing` feature).

use verbio_runtime::provider::soft::{
    check_soft_packet, soft_packet_seeds, SOFT_PACKET_HEADER_LEN, SOFT_PACKET_LEN_OFFSET,
};

use super::{LenField, Seed};

/// The packet header's payload length: `u32` at offset 4, counting what
/// follows the 56-byte header.
pub const LEN_FIELD: LenField = LenField {
    offset: SOFT_PACKET_LEN_OFFSET,
    width: 4,
    counted_from: SOFT_PACKET_HEADER_LEN,
};

/// Decodes `data` with every entry point of the codec and requires them to
/// agree; whatever decodes must re-encode to the very same bytes. Returns
/// whether `data` decoded as a whole packet.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    check_soft_packet(data)
}

/// One valid packet of every opcode (and first/middle/last segments).
pub fn seeds() -> Vec<Seed> {
    soft_packet_seeds()
        .into_iter()
        .map(|(name, bytes)| Seed::new(name, bytes))
        .collect()
}
