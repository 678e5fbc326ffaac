//! The registered vectors a connection READs large messages into, kept
//! for the next ones once the application drops a message it received
//! (`RecvMsg`): a 16 MiB message READ into a fresh vector paid for its
//! registration and for a page fault and a zeroed page per 4 KiB, every
//! message (the allocator gives such a vector's pages back to the kernel
//! when it is freed). A message taken as a `Vec` (`RecvMsg::into_vec`,
//! `Rdma::receive`) is deregistered and leaves for good.
//!
//! Bounds: at most [`KEPT`] vectors, together at most the connection's
//! `max_unread_bytes` (what the peer could make it hold unread anyway);
//! freed with the connection (a message dropped after that frees its
//! vector).

use std::cell::RefCell;
use std::rc::{Rc, Weak};

use verbio_runtime::buf::{IoBuf, RegisteredMem};

use super::wire::MAX_SPLIT_IN_PROGRESS;

/// Vectors kept at most: as many as READs may be in flight at once (a
/// window of large messages keeps that many going).
pub(crate) const KEPT: usize = MAX_SPLIT_IN_PROGRESS;

/// A connection's spare READ targets.
#[derive(Debug)]
pub(crate) struct ReadBufs {
    free: RefCell<Vec<RegisteredMem<Vec<u8>>>>,
    /// At most this many bytes of capacity kept.
    max_bytes: u64,
}

impl ReadBufs {
    /// Keeps at most `max_bytes` (the connection's `max_unread_bytes`).
    pub(crate) fn new(max_bytes: u64) -> Rc<ReadBufs> {
        Rc::new(ReadBufs {
            free: RefCell::new(Vec::new()),
            max_bytes,
        })
    }

    /// A kept vector for a message of `len` bytes: the smallest with room
    /// for it and at most twice its size (a small message does not take a
    /// large vector).
    pub(crate) fn take(&self, len: usize) -> Option<RegisteredMem<Vec<u8>>> {
        let mut free = self.free.borrow_mut();
        let fits = |m: &RegisteredMem<Vec<u8>>| {
            let cap = m.bytes_total();
            cap >= len && cap / 2 <= len
        };
        let (i, _) = free
            .iter()
            .enumerate()
            .filter(|(_, m)| fits(m))
            .min_by_key(|(_, m)| m.bytes_total())?;
        Some(free.swap_remove(i))
    }

    /// Keeps `mem` for a later READ if the bounds allow, else frees it.
    pub(crate) fn give_back(&self, mem: RegisteredMem<Vec<u8>>) {
        let mut free = self.free.borrow_mut();
        let held: u64 = free.iter().map(|m| m.bytes_total() as u64).sum();
        if free.len() < KEPT && held + mem.bytes_total() as u64 <= self.max_bytes {
            free.push(mem);
        }
    }

    /// Vectors kept now (tests).
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.free.borrow().len()
    }
}

/// A large message READ into a registered vector: its first `len` bytes.
/// Dropped, the vector goes back to the connection's [`ReadBufs`] (if it
/// is still there).
#[derive(Debug)]
pub(crate) struct ReadInto {
    /// Always `Some` until dropped or taken.
    mem: Option<RegisteredMem<Vec<u8>>>,
    len: usize,
    home: Weak<ReadBufs>,
}

impl ReadInto {
    /// The message: the first `len` bytes of `mem` (which the READ wrote).
    pub(crate) fn new(mem: RegisteredMem<Vec<u8>>, len: usize, home: &Rc<ReadBufs>) -> ReadInto {
        ReadInto {
            mem: Some(mem),
            len,
            home: Rc::downgrade(home),
        }
    }

    /// The message's bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.mem {
            Some(m) => m.get(..self.len).unwrap_or_default(),
            None => &[],
        }
    }

    /// The message's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The vector itself, deregistered, cut to the message.
    pub(crate) fn into_vec(mut self) -> Vec<u8> {
        let mut v = self
            .mem
            .take()
            .map(RegisteredMem::into_inner)
            .unwrap_or_default();
        v.truncate(self.len);
        v
    }
}

impl Drop for ReadInto {
    fn drop(&mut self) {
        if let (Some(mem), Some(home)) = (self.mem.take(), self.home.upgrade()) {
            home.give_back(mem);
        }
    }
}

#[cfg(test)]
mod tests;
