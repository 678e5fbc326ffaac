//! Property checks shared by the cargo-fuzz targets (`fuzz/fuzz_targets/`)
//! and the stable replay test (`tests/fuzz_replay.rs`), so both exercise the
//! very same properties. Compiled only with the `fuzzing` feature.
//!
//! Each target has a `check(&[u8]) -> bool`: it decodes the input with every
//! public entry point of the codec, formats any error (Display must not panic
//! either), and, when the input decodes, re-encodes the value and checks the
//! round trip (byte-exact where the codec has one canonical form). It returns
//! whether the input decoded. A failed property **panics**: that is the signal
//! libFuzzer and the replay test look for, so these functions are not for
//! production paths.
//!
//! Each target also has a `seeds()` generator: one valid frame of every
//! message kind. `cargo run --example fuzz_seeds` writes them to
//! `fuzz/corpus/<target>/seed-<name>`; the replay test checks the committed
//! files are up to date.

pub mod agent_wire;
pub mod cm_frame;
pub mod handshake;
pub mod handshake_exchange;
pub mod rpc_engine;
pub mod rpc_header;
pub mod soft_handshake;
pub mod soft_packet;

use std::fmt;

/// A named seed input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seed {
    /// File name suffix: the seed is stored as `seed-<name>`.
    pub name: &'static str,
    /// The input bytes.
    pub bytes: Vec<u8>,
}

impl Seed {
    fn new(name: &'static str, bytes: impl Into<Vec<u8>>) -> Seed {
        Seed {
            name,
            bytes: bytes.into(),
        }
    }
}

/// Where a codec keeps the length of what follows its header: lets a
/// structure-aware mutator repair the field after changing the input's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LenField {
    /// Byte offset of the little-endian length field.
    pub offset: usize,
    /// Its width in bytes (2 or 4).
    pub width: usize,
    /// Bytes before the counted part (the header length).
    pub counted_from: usize,
}

/// One fuzz target: its name (the directory under `fuzz/corpus/`), check,
/// seed generator and length field.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// Target name, as in `cargo fuzz run <name>`.
    pub name: &'static str,
    /// The property check; panics on a violation, returns whether the input decoded.
    pub check: fn(&[u8]) -> bool,
    /// Valid frames of every kind.
    pub seeds: fn() -> Vec<Seed>,
    /// The header's length field.
    pub len_field: LenField,
}

/// Every fuzz target.
pub const TARGETS: [Target; 8] = [
    Target {
        name: "agent_wire",
        check: agent_wire::check,
        seeds: agent_wire::seeds,
        len_field: agent_wire::LEN_FIELD,
    },
    Target {
        name: "handshake",
        check: handshake::check,
        seeds: handshake::seeds,
        len_field: handshake::LEN_FIELD,
    },
    Target {
        name: "handshake_exchange",
        check: handshake_exchange::check,
        seeds: handshake_exchange::seeds,
        len_field: handshake_exchange::LEN_FIELD,
    },
    Target {
        name: "soft_packet",
        check: soft_packet::check,
        seeds: soft_packet::seeds,
        len_field: soft_packet::LEN_FIELD,
    },
    Target {
        name: "soft_handshake",
        check: soft_handshake::check,
        seeds: soft_handshake::seeds,
        len_field: soft_handshake::LEN_FIELD,
    },
    Target {
        name: "rpc_header",
        check: rpc_header::check,
        seeds: rpc_header::seeds,
        len_field: rpc_header::LEN_FIELD,
    },
    Target {
        name: "rpc_engine",
        check: rpc_engine::check,
        seeds: rpc_engine::seeds,
        len_field: rpc_engine::LEN_FIELD,
    },
    Target {
        name: "cm_frame",
        check: cm_frame::check,
        seeds: cm_frame::seeds,
        len_field: cm_frame::LEN_FIELD,
    },
];

/// Formats `value` into nothing: runs its `Display` code without allocating.
fn display(value: &impl fmt::Display) {
    struct Sink;
    impl fmt::Write for Sink {
        fn write_str(&mut self, _: &str) -> fmt::Result {
            Ok(())
        }
    }
    // Writing to `Sink` cannot fail; a Display impl that returns an error is
    // itself a bug worth a panic.
    fmt::write(&mut Sink, format_args!("{value}")).expect("Display of a decode error failed");
}
