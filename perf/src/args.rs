//! Command-line flags, named as perftest's, and what they resolve to.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// Smallest message of the `-a` sweep.
pub const SWEEP_MIN: usize = 2;
/// Largest message of the `-a` sweep (2^24 bytes: perftest stops at
/// 2^23; the project's sweeps reach 16 MiB).
pub const SWEEP_MAX: usize = 1 << 24;
/// Smallest message of `--sizes pow4`.
pub const POW4_MIN: usize = 64;
/// Largest message `--api rpc` carries (the RPC engine's `MAX_MSG_LEN`).
pub const RPC_MAX: usize = 1 << 24;
/// Fewest iterations (perftest's `MIN_ITER`): the latency statistics drop
/// the two largest of `iters - 1` samples.
pub const MIN_ITERS: u64 = 5;
/// Size of the word an atomic works on.
pub const ATOMIC_SIZE: usize = 8;

/// The benchmark to run (perftest's `ib_<test>` binaries).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[value(rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Test {
    /// RDMA WRITE bandwidth.
    WriteBw,
    /// RDMA WRITE ping-pong latency (each side polls its memory).
    WriteLat,
    /// RDMA READ bandwidth.
    ReadBw,
    /// RDMA READ latency (one READ at a time).
    ReadLat,
    /// SEND bandwidth.
    SendBw,
    /// SEND ping-pong latency.
    SendLat,
    /// Atomic fetch-and-add bandwidth.
    AtomicBw,
    /// Atomic fetch-and-add latency.
    AtomicLat,
}

/// The operation family of a test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND / RECV.
    Send,
    /// Fetch-and-add.
    Atomic,
}

impl Test {
    /// All tests, in their wire order.
    pub const ALL: [Test; 8] = [
        Test::WriteBw,
        Test::WriteLat,
        Test::ReadBw,
        Test::ReadLat,
        Test::SendBw,
        Test::SendLat,
        Test::AtomicBw,
        Test::AtomicLat,
    ];

    /// The operation the test measures.
    pub fn verb(self) -> Verb {
        match self {
            Test::WriteBw | Test::WriteLat => Verb::Write,
            Test::ReadBw | Test::ReadLat => Verb::Read,
            Test::SendBw | Test::SendLat => Verb::Send,
            Test::AtomicBw | Test::AtomicLat => Verb::Atomic,
        }
    }

    /// True for the latency tests.
    pub fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat
        )
    }

    /// perftest's `rtt_factor`: ping-pongs report half the round trip.
    pub fn rtt_factor(self) -> f64 {
        match self {
            Test::WriteLat | Test::SendLat => 2.0,
            _ => 1.0,
        }
    }

    /// The test's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::WriteLat => "write_lat",
            Test::ReadBw => "read_bw",
            Test::ReadLat => "read_lat",
            Test::SendBw => "send_bw",
            Test::SendLat => "send_lat",
            Test::AtomicBw => "atomic_bw",
            Test::AtomicLat => "atomic_lat",
        }
    }

    /// perftest's banner title.
    pub fn title(self) -> &'static str {
        match self {
            Test::WriteBw => "RDMA_Write BW Test",
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::SendBw => "Send BW Test",
            Test::SendLat => "Send Latency Test",
            Test::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
        }
    }

    /// The test's code on the wire.
    pub fn code(self) -> u8 {
        Test::ALL.iter().position(|&t| t == self).unwrap_or(0) as u8 + 1
    }

    /// Decodes [`Test::code`].
    pub fn from_code(code: u8) -> Option<Test> {
        Test::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }
}

/// Which verbio API runs the measured loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// The runtime's owned-buffer op futures (`verbio::Verbs` on a `QueuePair`).
    Verbs,
    /// A bare post/poll loop on the provider's QP and CQ (perftest's loop).
    Raw,
    /// The high-level `Rdma` agent connection.
    Rdma,
    /// The RPC engine (`verbio::rpc`) over a UD queue pair: send_lat calls
    /// an echo, send_bw calls a sink with a window of calls in flight.
    Rpc,
}

impl Api {
    /// The API's code on the wire.
    pub fn code(self) -> u8 {
        match self {
            Api::Verbs => 1,
            Api::Raw => 2,
            Api::Rdma => 3,
            Api::Rpc => 4,
        }
    }
}

/// The queue-pair type (perftest's `-c`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Connection {
    /// Reliable connected.
    #[value(name = "RC", alias = "rc")]
    Rc,
    /// Unreliable datagram (send_lat only; messages up to the MTU).
    #[value(name = "UD", alias = "ud")]
    Ud,
}

impl Connection {
    /// The connection type's code on the wire.
    pub fn code(self) -> u8 {
        match self {
            Connection::Rc => 1,
            Connection::Ud => 2,
        }
    }
}

/// What carries the messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// RDMA verbs on the chosen device.
    Rdma,
    /// Plain kernel TCP sockets (a baseline for send_bw and send_lat).
    Tcp,
}

