//! The control messages between client and server: what to run, the
//! memory each side grants, and the step-by-step sync around each size.
//! Fixed 24-byte frames, over the setup's TCP connection (verbs and raw
//! APIs) or as tagged messages on the `Rdma` connection.

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::args::{Api, Connection, Test};

/// Size of every frame.
pub const FRAME: usize = 24;
/// Protocol version: both sides must run the same one.
const VERSION: u8 = 2;

/// One control message.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Frame {
    /// Client → server, first: the test, API, QP count and largest size.
    Hello {
        /// The test.
        test: Test,
        /// The API's wire code.
        api: u8,
        /// The connection type's wire code.
        connection: u8,
        /// QP count.
        qps: u16,
        /// Largest message size of the run.
        max_size: u64,
        /// The run's [`mode`] flags (`-b`, `--use-srq`, `-R`,
        /// `--run_infinitely`): both sides must be started with the same.
        mode: u8,
    },
    /// Both ways (UD): a UD queue pair's number, Q_Key, LID, active MTU
    /// and provider (0 soft, 1 ibverbs); then its [`Gid`](Frame::Gid) and,
    /// on the software device, its [`SoftAddr`](Frame::SoftAddr).
    UdQp {
        /// QP number.
        qpn: u32,
        /// Q_Key.
        qkey: u32,
        /// LID.
        lid: u16,
        /// Active MTU (verbs code).
        mtu: u8,
        /// Provider code.
        provider: u8,
    },
    /// The GID of the preceding [`UdQp`](Frame::UdQp), as two big-endian halves.
    Gid {
        /// Bytes 0..8.
        hi: u64,
        /// Bytes 8..16.
        lo: u64,
    },
    /// The software device's engine address of the preceding
    /// [`UdQp`](Frame::UdQp): an IPv6 (or IPv4-mapped) address and port.
    SoftAddr {
        /// Port.
        port: u16,
        /// Address bytes 0..8.
        hi: u64,
        /// Address bytes 8..16.
        lo: u64,
    },
    /// Both ways after the hello: memory the peer may read, write and use
    /// atomics on.
    Region {
        /// Virtual address.
        addr: u64,
        /// Length.
        len: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Client → server: the next size; `iters` 0 runs until the client's
    /// stop marker (for `ms` milliseconds, the duration of a timed step,
    /// which the server's own loop of `-b` runs for too).
    Step {
        /// Message size.
        size: u64,
        /// Iterations, or 0.
        iters: u64,
        /// A timed step's duration in milliseconds (0 with `iters`).
        ms: u32,
    },
    /// Client → server: the end of the run.
    Bye,
    /// Server → client: ready for the step's traffic.
    Go,
    /// Server → client (verbs and raw APIs): ready for the step's traffic,
    /// once the client has sent `drain` empty messages on each QP (they
    /// consume the receives the previous step left posted).
    GoDrain {
        /// Empty messages to send first, per QP.
        drain: u64,
    },
    /// Server → client: the step's traffic has all arrived.
    Done,
    /// Client → server (Rdma API): the step's messages have all been sent.
    Stop,
    /// Server → client (`-b`), after [`Done`](Frame::Done): the server's
    /// own direction of the step.
    PeerBw {
        /// Messages the server's loop completed.
        iterations: u64,
        /// Its average bandwidth, MB/s (2^20).
        avg_mbps: f64,
        /// Its peak bandwidth, MB/s (2^20).
        peak_mbps: f32,
    },
}

/// The bits of [`Frame::Hello`]'s `mode`.
pub mod mode {
    /// `-b`: traffic both ways.
    pub const BIDIRECTIONAL: u8 = 1;
    /// `--use-srq`: receives on a shared receive queue.
    pub const SRQ: u8 = 2;
    /// `-R`: the QPs connect through the RDMA CM.
    pub const RDMA_CM: u8 = 4;
    /// `--run_infinitely`.
    pub const INFINITE: u8 = 8;

    /// The flags set in `bits`, as on the command line.
    pub fn flags(bits: u8) -> String {
        let names: Vec<&str> = [
            (BIDIRECTIONAL, "-b"),
            (SRQ, "--use-srq"),
            (RDMA_CM, "-R"),
            (INFINITE, "--run_infinitely"),
        ]
        .into_iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| n)
        .collect();
        if names.is_empty() {
            "none of -b, --use-srq, -R, --run_infinitely".into()
        } else {
            names.join(" ")
        }
    }
}

