//! Output: perftest's banner and result table, or one JSON document.

use std::path::PathBuf;

use serde::Serialize;

use crate::args::{Api, Config, Connection, Test, Transport};
use crate::error::{msg, Context, Result};
use crate::stats::{mbps_to_gbits, BwStats, LatStats};

/// perftest's rule line.
pub const RULE_WIDTH: usize = 87;

/// The figures of one size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Figures {
    /// A bandwidth test's.
    Bw(BwStats),
    /// A latency test's.
    Lat(LatStats),
}

/// One line of the table: a message size and its figures.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Message size.
    pub bytes: usize,
    /// Iterations measured (all QPs together for bandwidth tests).
    pub iterations: u64,
    /// The figures.
    #[serde(flatten)]
    pub figures: Figures,
}

/// What ran, for the banner and the JSON document.
#[derive(Clone, Debug, Serialize)]
pub struct RunInfo {
    /// The test.
    pub test: Test,
    /// The API of the loop.
    pub api: Api,
    /// RDMA or TCP.
    pub transport: Transport,
    /// RC or UD (RDMA).
    pub connection: Connection,
    /// Device name (or "tcp").
    pub device: String,
    /// Provider kind ("soft", "ibverbs") or "tcp".
    pub provider: String,
    /// QP count.
    pub qps: u32,
    /// Operations in flight per QP.
    pub tx_depth: u32,
    /// Largest INLINE payload.
    pub inline_size: u32,
    /// Path MTU in bytes (0 for TCP).
    pub mtu: u32,
    /// Completions: "events" or "busy poll".
    pub completions: String,
    /// Units of the bandwidth figures: "MB/sec" (2^20 bytes) or "Gb/sec".
    pub bw_units: String,
    /// `-b`: the figures are the sum of both directions.
    pub bidirectional: bool,
    /// `--use-srq`: receives on a shared receive queue.
    pub srq: bool,
    /// `-R`: the QPs connected through the RDMA CM.
    pub rdma_cm: bool,
}

/// The whole JSON document.
#[derive(Debug, Serialize)]
pub struct JsonReport<'a> {
    /// What ran.
    #[serde(flatten)]
    pub info: &'a RunInfo,
    /// One entry per size.
    pub results: &'a [Row],
}

/// Prints rows as they come (table) or all at the end (JSON).
#[derive(Debug)]
pub struct Printer {
    json: bool,
    gbits: bool,
    no_peak: bool,
    limit_bw: Option<f64>,
    out_json: Option<PathBuf>,
    info: RunInfo,
    rows: Vec<Row>,
    header_done: bool,
}

impl Printer {
    /// A printer for `info`, formatted as `config` asks.
    pub fn new(config: &Config, info: RunInfo) -> Printer {
        Printer {
            json: config.json,
            gbits: config.gbits,
            no_peak: config.no_peak,
            limit_bw: config.limit_bw,
            out_json: config.out_json.clone(),
            info,
            rows: Vec::new(),
            header_done: false,
        }
    }

    /// Adds the row of one size (printed at once in table mode).
    pub fn row(&mut self, mut row: Row) {
        if let (true, Figures::Bw(b)) = (self.no_peak, &mut row.figures) {
            b.bw_peak_mbps = 0.0;
        }
        if !self.json {
            if !self.header_done {
                print!("{}", banner(&self.info));
                println!("{}", header(self.info.test, self.gbits));
                self.header_done = true;
            }
            println!("{}", format_row(&row, self.gbits));
        }
        // Kept for what reads them at the end (a --run_infinitely table
        // has no end: its rows are not kept).
        if self.json || self.out_json.is_some() || self.limit_bw.is_some() {
            self.rows.push(row);
        }
    }

    /// Ends the output (the table's closing rule, or the JSON document),
    /// writes the `--out_json` file, and fails if a size's average
    /// bandwidth is below `-w`.
    pub fn finish(self) -> Result<()> {
        let doc = JsonReport {
            info: &self.info,
            results: &self.rows,
        };
        if self.json {
            let text = serde_json::to_string_pretty(&doc).ctx("printing the results")?;
            println!("{text}");
        } else if self.header_done {
            println!("{}", "-".repeat(RULE_WIDTH));
        }
        if let Some(path) = &self.out_json {
            let text = serde_json::to_string_pretty(&doc).ctx("formatting --out_json")?;
            std::fs::write(path, text + "\n")
                .ctx_with(|| format!("writing --out_json to {}", path.display()))?;
        }
        match self.limit_bw {
            Some(limit) => below_limit(&self.rows, limit, self.gbits),
            None => Ok(()),
        }
    }
}

/// `-w`: an error naming the first size whose average bandwidth, in the
/// printed units, is below `limit`.
pub fn below_limit(rows: &[Row], limit: f64, gbits: bool) -> Result<()> {
    let units = if gbits { "Gb/sec" } else { "MB/sec" };
    for row in rows {
        if let Figures::Bw(b) = row.figures {
            let avg = if gbits {
                mbps_to_gbits(b.bw_avg_mbps)
            } else {
                b.bw_avg_mbps
            };
            if avg < limit {
                return Err(msg(format!(
                    "bandwidth below the -w limit: {avg:.2} {units} at {} bytes, limit {limit} {units}",
                    row.bytes
                )));
            }
        }
    }
    Ok(())
}

