//! [`PoolBuilder`]: how many runtime threads, pinned to which CPUs, with
//! which device, and each runtime's settings.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::mailbox::mailbox;
use super::thread::{run, Start, ThreadRef, ThreadShared};
use super::{Pool, PoolError};
use crate::device::Device;
use crate::provider::{Context, ProviderError};
use crate::reactor::Builder;

/// Opens the device context of runtime thread `index`.
type OpenContext = dyn Fn(usize) -> Result<Context, ProviderError> + Send + Sync;

#[derive(Clone)]
enum DeviceSource {
    None,
    Shared(Context),
    PerThread(Arc<OpenContext>),
}

/// Configures a [`Pool`].
#[derive(Clone)]
pub struct PoolBuilder {
    threads: usize,
    pin: Option<Vec<usize>>,
    runtime: Builder,
    device: DeviceSource,
    queue_depth: usize,
    grace: Duration,
    name: String,
    reply_spin: Duration,
    /// Where the runtimes are hosted (`None`: threads of their own).
    #[cfg(feature = "tokio")]
    host: Option<tokio::runtime::Handle>,
}

impl std::fmt::Debug for PoolBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuilder")
            .field("threads", &self.threads)
            .field("pin", &self.pin)
            .field("runtime", &self.runtime)
            .field("queue_depth", &self.queue_depth)
            .field("grace", &self.grace)
            .field("reply_spin", &self.reply_spin)
            .finish_non_exhaustive()
    }
}

impl Default for PoolBuilder {
    fn default() -> Self {
        PoolBuilder {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            pin: None,
            runtime: Builder::default(),
            device: DeviceSource::None,
            queue_depth: 1024,
            grace: Duration::from_secs(1),
            name: "verbio-pool".into(),
            reply_spin: Duration::ZERO,
            #[cfg(feature = "tokio")]
            host: None,
        }
    }
}