/// A malformed or unexpected control message.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The connection failed or closed.
    #[error("control connection: {0}")]
    Io(#[from] std::io::Error),
    /// Bytes that are no frame of this protocol.
    #[error("bad control frame {0:02x?} (is the peer a verbio-perf of the same version?)")]
    Bad(Vec<u8>),
    /// A valid frame where another was due.
    #[error("expected {expected} from the peer, got {got:?}")]
    Unexpected {
        /// What was due.
        expected: &'static str,
        /// What came.
        got: Frame,
    },
    /// The two sides were started differently.
    #[error("{0}")]
    Mismatch(String),
}

impl Frame {
    /// The frame's bytes.
    pub fn encode(&self) -> [u8; FRAME] {
        let mut b = [0u8; FRAME];
        b[1] = VERSION;
        let (kind, x, y, z) = match *self {
            Frame::Hello {
                test,
                api,
                connection,
                qps,
                max_size,
                mode,
            } => (
                1,
                u32::from(test.code()) | u32::from(api) << 8 | u32::from(qps) << 16,
                max_size,
                u64::from(connection) | u64::from(mode) << 8,
            ),
            Frame::UdQp {
                qpn,
                qkey,
                lid,
                mtu,
                provider,
            } => (
                9,
                qpn,
                u64::from(qkey) | u64::from(lid) << 32 | u64::from(mtu) << 48,
                u64::from(provider),
            ),
            Frame::Gid { hi, lo } => (10, 0, hi, lo),
            Frame::SoftAddr { port, hi, lo } => (11, u32::from(port), hi, lo),
            Frame::Region { addr, len, rkey } => (2, rkey, addr, len),
            Frame::Step { size, iters, ms } => (3, ms, size, iters),
            Frame::Bye => (4, 0, 0, 0),
            Frame::Go => (5, 0, 0, 0),
            Frame::Done => (6, 0, 0, 0),
            Frame::Stop => (7, 0, 0, 0),
            Frame::GoDrain { drain } => (8, 0, drain, 0),
            Frame::PeerBw {
                iterations,
                avg_mbps,
                peak_mbps,
            } => (12, peak_mbps.to_bits(), iterations, avg_mbps.to_bits()),
        };
        b[0] = kind;
        b[4..8].copy_from_slice(&x.to_le_bytes());
        b[8..16].copy_from_slice(&y.to_le_bytes());
        b[16..24].copy_from_slice(&z.to_le_bytes());
        b
    }

    /// Decodes [`Frame::encode`].
    pub fn decode(b: &[u8]) -> Result<Frame, CtlError> {
        let bad = || CtlError::Bad(b.to_vec());
        if b.len() != FRAME || b[1] != VERSION {
            return Err(bad());
        }
        let x = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let (y, z) = (word(8), word(16));
        Ok(match b[0] {
            1 => Frame::Hello {
                test: Test::from_code(x as u8).ok_or_else(bad)?,
                api: (x >> 8) as u8,
                connection: u8::try_from(z & 0xff).map_err(|_| bad())?,
                qps: (x >> 16) as u16,
                max_size: y,
                mode: u8::try_from(z >> 8).map_err(|_| bad())?,
            },
            2 => Frame::Region {
                addr: y,
                len: z,
                rkey: x,
            },
            3 => Frame::Step {
                size: y,
                iters: z,
                ms: x,
            },
            4 => Frame::Bye,
            5 => Frame::Go,
            6 => Frame::Done,
            7 => Frame::Stop,
            8 => Frame::GoDrain { drain: y },
            9 => Frame::UdQp {
                qpn: x,
                qkey: y as u32,
                lid: (y >> 32) as u16,
                mtu: (y >> 48) as u8,
                provider: u8::try_from(z).map_err(|_| bad())?,
            },
            10 => Frame::Gid { hi: y, lo: z },
            11 => Frame::SoftAddr {
                port: u16::try_from(x).map_err(|_| bad())?,
                hi: y,
                lo: z,
            },
            12 => Frame::PeerBw {
                iterations: y,
                avg_mbps: f64::from_bits(z),
                peak_mbps: f32::from_bits(x),
            },
            _ => return Err(bad()),
        })
    }
}

