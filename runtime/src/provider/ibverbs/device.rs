//! Devices and contexts: list, open, query device/port/GID (with GID types),
//! the default GID index, and asynchronous events.

use std::ffi::CStr;
use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::cq::{self, CompChannel, Cq};
use super::pd_mr::Pd;
use super::{errno_err, ret_err, GID_INDEX_ENV};
use crate::provider::{
    AsyncElement, AsyncEvent, AsyncEventKind, DeviceAttr, DeviceInfo, Gid, LinkLayer, Mtu,
    PortAttr, PortState, ProviderError, ProviderKind, Result,
};

/// The device list of libibverbs; freed on drop.
struct DeviceList {
    list: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    /// Fetches the list; no device (or no libibverbs) is `NoDevice`.
    fn get() -> Result<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the wrapper returns NULL with errno
        // EOPNOTSUPP when libibverbs.so.1 could not be loaded.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            let reason = match err.raw_os_error() {
                Some(libc::EOPNOTSUPP) => {
                    "libibverbs.so.1 could not be loaded (install rdma-core's libibverbs1)"
                        .to_string()
                }
                Some(libc::ENOSYS) => {
                    "the kernel has no RDMA support (ibv_get_device_list: ENOSYS)".to_string()
                }
                _ => format!("ibv_get_device_list failed: {err}"),
            };
            return Err(ProviderError::NoDevice { reason });
        }
        let list = DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        };
        if list.len == 0 {
            return Err(ProviderError::NoDevice {
                reason: "libibverbs lists no RDMA devices".to_string(),
            });
        }
        Ok(list)
    }

    fn device(&self, i: usize) -> *mut sys::ibv_device {
        debug_assert!(i < self.len);
        // SAFETY: `list` holds `len` valid entries (NULL-terminated array).
        unsafe { *self.list.add(i) }
    }

    fn name(&self, i: usize) -> String {
        // SAFETY: the device pointer is valid while the list lives; the name is a
        // NUL-terminated string owned by the device.
        unsafe {
            let p = sys::ibv_get_device_name(self.device(i));
            if p.is_null() {
                return String::new();
            }
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }

    fn guid(&self, i: usize) -> u64 {
        // SAFETY: valid device pointer while the list lives.
        u64::from_be(unsafe { sys::ibv_get_device_guid(self.device(i)) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from ibv_get_device_list and is freed once. Opened
        // contexts hold their own reference to their device.
        unsafe { sys::ibv_free_device_list(self.list) }
    }
}

/// Lists the RDMA devices libibverbs knows.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok((0..list.len)
        .map(|i| DeviceInfo {
            name: list.name(i),
            kind: ProviderKind::Ibverbs,
            guid: list.guid(i),
        })
        .collect())
}

/// Type of a GID table entry (`ibv_gid_type`, sysfs `gid_attrs/types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GidType {
    /// InfiniBand GID.
    Ib,
    /// RoCE v1 (Ethernet, GRH in an Ethernet frame).
    RoceV1,
    /// RoCE v2 (UDP/IP encapsulation, routable).
    RoceV2,
    /// Could not be determined.
    Unknown,
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidType::Ib => "IB",
            GidType::RoceV1 => "RoCE v1",
            GidType::RoceV2 => "RoCE v2",
            GidType::Unknown => "unknown",
        })
    }
}

/// One non-empty GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's GID table.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
}

/// True for `::ffff:a.b.c.d` (an IPv4-mapped IPv6 address).
fn is_ipv4_mapped(gid: &Gid) -> bool {
    gid.0[..10] == [0; 10] && gid.0[10] == 0xff && gid.0[11] == 0xff
}

/// True for `fe80::/10`.
fn is_link_local(gid: &Gid) -> bool {
    gid.0[0] == 0xfe && gid.0[1] & 0xc0 == 0x80
}

