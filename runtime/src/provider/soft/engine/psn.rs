//! Packet sequence numbers: 24-bit serial arithmetic.

pub(crate) const PSN_MASK: u32 = 0x00ff_ffff;

pub(crate) fn psn_add(a: u32, b: u32) -> u32 {
    a.wrapping_add(b) & PSN_MASK
}

/// `a <= b` in 24-bit serial arithmetic.
pub(crate) fn psn_le(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) & PSN_MASK) < (1 << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_add(5, PSN_MASK), 4);
        assert!(psn_le(PSN_MASK - 2, 3));
        assert!(!psn_le(3, PSN_MASK - 2));
        assert!(psn_le(7, 7));
        assert!(psn_le(0, (1 << 23) - 1));
        assert!(!psn_le(0, 1 << 23));
    }
}