/// perftest's banner above the table.
pub fn banner(info: &RunInfo) -> String {
    let line = "-".repeat(RULE_WIDTH);
    let mut s = format!("{line}\n");
    s += &format!("                    {} (verbio-perf)\n", info.test.title());
    s += &format!(" Device         : {} ({})\n", info.device, info.provider);
    let conn = match (info.transport, info.connection) {
        (Transport::Tcp, _) => "TCP",
        (Transport::Rdma, Connection::Ud) => "UD",
        (Transport::Rdma, Connection::Rc) => "RC",
    };
    s += &format!(
        " Number of qps  : {}\t\tTransport type : {}\n",
        info.qps, conn
    );
    s += &format!(" API            : {:?}\n", info.api).to_lowercase();
    if !info.test.is_lat() {
        s += &format!(" TX depth       : {}\n", info.tx_depth);
    }
    if info.mtu > 0 {
        s += &format!(" Mtu            : {}[B]\n", info.mtu);
    }
    s += &format!(" Max inline data: {}[B]\n", info.inline_size);
    s += &format!(" Completions    : {}\n", info.completions);
    if info.bidirectional {
        s += " Direction      : bidirectional (client's and server's traffic added)\n";
    }
    if info.srq {
        s += " Using SRQ      : ON\n";
    }
    if info.rdma_cm {
        s += " Connection     : RDMA CM\n";
    }
    s += &format!("{line}\n");
    s
}

/// The table's column titles.
pub fn header(test: Test, gbits: bool) -> String {
    if test.is_lat() {
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
         t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
            .to_string()
    } else {
        let u = if gbits { "Gb/sec" } else { "MB/sec" };
        format!(" #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]")
    }
}

/// One line of the table, in perftest's layout.
pub fn format_row(row: &Row, gbits: bool) -> String {
    match row.figures {
        Figures::Bw(b) => {
            let conv = |v: f64| if gbits { mbps_to_gbits(v) } else { v };
            format!(
                " {:<10} {:<14} {:<18.2} {:<20.2} {:.6}",
                row.bytes,
                row.iterations,
                conv(b.bw_peak_mbps),
                conv(b.bw_avg_mbps),
                b.msg_rate_mpps
            )
        }
        Figures::Lat(s) => format!(
            " {:<7} {:<10} {:>10.2} {:>14.2} {:>14.2} {:>16.2} {:>14.2} {:>16.2} {:>22.2}",
            row.bytes,
            row.iterations,
            s.t_min,
            s.t_max,
            s.t_typical,
            s.t_avg,
            s.t_stdev,
            s.p99,
            s.p999
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bw_row() -> Row {
        Row {
            bytes: 65536,
            iterations: 5000,
            figures: Figures::Bw(BwStats {
                bw_peak_mbps: 1200.5,
                bw_avg_mbps: 1100.25,
                msg_rate_mpps: 0.017604,
            }),
        }
    }

    #[test]
    fn bandwidth_table_in_perftest_layout() {
        assert_eq!(
            header(Test::WriteBw, false),
            " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
        );
        assert!(header(Test::WriteBw, true).contains("BW average[Gb/sec]"));
        let line = format_row(&bw_row(), false);
        assert_eq!(
            line,
            " 65536      5000           1200.50            1100.25              0.017604"
        );
        let g = format_row(&bw_row(), true);
        assert!(g.contains("9.23"), "{g}"); // 1100.25 MiB/s = 9.23 Gbit/s
    }

    #[test]
    fn limit_bw_fails_below_the_limit_in_the_printed_units() {
        let rows = [bw_row()];
        assert!(below_limit(&rows, 1100.0, false).is_ok());
        let e = below_limit(&rows, 1100.5, false).expect_err("below");
        assert!(
            e.to_string().contains("1100.25 MB/sec at 65536 bytes"),
            "{e}"
        );
        // 1100.25 MiB/s = 9.23 Gbit/s.
        assert!(below_limit(&rows, 9.2, true).is_ok());
        let e = below_limit(&rows, 9.3, true).expect_err("below");
        assert!(e.to_string().contains("Gb/sec"), "{e}");
    }

    #[test]
    fn latency_table_in_perftest_layout() {
        let h = header(Test::SendLat, false);
        assert!(h.starts_with(" #bytes #iterations    t_min[usec]"));
        assert!(h.contains("99.9% percentile[usec]"));
        let row = Row {
            bytes: 2,
            iterations: 1000,
            figures: Figures::Lat(LatStats {
                t_min: 1.0,
                t_max: 9.5,
                t_typical: 1.25,
                t_avg: 1.5,
                t_stdev: 0.5,
                p99: 3.0,
                p999: 9.0,
            }),
        };
        let line = format_row(&row, false);
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols,
            ["2", "1000", "1.00", "9.50", "1.25", "1.50", "0.50", "3.00", "9.00"]
        );
    }

    #[test]
    fn json_document_has_the_run_and_the_rows() {
        let info = RunInfo {
            test: Test::WriteBw,
            api: Api::Raw,
            transport: Transport::Rdma,
            connection: Connection::Rc,
            device: "soft0".into(),
            provider: "soft".into(),
            qps: 1,
            tx_depth: 128,
            inline_size: 0,
            mtu: 4096,
            completions: "events".into(),
            bw_units: "MB/sec".into(),
            bidirectional: false,
            srq: false,
            rdma_cm: false,
        };
        let rows = [bw_row()];
        let v: serde_json::Value = serde_json::to_value(JsonReport {
            info: &info,
            results: &rows,
        })
        .expect("serializes");
        assert_eq!(v["test"], "write_bw");
        assert_eq!(v["api"], "raw");
        assert_eq!(v["results"][0]["bytes"], 65536);
        assert_eq!(v["results"][0]["bw_avg_mbps"], 1100.25);
        assert_eq!(v["results"][0]["iterations"], 5000);
    }
}
