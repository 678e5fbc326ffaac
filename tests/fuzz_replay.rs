//! The fuzz targets on stable: replays every file of `fuzz/corpus/<target>/`
//! (the generated seeds, regression inputs, and locally whatever libFuzzer
//! saved) and a few hundred thousand mutated inputs through the same checks
//! the cargo-fuzz targets run (`verbio_ops::fuzz_checks`). Deterministic: a
//! fixed-seed xorshift PRNG, no dependencies.

use std::path::{Path, PathBuf};

use verbio_ops::fuzz_checks::{LenField, Target, TARGETS};

/// Mutated inputs per decoder target.
const MUTATED_INPUTS: usize = 100_000;
/// Fewer for the exchange target: each input runs two async handshakes.
const MUTATED_EXCHANGES: usize = 50_000;

fn target(name: &str) -> Target {
    match TARGETS.iter().find(|t| t.name == name) {
        Some(t) => *t,
        None => panic!("no fuzz target {name}"),
    }
}

fn corpus_dir(target: &Target) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join("corpus")
        .join(target.name)
}

/// Every file in the target's corpus directory, sorted by name.
fn corpus(target: &Target) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("directory entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (name, bytes)
        })
        .collect();
    files.sort();
    files
}

/// xorshift64*: deterministic pseudo-random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Boundary values for integer fields (lengths, QP numbers, offsets, flags).
const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xffff,
    0x00ff_ffff,
    0x0100_0000,
    1 << 20,
    (1 << 20) + 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    u64::MAX,
];

/// Applies one to four random mutations to `buf`, taking splice material
/// from `pool`, then (half of the time) repairs the length field so the
/// input gets past the framing checks into the body decoders.
fn mutate(rng: &mut Rng, buf: &mut Vec<u8>, pool: &[Vec<u8>], len_field: LenField) {
    for _ in 0..1 + rng.below(4) {
        let len = buf.len();
        match rng.below(10) {
            0 if len > 0 => {
                let at = rng.below(len);
                buf[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                buf[at] = rng.next() as u8;
            }
            2 if len > 0 => {
                let at = rng.below(len);
                buf[at] = INTERESTING[rng.below(6)] as u8;
            }
            3 => {
                let width = [1, 2, 4, 8][rng.below(4)];
                if len >= width {
                    let at = rng.below(len - width + 1);
                    let v = INTERESTING[rng.below(INTERESTING.len())];
                    let v = if rng.below(4) == 0 {
                        v.wrapping_sub(1)
                    } else {
                        v
                    };
                    buf[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
                }
            }
            4 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                buf.splice(at..at, bytes);
            }
            5 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below(len - at);
                buf.drain(at..at + n);
            }
            6 => buf.truncate(rng.below(len + 1)),
            7 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(32));
                let chunk = buf[at..at + n].to_vec();
                let to = rng.below(len + 1);
                buf.splice(to..to, chunk);
            }
            8 => {
                let other = &pool[rng.below(pool.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                buf.truncate(cut);
                buf.extend_from_slice(&other[from..]);
            }
            _ => {
                let n = 1 + rng.below(64);
                buf.extend((0..n).map(|_| rng.next() as u8));
            }
        }
    }
    let LenField {
        offset,
        width,
        counted_from,
    } = len_field;
    if rng.below(2) == 0 && buf.len() >= offset + width && buf.len() >= counted_from {
        let body = (buf.len() - counted_from) as u64;
        if body < 1 << (8 * width) {
            buf[offset..offset + width].copy_from_slice(&body.to_le_bytes()[..width]);
        }
    }
}

/// Runs the corpus and `inputs` mutated inputs through the check.
fn replay(name: &str, inputs: usize) {
    let target = target(name);
    let seeds = (target.seeds)();
    let files = corpus(&target);
    for (file, bytes) in &files {
        let decoded = (target.check)(bytes);
        // Generated seeds must decode; regression inputs need not.
        if seeds.iter().any(|s| format!("seed-{}", s.name) == *file) {
            assert!(decoded, "{name}: corpus seed {file} does not decode");
        }
    }
    // Mutate the committed `seed-*` files only (generated seeds and
    // regression inputs), so the run is the same here and in CI whatever
    // libFuzzer left in the directory locally.
    let pool: Vec<Vec<u8>> = files
        .into_iter()
        .filter(|(file, _)| file.starts_with("seed-"))
        .map(|(_, bytes)| bytes)
        .collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let mut decoded = 0usize;
    let mut buf = Vec::new();
    for i in 0..inputs {
        buf.clear();
        if i % 8 == 0 {
            // Noise, half of the time behind a valid header.
            let n = rng.below(200);
            buf.extend((0..n).map(|_| rng.next() as u8));
            let base = &pool[rng.below(pool.len())];
            if rng.below(2) == 0 {
                let keep = target.len_field.counted_from.min(base.len()).min(n);
                buf[..keep].copy_from_slice(&base[..keep]);
            }
        } else {
            buf.extend_from_slice(&pool[rng.below(pool.len())]);
            mutate(&mut rng, &mut buf, &pool, target.len_field);
        }
        if (target.check)(&buf) {
            decoded += 1;
        }
    }
    eprintln!("{name}: {decoded} of {inputs} mutated inputs decoded");
    // The mutator reaches both sides: many valid frames (round trips
    // checked) and many refused ones.
    assert!(
        decoded > inputs / 50 && decoded < inputs / 2,
        "{name}: {decoded} of {inputs} mutated inputs decoded"
    );
}

#[test]
fn agent_wire() {
    replay("agent_wire", MUTATED_INPUTS);
}

#[test]
fn handshake() {
    replay("handshake", MUTATED_INPUTS);
}

#[test]
fn handshake_exchange() {
    replay("handshake_exchange", MUTATED_EXCHANGES);
}

#[test]
fn soft_packet() {
    replay("soft_packet", MUTATED_INPUTS);
}

#[test]
fn soft_handshake() {
    replay("soft_handshake", MUTATED_INPUTS);
}

#[test]
fn rpc_header() {
    replay("rpc_header", MUTATED_INPUTS);
}

#[test]
fn rpc_engine() {
    replay("rpc_engine", MUTATED_EXCHANGES);
}

#[test]
fn cm_frame() {
    replay("cm_frame", MUTATED_INPUTS);
}

#[test]
fn committed_seeds_are_up_to_date() {
    for target in TARGETS {
        let dir = corpus_dir(&target);
        for seed in (target.seeds)() {
            let path = dir.join(format!("seed-{}", seed.name));
            let committed = std::fs::read(&path).unwrap_or_default();
            assert!(
                committed == seed.bytes,
                "{} differs from the generator: run `cargo run --example fuzz_seeds`",
                path.display()
            );
        }
    }
}
