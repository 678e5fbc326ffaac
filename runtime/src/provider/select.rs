//! Device selection: by name, by the `VERBIO_DEVICE` environment variable, or
//! automatically (the first ibverbs device with an active port, else the
//! software device).

use super::{Context, Result, SoftConfig};

/// Environment variable naming the device [`open_device`] opens when no name is given.
pub const DEVICE_ENV: &str = "VERBIO_DEVICE";

/// True for names of the software device (`soft0`, `soft1`, ...).
fn is_soft_name(name: &str) -> bool {
    name.starts_with("soft")
}

/// Opens a device.
///
/// - `Some(name)`: that device; names starting with `soft` open a software
///   device of that name, anything else an ibverbs device
///   ([`ProviderError::DeviceNotFound`](super::ProviderError::DeviceNotFound) / [`ProviderError::NoDevice`](super::ProviderError::NoDevice) if absent).
/// - `None`: the device named by `VERBIO_DEVICE` if set and non-empty, else the
///   first ibverbs device that has an active port, else the software device
///   `soft0`. A `tracing` info line says which was chosen and why.
pub fn open_device(name: Option<&str>) -> Result<Context> {
    if let Some(name) = name {
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
    tracing::info!(reason = %why, "no usable ibverbs device; using the software device soft0");
    Context::open_soft(SoftConfig::default())
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
        Err(super::ProviderError::DeviceNotFound {
            name: format!("{name} (built without the `ibverbs` feature: only soft devices)"),
        })
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
    fn unknown_hardware_name_is_an_error_not_a_crash() {
        match open_device(Some("no_such_dev9")) {
            Err(ProviderError::DeviceNotFound { .. }) | Err(ProviderError::NoDevice { .. }) => {}
            other => panic!("expected DeviceNotFound/NoDevice, got {other:?}"),
        }
    }
}