/// perftest-style RDMA benchmarks on verbio. Without HOST this is the
/// server; with HOST, the client that connects to it and prints the results.
#[derive(Clone, Debug, Parser)]
#[command(name = "verbio-perf", version, about, long_about = None)]
pub struct Cli {
    /// The test to run (the same on both sides).
    #[arg(value_enum)]
    pub test: Test,
    /// The server to connect to; none: be the server.
    pub host: Option<String>,
    /// Message size in bytes, or with a K or M suffix (default: 65536 for
    /// bandwidth tests, 2 for latency tests, 8 for atomics).
    #[arg(short = 's', long = "size", value_parser = size_value)]
    pub size: Option<usize>,
    /// Run all sizes from 2 to 2^24 bytes, doubling.
    #[arg(short = 'a', long = "all")]
    pub all: bool,
    /// The sizes to run, in order: a comma-separated list of byte counts
    /// (suffixes K and M: KiB, MiB), or `pow4` for 64 B .. 16 MiB in
    /// powers of 4.
    #[arg(long = "sizes", value_name = "LIST|pow4")]
    pub size_list: Option<String>,
    /// Iterations per size (per QP for bandwidth tests; default 5000 for
    /// bandwidth, 1000 for latency).
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u64>,
    /// Run each size for this many seconds (decimals allowed) instead of a
    /// number of iterations; at least 5 iterations run whatever the time.
    #[arg(short = 'D', long = "duration")]
    pub duration: Option<f64>,
    /// Number of QPs (bandwidth tests).
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    pub qps: u32,
    /// Operations in flight per QP (bandwidth tests; default 128).
    #[arg(short = 't', long = "tx-depth")]
    pub tx_depth: Option<u32>,
    /// Largest payload sent INLINE (copied at post time; default 64 for
    /// latency tests, 0 for bandwidth tests).
    #[arg(short = 'I', long = "inline_size")]
    pub inline: Option<u32>,
    /// Sleep on the completion channel instead of busy-polling the CQ.
    #[arg(short = 'e', long = "events")]
    pub events: bool,
    /// RDMA device (e.g. soft0, rxe0, mlx5_0); default: VERBIO_DEVICE, else
    /// the first active ibverbs device, else the software device soft0.
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// GID index (RoCE).
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u8>,
    /// Physical port of the device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u8,
    /// TCP port of the connection setup (0: any, the server prints it).
    #[arg(short = 'p', long = "port", default_value_t = 18515)]
    pub port: u16,
    /// Report bandwidth in Gbit/s instead of MB/s (2^20 bytes).
    #[arg(long = "report_gbits")]
    pub report_gbits: bool,
    /// The verbio API that runs the loop (the same on both sides).
    #[arg(long, value_enum, default_value_t = Api::Verbs)]
    pub api: Api,
    /// RDMA, or kernel TCP as a baseline (send_bw and send_lat only).
    #[arg(long, value_enum, default_value_t = Transport::Rdma)]
    pub transport: Transport,
    /// Queue-pair type: RC, or UD (send_lat with --api verbs only).
    #[arg(short = 'c', long = "connection", value_enum, default_value_t = Connection::Rc)]
    pub connection: Connection,
    /// Print the results as one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Busy-poll time in microseconds before the runtime sleeps (default:
    /// 50000 on hardware, 0 on the software device, whose engine threads
    /// need the CPU).
    #[arg(long = "busy-poll")]
    pub busy_poll_us: Option<u64>,
    /// `--api rpc`: messages of at least this many bytes go by RDMA READ
    /// (`RpcConfig::read_threshold`; default: the engine's, 32 KiB; 0
    /// keeps every message in packets). Both sides take it from their
    /// own flag.
    #[arg(long = "rpc-read-threshold")]
    pub rpc_read_threshold: Option<usize>,
    /// `--api rpc` send_lat: each call sends an 8-byte request and gets a
    /// response of `-s` bytes (a GET), instead of an echo of `-s` bytes
    /// both ways.
    #[arg(long = "rpc-get")]
    pub rpc_get: bool,
    /// perftest's `-F`: no warning when the CPU frequency is not at its
    /// maximum. Accepted for perftest scripts; verbio-perf prints no such
    /// warning, so it changes nothing.
    #[arg(short = 'F', long = "CPU-freq")]
    pub cpu_freq: bool,
    /// Do not compute the peak bandwidth: the BW peak column reads 0.00
    /// (perftest's `-N`; latency tests have no peak).
    #[arg(short = 'N', long = "noPeak")]
    pub no_peak: bool,
    /// Exit with status 1 if a size's average bandwidth is below this
    /// value, in the units printed (MB/sec, or Gb/sec with --report_gbits)
    /// (perftest's verifier limit; bandwidth tests).
    #[arg(short = 'w', long = "limit_bw", value_name = "VALUE")]
    pub limit_bw: Option<f64>,
    /// Also write the results as one JSON document to a file (see
    /// --out_json_file); the table still goes to standard output.
    #[arg(long = "out_json")]
    pub out_json: bool,
    /// The file of --out_json (default perftest_out.json in the working
    /// directory, as perftest); implies --out_json.
    #[arg(long = "out_json_file", value_name = "FILE")]
    pub out_json_file: Option<PathBuf>,
    /// perftest: report RX and TX separately in bidirectional tests.
    /// Accepted without -b (it changes nothing there); refused with -b,
    /// where verbio-perf prints the sum of both directions only.
    #[arg(long = "report-both")]
    pub report_both: bool,
    /// Traffic both ways at once (bandwidth tests, --api verbs): the server
    /// runs the same loop towards the client, and the client prints the sum
    /// of both directions (as perftest).
    #[arg(short = 'b', long = "bidirectional")]
    pub bidirectional: bool,
    /// WRs per post list (one doorbell, the last WR signaled): write_bw
    /// and send_bw with --api verbs; -t and -n must be multiples of it.
    #[arg(short = 'l', long = "post_list", value_name = "N")]
    pub post_list: Option<u32>,
    /// One WR signaled in N: with -l, N must equal -l (the runtime signals
    /// the last WR of each post list); without -l, only 1 (every WR).
    #[arg(short = 'Q', long = "cq-mod", value_name = "N")]
    pub cq_mod: Option<u32>,
    /// Connect the QPs through the RDMA CM (on the -p port) instead of the
    /// TCP handshake (--api verbs and raw, RC).
    #[arg(short = 'R', long = "rdma_cm")]
    pub rdma_cm: bool,
    /// Post the receives on a shared receive queue, all QPs of a side on
    /// one SRQ (send_bw and send_lat, --api verbs).
    #[arg(long = "use-srq")]
    pub use_srq: bool,
    /// Refused: device counters are not reported.
    #[arg(short = 'W', long = "report-counters", value_name = "LIST")]
    pub report_counters: Option<String>,
    /// Run until killed, printing a result line per -D interval (default
    /// 5 s) (bandwidth tests, one size, --api verbs or raw).
    #[arg(long = "run_infinitely")]
    pub run_infinitely: bool,
}