impl PoolBuilder {
    /// Number of runtime threads (default: the CPUs available; at least 1).
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }

    /// Pins thread `i` to CPU `i` modulo the CPUs available.
    pub fn pin_threads(mut self) -> Self {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.pin = Some((0..n).collect());
        self
    }

    /// Pins thread `i` to `cpus[i % cpus.len()]`.
    pub fn pin_to_cpus(mut self, cpus: Vec<usize>) -> Self {
        self.pin = Some(cpus);
        self
    }

    /// Every thread's runtime settings (busy poll, batch sizes, drain
    /// timeout, ...).
    pub fn runtime(mut self, b: Builder) -> Self {
        self.runtime = b;
        self
    }

    /// One device context for every thread: each binds it to its runtime
    /// (its own PD, CQ and completion channel on the shared context).
    pub fn shared_device(mut self, ctx: Context) -> Self {
        self.device = DeviceSource::Shared(ctx);
        self
    }

    /// A device context per thread, opened on the thread by `open(index)`
    /// (e.g. a software device each, or the NIC nearest the thread's CPU).
    pub fn device_per_thread<F>(mut self, open: F) -> Self
    where
        F: Fn(usize) -> Result<Context, ProviderError> + Send + Sync + 'static,
    {
        self.device = DeviceSource::PerThread(Arc::new(open));
        self
    }

    /// Requests queued per thread before senders wait for room (default
    /// 1024; the queue is allocated once).
    pub fn queue_depth(mut self, n: usize) -> Self {
        self.queue_depth = n;
        self
    }

    /// How long a thread lets its tasks finish once the pool shuts down
    /// (default 1 s) before dropping them with its runtime.
    pub fn grace_period(mut self, d: Duration) -> Self {
        self.grace = d;
        self
    }

    /// How long a handle's reply future, polled before its reply is there,
    /// spins on the reply's slot before registering its waker and
    /// returning `Pending` (default zero: no spin). A tokio worker whose
    /// reply comes within the budget then never parks and is never woken
    /// (a few context switches per request saved) at the price of the
    /// worker's CPU for up to `d` per request that waits. Spins once per
    /// request (its first `Pending` poll).
    pub fn reply_spin(mut self, d: Duration) -> Self {
        self.reply_spin = d;
        self
    }

    /// Hosts the runtimes on the tokio runtime `tokio` instead of threads
    /// of their own: each is turned by a tokio task, on whichever worker
    /// polls it, waiting on its fd in tokio's reactor (feature `tokio`).
    /// A handle used from that runtime's tasks then never crosses to
    /// another thread: its request is served, and its answer woken, on
    /// the worker that polls (one sleep per echo for the worker, against
    /// three or four with runtime threads; `docs/tokio.md`).
    ///
    /// `tokio` needs its I/O and time drivers (`enable_all`). The pool's
    /// "threads" are then tokio tasks: [`Pool::threads`] and placement
    /// work as usual, a job's code runs on a tokio worker (it must not
    /// block it), pinning does not apply, and [`Pool::shutdown`] returns
    /// without waiting (each runtime ends on its own within the grace
    /// period, or when the tokio runtime shuts down).
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub fn host_on_tokio(mut self, tokio: tokio::runtime::Handle) -> Self {
        self.host = Some(tokio);
        self
    }

    /// The threads' name prefix (default `verbio-pool`; thread `i` is
    /// `<name>-<i>`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Starts the threads; returns once each has its runtime (and device)
    /// or with the first thread's failure (the others are shut down).
    pub fn build(self) -> Result<Pool, PoolError> {
        if self.threads == 0 {
            return Err(PoolError::Config {
                setting: "threads",
                reason: "a pool needs at least one thread",
            });
        }
        if self.pin.as_ref().is_some_and(Vec::is_empty) {
            return Err(PoolError::Config {
                setting: "pin_to_cpus",
                reason: "needs at least one CPU",
            });
        }
        let mut pool = Pool {
            threads: Vec::with_capacity(self.threads),
            next: AtomicUsize::new(0),
            joins: Mutex::new(Vec::with_capacity(self.threads)),
        };
        #[cfg(feature = "tokio")]
        if let Some(host) = self.host.clone() {
            return self.build_hosted(pool, host);
        }
        for index in 0..self.threads {
            let (tx, rx) = mailbox(self.queue_depth);
            let shared = Arc::new(ThreadShared::new(index, tx, self.reply_spin));
            let start = Start {
                shared: shared.clone(),
                jobs: rx,
                grace: self.grace,
            };
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            let cfg = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{index}", self.name))
                .spawn(move || match cfg.prepare(index) {
                    Ok((rt, device)) => {
                        let _ = ready_tx.send(Ok(()));
                        run(rt, device, start);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                });
            let join = match spawned {
                Ok(j) => j,
                Err(e) => {
                    return Err(PoolError::Start {
                        index,
                        stage: "spawning the thread",
                        source: Box::new(e),
                    })
                }
            };
            pool.joins
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .push(join);
            pool.threads.push(ThreadRef { shared });
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(PoolError::Start {
                        index,
                        stage: "setting up (the thread panicked)",
                        source: "no runtime".into(),
                    })
                }
            }
        }
        Ok(pool)
    }

    /// [`build`](Self::build) for [`host_on_tokio`](Self::host_on_tokio):
    /// each runtime (and device) is made here, then handed to its task.
    #[cfg(feature = "tokio")]
    fn build_hosted(self, mut pool: Pool, host: tokio::runtime::Handle) -> Result<Pool, PoolError> {
        use super::hosted::{prepare, HostedRuntime};
        // tokio panics (rather than fails) without its time driver.
        let timers = std::panic::catch_unwind(|| {
            let _in = host.enter();
            drop(tokio::time::sleep(Duration::ZERO));
        });
        if timers.is_err() {
            return Err(PoolError::Config {
                setting: "host_on_tokio",
                reason: "the tokio runtime needs its time driver (enable_all)",
            });
        }
        for index in 0..self.threads {
            let (tx, rx) = mailbox(self.queue_depth);
            let shared = Arc::new(ThreadShared::new(index, tx, self.reply_spin));
            let made = prepare(|| self.make_runtime(index))?;
            let task = {
                let _in = host.enter();
                HostedRuntime::start(made, shared.clone(), rx, self.grace)
            };
            let task = task.map_err(|e| PoolError::Start {
                index,
                stage: "registering the runtime's fd with tokio",
                source: Box::new(e),
            })?;
            drop(host.spawn(task));
            pool.threads.push(ThreadRef { shared });
        }
        Ok(pool)
    }

    /// On the new thread: pinning, the runtime, the device.
    fn prepare(
        &self,
        index: usize,
    ) -> Result<(crate::reactor::Runtime, Option<Device>), PoolError> {
        let fail = |stage, source: Box<dyn std::error::Error + Send + Sync>| PoolError::Start {
            index,
            stage,
            source,
        };
        if let Some(cpus) = &self.pin {
            pin_current_thread(cpus[index % cpus.len()])
                .map_err(|e| fail("pinning the thread to its CPU", Box::new(e)))?;
        }
        self.make_runtime(index)
    }

    /// The runtime and device of thread `index`, made on the calling thread.
    fn make_runtime(
        &self,
        index: usize,
    ) -> Result<(crate::reactor::Runtime, Option<Device>), PoolError> {
        let fail = |stage, source: Box<dyn std::error::Error + Send + Sync>| PoolError::Start {
            index,
            stage,
            source,
        };
        let rt = self
            .runtime
            .clone()
            .build()
            .map_err(|e| fail("building the runtime", Box::new(e)))?;
        let ctx = match &self.device {
            DeviceSource::None => None,
            DeviceSource::Shared(ctx) => Some(ctx.clone()),
            DeviceSource::PerThread(open) => {
                Some(open(index).map_err(|e| fail("opening the device", Box::new(e)))?)
            }
        };
        let device = match ctx {
            None => None,
            Some(ctx) => Some(
                Device::open(ctx)
                    .map_err(|e| fail("binding the device to the runtime", Box::new(e)))?,
            ),
        };
        Ok((rt, device))
    }
}

/// Pins the calling thread to `cpu`.
fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("CPU {cpu} is beyond CPU_SETSIZE"),
        ));
    }
    // SAFETY: a zeroed `cpu_set_t` is the empty set (what CPU_ZERO makes).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu < CPU_SETSIZE` (checked above), within the set.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid `cpu_set_t` of the size passed; pid 0 is
    // the calling thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
