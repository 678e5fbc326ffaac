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
//!
//! # Limits of the listener
//!
//! What a client can make a [`Listener`] hold before its hello is
//! validated, and the defaults:
//!
//! | bound | default |
//! |---|---|
//! | time for the whole handshake (the `timeout` of [`Listener::bind`]); then the connection is closed | [`DEFAULT_TIMEOUT`], 5 s |
//! | bytes of a frame's body, checked in the header before any is read | [`MAX_BODY_LEN`](handshake::MAX_BODY_LEN), 1024 |
//! | memory per pending client: one fixed-size handshake future, its frame buffer included (nothing allocated from peer input) | under 4 KiB |
//! | handshakes at once; when reached the listener stops accepting (new connections wait in the kernel's backlog) | [`DEFAULT_MAX_PENDING`], 128 |
//! | of those, from one IP address; more wait up to [`PARK_GRACE`] (100 ms) for one of the source's to end, then get a reject | [`DEFAULT_MAX_PENDING_PER_SOURCE`], 32 |
//!
//! Set the caps with [`Listener::with_pending_caps`]. Hitting a cap is
//! logged (`warn`, at most every 10 s). `accept(2)` errors for lack of
//! resources (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`) pause accepting (10
//! ms doubling to 1 s) and are logged once per burst; a client's own
//! failure (a bad frame, a hello sent twice, silence) fails its handshake
//! only; [`Listener::accept`] fails only when the listening socket does.
//! The listener's tests attack it from raw sockets (floods of idle and
//! half-open connections, every length at and past its limit, the caps,
//! and `EMFILE` in a child process with a lowered descriptor limit).

mod error;
mod exchange;
pub mod handshake;
mod listener;
mod reach;
mod setup;

pub use error::HandshakeError;
pub use exchange::{accept_exchange, connect_exchange, Deadline};
pub use handshake::{decode, encode, Hello};
pub use listener::{
    connect, Connection, Listener, DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_SOURCE,
    DEFAULT_TIMEOUT, PARK_GRACE,
};
pub use reach::{check_engine_reachable, peer_is_local};
pub use setup::{path_mtu, DeviceQps, QpConfig, QpFactory};
