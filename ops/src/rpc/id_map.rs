//! Hash maps keyed by numbers this endpoint allocates itself (link
//! numbers, queue pair numbers, region tokens), looked up per packet on
//! the link path: hashed with rustc-hash's multiply-and-rotate instead of
//! SipHash (about 140 instructions per 4 KiB message on the link path,
//! `docs/benchmarks.md`, "A window of small calls over several
//! sessions"). A peer can make the endpoint look keys up, never add one
//! of its choosing, so there is no collision flooding to defend against.

use std::collections::HashMap;

/// A hash map keyed by a locally allocated number (see the module).
pub(crate) type IdMap<K, V> = HashMap<K, V, rustc_hash::FxBuildHasher>;

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    /// Links of one session (the same low half) and of many sessions spread
    /// over the buckets a small table indexes by its hash's low bits.
    #[test]
    fn link_numbers_spread_over_the_low_bits() {
        let build = rustc_hash::FxBuildHasher;
        let mut buckets = std::collections::HashSet::new();
        for counter in 0..64u64 {
            buckets.insert(build.hash_one((counter << 32) | 7) & 63);
        }
        assert!(
            buckets.len() > 32,
            "one session's links in {} buckets",
            buckets.len()
        );
        buckets.clear();
        for sid in 0..64u64 {
            buckets.insert(build.hash_one((1u64 << 32) | sid) & 63);
        }
        assert!(
            buckets.len() > 32,
            "64 sessions' links in {} buckets",
            buckets.len()
        );
    }

    #[test]
    fn a_map_finds_what_it_holds() {
        let mut map: IdMap<u64, u64> = IdMap::default();
        for k in 0..1000u64 {
            map.insert((k << 32) | (k % 7), k);
        }
        for k in 0..1000u64 {
            assert_eq!(map.get(&((k << 32) | (k % 7))), Some(&k));
        }
        assert_eq!(map.get(&5), None);
    }
}
