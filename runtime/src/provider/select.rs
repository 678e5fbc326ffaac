//! Device selection: by name, by the `VERBIO_DEVICE` environment variable, or
//! automatically (the first ibverbs device with an active port, else the
//! software device). [`open_hardware_device`] never falls back.

use std::path::Path;

use super::{Context, ProviderError, Result, SoftConfig};

/// Environment variable naming the device [`open_device`] opens when no name is given.
pub const DEVICE_ENV: &str = "VERBIO_DEVICE";

/// Where the kernel lists this host's RDMA devices.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// True for names of the software device (`soft0`, `soft1`, ...).
fn is_soft_name(name: &str) -> bool {
    name.starts_with("soft")
}

/// Opens a device.
///
/// - `Some(name)`: that device (a blank name counts as `None`); names
///   starting with `soft` open a software device of that name, anything
///   else an ibverbs device
///   ([`ProviderError::DeviceNotFound`](super::ProviderError::DeviceNotFound) / [`ProviderError::NoDevice`](super::ProviderError::NoDevice) if absent).
/// - `None`: the device named by `VERBIO_DEVICE` if set and non-empty, else the
///   first ibverbs device that has an active port, else the software device
///   `soft0`. A `tracing` info line says which was chosen and why; falling
///   back to `soft0` on a host whose `/sys/class/infiniband` lists devices
///   is a warning (a build without the `ibverbs` feature, or an HCA whose
///   port is down, silently running on the software device is rarely
///   meant). Use [`open_hardware_device`] to refuse the fallback.
pub fn open_device(name: Option<&str>) -> Result<Context> {
    if let Some(name) = given(name) {
        return open_named(name);
    }
    if let Ok(name) = std::env::var(DEVICE_ENV) {
        let name = name.trim();
        if !name.is_empty() {
            tracing::info!(device = name, "opening the device named by {DEVICE_ENV}");
            return open_named(name);
        }
    }
    let why = match first_active_ibverbs() {
        Ok(ctx) => return Ok(ctx),
        Err(why) => why,
    };
    match fallback_warning(&sysfs_devices(Path::new(SYSFS_INFINIBAND)), &why) {
        Some(warning) => tracing::warn!("{warning}"),
        None => tracing::info!(
            reason = %why,
            "no usable ibverbs device; using the software device soft0"
        ),
    }
    Context::open_soft(SoftConfig::default())
}

/// Opens a hardware (ibverbs) device, never the software device: `name`, or
/// the one `VERBIO_DEVICE` names, or the first ibverbs device with an active
/// port. Fails with [`ProviderError::NoDevice`] saying why when there is
/// none (no device, no active port, a build without the `ibverbs`
/// feature), and with [`ProviderError::InvalidArgument`] for a `soft*` name.
pub fn open_hardware_device(name: Option<&str>) -> Result<Context> {
    let env = std::env::var(DEVICE_ENV).ok();
    let named = given(name).or_else(|| given(env.as_deref()));
    if let Some(name) = named {
        if is_soft_name(name) {
            return Err(ProviderError::InvalidArgument {
                call: "open_hardware_device",
                what: format!("{name:?} names the software device, and hardware is required"),
            });
        }
        return open_named(name);
    }
    first_active_ibverbs().map_err(|why| ProviderError::NoDevice {
        reason: format!(
            "hardware required, and no ibverbs device with an active port: {why}{}",
            listed_hint(&sysfs_devices(Path::new(SYSFS_INFINIBAND)))
        ),
    })
}

/// `name` trimmed, `None` if blank: an empty name (an empty
/// `VERBIO_DEVICE` passed on by a command-line parser, say) means "none
/// given", not a device called "".
fn given(name: Option<&str>) -> Option<&str> {
    name.map(str::trim).filter(|n| !n.is_empty())
}