/// Rank of a GID for the automatic choice on Ethernet ports (lower is better):
/// RoCE v2 IPv4-mapped, RoCE v2 routable, RoCE v2, RoCE v1 IPv4-mapped, anything.
fn roce_rank(e: &GidEntry) -> u8 {
    match (e.gid_type, is_ipv4_mapped(&e.gid), is_link_local(&e.gid)) {
        (GidType::RoceV2, true, _) => 0,
        (GidType::RoceV2, false, false) => 1,
        (GidType::RoceV2, _, _) => 2,
        (_, true, _) => 3,
        _ => 4,
    }
}

/// Picks the default GID index from a port's table.
fn choose_gid_index(link_layer: LinkLayer, table: &[GidEntry]) -> Option<u32> {
    if link_layer == LinkLayer::InfiniBand {
        return table.first().map(|e| e.index);
    }
    table
        .iter()
        .min_by_key(|e| (roce_rank(e), e.index))
        .map(|e| e.index)
}

pub(crate) struct ContextInner {
    pub(crate) ctx: *mut sys::ibv_context,
    name: String,
    guid: u64,
    attr: DeviceAttr,
    next_cq_handle: AtomicU32,
}

// SAFETY: an ibv_context may be used from any thread (libibverbs verbs are
// thread-safe); the other fields are immutable or atomic.
unsafe impl Send for ContextInner {}
// SAFETY: as above, shared use from several threads is allowed by libibverbs.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child object holds a Context clone, so none is left when
        // the last one drops; the context is closed exactly once.
        let ret = unsafe { sys::ibv_close_device(self.ctx) };
        if ret != 0 {
            tracing::warn!(device = %self.name, error = %ret_err("ibv_close_device", ret), "closing device");
        }
    }
}

/// An opened libibverbs device.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ibverbs::Context")
            .field("name", &self.inner.name)
            .finish()
    }
}

