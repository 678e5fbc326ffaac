//! The software RDMA device: a faithful RC "NIC" in pure Rust.
//!
//! Each opened [`Context`] runs one engine thread that sleeps in its own mio
//! poll when idle (woken by the post path only when it sleeps), owns a TCP
//! listener and one connection per remote engine, and moves data between
//! registered memory and the wire like a NIC's DMA. See `DESIGN.md` §2.1.
//!
//! Where rxe and the verbs spec differ the device follows the spec:
//! a SEND longer than the posted RECV completes `REM_OP_ERR` at the requester
//! (rxe's behaviour; mlx5 reports `REM_INV_REQ_ERR`) and `LOC_LEN_ERR` at the
//! responder; a bad local key completes `LOC_PROT_ERR`. Transport is TCP, so
//! nothing is retransmitted on timeout: an ACK timeout only counts towards
//! `retry_cnt` (a lost peer), and RNR NAKs make the requester go back to the
//! NAKed PSN after the responder's `min_rnr_timer`.

mod conn;
mod context;
mod cq;
mod dma;
mod engine;
mod mr;
pub mod packet;
mod qp;
mod requester;
mod responder;

pub use context::{Context, Pd};
pub use cq::{CompChannel, Cq};
pub use mr::Mr;
pub use qp::Qp;

use super::{DeviceInfo, ProviderKind};

pub(crate) fn device_info() -> DeviceInfo {
    DeviceInfo {
        name: "soft0".into(),
        kind: ProviderKind::Soft,
        guid: 0,
    }
}
