//! ibverbs provider: memory windows (type 2) on a real device (rxe in
//! scripts/rxe-test.sh); the cases are shared with `soft_mw.rs`
//! (`mw_cases/`), so both providers give the statuses asserted there.
//! Skipped, saying why, without an ibverbs device.
#![cfg(feature = "ibverbs")]

mod common;
mod ibverbs_support;
mod mw_cases;

use ibverbs_support::{device, gid_index};

macro_rules! on_device {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            let Some(ctx) = device(stringify!($name)) else {
                return;
            };
            mw_cases::$name(&ctx, gid_index(&ctx));
        }
    )*};
}

on_device!(
    bind_then_access,
    access_outside_region_fails,
    access_beyond_window_rights_fails,
    local_inv_revokes_and_rebind_works,
    bind_needs_mw_bind_access,
    bound_window_cannot_rebind,
    window_belongs_to_its_qp,
);

/// SEND_WITH_INV revokes the window on the device too; prints what the
/// receive completion reports (`IBV_WC_WITH_INV` and the rkey, or not).
#[test]
fn send_with_inv_revokes() {
    let Some(ctx) = device("send_with_inv_revokes") else {
        return;
    };
    let rc = mw_cases::send_with_inv_revokes(&ctx, gid_index(&ctx));
    println!(
        "MEASURED: SEND_WITH_INV receive: with_inv {}, imm_data {:?}",
        rc.with_inv, rc.imm_data
    );
}

/// Measures what the device does with a READ one byte past a window (inside
/// its region): the soft device refuses it; rxe on Linux 6.1 was measured
/// to let it through (it checks the region's range only).
#[test]
fn access_outside_window() {
    let Some(ctx) = device("access_outside_window") else {
        return;
    };
    let status = mw_cases::access_outside_window(&ctx, gid_index(&ctx));
    println!("MEASURED: READ one byte past a window, inside its MR: {status}");
    assert!(
        matches!(
            status,
            verbio_runtime::provider::WcStatus::Success
                | verbio_runtime::provider::WcStatus::RemAccessErr
        ),
        "{status}"
    );
}

/// LOCAL_INV of an allocated, never bound window is not run here: Linux
/// 6.1's rxe dereferences the window's NULL QP and panics the kernel
/// (`__rxe_put` from `rxe_do_invalidate_mw`, measured in the VM).
#[test]
fn local_inv_of_unbound_window_fails() {
    println!("SKIPPED: local_inv_of_unbound_window_fails: panics Linux 6.1's rxe (NULL QP in rxe_do_invalidate_mw)");
}
