//! Reserved wr_ids and the layout constants of tracked ones (see the
//! [`op`](super) module docs for the layout).

/// The reserved namespace bit: wr_ids with this bit set are not slab keys.
pub const RESERVED: u64 = 1 << 63;
/// A WR whose completion the runtime drops silently (fire and forget, e.g.
/// a raw post made outside the `QueuePair` API).
pub const UNTRACKED: u64 = RESERVED;
/// First wr_id handed to the reserved-completion handler
/// ([`Handle::set_reserved_handler`](crate::reactor::Handle::set_reserved_handler)),
/// e.g. for agent-internal receives. Every id in `AGENT_BASE..` goes there.
pub const AGENT_BASE: u64 = RESERVED | (1 << 32);
/// Inline sends posted without an op ([`QueuePair::post_send_inline`](crate::QueuePair::post_send_inline)):
/// `INLINE | marker << 30 | entries << 20 | QP registry key`. Their
/// completions release `entries` send-queue and CQ entries of that QP
/// and record its first error; they never touch the op slab.
pub const INLINE: u64 = RESERVED | (1 << 31);
/// Bits of the QP registry key in an inline wr_id.
pub const INLINE_KEY_BITS: u32 = 20;
/// Bits of the entry count in an inline wr_id.
pub const INLINE_ENTRY_BITS: u32 = 10;
/// Set in the wr_id of the zero-length WR that retires a QP's trailing
/// unsignaled inline sends (it carries no data: its errors are not recorded).
pub const INLINE_MARKER: u64 = 1 << 30;
/// Receives of a [`RecvRing`](crate::qp::RecvRing):
/// `RING | ring key << RING_SLOT_BITS | slot`. Their completions go to
/// the ring (named by its key in the reactor's ring registry); they
/// never touch the op slab.
pub const RING: u64 = RESERVED | (1 << 30);
/// Bits of the slot (buffer index) in a ring wr_id.
pub const RING_SLOT_BITS: u32 = 16;
/// Bits of the ring key in a ring wr_id.
pub const RING_KEY_BITS: u32 = 14;
pub(crate) const RING_SLOT_MASK: u64 = (1 << RING_SLOT_BITS) - 1;
pub(crate) const RING_KEY_MASK: u64 = (1 << RING_KEY_BITS) - 1;

/// True for the wr_ids of [`RING`] WRs.
#[inline]
pub(crate) fn is_ring(id: u64) -> bool {
    id & !((1u64 << 30) - 1) == RING
}

/// Builds a ring wr_id (`key` < 2^14, `slot` < 2^16).
#[inline]
pub(crate) fn encode_ring(key: usize, slot: u32) -> u64 {
    RING | (key as u64 & RING_KEY_MASK) << RING_SLOT_BITS | (u64::from(slot) & RING_SLOT_MASK)
}

/// The ring key of a ring wr_id.
#[inline]
pub(crate) fn ring_key(id: u64) -> usize {
    ((id >> RING_SLOT_BITS) & RING_KEY_MASK) as usize
}

/// The slot of a ring wr_id.
#[inline(always)]
pub(crate) fn ring_slot(id: u64) -> u32 {
    (id & RING_SLOT_MASK) as u32
}

/// Bits of the slab key.
pub const KEY_BITS: u32 = 24;
/// Bits of the generation.
pub const GEN_BITS: u32 = 24;
/// Bits of the index within a chain.
pub const INDEX_BITS: u32 = 14;
/// Largest number of WRs in one op's chain.
pub const MAX_CHAIN: usize = 1 << INDEX_BITS;
/// Largest number of ops in flight at once per runtime.
pub const MAX_OPS: usize = 1 << KEY_BITS;

pub(crate) const KEY_MASK: u64 = (1 << KEY_BITS) - 1;
pub(crate) const GEN_SHIFT: u32 = KEY_BITS;
pub(crate) const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
pub(crate) const INDEX_SHIFT: u32 = KEY_BITS + GEN_BITS;
pub(crate) const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;

/// Builds a tracked wr_id.
#[inline(always)]
pub(crate) fn encode(key: usize, gen: u32, index: u16) -> u64 {
    (key as u64 & KEY_MASK)
        | ((u64::from(gen) & GEN_MASK) << GEN_SHIFT)
        | ((u64::from(index) & INDEX_MASK) << INDEX_SHIFT)
}

