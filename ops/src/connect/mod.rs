//! Connection setup over a byte stream (TCP): a small versioned handshake
//! that exchanges queue-pair endpoints (DESIGN section 6).
//!
//! The protocol, for a client C and a server S:
//!
//! 1. C → S: `hello` (C's endpoint).
//! 2. S checks it (magic, version, fields, same provider), builds and connects
//!    its QP (INIT → RTR → RTS), then S → C: `hello` (S's endpoint) — or
//!    `reject` with a reason, and closes.
//! 3. C checks S's hello, connects its QP, then C → S: `ready` (or `reject`).
//!
//! Both sides also refuse a software-device peer that announces a loopback
//! engine address from another host ([`check_engine_reachable`]): its QP
//! could never be reached, so the handshake fails at once, with
//! [`HandshakeError::UnreachableEngine`] on the side that finds it and the
//! same text in [`HandshakeError::RejectedByPeer`] on the other.
//!
//! The final `ready` makes sure C's QP is ready to receive before S's
//! `accept` returns and S starts sending. The frame codec is in
//! [`handshake`]; [`connect_exchange`] and [`accept_exchange`] run the two
//! roles over any `futures::io` stream, bounded by a [`Deadline`];
//! [`Listener`] and [`connect`] run them over the reactor's TCP, with QPs
//! from a [`QpFactory`] ([`DeviceQps`] on a runtime `Device`).

mod error;
mod exchange;
pub mod handshake;
mod listener;
mod reach;
mod setup;

pub use error::HandshakeError;
pub use exchange::{accept_exchange, connect_exchange, Deadline};
pub use handshake::{decode, encode, Hello};
pub use listener::{connect, Connection, Listener, DEFAULT_TIMEOUT};
pub use reach::{check_engine_reachable, peer_is_local};
pub use setup::{path_mtu, DeviceQps, QpConfig, QpFactory};
