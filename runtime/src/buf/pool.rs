//! [`MrPool`]: registered chunks carved into power-of-two size classes.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::rc::Rc;

use super::error::BufError;
use super::local_buf::LocalBuf;
use super::registrar::{RegisteredRaw, Registrar};
use super::size_class::SizeClasses;
use crate::provider::{AccessFlags, Pd};

/// Access flags of every pool registration: the device may write locally
/// (RECV, READ results). No remote flag: a peer must never reach pool memory
/// through a (guessed) rkey, because [`LocalBuf`] hands out plain slices. Grant
/// peers memory through [`RemoteAccessRegion`](super::RemoteAccessRegion).
pub(crate) const POOL_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE;

/// Shape of a pool's size classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Smallest block in bytes (a power of two, at least 8). Default 64.
    pub min_block: usize,
    /// Largest pooled block in bytes (a power of two, at most 1 GiB); larger
    /// requests get a dedicated registration each. Default 1 MiB.
    pub max_block: usize,
    /// Largest chunk registered at once when a class runs dry. Default
    /// 512 KiB. A class's first chunk is one page (one block for blocks of
    /// a page or more) and each later one as large as all before it, up
    /// to this (and at least `min_blocks_per_chunk` blocks): a pool used
    /// for a few small buffers registers a few KiB, not a full chunk per
    /// class.
    pub chunk_bytes: usize,
    /// Fewest blocks in a full chunk, for classes bigger than
    /// `chunk_bytes`. Default 4.
    pub min_blocks_per_chunk: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            min_block: 64,
            max_block: 1 << 20,
            chunk_bytes: 512 << 10,
            min_blocks_per_chunk: 4,
        }
    }
}

impl PoolConfig {
    fn classes(&self) -> Result<SizeClasses, BufError> {
        let bad = |reason| BufError::InvalidConfig { reason };
        if !self.min_block.is_power_of_two() || self.min_block < 8 {
            return Err(bad("min_block must be a power of two >= 8"));
        }
        if !self.max_block.is_power_of_two() || self.max_block > 1 << 30 {
            return Err(bad("max_block must be a power of two <= 1 GiB"));
        }
        if self.min_block > self.max_block {
            return Err(bad("min_block must not exceed max_block"));
        }
        if self.chunk_bytes > 1 << 32 || self.min_blocks_per_chunk > 1 << 16 {
            return Err(bad(
                "chunk_bytes must be <= 4 GiB and min_blocks_per_chunk <= 65536",
            ));
        }
        Ok(SizeClasses::new(
            self.min_block.trailing_zeros(),
            self.max_block.trailing_zeros(),
            self.chunk_bytes,
            self.min_blocks_per_chunk,
        ))
    }
}

/// Counters of a pool, for tests and monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Chunks registered for the size classes.
    pub chunks: usize,
    /// Bytes in those chunks.
    pub chunk_bytes: usize,
    /// Pooled blocks currently free.
    pub free_blocks: usize,
    /// Pooled blocks currently held by [`LocalBuf`]s.
    pub blocks_in_use: usize,
    /// Dedicated (oversize) buffers currently alive.
    pub dedicated_in_use: usize,
    /// Registrations made so far (chunks plus dedicated buffers).
    pub registrations: u64,
}

/// A free pooled block.
#[derive(Clone, Copy)]
pub(crate) struct FreeBlock {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) lkey: u32,
}

pub(crate) struct PoolInner {
    registrar: Box<dyn Registrar>,
    pub(crate) classes: SizeClasses,
    /// One LIFO free list per class.
    /// # Invariant
    /// `free[k].capacity()` is at least the number of blocks ever carved for
    /// class `k`, so pushing a returned block never reallocates.
    free: Vec<Vec<FreeBlock>>,
    /// Blocks carved so far, per class.
    carved: Vec<usize>,
    /// Registered chunks; live until the pool and every buffer are gone.
    chunks: Vec<RegisteredRaw>,
    /// The registrations of the live dedicated buffers, by address (a
    /// [`LocalBuf`] keeps only its address: dedicated buffers are rare, and
    /// every op moves its buffer several times).
    dedicated: HashMap<usize, RegisteredRaw>,
    stats: PoolStats,
}