pub(crate) fn set_nonblocking(fd: RawFd, what: &'static str) -> Result<()> {
    // SAFETY: fcntl on an fd we own through the verbs object; no memory involved.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(ProviderError::Io {
            context: what,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

impl Context {
    /// Opens the device called `name` (e.g. `mlx5_0`, `rxe0`).
    pub fn open(name: &str) -> Result<Context> {
        let list = DeviceList::get()?;
        let index = (0..list.len)
            .find(|&i| list.name(i) == name)
            .ok_or_else(|| {
                let names: Vec<String> = (0..list.len).map(|i| list.name(i).to_string()).collect();
                crate::provider::select::device_not_found(name, &names)
            })?;
        let guid = list.guid(index);
        // SAFETY: a valid device pointer from the live list.
        let ctx = unsafe { sys::ibv_open_device(list.device(index)) };
        if ctx.is_null() {
            return Err(errno_err("ibv_open_device"));
        }
        drop(list);
        let mut inner = ContextInner {
            ctx,
            name: name.to_string(),
            guid,
            attr: empty_device_attr(),
            next_cq_handle: AtomicU32::new(1),
        };
        // Closes the context on the error paths below (inner drops).
        inner.attr = query_device_raw(ctx)?;
        // SAFETY: ctx is a valid open context.
        let async_fd = unsafe { (*ctx).async_fd };
        set_nonblocking(async_fd, "setting the async event fd non-blocking")?;
        tracing::debug!(device = name, "opened ibverbs device");
        Ok(Context {
            inner: Arc::new(inner),
        })
    }

    pub(crate) fn raw(&self) -> *mut sys::ibv_context {
        self.inner.ctx
    }

    pub(crate) fn next_cq_handle(&self) -> u32 {
        self.inner.next_cq_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Node GUID as listed by `ibv_get_device_guid`.
    pub fn guid(&self) -> u64 {
        self.inner.guid
    }

    /// Transport as `ibv_devinfo` prints it, e.g. `"InfiniBand (0)"`.
    pub fn transport(&self) -> &'static str {
        // SAFETY: ctx->device is valid while the context is open.
        let t = unsafe { (*(*self.inner.ctx).device).transport_type };
        match t {
            sys::ibv_transport_type::IBV_TRANSPORT_IB => "InfiniBand (0)",
            sys::ibv_transport_type::IBV_TRANSPORT_IWARP => "iWARP (1)",
            sys::ibv_transport_type::IBV_TRANSPORT_USNIC => "usNIC (2)",
            sys::ibv_transport_type::IBV_TRANSPORT_USNIC_UDP => "usNIC UDP (3)",
            sys::ibv_transport_type::IBV_TRANSPORT_UNSPECIFIED => "unspecified (4)",
            _ => "invalid transport",
        }
    }

    /// Attributes cached when the device was opened (limits used to clamp QP attributes).
    pub(crate) fn cached_attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> Result<DeviceAttr> {
        query_device_raw(self.inner.ctx)
    }

    /// Port attributes (`ibv_query_port`), `port` is 1-based.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let raw = self.query_port_raw(port)?;
        Ok(PortAttr {
            state: match raw.state {
                1 => PortState::Down,
                2 => PortState::Init,
                3 => PortState::Armed,
                4 => PortState::Active,
                5 => PortState::ActiveDefer,
                _ => PortState::Nop,
            },
            max_mtu: Mtu::from_raw(raw.max_mtu as u8).unwrap_or(Mtu::Mtu256),
            active_mtu: Mtu::from_raw(raw.active_mtu as u8).unwrap_or(Mtu::Mtu256),
            lid: raw.lid,
            gid_tbl_len: u32::try_from(raw.gid_tbl_len).unwrap_or(0),
            link_layer: match raw.link_layer {
                sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
        })
    }

    fn query_port_raw(&self, port: u8) -> Result<sys::ibv_port_attr> {
        let mut raw = MaybeUninit::<sys::ibv_port_attr>::zeroed();
        // SAFETY: valid context; `raw` is a zeroed ibv_port_attr (all-integer
        // struct, zero is valid) the wrapper fills with its own size.
        let ret = unsafe { sys::ibv_query_port(self.inner.ctx, port, raw.as_mut_ptr()) };
        if ret != 0 {
            return Err(ret_err("ibv_query_port", ret));
        }
        // SAFETY: zero-initialised integers, filled by the call.
        Ok(unsafe { raw.assume_init() })
    }

    /// One GID table entry (`ibv_query_gid`).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let index_c = libc::c_int::try_from(index).map_err(|_| ProviderError::InvalidArgument {
            call: "query_gid",
            what: format!("GID index {index} out of range"),
        })?;
        let mut gid = sys::ibv_gid { raw: [0; 16] };
        // SAFETY: valid context and out-pointer.
        let ret = unsafe { sys::ibv_query_gid(self.inner.ctx, port, index_c, &mut gid) };
        if ret != 0 {
            return Err(ret_err("ibv_query_gid", ret));
        }
        // SAFETY: every bit pattern is a valid [u8; 16].
        Ok(Gid(unsafe { gid.raw }))
    }

    /// The type of GID `index` on `port`: from sysfs
    /// (`/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<index>`),
    /// else `ibv_query_gid_ex`, else guessed from the link layer.
    pub fn gid_type(&self, port: u8, index: u32) -> Result<GidType> {
        let link_layer = self.query_port(port)?.link_layer;
        let path = format!(
            "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}",
            self.inner.name
        );
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Some(t) = parse_sysfs_gid_type(&text, link_layer) {
                return Ok(t);
            }
        }
        let mut entry = MaybeUninit::<sys::ibv_gid_entry>::zeroed();
        // SAFETY: valid context; zeroed plain-data out struct.
        let ret = unsafe {
            sys::ibv_query_gid_ex(
                self.inner.ctx,
                u32::from(port),
                index,
                entry.as_mut_ptr(),
                0,
            )
        };
        if ret == 0 {
            // SAFETY: filled by the call (plain integers and bytes).
            let entry = unsafe { entry.assume_init() };
            return Ok(match entry.gid_type {
                0 => GidType::Ib,
                1 => GidType::RoceV1,
                2 => GidType::RoceV2,
                _ => GidType::Unknown,
            });
        }
        Ok(match link_layer {
            LinkLayer::InfiniBand => GidType::Ib,
            _ => GidType::Unknown,
        })
    }

    /// The non-zero entries of `port`'s GID table, with their types: one
    /// `ibv_query_gid_table` call where supported, else entry by entry
    /// (`ibv_query_gid` + [`Context::gid_type`]).
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let attr = self.query_port(port)?;
        if let Some(table) = self.gid_table_ex(port, attr.link_layer) {
            return Ok(table);
        }
        let mut out = Vec::new();
        for index in 0..attr.gid_tbl_len {
            let gid = match self.query_gid(port, index) {
                Ok(g) => g,
                // Unpopulated RoCE entries fail with EINVAL/ENODATA: skip them.
                Err(_) => continue,
            };
            if gid.is_zero() {
                continue;
            }
            out.push(GidEntry {
                index,
                gid,
                gid_type: self.gid_type(port, index)?,
            });
        }
        Ok(out)
    }

    /// The whole table in one `ibv_query_gid_table` call (rdma-core >= 32).
    fn gid_table_ex(&self, port: u8, link_layer: LinkLayer) -> Option<Vec<GidEntry>> {
        let mut total = 0usize;
        for p in 1..=self.inner.attr.phys_port_cnt {
            total += self.query_port(p).ok()?.gid_tbl_len as usize;
        }
        if total == 0 {
            return Some(Vec::new());
        }
        let mut raw: Vec<sys::ibv_gid_entry> = Vec::with_capacity(total);
        // SAFETY: valid context; room for `total` entries (the sum of every
        // port's table length), of which the call initialises the first `n`.
        let n = unsafe { sys::ibv_query_gid_table(self.inner.ctx, raw.as_mut_ptr(), total, 0) };
        let n = usize::try_from(n).ok()?.min(total);
        // SAFETY: the first n entries were written (plain data).
        unsafe { raw.set_len(n) };
        let mut table: Vec<GidEntry> = raw
            .iter()
            .filter(|e| e.port_num == u32::from(port))
            .map(|e| GidEntry {
                index: e.gid_index,
                // SAFETY: any bytes are a valid [u8; 16].
                gid: Gid(unsafe { e.gid.raw }),
                gid_type: match (e.gid_type, link_layer) {
                    (0, LinkLayer::InfiniBand) => GidType::Ib,
                    (0 | 1, _) => GidType::RoceV1,
                    (2, _) => GidType::RoceV2,
                    _ => GidType::Unknown,
                },
            })
            .filter(|e| !e.gid.is_zero())
            .collect();
        table.sort_by_key(|e| e.index);
        Some(table)
    }

    /// The GID index to use on `port`: the value of the `VERBIO_GID_INDEX`
    /// environment variable if set, else 0 on InfiniBand, else (RoCE) the first
    /// RoCE v2 IPv4-mapped GID, then RoCE v2 routable, RoCE v2, RoCE v1 IPv4-mapped,
    /// then any non-zero entry.
    pub fn default_gid_index(&self, port: u8) -> Result<u8> {
        if let Ok(v) = std::env::var(GID_INDEX_ENV) {
            return v
                .trim()
                .parse::<u8>()
                .map_err(|_| ProviderError::InvalidArgument {
                    call: "default_gid_index",
                    what: format!("{GID_INDEX_ENV}={v:?} is not a GID index (0..=255)"),
                });
        }
        let link_layer = self.query_port(port)?.link_layer;
        let table: Vec<GidEntry> = self
            .gid_table(port)?
            .into_iter()
            .filter(|e| e.index <= u32::from(u8::MAX))
            .collect();
        let index =
            choose_gid_index(link_layer, &table).ok_or_else(|| ProviderError::InvalidArgument {
                call: "default_gid_index",
                what: format!("port {port} of {} has no GID", self.inner.name),
            })?;
        // Filtered to <= u8::MAX above.
        Ok(u8::try_from(index).unwrap_or(0))
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        Pd::alloc(self)
    }

    /// Creates a non-blocking completion channel.
    pub fn create_comp_channel(&self) -> Result<CompChannel> {
        CompChannel::create(self)
    }

    /// Creates a CQ of at least `cqe` entries, optionally bound to `channel`.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompChannel>) -> Result<Cq> {
        Cq::create(self, cqe, channel)
    }

    /// The async-event fd (set non-blocking at open).
    pub fn async_fd(&self) -> RawFd {
        // SAFETY: valid context; reading a plain field.
        unsafe { (*self.inner.ctx).async_fd }
    }

    /// Takes and acknowledges the next async event; `None` if none is pending.
    pub fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
        let mut ev = MaybeUninit::<sys::ibv_async_event>::uninit();
        // SAFETY: valid context and out-pointer; the fd is non-blocking, so this
        // fails with EAGAIN instead of blocking.
        let ret = unsafe { sys::ibv_get_async_event(self.inner.ctx, ev.as_mut_ptr()) };
        if ret != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(ProviderError::Verbs {
                call: "ibv_get_async_event",
                source: err,
            });
        }
        let p = ev.as_mut_ptr();
        // SAFETY: the call filled the event. The type is read as its C integer
        // (never as the Rust enum, so an unknown value is not UB), and the union
        // member read is the one the event type says is valid.
        let event = unsafe {
            let raw_type = ptr::addr_of!((*p).event_type).cast::<u32>().read();
            let element = ptr::addr_of!((*p).element);
            let kind = event_kind(raw_type);
            let element = match raw_type {
                0 => AsyncElement::Cq(cq::note_cq_error(ptr::addr_of!((*element).cq).read())),
                1..=7 | 16 => AsyncElement::Qp(qp_num_of(ptr::addr_of!((*element).qp).read())),
                14 | 15 => AsyncElement::Srq(srq_handle_of(ptr::addr_of!((*element).srq).read())),
                9..=13 | 17 | 18 | 20 => AsyncElement::Port(
                    u8::try_from(ptr::addr_of!((*element).port_num).read()).unwrap_or(0),
                ),
                _ => AsyncElement::Device,
            };
            sys::ibv_ack_async_event(p);
            AsyncEvent { kind, element }
        };
        tracing::debug!(device = %self.inner.name, ?event, "async event");
        Ok(Some(event))
    }
}