/// Checks a client's hello against this server's settings (`mode`: its
/// [`mode`] bits); returns the client's QP count and largest size.
pub fn check_hello(
    f: Frame,
    test: Test,
    api: Api,
    connection: Connection,
    mode: u8,
) -> Result<(u32, usize), CtlError> {
    match f {
        Frame::Hello {
            test: t,
            api: a,
            connection: c,
            qps,
            max_size,
            mode: m,
        } => {
            if t != test || a != api.code() || c != connection.code() {
                return Err(CtlError::Mismatch(format!(
                    "the client runs {} with API code {a} and connection code {c}, this server \
                     {} with {api:?} over {connection:?} (start both sides with the same test, \
                     --api and -c)",
                    t.name(),
                    test.name()
                )));
            }
            if m != mode {
                return Err(CtlError::Mismatch(format!(
                    "the client runs with {}, this server with {} (start both sides with \
                     the same flags)",
                    mode::flags(m),
                    mode::flags(mode)
                )));
            }
            let size = usize::try_from(max_size)
                .ok()
                .filter(|&s| s > 0 && s <= crate::args::SWEEP_MAX.max(1 << 30))
                .ok_or_else(|| CtlError::Mismatch(format!("bad message size {max_size}")))?;
            if qps == 0 || qps > 1024 {
                return Err(CtlError::Mismatch(format!("bad QP count {qps}")));
            }
            Ok((u32::from(qps), size))
        }
        got => Err(CtlError::Unexpected {
            expected: "the client's hello",
            got,
        }),
    }
}

/// Writes one frame.
pub async fn send<S: AsyncWrite + Unpin>(s: &mut S, f: Frame) -> Result<(), CtlError> {
    s.write_all(&f.encode()).await?;
    s.flush().await?;
    Ok(())
}

/// Reads one frame.
pub async fn recv<S: AsyncRead + Unpin>(s: &mut S) -> Result<Frame, CtlError> {
    let mut b = [0u8; FRAME];
    s.read_exact(&mut b).await?;
    Frame::decode(&b)
}

/// Reads one frame and checks it is `want`.
pub async fn expect<S: AsyncRead + Unpin>(
    s: &mut S,
    want: Frame,
    what: &'static str,
) -> Result<(), CtlError> {
    match recv(s).await? {
        f if f == want => Ok(()),
        got => Err(CtlError::Unexpected {
            expected: what,
            got,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        for f in [
            Frame::Hello {
                test: Test::AtomicLat,
                api: Api::Raw.code(),
                connection: Connection::Rc.code(),
                qps: 7,
                max_size: 1 << 23,
                mode: mode::BIDIRECTIONAL | mode::INFINITE,
            },
            Frame::UdQp {
                qpn: 0xab_cdef,
                qkey: 0x1111_1111,
                lid: 0xbeef,
                mtu: 5,
                provider: 1,
            },
            Frame::Gid {
                hi: 1,
                lo: u64::MAX,
            },
            Frame::SoftAddr {
                port: 18515,
                hi: 7,
                lo: 9,
            },
            Frame::Region {
                addr: 0xdead_beef_0000,
                len: 4096,
                rkey: 0x1234_5678,
            },
            Frame::Step {
                size: 64,
                iters: 0,
                ms: 86_400_000,
            },
            Frame::PeerBw {
                iterations: 1 << 40,
                avg_mbps: 1234.5,
                peak_mbps: 2345.25,
            },
            Frame::Bye,
            Frame::Go,
            Frame::Done,
            Frame::Stop,
            Frame::GoDrain { drain: 37 },
        ] {
            assert_eq!(Frame::decode(&f.encode()).expect("decodes"), f);
        }
    }

    #[test]
    fn garbage_and_mismatches_are_errors() {
        assert!(Frame::decode(&[0u8; FRAME]).is_err());
        assert!(Frame::decode(&[1u8; 5]).is_err());
        let mut b = Frame::Go.encode();
        b[0] = 99;
        assert!(Frame::decode(&b).is_err());
        let hello = Frame::Hello {
            test: Test::SendBw,
            api: Api::Verbs.code(),
            connection: Connection::Rc.code(),
            qps: 2,
            max_size: 65536,
            mode: mode::SRQ,
        };
        let rc = Connection::Rc;
        let srq = mode::SRQ;
        assert_eq!(
            check_hello(hello, Test::SendBw, Api::Verbs, rc, srq).expect("matches"),
            (2, 65536)
        );
        assert!(check_hello(hello, Test::SendLat, Api::Verbs, rc, srq).is_err());
        assert!(check_hello(hello, Test::SendBw, Api::Raw, rc, srq).is_err());
        assert!(check_hello(hello, Test::SendBw, Api::Verbs, Connection::Ud, srq).is_err());
        assert!(check_hello(Frame::Go, Test::SendBw, Api::Verbs, rc, srq).is_err());
        let e = check_hello(hello, Test::SendBw, Api::Verbs, rc, mode::BIDIRECTIONAL)
            .expect_err("another mode")
            .to_string();
        assert!(
            e.contains("the client runs with --use-srq, this server with -b"),
            "{e}"
        );
    }
}