impl PoolInner {
    /// Takes a block of `class`, carving a new chunk if the class is empty.
    fn take(&mut self, class: usize) -> Result<FreeBlock, BufError> {
        if self.free[class].is_empty() {
            self.carve(class)?;
        }
        let block = self.free[class].pop().ok_or(BufError::Alloc {
            what: "MrPool::alloc",
            len: self.classes.block_size(class),
        })?;
        self.stats.free_blocks -= 1;
        self.stats.blocks_in_use += 1;
        Ok(block)
    }

    /// Registers one chunk for `class` and puts its blocks on the free list.
    fn carve(&mut self, class: usize) -> Result<(), BufError> {
        let block = self.classes.block_size(class);
        let size = self.classes.next_chunk_size(class, self.carved[class]);
        let chunk = RegisteredRaw::new("MrPool chunk", &*self.registrar, size, POOL_ACCESS)?;
        let n = size / block;
        let base = chunk.mem.ptr();
        let lkey = chunk.reg.lkey;
        self.chunks.push(chunk);
        self.stats.chunks += 1;
        self.stats.chunk_bytes += size;
        self.stats.registrations += 1;
        self.stats.free_blocks += n;
        self.carved[class] += n;
        let list = &mut self.free[class];
        // Capacity for every block of the class, so frees never reallocate.
        list.reserve(self.carved[class].saturating_sub(list.len()));
        // Highest address first, so blocks are handed out in address order.
        for i in (0..n).rev() {
            // SAFETY: `i * block < size`: the pointer stays inside the chunk.
            let ptr = unsafe { base.add(i * block) };
            list.push(FreeBlock { ptr, lkey });
        }
        tracing::debug!(class, block, size, "MrPool registered a chunk");
        Ok(())
    }

    /// Returns a block to its free list (from `LocalBuf::drop`). No allocation:
    /// the list's capacity covers every block of the class.
    pub(crate) fn give_back(&mut self, class: usize, block: FreeBlock) {
        if let Some(list) = self.free.get_mut(class) {
            list.push(block);
            self.stats.free_blocks += 1;
            self.stats.blocks_in_use -= 1;
        }
    }

    /// A dedicated buffer at `ptr` was dropped: its registration, to be
    /// dropped (deregistered, then freed) once the pool's borrow is released.
    pub(crate) fn dedicated_dropped(&mut self, ptr: NonNull<u8>) -> Option<RegisteredRaw> {
        let raw = self.dedicated.remove(&(ptr.as_ptr() as usize));
        if raw.is_some() {
            self.stats.dedicated_in_use -= 1;
        }
        raw
    }
}

/// A per-thread pool of registered memory. Cheap to clone (a reference count);
/// `!Send`: use one pool per reactor thread.
///
/// Requests up to `max_block` bytes are rounded up to a power-of-two block
/// carved from a chunk registered once (`LOCAL_WRITE` only); freed blocks go
/// back to a LIFO free list, so after warm-up (or [`MrPool::reserve`]) neither
/// `alloc` nor dropping a [`LocalBuf`] allocates or calls the device. Larger
/// requests get a dedicated allocation and registration, released on drop.
/// Chunks stay registered until the pool and all its buffers are dropped.
///
/// # Example
///
/// ```
/// # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use verbio::provider::{Context, SoftConfig};
/// use verbio::runtime::buf::MrPool;
/// use verbio::runtime::{Device, Runtime};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let _rt = Runtime::new()?;
/// let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
/// let pool = MrPool::new(dev.pd());
///
/// let mut buf = pool.alloc(100)?; // empty, room for at least 100 bytes
/// buf.extend_from_slice(b"hello")?;
/// assert_eq!((&buf[..], buf.capacity()), (&b"hello"[..], 128)); // the 128 B class
/// let copy = pool.alloc_from(b"a copy")?; // allocated and filled
/// assert_eq!(&copy[..], b"a copy");
///
/// // Freed blocks go back to the pool: no registration the second time.
/// drop((buf, copy));
/// let registrations = pool.stats().registrations;
/// let again = pool.alloc(100)?;
/// assert_eq!(pool.stats().registrations, registrations);
/// # drop(again);
/// # Ok(())
/// # }
/// ```
///
/// Buffers are moved into the verbs and handed back with their result
/// (`let (res, buf) = qp.send(buf).await`): the device may touch them
/// until the completion.
#[derive(Clone)]
pub struct MrPool {
    inner: Rc<RefCell<PoolInner>>,
}