/// # Safety
///
/// `qp` must be NULL or a valid `ibv_qp`.
unsafe fn qp_num_of(qp: *mut sys::ibv_qp) -> u32 {
    if qp.is_null() {
        0
    } else {
        // SAFETY: valid per the contract.
        unsafe { (*qp).qp_num }
    }
}

/// # Safety
///
/// `srq` must be NULL or a valid `ibv_srq`.
unsafe fn srq_handle_of(srq: *mut sys::ibv_srq) -> u32 {
    if srq.is_null() {
        0
    } else {
        // SAFETY: valid per the contract.
        unsafe { (*srq).handle }
    }
}

fn event_kind(raw: u32) -> AsyncEventKind {
    use AsyncEventKind::*;
    match raw {
        0 => CqErr,
        1 => QpFatal,
        2 => QpReqErr,
        3 => QpAccessErr,
        4 => CommEst,
        5 => SqDrained,
        6 => PathMig,
        7 => PathMigErr,
        8 => DeviceFatal,
        9 => PortActive,
        10 => PortErr,
        11 => LidChange,
        12 => PkeyChange,
        13 => SmChange,
        14 => SrqErr,
        15 => SrqLimitReached,
        16 => QpLastWqeReached,
        17 => ClientReregister,
        18 => GidChange,
        other => Other(other),
    }
}

