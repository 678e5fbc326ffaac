//! An RPC engine over datagrams, in the style of eRPC and rrppcc.
//!
//! * [`header`]: the packet header codec.
pub mod header;