/// perftest's JSON file name (`--out_json` without `--out_json_file`).
pub const DEFAULT_JSON_FILE: &str = "perftest_out.json";

/// The flags resolved against the test's defaults and checked.
#[derive(Clone, Debug)]
pub struct Config {
    /// The test.
    pub test: Test,
    /// Client: the server's address; server: none.
    pub host: Option<String>,
    /// Message sizes, in the order they run.
    pub sizes: Vec<usize>,
    /// Iterations per size (per QP), or none with a duration.
    pub iters: Option<u64>,
    /// Run time per size, if set.
    pub duration: Option<Duration>,
    /// QP count.
    pub qps: u32,
    /// Operations in flight per QP.
    pub tx_depth: u32,
    /// Largest INLINE payload.
    pub inline: u32,
    /// `-I` as given (`--api rdma` keeps the builder's default without it).
    pub inline_given: Option<u32>,
    /// Sleep on the completion channel.
    pub events: bool,
    /// Device name.
    pub device: Option<String>,
    /// GID index.
    pub gid_index: Option<u8>,
    /// Device port.
    pub ib_port: u8,
    /// TCP port.
    pub port: u16,
    /// Gbit/s instead of MB/s.
    pub gbits: bool,
    /// The API.
    pub api: Api,
    /// The queue-pair type.
    pub connection: Connection,
    /// The transport.
    pub transport: Transport,
    /// JSON output.
    pub json: bool,
    /// Explicit busy-poll time.
    pub busy_poll: Option<Duration>,
    /// `--api rpc`: the READ threshold (`None`: the engine's default).
    pub rpc_read_threshold: Option<usize>,
    /// `--api rpc` send_lat: small requests, `-s`-byte responses.
    pub rpc_get: bool,
    /// `-N`: the peak bandwidth is not computed (printed as 0).
    pub no_peak: bool,
    /// `-w`: the least average bandwidth, in the printed units.
    pub limit_bw: Option<f64>,
    /// `--out_json`: the file that also gets the JSON document.
    pub out_json: Option<PathBuf>,
    /// `-l`: WRs per post list (1: one WR per post, every WR signaled).
    pub post_list: u32,
    /// `-b`: the server runs the test's loop towards the client too.
    pub bidirectional: bool,
    /// `-R`: the QPs connect through the RDMA CM.
    pub rdma_cm: bool,
    /// `--use-srq`: receives on a shared receive queue.
    pub srq: bool,
    /// `--run_infinitely`: steps of `duration` until killed.
    pub run_infinitely: bool,
}

/// A flag combination that cannot run, with what to do instead.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ArgError(pub String);

fn bad(msg: impl Into<String>) -> ArgError {
    ArgError(msg.into())
}

/// The sizes of the `-a` sweep: powers of two from [`SWEEP_MIN`] to
/// [`SWEEP_MAX`].
pub fn sweep_sizes() -> Vec<usize> {
    std::iter::successors(Some(SWEEP_MIN), |&s| Some(s * 2))
        .take_while(|&s| s <= SWEEP_MAX)
        .collect()
}

/// The sizes of `--sizes pow4`: powers of 4 from [`POW4_MIN`] to
/// [`SWEEP_MAX`].
pub fn pow4_sizes() -> Vec<usize> {
    std::iter::successors(Some(POW4_MIN), |&s| Some(s * 4))
        .take_while(|&s| s <= SWEEP_MAX)
        .collect()
}

