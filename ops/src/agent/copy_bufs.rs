//! The vectors a connection copies staged messages out of its staging ring
//! into (`staging.rs`), kept for the next ones once the application drops
//! a message it received (`RecvMsg`). A fresh vector per message cost a
//! page fault and a zeroed page per 4 KiB for a good part of the messages
//! of a stream (the allocator gives the pages of a freed vector at the top
//! of its heap back to the kernel): 0.84 faults per 16 KiB message and 9.6
//! per 64 KiB one in a `send_bw` window (verbs: none). A message taken as
//! a `Vec` (`RecvMsg::into_vec`, `Rdma::receive`) leaves for good.
//!
//! Bounds: at most [`KEPT`] vectors, together at most half the
//! connection's staging ring (a burst of 64 messages of 16 KiB is a
//! quarter of the default 4 MiB ring); freed with the connection (a
//! message dropped after that frees its vector).

use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// Vectors kept at most: a receiver takes a burst of messages (up to the
/// peer's credits, 64 by default) into its inbox before the application
/// drops the first.
pub(crate) const KEPT: usize = 64;

/// A connection's spare copy-out vectors.
#[derive(Debug)]
pub(crate) struct CopyBufs {
    free: RefCell<Vec<Vec<u8>>>,
    /// At most this many bytes of capacity kept.
    max_bytes: usize,
}

impl CopyBufs {
    /// Keeps at most `max_bytes` of capacity.
    pub(crate) fn new(max_bytes: usize) -> Rc<CopyBufs> {
        Rc::new(CopyBufs {
            free: RefCell::new(Vec::new()),
            max_bytes,
        })
    }

    /// An empty vector with room for `len` bytes: a kept one (the smallest
    /// with room for it and at most twice its size, so a small message does
    /// not take a large vector) or a new one.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut free = self.free.borrow_mut();
        let fits = |v: &Vec<u8>| v.capacity() >= len && v.capacity() / 2 <= len;
        // The latest kept first: a stream's messages are of one size.
        if free.last().is_some_and(fits) {
            if let Some(v) = free.pop() {
                return v;
            }
        }
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| fits(v))
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `v` (emptied) for a later message if the bounds allow, else
    /// frees it.
    pub(crate) fn give_back(&self, mut v: Vec<u8>) {
        let mut free = self.free.borrow_mut();
        let held: usize = free.iter().map(Vec::capacity).sum();
        if free.len() < KEPT && held.saturating_add(v.capacity()) <= self.max_bytes {
            v.clear();
            free.push(v);
        }
    }

    /// Vectors kept now (tests).
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.free.borrow().len()
    }
}

/// A message copied into a vector of a connection's [`CopyBufs`]: dropped,
/// the vector goes back there (if the connection is still there).
#[derive(Debug)]
pub(crate) struct Copied {
    bytes: Vec<u8>,
    home: Weak<CopyBufs>,
}

impl Copied {
    /// The message `bytes`, in a vector of `home`'s.
    pub(crate) fn new(bytes: Vec<u8>, home: &Rc<CopyBufs>) -> Copied {
        Copied {
            bytes,
            home: Rc::downgrade(home),
        }
    }

    /// The message `bytes` in a vector of no connection's (freed when
    /// dropped).
    pub(crate) fn detached(bytes: Vec<u8>) -> Copied {
        Copied {
            bytes,
            home: Weak::new(),
        }
    }

    /// The message's bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The vector itself (not kept).
    pub(crate) fn into_vec(mut self) -> Vec<u8> {
        std::mem::take(&mut self.bytes)
    }
}

impl Drop for Copied {
    fn drop(&mut self) {
        if self.bytes.capacity() == 0 {
            return;
        }
        if let Some(home) = self.home.upgrade() {
            home.give_back(std::mem::take(&mut self.bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Copied, CopyBufs, KEPT};

    #[test]
    fn a_dropped_message_s_vector_is_taken_again() {
        let bufs = CopyBufs::new(1 << 20);
        let mut v = bufs.take(16384);
        v.extend_from_slice(&[7; 16384]);
        let at = v.as_ptr();
        drop(Copied::new(v, &bufs));
        assert_eq!(bufs.kept(), 1);
        let again = bufs.take(10000);
        assert_eq!(again.as_ptr(), at, "the kept vector, not a new one");
        assert!(again.is_empty());
        assert_eq!(bufs.kept(), 0);
    }

    #[test]
    fn a_small_message_takes_no_large_vector() {
        let bufs = CopyBufs::new(1 << 20);
        bufs.give_back(Vec::with_capacity(65536));
        assert!(bufs.take(4000).capacity() < 65536);
        assert_eq!(bufs.kept(), 1);
    }

    #[test]
    fn keeps_within_its_bounds() {
        let bufs = CopyBufs::new(1 << 30);
        for _ in 0..KEPT + 2 {
            bufs.give_back(Vec::with_capacity(20_000));
        }
        assert_eq!(bufs.kept(), KEPT, "at most KEPT vectors");
        let bufs = CopyBufs::new(50_000);
        for _ in 0..3 {
            bufs.give_back(Vec::with_capacity(20_000));
        }
        assert_eq!(bufs.kept(), 2, "at most max_bytes of capacity");
    }

    #[test]
    fn a_vector_taken_as_a_vec_leaves() {
        let bufs = CopyBufs::new(1 << 20);
        let m = Copied::new(vec![1, 2, 3], &bufs);
        assert_eq!(m.into_vec(), vec![1, 2, 3]);
        assert_eq!(bufs.kept(), 0);
        let m = Copied::new(vec![1, 2, 3], &bufs);
        drop(bufs);
        drop(m); // its connection is gone: freed
    }
}