impl std::fmt::Debug for MrPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrPool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl MrPool {
    /// A pool with the default classes (64 B to 1 MiB) registering with `pd`.
    pub fn new(pd: &Pd) -> MrPool {
        Self::from_registrar(Box::new(pd.clone()), PoolConfig::default())
            .unwrap_or_else(|_| unreachable!("the default configuration is valid"))
    }

    /// A pool with custom size classes; fails if `config` is inconsistent.
    pub fn with_config(pd: &Pd, config: PoolConfig) -> Result<MrPool, BufError> {
        Self::from_registrar(Box::new(pd.clone()), config)
    }

    pub(crate) fn from_registrar(
        registrar: Box<dyn Registrar>,
        config: PoolConfig,
    ) -> Result<MrPool, BufError> {
        let classes = config.classes()?;
        Ok(MrPool {
            inner: Rc::new(RefCell::new(PoolInner {
                registrar,
                classes,
                free: (0..classes.count()).map(|_| Vec::new()).collect(),
                carved: vec![0; classes.count()],
                chunks: Vec::new(),
                dedicated: HashMap::new(),
                stats: PoolStats::default(),
            })),
        })
    }

    /// True if `buf` came from this pool (so its key is valid on the QPs
    /// of this pool's protection domain).
    pub fn owns(&self, buf: &LocalBuf) -> bool {
        Rc::ptr_eq(&self.inner, buf.pool_inner())
    }

    /// An empty buffer (`len() == 0`) with room for at least `capacity` bytes.
    pub fn alloc(&self, capacity: usize) -> Result<LocalBuf, BufError> {
        let mut inner = self.inner.borrow_mut();
        match inner.classes.class_of(capacity) {
            Some(class) => {
                let block = inner.take(class)?;
                let cap = inner.classes.block_size(class);
                drop(inner);
                Ok(LocalBuf::pooled(self.inner.clone(), block, cap, class))
            }
            None => {
                // A buffer's length is a `u32`, as an SGE's.
                let Ok(cap) = u32::try_from(capacity) else {
                    return Err(BufError::TooLarge {
                        what: "MrPool::alloc",
                        len: capacity,
                        max: u32::MAX as usize,
                    });
                };
                let raw = RegisteredRaw::new(
                    "MrPool dedicated buffer",
                    &*inner.registrar,
                    capacity,
                    POOL_ACCESS,
                )?;
                let block = FreeBlock {
                    ptr: raw.mem.ptr(),
                    lkey: raw.reg.lkey,
                };
                inner.dedicated.insert(block.ptr.as_ptr() as usize, raw);
                inner.stats.registrations += 1;
                inner.stats.dedicated_in_use += 1;
                drop(inner);
                Ok(LocalBuf::dedicated(self.inner.clone(), block, cap))
            }
        }
    }

    /// A buffer of `len` zero bytes.
    pub fn alloc_zeroed(&self, len: usize) -> Result<LocalBuf, BufError> {
        let mut buf = self.alloc(len)?;
        buf.resize(len, 0)?;
        Ok(buf)
    }

    /// A buffer holding a copy of `data`.
    pub fn alloc_from(&self, data: &[u8]) -> Result<LocalBuf, BufError> {
        let mut buf = self.alloc(data.len())?;
        buf.extend_from_slice(data)?;
        Ok(buf)
    }

    /// Makes sure at least `count` blocks for requests of `len` bytes are free,
    /// registering chunks now rather than on the hot path. Fails for sizes
    /// above the largest class (those are never pooled).
    pub fn reserve(&self, len: usize, count: usize) -> Result<(), BufError> {
        let mut inner = self.inner.borrow_mut();
        let class = inner.classes.class_of(len).ok_or(BufError::TooLarge {
            what: "MrPool::reserve",
            len,
            max: inner.classes.max_block(),
        })?;
        while inner.free[class].len() < count {
            inner.carve(class)?;
        }
        Ok(())
    }

    /// Largest request served from the size classes.
    pub fn max_pooled_size(&self) -> usize {
        self.inner.borrow().classes.max_block()
    }

    #[cfg(test)]
    fn free_list_capacity(&self, len: usize) -> usize {
        let inner = self.inner.borrow();
        inner
            .classes
            .class_of(len)
            .map_or(0, |k| inner.free[k].capacity())
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        self.inner.borrow().stats
    }
}