/// Parses one size: a byte count with an optional `K` (KiB) or `M` (MiB)
/// suffix, at least 1 (`-s` and the items of `--sizes`).
pub fn size_value(t: &str) -> Result<usize, String> {
    let (digits, unit) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1 << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        _ => (t, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{t:?} is not a size in bytes (e.g. 64, 4K, 1M)"))
}

/// Parses `--sizes`: `pow4`, or byte counts separated by commas, each
/// with an optional `K` (KiB) or `M` (MiB) suffix.
pub fn parse_sizes(list: &str) -> Result<Vec<usize>, ArgError> {
    if list.eq_ignore_ascii_case("pow4") {
        return Ok(pow4_sizes());
    }
    list.split(',')
        .map(|item| {
            size_value(item.trim()).map_err(|_| {
                bad(format!(
                    "--sizes: {:?} is not a size (byte counts like 64,4K,1M, or pow4)",
                    item.trim()
                ))
            })
        })
        .collect()
}

impl Cli {
    /// The first perftest flag given that verbio-perf refuses, with what
    /// it would do.
    fn refused_flag(&self) -> Option<&'static str> {
        self.report_counters
            .is_some()
            .then_some("-W (--report-counters: device performance counters)")
    }

    /// Resolves the defaults and refuses unsupported combinations.
    pub fn resolve(self) -> Result<Config, ArgError> {
        if let Some(what) = self.refused_flag() {
            return Err(bad(format!("does not support {what} yet")));
        }
        let test = self.test;
        if let Some(limit) = self.limit_bw {
            if test.is_lat() {
                return Err(bad("-w (--limit_bw) applies to bandwidth tests only"));
            }
            if !(limit.is_finite() && limit >= 0.0) {
                return Err(bad("-w (--limit_bw) takes a bandwidth of 0 or more"));
            }
        }
        let sizes = if test.verb() == Verb::Atomic {
            match self.size {
                Some(s) if s != ATOMIC_SIZE => {
                    return Err(bad(format!(
                        "{}: atomics work on {ATOMIC_SIZE}-byte words (-s {s} given)",
                        test.name()
                    )))
                }
                _ => vec![ATOMIC_SIZE],
            }
        } else if self.all {
            if self.size.is_some() || self.size_list.is_some() {
                return Err(bad("choose one of -s, -a and --sizes"));
            }
            sweep_sizes()
        } else if let Some(list) = &self.size_list {
            if self.size.is_some() {
                return Err(bad("choose one of -s, -a and --sizes"));
            }
            parse_sizes(list)?
        } else {
            let s = self.size.unwrap_or(if test.is_lat() { 2 } else { 65536 });
            vec![s]
        };
        if self.duration.is_some() && self.iters.is_some() {
            return Err(bad("choose -n or -D, not both"));
        }
        if self.run_infinitely {
            run_infinitely(&self, test, &sizes)?;
        }
        // --run_infinitely: perftest's default duration of 5 s per line.
        let duration_secs = match (self.duration, self.run_infinitely) {
            (None, true) => Some(DEFAULT_INFINITE_SECS),
            (d, _) => d,
        };
        let iters = match (duration_secs, self.iters) {
            (Some(_), _) => None,
            (None, Some(n)) => Some(n),
            (None, None) => Some(if test.is_lat() { 1000 } else { 5000 }),
        };
        if let Some(n) = iters {
            if n < MIN_ITERS {
                return Err(bad(format!(
                    "-n must be at least {MIN_ITERS} (as perftest)"
                )));
            }
        }
        let duration = match duration_secs {
            Some(d) if !(d.is_finite() && (0.001..=86_400.0).contains(&d)) => {
                return Err(bad("-D takes seconds from 0.001 to 86400"))
            }
            d => d.map(Duration::from_secs_f64),
        };
        if self.qps == 0 {
            return Err(bad("-q must be at least 1"));
        }
        if test.is_lat() && self.qps != 1 {
            return Err(bad("latency tests run on one QP (-q 1), as perftest"));
        }
        let tx_depth = self.tx_depth.unwrap_or(if test.is_lat() { 1 } else { 128 });
        if tx_depth == 0 {
            return Err(bad("-t must be at least 1"));
        }
        if self.transport == Transport::Tcp {
            if !matches!(test, Test::SendBw | Test::SendLat) {
                return Err(bad(format!(
                    "--transport tcp runs send_bw and send_lat only, not {}",
                    test.name()
                )));
            }
            if self.api != Api::Verbs {
                return Err(bad("--api applies to --transport rdma only"));
            }
            if self.qps != 1 {
                return Err(bad("--transport tcp uses one connection (-q 1)"));
            }
        }
        if self.api == Api::Rdma && self.qps != 1 {
            return Err(bad(
                "--api rdma runs one connection (-q 1): one Rdma agent per QP is not \
                 a perftest multi-QP run",
            ));
        }
        if self.api == Api::Rpc {
            if !matches!(test, Test::SendBw | Test::SendLat) {
                return Err(bad(format!(
                    "--api rpc runs send_bw and send_lat only, not {}",
                    test.name()
                )));
            }
            if self.qps != 1 {
                return Err(bad("--api rpc runs one session (-q 1)"));
            }
            if let Some(s) = sizes.iter().find(|&&s| s > RPC_MAX) {
                return Err(bad(format!(
                    "--api rpc carries messages up to {RPC_MAX} bytes (the RPC engine's \
                     largest message), not {s}"
                )));
            }
        }
        // RPC runs over UD whatever -c says.
        let connection = if self.api == Api::Rpc {
            Connection::Ud
        } else {
            self.connection
        };
        if self.connection == Connection::Ud
            && self.api != Api::Rpc
            && (test != Test::SendLat
                || self.api != Api::Verbs
                || self.transport != Transport::Rdma)
        {
            return Err(bad(
                "-c UD runs send_lat with --api verbs over RDMA only (UD loses datagrams \
                 that find no receive posted: a bandwidth test would need flow control)",
            ));
        }
        if self.api == Api::Raw && self.events {
            return Err(bad(
                "-e is not supported with --api raw: the raw loop busy-polls the CQ as \
                 perftest's default (use --api verbs -e to sleep on the completion channel)",
            ));
        }
        let post_list = post_list(&self, test, tx_depth, iters)?;
        both_ways_srq_and_cm(&self, test)?;
        let inline = self.inline.unwrap_or(if test.is_lat() { 64 } else { 0 });
        Ok(Config {
            test,
            host: self.host,
            sizes,
            iters,
            duration,
            qps: self.qps,
            tx_depth,
            inline,
            inline_given: self.inline,
            events: self.events,
            device: self.device,
            gid_index: self.gid_index,
            ib_port: self.ib_port,
            port: self.port,
            gbits: self.report_gbits,
            api: self.api,
            transport: self.transport,
            connection,
            json: self.json,
            busy_poll: self.busy_poll_us.map(Duration::from_micros),
            rpc_read_threshold: self.rpc_read_threshold,
            rpc_get: self.rpc_get,
            no_peak: self.no_peak,
            limit_bw: self.limit_bw,
            post_list,
            bidirectional: self.bidirectional,
            rdma_cm: self.rdma_cm,
            srq: self.use_srq,
            run_infinitely: self.run_infinitely,
            out_json: match (self.out_json, self.out_json_file) {
                (_, Some(path)) => Some(path),
                (true, None) => Some(PathBuf::from(DEFAULT_JSON_FILE)),
                (false, None) => None,
            },
        })
    }
}

