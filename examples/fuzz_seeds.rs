//! Writes the fuzz targets' seed corpora: `fuzz/corpus/<target>/seed-<name>`,
//! one valid frame of every message kind, from the generators in
//! `verbio_ops::fuzz_checks` (so the seeds follow the codecs when they change).
//!
//! ```text
//! cargo run --example fuzz_seeds
//! ```
//!
//! `tests/fuzz_replay.rs` fails while the committed seeds differ from what
//! this writes. Other `seed-*` files (regression inputs) are left alone.

use std::path::Path;

use verbio_ops::fuzz_checks::TARGETS;

/// Writes the fuzz targets' seed corpora under fuzz/corpus.
#[derive(clap::Parser)]
struct Args {}

fn main() -> std::io::Result<()> {
    <Args as clap::Parser>::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join("corpus");
    for target in TARGETS {
        let dir = root.join(target.name);
        std::fs::create_dir_all(&dir)?;
        let seeds = (target.seeds)();
        for seed in &seeds {
            assert!(
                (target.check)(&seed.bytes),
                "{}: seed {} does not decode",
                target.name,
                seed.name
            );
            std::fs::write(dir.join(format!("seed-{}", seed.name)), &seed.bytes)?;
        }
        println!(
            "{:<12} {} seeds in {}",
            target.name,
            seeds.len(),
            dir.display()
        );
    }
    Ok(())
}