/// The entries of a sysfs RDMA class directory (empty if it is absent).
pub(crate) fn sysfs_devices(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn listed_hint(listed: &[String]) -> String {
    if listed.is_empty() {
        String::new()
    } else {
        format!(" (the kernel lists {})", listed.join(", "))
    }
}

/// The warning for falling back to `soft0` while the kernel lists RDMA
/// devices (`None` if it lists none: the fallback is expected then).
pub(crate) fn fallback_warning(listed: &[String], why: &str) -> Option<String> {
    if listed.is_empty() {
        return None;
    }
    Some(format!(
        "falling back to the software device soft0 although this host has RDMA devices ({}): \
         {why}; open one by name (VERBIO_DEVICE or the device name), or use \
         open_hardware_device / RdmaBuilder::require_hardware to refuse the fallback",
        listed.join(", ")
    ))
}

fn open_named(name: &str) -> Result<Context> {
    if is_soft_name(name) {
        return Context::open_soft(SoftConfig {
            name: name.to_string(),
            ..SoftConfig::default()
        });
    }
    #[cfg(feature = "ibverbs")]
    {
        Context::open(&super::DeviceInfo {
            name: name.to_string(),
            kind: super::ProviderKind::Ibverbs,
            guid: 0,
        })
    }
    #[cfg(not(feature = "ibverbs"))]
    {
        Err(device_not_found(name, &[]))
    }
}

/// [`ProviderError::DeviceNotFound`] for `name`, listing the devices that
/// exist: `ibverbs` (the names libibverbs lists; empty in a build without
/// the `ibverbs` feature), the software devices, and in a build without
/// the feature the devices the kernel lists (which it cannot open).
pub(crate) fn device_not_found(name: &str, ibverbs: &[String]) -> ProviderError {
    const SOFT: &str = "software devices: any name starting with \"soft\", e.g. soft0";
    let known = if cfg!(feature = "ibverbs") {
        if ibverbs.is_empty() {
            format!("libibverbs lists no device; {SOFT}")
        } else {
            format!("the devices here: {}; {SOFT}", ibverbs.join(", "))
        }
    } else {
        let listed = sysfs_devices(Path::new(SYSFS_INFINIBAND));
        let kernel = if listed.is_empty() {
            String::new()
        } else {
            format!(
                " (the kernel lists {}: build with --features ibverbs to open them)",
                listed.join(", ")
            )
        };
        format!("this build has no `ibverbs` feature, so only {SOFT}{kernel}")
    };
    ProviderError::DeviceNotFound {
        name: name.to_string(),
        known,
    }
}

/// The first ibverbs device with an active port, or why there is none.
#[cfg(feature = "ibverbs")]
fn first_active_ibverbs() -> std::result::Result<Context, String> {
    use super::{ibverbs, DeviceInfo, PortState, ProviderKind};

    let list = ibverbs::devices().map_err(|e| e.to_string())?;
    let mut reasons = Vec::new();
    for info in list {
        let ctx = match Context::open(&DeviceInfo {
            kind: ProviderKind::Ibverbs,
            ..info.clone()
        }) {
            Ok(c) => c,
            Err(e) => {
                reasons.push(format!("{}: {e}", info.name));
                continue;
            }
        };
        let ports = match ctx.query_device() {
            Ok(a) => a.phys_port_cnt,
            Err(e) => {
                reasons.push(format!("{}: {e}", info.name));
                continue;
            }
        };
        let active = (1..=ports).find(|&p| {
            ctx.query_port(p)
                .map(|a| a.state == PortState::Active)
                .unwrap_or(false)
        });
        match active {
            Some(port) => {
                tracing::info!(device = %info.name, port, "using ibverbs device with an active port");
                return Ok(ctx);
            }
            None => reasons.push(format!("{}: no active port", info.name)),
        }
    }
    Err(reasons.join("; "))
}

#[cfg(not(feature = "ibverbs"))]
fn first_active_ibverbs() -> std::result::Result<Context, String> {
    Err("built without the `ibverbs` feature".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::ProviderError;

    #[test]
    fn soft_names_are_recognised() {
        assert!(is_soft_name("soft0"));
        assert!(is_soft_name("soft7"));
        assert!(!is_soft_name("rxe0"));
        assert!(!is_soft_name("mlx5_0"));
    }

    #[test]
    fn the_fallback_warns_only_when_the_kernel_lists_devices() {
        let dir = std::env::temp_dir().join(format!("verbio-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(sysfs_devices(&dir).is_empty(), "absent directory");
        std::fs::create_dir_all(&dir).unwrap();
        assert!(sysfs_devices(&dir).is_empty());
        assert_eq!(fallback_warning(&sysfs_devices(&dir), "no ibverbs"), None);
        std::fs::create_dir(dir.join("mlx5_1")).unwrap();
        std::fs::create_dir(dir.join("mlx5_0")).unwrap();
        let listed = sysfs_devices(&dir);
        assert_eq!(listed, ["mlx5_0", "mlx5_1"]);
        let w = fallback_warning(&listed, "built without the `ibverbs` feature").unwrap();
        assert!(w.contains("mlx5_0, mlx5_1"), "{w}");
        assert!(w.contains("built without the `ibverbs` feature"), "{w}");
        assert!(w.contains("open_hardware_device"), "{w}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn requiring_hardware_refuses_the_software_device() {
        match open_hardware_device(Some("soft0")) {
            Err(ProviderError::InvalidArgument { what, .. }) => {
                assert!(what.contains("hardware is required"), "{what}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        // Without a name: this host's hardware, or a clear refusal (the
        // test hosts have no HCA; a build without ibverbs never has one).
        match open_hardware_device(None) {
            Ok(ctx) => assert_ne!(ctx.kind(), crate::provider::ProviderKind::Soft),
            Err(ProviderError::NoDevice { reason }) => {
                assert!(reason.contains("hardware required"), "{reason}")
            }
            // VERBIO_DEVICE names a soft device in this environment.
            Err(ProviderError::InvalidArgument { what, .. })
                if std::env::var(DEVICE_ENV).is_ok_and(|n| is_soft_name(n.trim())) =>
            {
                assert!(what.contains("hardware is required"), "{what}")
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    #[test]
    fn unknown_hardware_name_is_an_error_not_a_crash() {
        match open_device(Some("no_such_dev9")) {
            Err(ProviderError::DeviceNotFound { .. }) | Err(ProviderError::NoDevice { .. }) => {}
            other => panic!("expected DeviceNotFound/NoDevice, got {other:?}"),
        }
    }

    #[test]
    fn a_blank_name_is_no_name() {
        assert_eq!(given(Some("")), None);
        assert_eq!(given(Some("  ")), None);
        assert_eq!(given(None), None);
        assert_eq!(given(Some(" soft3 ")), Some("soft3"));
    }

    #[test]
    fn an_unknown_name_is_quoted_alone_and_the_known_devices_follow() {
        let e = device_not_found("nonexistent", &["rxe0".into(), "mlx5_0".into()]).to_string();
        assert!(
            e.starts_with("no RDMA device named \"nonexistent\"; "),
            "the name is quoted alone: {e}"
        );
        assert!(e.contains("soft0"), "the software devices are named: {e}");
        if cfg!(feature = "ibverbs") {
            assert!(e.contains("the devices here: rxe0, mlx5_0"), "{e}");
            let none = device_not_found("x", &[]).to_string();
            assert!(none.contains("libibverbs lists no device"), "{none}");
        } else {
            assert!(e.contains("no `ibverbs` feature"), "{e}");
        }
    }
}