/// perftest's duration of a `--run_infinitely` line without `-D`.
pub const DEFAULT_INFINITE_SECS: f64 = 5.0;

/// Checks `--run_infinitely` against the test, the sizes and the output.
fn run_infinitely(cli: &Cli, test: Test, sizes: &[usize]) -> Result<(), ArgError> {
    let why = if test.is_lat() {
        "bandwidth tests only (as perftest)"
    } else if sizes.len() != 1 {
        "one message size (-s), not a sweep"
    } else if cli.iters.is_some() {
        "-D (a line per interval), not -n"
    } else if !matches!(cli.api, Api::Verbs | Api::Raw) || cli.transport != Transport::Rdma {
        "--api verbs or raw over RDMA"
    } else if cli.json || cli.out_json || cli.out_json_file.is_some() {
        "the table: a JSON document printed at the end would never be"
    } else if cli.limit_bw.is_some() {
        "no -w: the run has no end at which to judge it"
    } else {
        return Ok(());
    };
    Err(bad(format!("--run_infinitely runs with {why}")))
}

/// Checks `-b`, `--use-srq` and `-R` against the test and the API.
fn both_ways_srq_and_cm(cli: &Cli, test: Test) -> Result<(), ArgError> {
    let verbs = cli.api == Api::Verbs && cli.transport == Transport::Rdma;
    if cli.bidirectional {
        if test.is_lat() {
            return Err(bad(format!(
                "-b (--bidirectional) applies to bandwidth tests (as perftest): {} is a \
                 ping-pong or one op at a time already",
                test.name()
            )));
        }
        if !verbs {
            return Err(bad(
                "-b (--bidirectional) runs with --api verbs over RDMA only: the raw loop, \
                 the Rdma agent and the RPC engine are measured one way",
            ));
        }
        if cli.report_both {
            return Err(bad(
                "--report-both with -b: verbio-perf prints the sum of both directions only",
            ));
        }
    }
    if cli.use_srq {
        if !matches!(test, Test::SendBw | Test::SendLat) {
            return Err(bad(format!(
                "--use-srq applies to send_bw and send_lat (as perftest: only SENDs take \
                 receives), not {}",
                test.name()
            )));
        }
        if !verbs || cli.connection != Connection::Rc {
            return Err(bad(
                "--use-srq runs with --api verbs over RC only: the raw loop posts to each \
                 QP's own receive queue, the Rdma agent and RPC manage their receives",
            ));
        }
        if cli.rdma_cm {
            return Err(bad(
                "--use-srq with -R: the RDMA CM creates each connection's QP with a receive \
                 queue of its own",
            ));
        }
    }
    if cli.rdma_cm
        && (!matches!(cli.api, Api::Verbs | Api::Raw)
            || cli.transport != Transport::Rdma
            || cli.connection != Connection::Rc)
    {
        return Err(bad(
            "-R (--rdma_cm) runs with --api verbs or raw over RC: -c UD swaps its \
             addresses over the control port, --api rdma and rpc make their own connections",
        ));
    }
    Ok(())
}

/// Checks `-l` and `-Q` against the test, the API and `-t` / `-n`;
/// returns the WRs per post list (1 without `-l`).
fn post_list(cli: &Cli, test: Test, tx_depth: u32, iters: Option<u64>) -> Result<u32, ArgError> {
    if cli.post_list.is_none() && cli.cq_mod.is_none() {
        return Ok(1);
    }
    if cli.post_list == Some(0) || cli.cq_mod == Some(0) {
        return Err(bad("-l and -Q take a count of at least 1"));
    }
    if !matches!(test, Test::WriteBw | Test::SendBw) {
        return Err(bad(format!(
            "-l (--post_list) and -Q (--cq-mod) apply to write_bw and send_bw, not {} \
             (the runtime chains WRs that gather from memory: SEND and WRITE)",
            test.name()
        )));
    }
    if cli.api != Api::Verbs || cli.transport != Transport::Rdma {
        return Err(bad(
            "-l (--post_list) and -Q (--cq-mod) apply to --api verbs over RDMA only: \
             --api raw signals one WR in 100 and posts one at a time, --api rdma and rpc \
             post one message per call",
        ));
    }
    let list = cli.post_list.unwrap_or(1);
    let cq_mod = cli.cq_mod.unwrap_or(list);
    if cq_mod != list {
        return Err(bad(format!(
            "-Q {cq_mod} with -l {list}: the runtime leaves WRs unsignaled only inside a \
             post list and signals its last WR, so -Q must equal -l (or be left out; \
             without -l, -Q 1: every WR signaled)"
        )));
    }
    if tx_depth % list != 0 {
        return Err(bad(format!(
            "-t {tx_depth} is not a multiple of -l {list}: -t counts WRs in flight, \
             posted as whole lists"
        )));
    }
    if let Some(n) = iters {
        if n % u64::from(list) != 0 {
            return Err(bad(format!(
                "-n {n} is not a multiple of -l {list} (as perftest)"
            )));
        }
    }
    Ok(list)
}

