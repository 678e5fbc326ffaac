//! The progress line on stderr for long runs (size sweeps and timed runs).

use std::io::{IsTerminal, Write};
use std::time::Instant;

use crate::args::Config;
use crate::report::{Figures, Row};

/// Prints one line per size while a sweep or a timed run goes on.
#[derive(Debug)]
pub struct Progress {
    on: bool,
    total: usize,
    k: usize,
    start: Instant,
}

impl Progress {
    /// On for `-a`, `-D` or JSON output (whose table comes only at the end).
    pub fn new(cfg: &Config) -> Progress {
        Progress {
            on: cfg.sizes.len() > 1 || cfg.duration.is_some() || cfg.json,
            total: cfg.sizes.len(),
            k: 0,
            start: Instant::now(),
        }
    }

    /// A size starts.
    pub fn start(&mut self, size: usize) {
        self.k += 1;
        if self.on {
            let mut e = std::io::stderr();
            let _ = write!(
                e,
                "{}[{}/{}] {} B ... ",
                if e.is_terminal() { "\r\x1b[K" } else { "" },
                self.k,
                self.total,
                size
            );
            if !e.is_terminal() {
                let _ = writeln!(e);
            }
            let _ = e.flush();
        }
    }

    /// A size ended with `row`.
    pub fn done(&mut self, row: &Row) {
        if !self.on || !std::io::stderr().is_terminal() {
            return;
        }
        let what = match row.figures {
            Figures::Bw(b) => format!("{:.2} MB/sec", b.bw_avg_mbps),
            Figures::Lat(l) => format!("{:.2} usec", l.t_typical),
        };
        let _ = write!(
            std::io::stderr(),
            "{what} ({:.1} s elapsed)",
            self.start.elapsed().as_secs_f64()
        );
        if self.k == self.total {
            let _ = writeln!(std::io::stderr());
        }
    }
}