#[cfg(test)]
mod tests {
    use super::super::io_buf::{IoBuf, RegisteredBuf};
    use super::super::registrar::fake::FakeRegistrar;
    use super::*;

    fn pool(config: PoolConfig) -> (MrPool, FakeRegistrar) {
        let reg = FakeRegistrar::default();
        (
            MrPool::from_registrar(Box::new(reg.clone()), config).unwrap(),
            reg,
        )
    }

    fn small() -> PoolConfig {
        PoolConfig {
            min_block: 64,
            max_block: 4096,
            chunk_bytes: 1024,
            min_blocks_per_chunk: 2,
        }
    }

    #[test]
    fn rejects_inconsistent_configs() {
        for bad in [
            PoolConfig {
                min_block: 48,
                ..small()
            },
            PoolConfig {
                min_block: 4,
                ..small()
            },
            PoolConfig {
                max_block: 3000,
                ..small()
            },
            PoolConfig {
                min_block: 8192,
                ..small()
            },
            PoolConfig {
                max_block: 1 << 31,
                ..small()
            },
        ] {
            let reg = FakeRegistrar::default();
            assert!(matches!(
                MrPool::from_registrar(Box::new(reg), bad),
                Err(BufError::InvalidConfig { .. })
            ));
        }
    }

    #[test]
    fn rounds_up_to_the_class_and_registers_local_only() {
        let (pool, reg) = pool(small());
        let b = pool.alloc(100).unwrap();
        assert_eq!(b.capacity(), 128);
        assert_eq!(b.len(), 0);
        assert_eq!(b.stable_ptr() as usize % 128, 0, "blocks are size-aligned");
        assert_eq!(reg.0.last_access.get(), Some(AccessFlags::LOCAL_WRITE));
        assert_eq!(b.lkey(), 0x1001);
        let s = pool.stats();
        assert_eq!(s.chunks, 1);
        assert_eq!(s.chunk_bytes, 1024);
        assert_eq!((s.blocks_in_use, s.free_blocks), (1, 7));
    }

    #[test]
    fn reuse_after_free_returns_the_same_address() {
        let (pool, reg) = pool(small());
        let a = pool.alloc(64).unwrap();
        let pa = a.stable_ptr();
        let b = pool.alloc(64).unwrap();
        assert_ne!(pa, b.stable_ptr());
        drop(a);
        let c = pool.alloc(50).unwrap();
        assert_eq!(
            c.stable_ptr(),
            pa,
            "LIFO free list hands back the freed block"
        );
        drop((b, c));
        assert_eq!(reg.0.registered.get(), 1);
        assert_eq!(pool.stats().blocks_in_use, 0);
    }