impl Config {
    /// The largest message size of the run.
    pub fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1)
    }

    /// The run's mode bits for the hello (`ctl::mode`).
    pub fn mode(&self) -> u8 {
        use crate::ctl::mode;
        [
            (self.bidirectional, mode::BIDIRECTIONAL),
            (self.srq, mode::SRQ),
            (self.rdma_cm, mode::RDMA_CM),
            (self.run_infinitely, mode::INFINITE),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .fold(0, |bits, (_, b)| bits | b)
    }

    /// Ops in flight at a time over all QPs.
    pub fn in_flight(&self) -> u64 {
        u64::from(self.tx_depth) * u64::from(self.qps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        let cli = Cli::try_parse_from(std::iter::once("verbio-perf").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.resolve().map_err(|e| e.to_string())
    }

    #[test]
    fn perftest_flag_names_parse() {
        let c = parse(&[
            "write_bw",
            "10.0.0.2",
            "-s",
            "4096",
            "-n",
            "100",
            "-q",
            "2",
            "-t",
            "64",
            "-I",
            "0",
            "-e",
            "-d",
            "rxe0",
            "-x",
            "1",
            "-p",
            "19000",
            "--report_gbits",
            "--json",
        ])
        .expect("valid");
        assert_eq!(c.test, Test::WriteBw);
        assert_eq!(c.host.as_deref(), Some("10.0.0.2"));
        assert_eq!(c.sizes, vec![4096]);
        assert_eq!(c.iters, Some(100));
        assert_eq!((c.qps, c.tx_depth, c.inline), (2, 64, 0));
        assert!(c.events && c.gbits && c.json);
        assert_eq!(c.device.as_deref(), Some("rxe0"));
        assert_eq!((c.gid_index, c.port), (Some(1), 19000));
    }

    #[test]
    fn defaults_follow_the_test() {
        let bw = parse(&["send_bw"]).expect("valid");
        assert_eq!(
            (bw.sizes[0], bw.iters, bw.tx_depth),
            (65536, Some(5000), 128)
        );
        assert!(bw.host.is_none());
        let lat = parse(&["send_lat", "h"]).expect("valid");
        assert_eq!((lat.sizes[0], lat.iters, lat.tx_depth), (2, Some(1000), 1));
        assert_eq!(parse(&["atomic_bw"]).expect("valid").sizes, vec![8]);
    }

    #[test]
    fn sweep_is_powers_of_two_from_2_to_16_mib() {
        let s = sweep_sizes();
        assert_eq!(s.len(), 24);
        assert_eq!((s[0], s[23]), (2, 1 << 24));
        assert!(s.windows(2).all(|w| w[1] == 2 * w[0]));
        assert_eq!(parse(&["read_bw", "-a"]).expect("valid").sizes, s);
        assert_eq!(parse(&["atomic_lat", "-a"]).expect("valid").sizes, vec![8]);
    }

    #[test]
    fn ud_runs_send_lat_with_the_verbs_api_only() {
        let c = parse(&["send_lat", "-c", "UD"]).expect("valid");
        assert_eq!(c.connection, Connection::Ud);
        assert_eq!(
            parse(&["send_lat", "-c", "ud"]).expect("valid").connection,
            Connection::Ud
        );
        assert_eq!(
            parse(&["send_lat"]).expect("valid").connection,
            Connection::Rc
        );
        assert!(parse(&["send_bw", "-c", "UD"]).is_err());
        assert!(parse(&["send_lat", "-c", "UD", "--api", "raw"]).is_err());
        assert!(parse(&["send_lat", "-c", "UD", "--transport", "tcp"]).is_err());
    }

    #[test]
    fn size_lists_and_powers_of_4() {
        assert_eq!(
            parse(&["send_bw", "--sizes", "64, 4K,1m,100"])
                .expect("valid")
                .sizes,
            vec![64, 4096, 1 << 20, 100]
        );
        let p = parse(&["send_lat", "--sizes", "pow4"])
            .expect("valid")
            .sizes;
        assert_eq!(p, pow4_sizes());
        assert_eq!(p.len(), 10);
        assert_eq!((p[0], p[9]), (64, 16 << 20));
        assert!(p.windows(2).all(|w| w[1] == 4 * w[0]));
    }

    #[test]
    fn rpc_runs_send_tests_over_ud() {
        let c = parse(&["send_lat", "--api", "rpc", "-s", "16M"]).expect("valid");
        assert_eq!((c.api, c.connection), (Api::Rpc, Connection::Ud));
        assert_eq!(c.sizes, vec![16 << 20]);
        let c = parse(&["send_bw", "--api", "rpc", "-c", "UD", "-t", "8"]).expect("valid");
        assert_eq!((c.connection, c.tx_depth), (Connection::Ud, 8));
    }

    #[test]
    fn duration_replaces_iterations() {
        let c = parse(&["write_bw", "-D", "3"]).expect("valid");
        assert_eq!((c.iters, c.duration), (None, Some(Duration::from_secs(3))));
        let c = parse(&["send_lat", "-D", "0.25"]).expect("valid");
        assert_eq!(c.duration, Some(Duration::from_millis(250)));
        assert!(parse(&["write_bw", "-D", "3", "-n", "10"]).is_err());
    }

    #[test]
    fn unsupported_combinations_are_refused_with_a_reason() {
        for (args, needle) in [
            (&["send_lat", "-q", "2"][..], "one QP"),
            (
                &["write_bw", "--transport", "tcp"][..],
                "send_bw and send_lat only",
            ),
            (
                &["send_bw", "--api", "raw", "-e"][..],
                "-e is not supported",
            ),
            (&["send_bw", "-n", "2"][..], "at least 5"),
            (&["atomic_bw", "-s", "64"][..], "8-byte words"),
            (&["send_bw", "-a", "-s", "8"][..], "one of -s, -a"),
            (&["send_bw", "--sizes", "64", "-a"][..], "one of -s, -a"),
            (
                &["send_bw", "--sizes", "64", "-s", "8"][..],
                "one of -s, -a",
            ),
            (&["send_bw", "--sizes", "64,x"][..], "\"x\" is not a size"),
            (&["send_bw", "--sizes", "0"][..], "is not a size"),
            (&["send_bw", "-s", "0"][..], "is not a size in bytes"),
            (&["send_bw", "-s", "1G"][..], "is not a size in bytes"),
            (&["send_bw", "-D", "0"][..], "-D takes seconds"),
            (&["send_bw", "-D", "nan"][..], "-D takes seconds"),
            (
                &["write_bw", "--api", "rpc"][..],
                "send_bw and send_lat only",
            ),
            (&["send_bw", "--api", "rpc", "-q", "2"][..], "one session"),
            (
                &["send_bw", "--api", "rpc", "-s", "32M"][..],
                "up to 16777216 bytes",
            ),
            (
                &["send_bw", "--api", "rdma", "-q", "2"][..],
                "one connection",
            ),
        ] {
            let e = parse(args).expect_err("refused");
            assert!(e.contains(needle), "{args:?}: {e}");
        }
        assert!(parse(&["bogus_test"]).is_err());
    }

    #[test]
    fn perftest_flags_that_change_the_output_are_applied() {
        let c = parse(&["write_bw", "-N", "-w", "1000.5", "--out_json"]).expect("valid");
        assert!(c.no_peak);
        assert_eq!(c.limit_bw, Some(1000.5));
        assert_eq!(c.out_json, Some(PathBuf::from(DEFAULT_JSON_FILE)));
        let c = parse(&[
            "send_bw",
            "--noPeak",
            "--limit_bw",
            "5",
            "--out_json_file",
            "r.json",
        ])
        .expect("valid");
        assert!(c.no_peak);
        assert_eq!(c.limit_bw, Some(5.0));
        assert_eq!(c.out_json, Some(PathBuf::from("r.json")));
        let c = parse(&["send_bw"]).expect("valid");
        assert!(!c.no_peak && c.limit_bw.is_none() && c.out_json.is_none());
        for (args, needle) in [
            (&["send_lat", "-w", "10"][..], "bandwidth tests only"),
            (&["send_bw", "-w=-3"][..], "0 or more"),
            (&["send_bw", "-w", "inf"][..], "0 or more"),
        ] {
            let e = parse(args).expect_err("refused");
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn perftest_flags_that_change_nothing_are_accepted() {
        for args in [
            &["write_bw", "-F"][..],
            &["write_bw", "--CPU-freq"][..],
            &["send_bw", "--report-both"][..],
            &["send_lat", "-N"][..],
            &["read_bw", "-s", "1K", "-F", "-N", "--report-both"][..],
        ] {
            let c = parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert!(c.limit_bw.is_none() && c.out_json.is_none(), "{args:?}");
        }
        assert_eq!(
            parse(&["send_bw", "-s", "1K"]).expect("valid").sizes,
            [1024]
        );
    }

    #[test]
    fn post_list_and_cq_mod_apply_where_the_runtime_can_honour_them() {
        for args in [
            &["write_bw", "-l", "4"][..],
            &[
                "send_bw",
                "--post_list=4",
                "--cq-mod=4",
                "-t",
                "16",
                "-n",
                "40",
            ],
            &["write_bw", "-Q", "1"],
            &["send_bw", "-l", "1", "-Q", "1"],
        ] {
            let c = parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            let want = args
                .iter()
                .position(|a| *a == "-l")
                .map_or(if args[1] == "--post_list=4" { 4 } else { 1 }, |i| {
                    args[i + 1].parse().expect("a count")
                });
            assert_eq!(c.post_list, want, "{args:?}");
        }
        assert_eq!(parse(&["write_bw"]).expect("valid").post_list, 1);
        for (args, why) in [
            (&["write_bw", "-l", "4", "-Q", "8"][..], "-Q must equal -l"),
            (&["write_bw", "-l", "8", "-Q", "4"], "-Q must equal -l"),
            (&["write_bw", "-Q", "100"], "-Q must equal -l"),
            (&["write_bw", "-l", "0"], "at least 1"),
            (&["write_bw", "-Q", "0"], "at least 1"),
            (&["write_bw", "-l", "3"], "-t 128 is not a multiple of -l 3"),
            (
                &["write_bw", "-l", "4", "-n", "42"],
                "-n 42 is not a multiple",
            ),
            (&["read_bw", "-l", "4"], "not read_bw"),
            (&["atomic_bw", "-Q", "1"], "not atomic_bw"),
            (&["send_lat", "-l", "2"], "not send_lat"),
            (
                &["write_bw", "-l", "4", "--api", "raw"],
                "--api verbs over RDMA only",
            ),
            (
                &["write_bw", "-l", "4", "--api", "rdma"],
                "--api verbs over RDMA only",
            ),
            (
                &["send_bw", "-Q", "1", "--api", "rpc"],
                "--api verbs over RDMA only",
            ),
            (
                &["send_bw", "-l", "4", "--transport", "tcp"],
                "--api verbs over RDMA only",
            ),
        ] {
            let e = parse(args).expect_err("refused");
            assert!(e.contains(why), "{args:?}: {e}");
        }
    }

    #[test]
    fn perftest_flags_that_would_change_the_measure_are_refused_by_name() {
        let e = parse(&["send_bw", "-W", "counters/port_xmit_data"]).expect_err("refused");
        assert!(
            e.starts_with("does not support -W (--report-counters") && e.ends_with(" yet"),
            "{e}"
        );
    }

    #[test]
    fn bidirectional_srq_and_rdma_cm_where_they_can_be_honoured() {
        let c = parse(&["write_bw", "-b", "-R", "-q", "2"]).expect("valid");
        assert!(c.bidirectional && c.rdma_cm && !c.srq);
        assert_eq!(
            c.mode(),
            crate::ctl::mode::BIDIRECTIONAL | crate::ctl::mode::RDMA_CM
        );
        let c = parse(&["send_bw", "--bidirectional", "--use-srq", "-q", "4"]).expect("valid");
        assert!(c.bidirectional && c.srq);
        let c = parse(&["send_lat", "--use-srq"]).expect("valid");
        assert!(c.srq && !c.bidirectional);
        assert!(
            parse(&["send_lat", "--rdma_cm", "--api", "raw"])
                .expect("valid")
                .rdma_cm
        );
        assert_eq!(parse(&["send_bw"]).expect("valid").mode(), 0);
        for (args, why) in [
            (&["send_lat", "-b"][..], "applies to bandwidth tests"),
            (&["read_lat", "-b"], "applies to bandwidth tests"),
            (
                &["send_bw", "-b", "--api", "raw"],
                "--api verbs over RDMA only",
            ),
            (
                &["send_bw", "-b", "--api", "rdma"],
                "--api verbs over RDMA only",
            ),
            (
                &["send_bw", "-b", "--transport", "tcp"],
                "--api verbs over RDMA only",
            ),
            (
                &["send_bw", "-b", "--report-both"],
                "sum of both directions",
            ),
            (&["write_bw", "--use-srq"], "not write_bw"),
            (&["read_bw", "--use-srq"], "not read_bw"),
            (
                &["send_lat", "--use-srq", "-c", "UD"],
                "--api verbs over RC only",
            ),
            (
                &["send_bw", "--use-srq", "--api", "raw"],
                "--api verbs over RC only",
            ),
            (
                &["send_bw", "--use-srq", "-R"],
                "a receive queue of its own",
            ),
            (
                &["send_bw", "-R", "--api", "rpc"],
                "-R (--rdma_cm) runs with",
            ),
            (
                &["send_bw", "-R", "--api", "rdma"],
                "-R (--rdma_cm) runs with",
            ),
            (&["send_lat", "-R", "-c", "UD"], "-R (--rdma_cm) runs with"),
            (
                &["send_lat", "-R", "--transport", "tcp"],
                "-R (--rdma_cm) runs with",
            ),
        ] {
            let e = parse(args).expect_err("refused");
            assert!(e.contains(why), "{args:?}: {e}");
        }
    }

    #[test]
    fn run_infinitely_is_timed_one_size_and_a_table() {
        let c = parse(&["write_bw", "--run_infinitely"]).expect("valid");
        assert!(c.run_infinitely);
        assert_eq!(
            (c.iters, c.duration),
            (None, Some(Duration::from_secs_f64(DEFAULT_INFINITE_SECS)))
        );
        let c =
            parse(&["send_bw", "--run_infinitely", "-D", "0.5", "--api", "raw"]).expect("valid");
        assert_eq!(c.duration, Some(Duration::from_millis(500)));
        for (args, why) in [
            (
                &["send_lat", "--run_infinitely"][..],
                "bandwidth tests only",
            ),
            (&["write_bw", "--run_infinitely", "-a"], "one message size"),
            (
                &["write_bw", "--run_infinitely", "--sizes", "64,128"],
                "one message size",
            ),
            (&["write_bw", "--run_infinitely", "-n", "100"], "not -n"),
            (
                &["send_bw", "--run_infinitely", "--api", "rdma"],
                "--api verbs or raw",
            ),
            (
                &["send_bw", "--run_infinitely", "--transport", "tcp"],
                "--api verbs or raw",
            ),
            (&["write_bw", "--run_infinitely", "--json"], "the table"),
            (&["write_bw", "--run_infinitely", "--out_json"], "the table"),
            (&["write_bw", "--run_infinitely", "-w", "10"], "no -w"),
        ] {
            let e = parse(args).expect_err("refused");
            assert!(e.contains(why), "{args:?}: {e}");
        }
    }

    #[test]
    fn test_codes_round_trip() {
        for t in Test::ALL {
            assert_eq!(Test::from_code(t.code()), Some(t));
        }
        assert_eq!(Test::from_code(0), None);
        assert_eq!(Test::from_code(9), None);
    }
}
