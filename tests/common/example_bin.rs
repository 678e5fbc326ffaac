//! The example binaries `cargo test` builds, for tests that run them.

use std::path::PathBuf;

use super::test_device;

/// `target/<profile>/examples/<name>`, next to this test's `deps/`; `None`
/// (after printing why the test `test` is skipped) on a device other than
/// the soft one, or when the example is not built.
pub fn example(test: &str, name: &str) -> Option<PathBuf> {
    if test_device().is_some() {
        println!("SKIPPED: {test}: runs the examples on the soft device");
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    if path.exists() {
        Some(path)
    } else {
        println!(
            "SKIPPED: {test}: {} not built (cargo build --examples)",
            path.display()
        );
        None
    }
}