    #[test]
    fn exhausting_a_chunk_registers_another_and_drops_return_blocks() {
        let (pool, reg) = pool(small());
        let bufs: Vec<_> = (0..20).map(|_| pool.alloc(64).unwrap()).collect();
        // 16 blocks per 1 KiB chunk of 64 B blocks.
        assert_eq!(reg.0.registered.get(), 2);
        let mut addrs: Vec<_> = bufs.iter().map(|b| b.stable_ptr() as usize).collect();
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), 20, "no block is handed out twice");
        let cap = pool.free_list_capacity(64);
        assert!(cap >= 32, "room for every carved block");
        drop(bufs);
        assert_eq!(pool.free_list_capacity(64), cap, "frees did not reallocate");
        let s = pool.stats();
        assert_eq!((s.blocks_in_use, s.free_blocks), (0, 32));
        // Steady state: cycles of alloc/free never register again.
        for _ in 0..1000 {
            let v: Vec<_> = (0..20).map(|_| pool.alloc(64).unwrap()).collect();
            drop(v);
        }
        assert_eq!(reg.0.registered.get(), 2);
        assert_eq!(reg.0.live.get(), 2);
    }

    #[test]
    fn big_classes_grow_to_min_blocks_per_chunk() {
        let (pool, _reg) = pool(small());
        let b = pool.alloc(4096).unwrap();
        assert_eq!(b.capacity(), 4096);
        // One block first, then as many as before, up to full chunks of 2.
        assert_eq!(pool.stats().chunk_bytes, 4096);
        let more: Vec<_> = (0..3).map(|_| pool.alloc(4096).unwrap()).collect();
        let s = pool.stats();
        assert_eq!((s.chunks, s.chunk_bytes), (3, 4096 + 4096 + 8192));
        drop((b, more));
    }

    #[test]
    fn a_pool_used_for_a_few_small_buffers_registers_a_page() {
        let (pool, reg) = pool(PoolConfig::default());
        let bufs: Vec<_> = (0..10).map(|_| pool.alloc(200).unwrap()).collect();
        let s = pool.stats();
        assert_eq!((s.chunks, s.chunk_bytes), (1, 4096));
        drop(bufs);
        // A busy class doubles its chunks up to the configured size.
        let bufs: Vec<_> = (0..4096).map(|_| pool.alloc(200).unwrap()).collect();
        let s = pool.stats();
        assert!(s.chunks <= 9, "{s:?}");
        assert_eq!(s.chunk_bytes, 256 * 4096, "{s:?}");
        assert_eq!(reg.0.live.get(), s.chunks);
        drop(bufs);
    }

    #[test]
    fn oversize_buffers_get_a_dedicated_registration_released_on_drop() {
        let (pool, reg) = pool(small());
        let b = pool.alloc(10_000).unwrap();
        assert_eq!(b.capacity(), 10_000);
        assert_eq!(reg.0.live.get(), 1);
        assert_eq!(pool.stats().dedicated_in_use, 1);
        assert_eq!(pool.stats().chunks, 0);
        drop(b);
        assert_eq!(
            reg.0.live.get(),
            0,
            "dedicated registration dropped with the buffer"
        );
        assert_eq!(pool.stats().dedicated_in_use, 0);
    }

    #[test]
    fn two_dedicated_buffers_release_their_own_registrations() {
        let (pool, reg) = pool(small());
        let a = pool.alloc(10_000).unwrap();
        let b = pool.alloc(20_000).unwrap();
        let b_ptr = b.stable_ptr();
        assert_eq!(reg.0.live.get(), 2);
        drop(a);
        assert_eq!((reg.0.live.get(), pool.stats().dedicated_in_use), (1, 1));
        assert_eq!(b.stable_ptr(), b_ptr);
        assert_eq!(b.capacity(), 20_000);
        drop(b);
        assert_eq!((reg.0.live.get(), pool.stats().dedicated_in_use), (0, 0));
    }

    #[test]
    fn a_buffer_longer_than_an_sge_is_refused_before_allocating() {
        let (pool, reg) = pool(small());
        let too_long = u32::MAX as usize + 1;
        assert!(matches!(
            pool.alloc(too_long),
            Err(BufError::TooLarge { len, .. }) if len == too_long
        ));
        assert_eq!(reg.0.live.get(), 0);
        assert_eq!(pool.stats().registrations, 0);
    }

    #[test]
    fn registration_failure_is_an_error_not_a_panic() {
        let (pool, reg) = pool(small());
        reg.0.fail_next.set(true);
        assert!(matches!(
            pool.alloc(64),
            Err(BufError::Register {
                what: "MrPool chunk",
                ..
            })
        ));
        reg.0.fail_next.set(true);
        assert!(matches!(
            pool.alloc(1 << 20),
            Err(BufError::Register { .. })
        ));
        // It recovers.
        assert!(pool.alloc(64).is_ok());
        assert!(matches!(
            pool.alloc(usize::MAX - 10),
            Err(BufError::TooLarge { .. } | BufError::Alloc { .. })
        ));
    }

    #[test]
    fn reserve_registers_up_front() {
        let (pool, reg) = pool(small());
        pool.reserve(200, 10).unwrap();
        // 256 B blocks, 4 per 1 KiB chunk: 3 chunks for 10 blocks.
        assert_eq!(reg.0.registered.get(), 3);
        let v: Vec<_> = (0..10).map(|_| pool.alloc(256).unwrap()).collect();
        assert_eq!(reg.0.registered.get(), 3);
        drop(v);
        assert!(pool.reserve(5000, 1).is_err());
    }

    #[test]
    fn chunks_outlive_the_pool_handle_while_buffers_live() {
        let (pool, reg) = pool(small());
        let mut b = pool.alloc_from(b"still here").unwrap();
        drop(pool);
        assert_eq!(reg.0.live.get(), 1);
        b.extend_from_slice(b"!").unwrap();
        assert_eq!(&b[..], b"still here!");
        drop(b);
        assert_eq!(
            reg.0.live.get(),
            0,
            "last buffer drops the pool and deregisters"
        );
    }
}
