//! verbio-ops: every verb as an owned-buffer `Op` future, connection setup over
//! TCP, and the MR-token agent.
#![deny(missing_docs)]
pub mod agent;
pub mod connect;
#[cfg(feature = "fuzzing")]
pub mod fuzz_checks;
