//! [`Fifo`]: the fake's queues (posted send WRs, completions): a `Vec`
//! read from a moving head. Pushing is a `Vec` push and taking from the
//! front moves the head; the storage is reset once the reader caught up
//! (the reactor drains the CQ, and the fake completes every posted WR,
//! so that is the usual state between passes). Cheaper than a
//! `VecDeque`, whose ring arithmetic the fake's hot paths would pay per
//! element: the fake stands in for a device, whose own work costs the
//! application thread nothing, so it should cost the runtime's
//! measurements as little as it can.

/// See the module docs.
pub(super) struct Fifo<T> {
    items: Vec<T>,
    /// Index of the oldest item still queued.
    head: usize,
}

impl<T> Default for Fifo<T> {
    fn default() -> Fifo<T> {
        Fifo {
            items: Vec::new(),
            head: 0,
        }
    }
}

/// Taken items kept before the storage is compacted though the reader
/// never caught up.
const COMPACT_AT: usize = 4096;

impl<T> Fifo<T> {
    pub(super) fn len(&self) -> usize {
        self.items.len() - self.head
    }

    pub(super) fn push(&mut self, item: T) {
        self.items.push(item);
    }

    /// Appends `items` (one reservation for an exactly sized iterator,
    /// such as a mapped slice).
    pub(super) fn extend(&mut self, items: impl IntoIterator<Item = T>) {
        self.items.extend(items);
    }

    /// The queued items, oldest first.
    pub(super) fn as_slice(&self) -> &[T] {
        &self.items[self.head..]
    }

    /// Removes the oldest `n` items (`n <= len()`).
    pub(super) fn advance(&mut self, n: usize) {
        debug_assert!(n <= self.len());
        self.head += n.min(self.len());
        if self.head == self.items.len() {
            self.items.clear();
            self.head = 0;
        } else if self.head >= COMPACT_AT {
            self.items.drain(..self.head);
            self.head = 0;
        }
    }

    /// Removes every item, oldest first.
    pub(super) fn take_all(&mut self) -> Vec<T> {
        let mut items = std::mem::take(&mut self.items);
        items.drain(..std::mem::take(&mut self.head));
        items
    }
}

impl<T: Copy> Fifo<T> {
    /// Removes the oldest item.
    pub(super) fn pop_front(&mut self) -> Option<T> {
        let item = *self.as_slice().first()?;
        self.advance(1);
        Some(item)
    }

    /// Copies up to `out.len()` of the oldest items into `out` and removes
    /// them; returns how many.
    pub(super) fn take_into(&mut self, out: &mut [T]) -> usize {
        let n = self.len().min(out.len());
        out[..n].copy_from_slice(&self.as_slice()[..n]);
        self.advance(n);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items come out in order across partial takes, compaction and resets.
    #[test]
    fn keeps_order_across_takes_and_compaction() {
        let mut f = Fifo::default();
        let mut next_in = 0u32;
        let mut next_out = 0u32;
        let mut out = [0u32; 7];
        for round in 0..2000 {
            for _ in 0..(round % 11) {
                f.push(next_in);
                next_in += 1;
            }
            let n = f.take_into(&mut out[..round % 8]);
            for &v in &out[..n] {
                assert_eq!(v, next_out);
                next_out += 1;
            }
            assert_eq!(f.len() as u32, next_in - next_out);
        }
        while let Some(v) = f.pop_front() {
            assert_eq!(v, next_out);
            next_out += 1;
        }
        assert_eq!(next_out, next_in);
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn take_all_returns_only_queued_items() {
        let mut f = Fifo::default();
        for i in 0..5 {
            f.push(i);
        }
        assert_eq!(f.pop_front(), Some(0));
        assert_eq!(f.take_all(), vec![1, 2, 3, 4]);
        assert_eq!(f.len(), 0);
        assert_eq!(f.pop_front(), None);
    }
}
