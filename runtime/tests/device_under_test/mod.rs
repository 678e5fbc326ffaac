//! The device of the provider-agnostic runtime tests: a fresh soft device, or
//! the device named by `VERBIO_TEST_DEVICE` (`rxe0` in scripts/rxe-test.sh,
//! built with `--features ibverbs`).
#![allow(dead_code)]

use verbio_runtime::provider::{open_device, Context, ProviderError, SoftConfig};

/// Names the device the tests run on instead of a fresh soft device.
pub const TEST_DEVICE_ENV: &str = "VERBIO_TEST_DEVICE";

/// The device named by [`TEST_DEVICE_ENV`], if set and non-empty.
pub fn named() -> Option<String> {
    std::env::var(TEST_DEVICE_ENV)
        .ok()
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
}

/// Opens the test device: the named one, else a fresh soft device on an
/// ephemeral loopback port.
pub fn open() -> Result<Context, ProviderError> {
    match named() {
        Some(name) => open_device(Some(&name)),
        None => Context::open_soft(SoftConfig::default()),
    }
}

/// The GID index for connecting QPs of `ctx` (0 on the soft device; the
/// provider's choice, or `VERBIO_GID_INDEX`, on hardware).
pub fn gid_index(ctx: &Context) -> u8 {
    ctx.default_gid_index(1).expect("default GID index")
}

/// True, after printing `SKIPPED: soft-only`, when the tests run on a named
/// device: the calling test relies on the soft device's behaviour.
pub fn skip_soft_only(test: &str, why: &str) -> bool {
    match named() {
        Some(name) => {
            println!("SKIPPED: soft-only: {test} on {name}: {why}");
            true
        }
        None => false,
    }
}