fn parse_sysfs_gid_type(text: &str, link_layer: LinkLayer) -> Option<GidType> {
    match text.trim() {
        "RoCE v2" => Some(GidType::RoceV2),
        "IB/RoCE v1" if link_layer == LinkLayer::InfiniBand => Some(GidType::Ib),
        "IB/RoCE v1" | "RoCE v1" => Some(GidType::RoceV1),
        "IB" => Some(GidType::Ib),
        _ => None,
    }
}

fn empty_device_attr() -> DeviceAttr {
    DeviceAttr {
        fw_ver: String::new(),
        node_guid: 0,
        vendor_id: 0,
        vendor_part_id: 0,
        hw_ver: 0,
        max_mr_size: 0,
        max_qp: 0,
        max_qp_wr: 0,
        max_sge: 0,
        max_cq: 0,
        max_cqe: 0,
        max_mr: 0,
        max_pd: 0,
        max_qp_rd_atom: 0,
        max_qp_init_rd_atom: 0,
        phys_port_cnt: 0,
    }
}

fn query_device_raw(ctx: *mut sys::ibv_context) -> Result<DeviceAttr> {
    let mut raw = MaybeUninit::<sys::ibv_device_attr>::zeroed();
    // SAFETY: valid context; zeroed plain-data out struct (the only enum-typed
    // field is a C integer alias).
    let ret = unsafe { sys::ibv_query_device(ctx, raw.as_mut_ptr()) };
    if ret != 0 {
        return Err(ret_err("ibv_query_device", ret));
    }
    // SAFETY: filled by the call; all fields are integers.
    let raw = unsafe { raw.assume_init() };
    let fw: Vec<u8> = raw
        .fw_ver
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let u = |v: libc::c_int| u32::try_from(v).unwrap_or(0);
    Ok(DeviceAttr {
        fw_ver: String::from_utf8_lossy(&fw).into_owned(),
        node_guid: u64::from_be(raw.node_guid),
        vendor_id: raw.vendor_id,
        vendor_part_id: raw.vendor_part_id,
        hw_ver: raw.hw_ver,
        max_mr_size: raw.max_mr_size,
        max_qp: u(raw.max_qp),
        max_qp_wr: u(raw.max_qp_wr),
        max_sge: u(raw.max_sge),
        max_cq: u(raw.max_cq),
        max_cqe: u(raw.max_cqe),
        max_mr: u(raw.max_mr),
        max_pd: u(raw.max_pd),
        max_qp_rd_atom: u(raw.max_qp_rd_atom),
        max_qp_init_rd_atom: u(raw.max_qp_init_rd_atom),
        phys_port_cnt: raw.phys_port_cnt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid_type: GidType, bytes: [u8; 16]) -> GidEntry {
        GidEntry {
            index,
            gid: Gid(bytes),
            gid_type,
        }
    }

    #[test]
    fn prefers_roce_v2_ipv4_mapped() {
        let ll = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1];
        let table = [
            entry(0, GidType::RoceV1, ll),
            entry(1, GidType::RoceV2, ll),
            entry(2, GidType::RoceV1, v4),
            entry(3, GidType::RoceV2, v4),
        ];
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &table), Some(3));
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &table[..3]), Some(1));
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &table[..1]), Some(0));
        assert_eq!(choose_gid_index(LinkLayer::InfiniBand, &table), Some(0));
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &[]), None);
    }

    #[test]
    fn parses_sysfs_gid_types() {
        assert_eq!(
            parse_sysfs_gid_type("RoCE v2\n", LinkLayer::Ethernet),
            Some(GidType::RoceV2)
        );
        assert_eq!(
            parse_sysfs_gid_type("IB/RoCE v1\n", LinkLayer::Ethernet),
            Some(GidType::RoceV1)
        );
        assert_eq!(
            parse_sysfs_gid_type("IB/RoCE v1\n", LinkLayer::InfiniBand),
            Some(GidType::Ib)
        );
        assert_eq!(parse_sysfs_gid_type("", LinkLayer::Ethernet), None);
    }
}