/// `first` (a tracked wr_id of index 0) with chain index `index`.
#[inline(always)]
pub(crate) fn with_index(first: u64, index: u16) -> u64 {
    first | ((u64::from(index) & INDEX_MASK) << INDEX_SHIFT)
}

/// The generation after `gen`: they run `1..=GEN_MASK` and wrap to 1
/// (never 0, so a tracked wr_id is never 0).
#[inline(always)]
pub(crate) fn next_gen(gen: u32) -> u32 {
    if gen >= GEN_MASK as u32 {
        1
    } else {
        gen + 1
    }
}

/// True for the wr_ids of [`INLINE`] WRs.
pub(crate) fn is_inline(id: u64) -> bool {
    id & !((1u64 << 31) - 1) == INLINE
}

/// Builds an inline wr_id (`key` < 2^20, `entries` < 2^10).
pub(crate) fn encode_inline(key: usize, entries: u32, marker: bool) -> u64 {
    INLINE
        | if marker { INLINE_MARKER } else { 0 }
        | (u64::from(entries) & ((1 << INLINE_ENTRY_BITS) - 1)) << INLINE_KEY_BITS
        | (key as u64 & ((1 << INLINE_KEY_BITS) - 1))
}

/// Splits an inline wr_id into (QP registry key, entries, marker).
pub(crate) fn decode_inline(id: u64) -> (usize, u32, bool) {
    (
        (id & ((1 << INLINE_KEY_BITS) - 1)) as usize,
        ((id >> INLINE_KEY_BITS) & ((1 << INLINE_ENTRY_BITS) - 1)) as u32,
        id & INLINE_MARKER != 0,
    )
}

/// Splits a tracked wr_id into (key, generation, index).
pub(crate) fn decode(id: u64) -> (usize, u32, u16) {
    (
        (id & KEY_MASK) as usize,
        ((id >> GEN_SHIFT) & GEN_MASK) as u32,
        ((id >> INDEX_SHIFT) & INDEX_MASK) as u16,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_id_round_trips() {
        let id = encode(0xab_cdef, 0x12_3456, 0x2abc);
        assert_eq!(decode(id), (0xab_cdef, 0x12_3456, 0x2abc));
        assert_eq!(id & RESERVED, 0);
        assert_ne!(AGENT_BASE & RESERVED, 0);
    }

    #[test]
    fn generations_skip_zero_when_they_wrap() {
        assert_eq!(next_gen(1), 2);
        assert_eq!(next_gen(GEN_MASK as u32 - 1), GEN_MASK as u32);
        assert_eq!(next_gen(GEN_MASK as u32), 1);
    }

    #[test]
    fn inline_wr_ids_round_trip_below_the_agent_range() {
        let id = encode_inline(0xf_abcd, 0x3ff, true);
        assert!(is_inline(id));
        assert!(id < AGENT_BASE && id & RESERVED != 0);
        assert_eq!(decode_inline(id), (0xf_abcd, 0x3ff, true));
        let id = encode_inline(7, 3, false);
        assert_eq!(decode_inline(id), (7, 3, false));
        assert!(!is_inline(UNTRACKED));
        assert!(!is_inline(AGENT_BASE));
        assert!(!is_inline(encode(1, 1, 0)));
    }

    #[test]
    fn ring_wr_ids_are_neither_inline_nor_agent_nor_slab() {
        for (key, slot) in [(0, 0), (0x3fff, 0xffff), (5, 77)] {
            let id = encode_ring(key, slot);
            assert!(is_ring(id));
            assert!(!is_inline(id));
            assert!(id < AGENT_BASE && id & RESERVED != 0);
            assert_eq!(ring_key(id), key);
            assert_eq!(id & RING_SLOT_MASK, u64::from(slot));
        }
        assert!(!is_ring(UNTRACKED));
        assert!(!is_ring(AGENT_BASE));
        assert!(!is_ring(encode_inline(7, 3, true)));
        assert!(!is_ring(encode_inline(0xf_ffff, 0x3ff, false)));
        assert!(!is_ring(encode(1, 1, 0)));
    }
}
