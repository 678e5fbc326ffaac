//! Size-class arithmetic of the pool: power-of-two block sizes from
//! `2^min_shift` to `2^max_shift`; anything larger gets its own registration.

/// The size classes of one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SizeClasses {
    /// log2 of the smallest block.
    min_shift: u32,
    /// log2 of the largest block.
    max_shift: u32,
    /// Smallest chunk to register at once, in bytes.
    chunk_bytes: usize,
    /// Fewest blocks one chunk holds (for the big classes).
    min_blocks_per_chunk: usize,
}

impl SizeClasses {
    /// Callers guarantee `min_shift <= max_shift < usize::BITS - 4`.
    pub(crate) fn new(
        min_shift: u32,
        max_shift: u32,
        chunk_bytes: usize,
        min_blocks_per_chunk: usize,
    ) -> SizeClasses {
        SizeClasses {
            min_shift,
            max_shift,
            chunk_bytes,
            min_blocks_per_chunk: min_blocks_per_chunk.max(1),
        }
    }

    /// Number of classes.
    pub(crate) fn count(&self) -> usize {
        (self.max_shift - self.min_shift + 1) as usize
    }

    /// Largest pooled size; bigger requests are dedicated registrations.
    pub(crate) fn max_block(&self) -> usize {
        1 << self.max_shift
    }

    /// The class of a request of `len` bytes, `None` if it is too big for the pool.
    pub(crate) fn class_of(&self, len: usize) -> Option<usize> {
        if len > self.max_block() {
            return None;
        }
        // ceil(log2(len)), with 0 and 1 mapping to 0.
        let shift = match len {
            0 | 1 => 0,
            n => usize::BITS - (n - 1).leading_zeros(),
        };
        Some(shift.saturating_sub(self.min_shift) as usize)
    }

    /// Block size of `class`.
    pub(crate) fn block_size(&self, class: usize) -> usize {
        1 << (self.min_shift as usize + class)
    }

    /// Bytes of one full chunk of `class`: at least `chunk_bytes` and at
    /// least `min_blocks_per_chunk` blocks; always a multiple of the block
    /// size.
    pub(crate) fn chunk_size(&self, class: usize) -> usize {
        let block = self.block_size(class);
        let blocks = (self.chunk_bytes / block).max(self.min_blocks_per_chunk);
        blocks * block
    }

    /// Bytes of the next chunk to carve for `class` when `carved` blocks
    /// of it were carved before: the first chunk is one page (one block
    /// for blocks of a page or more), each later one as large as all
    /// before it, up to a full [`chunk_size`](Self::chunk_size). A class
    /// used for a few buffers (a connection's first sends) so registers a
    /// page, not a full chunk, and a busy one reaches full chunks after a
    /// few doublings.
    pub(crate) fn next_chunk_size(&self, class: usize, carved: usize) -> usize {
        let block = self.block_size(class);
        let full = self.chunk_size(class) / block;
        let first = (PAGE / block).max(1);
        carved.max(first).min(full) * block
    }
}

/// Size of the first chunk of a class of small blocks.
const PAGE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    fn classes() -> SizeClasses {
        SizeClasses::new(6, 20, 512 * 1024, 4)
    }

    #[test]
    fn classes_are_powers_of_two_from_64_bytes_to_1_mib() {
        let c = classes();
        assert_eq!(c.count(), 15);
        assert_eq!(c.block_size(0), 64);
        assert_eq!(c.block_size(14), 1 << 20);
        assert_eq!(c.max_block(), 1 << 20);
    }

    #[test]
    fn requests_round_up_to_the_next_class() {
        let c = classes();
        assert_eq!(c.class_of(0), Some(0));
        assert_eq!(c.class_of(1), Some(0));
        assert_eq!(c.class_of(64), Some(0));
        assert_eq!(c.class_of(65), Some(1));
        assert_eq!(c.class_of(128), Some(1));
        assert_eq!(c.class_of(129), Some(2));
        assert_eq!(c.class_of(4096), Some(6));
        assert_eq!(c.class_of(1 << 20), Some(14));
        assert_eq!(c.class_of((1 << 20) + 1), None);
        assert_eq!(c.class_of(usize::MAX), None);
        for len in 0..=70_000usize {
            let k = c.class_of(len).unwrap();
            assert!(c.block_size(k) >= len, "len {len}");
            if k > 0 {
                assert!(
                    c.block_size(k - 1) < len,
                    "len {len} not in the smallest class"
                );
            }
        }
    }

    #[test]
    fn chunks_hold_whole_blocks() {
        let c = classes();
        for k in 0..c.count() {
            let chunk = c.chunk_size(k);
            assert_eq!(chunk % c.block_size(k), 0);
            assert!(chunk >= 512 * 1024);
            assert!(chunk / c.block_size(k) >= 4);
        }
        assert_eq!(c.chunk_size(0), 512 * 1024);
        assert_eq!(c.chunk_size(14), 4 << 20);
    }

    #[test]
    fn chunks_start_at_a_page_and_double_up_to_a_full_chunk() {
        let c = classes();
        // 64-byte blocks: a page, then as much again, up to 512 KiB.
        let mut carved = 0;
        let mut sizes = Vec::new();
        while sizes.last() != Some(&(512 * 1024)) {
            let size = c.next_chunk_size(0, carved);
            assert_eq!(size % 64, 0);
            carved += size / 64;
            sizes.push(size);
        }
        assert_eq!(sizes[0], 4096);
        assert_eq!(sizes[1], 4096);
        assert_eq!(sizes[2], 8192);
        assert_eq!(sizes.len(), 9, "{sizes:?}");
        assert_eq!(c.next_chunk_size(0, carved), 512 * 1024, "stays full");
        // Blocks of a page or more: one block first.
        assert_eq!(c.next_chunk_size(6, 0), 4096);
        assert_eq!(c.next_chunk_size(14, 0), 1 << 20);
        assert_eq!(c.next_chunk_size(14, 1), 1 << 20);
        assert_eq!(c.next_chunk_size(14, 2), 2 << 20);
        assert_eq!(c.next_chunk_size(14, 4), 4 << 20);
        assert_eq!(c.next_chunk_size(14, 100), 4 << 20);
        // A full chunk smaller than a page is carved whole at once.
        let tiny = SizeClasses::new(6, 12, 1024, 2);
        assert_eq!(tiny.next_chunk_size(0, 0), 1024);
    }
}
