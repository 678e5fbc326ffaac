//! [`RpcAddr`]: an endpoint's address, and its text form for handing it to
//! another process.
//!
//! An address is the transport's bytes (on UD: the queue pair's endpoint
//! and Q_Key, `ud::encode_ud_addr`). Its text form is `rpc:` followed by
//! those bytes in lowercase hex, one token with no spaces, so it can go on
//! a command line, in an environment variable, a file or a line of a TCP
//! stream:
//!
//! ```text
//! server$ my_server            # prints: serving at rpc:0a1b…
//! client$ my_client rpc:0a1b…  # "rpc:0a1b…".parse::<RpcAddr>()?
//! ```

use std::fmt;
use std::io::{self, BufRead};
use std::ops::Deref;
use std::str::FromStr;

use thiserror::Error;

/// The longest address, in bytes, that [`RpcAddr::from_str`] and
/// [`RpcAddr::read_from`] accept (a UD address is 84: `ud::UD_ADDR_LEN`).
pub const MAX_RPC_ADDR_LEN: usize = 256;

/// What an address's text form starts with.
const PREFIX: &str = "rpc:";

/// The longest text form: the prefix, two hex digits per byte.
const MAX_TEXT_LEN: usize = PREFIX.len() + 2 * MAX_RPC_ADDR_LEN;

/// An RPC endpoint's address ([`Rpc::local_addr`](super::Rpc::local_addr)),
/// as a peer's [`Rpc::connect`](super::Rpc::connect) takes it (it
/// dereferences to the transport's bytes).
///
/// Its [`Display`](fmt::Display) and [`FromStr`] are the text form `rpc:`
/// + hex, to hand the address to another process (module docs):
///
/// ```
/// # mod verbio { pub use verbio_ops::*; }
/// use verbio::rpc::RpcAddr;
///
/// let addr = RpcAddr::from(vec![0x0a, 0x1b, 0xff]);
/// assert_eq!(addr.to_string(), "rpc:0a1bff");
/// assert_eq!("rpc:0a1bff".parse::<RpcAddr>().unwrap(), addr);
/// assert!("0a1bff".parse::<RpcAddr>().is_err()); // no "rpc:"
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RpcAddr(Vec<u8>);

impl RpcAddr {
    /// The transport's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The transport's bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// Reads one address in text form from a line of `reader` (as a peer
    /// wrote it with `writeln!(stream, "{addr}")`), reading at most the
    /// longest text form and its line end: a peer that sends anything else
    /// gets an [`io::ErrorKind::InvalidData`] error naming what it sent,
    /// never an unbounded read. How long it waits is the reader's (set a
    /// read timeout on a socket).
    pub fn read_from(reader: impl BufRead) -> io::Result<RpcAddr> {
        let mut line = Vec::new();
        // Room for "\r\n" and one byte more, to tell "too long" apart.
        let limit = (MAX_TEXT_LEN + 3) as u64;
        reader.take(limit).read_until(b'\n', &mut line)?;
        if line.last() != Some(&b'\n') {
            let why = if line.len() as u64 == limit {
                format!("a line longer than an RPC address ({MAX_TEXT_LEN} characters at most)")
            } else {
                format!("{} bytes and then the end of the stream", line.len())
            };
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected an RPC address on a line, got {why}"),
            ));
        }
        let text = std::str::from_utf8(&line).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "expected an RPC address on a line, got bytes that are not text",
            )
        })?;
        text.parse()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

impl From<Vec<u8>> for RpcAddr {
    fn from(bytes: Vec<u8>) -> RpcAddr {
        RpcAddr(bytes)
    }
}

impl From<RpcAddr> for Vec<u8> {
    fn from(addr: RpcAddr) -> Vec<u8> {
        addr.0
    }
}

impl Deref for RpcAddr {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for RpcAddr {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Display for RpcAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PREFIX)?;
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for RpcAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RpcAddr({self})")
    }
}

/// Why a text is not an [`RpcAddr`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ParseRpcAddrError {
    /// It does not start with `rpc:`.
    #[error("an RPC address starts with \"rpc:\" (got {start:?})")]
    NoPrefix {
        /// Its first characters.
        start: String,
    },
    /// Nothing follows `rpc:`.
    #[error("an RPC address has bytes after \"rpc:\"")]
    Empty,
    /// A character that is not a hex digit.
    #[error("an RPC address is hex after \"rpc:\", but character {at} is {found:?}")]
    NotHex {
        /// Its position, counted in characters from the start of the address.
        at: usize,
        /// The character.
        found: char,
    },
    /// An odd number of hex digits.
    #[error("an RPC address has two hex digits per byte, got {digits} digits")]
    OddLength {
        /// Digits found.
        digits: usize,
    },
    /// Longer than [`MAX_RPC_ADDR_LEN`].
    #[error("an RPC address of {len} bytes is longer than the {MAX_RPC_ADDR_LEN} accepted")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
}

impl FromStr for RpcAddr {
    type Err = ParseRpcAddrError;

    /// Parses the text form `rpc:` + hex (either case); whitespace around
    /// it (a line end, say) is ignored.
    fn from_str(s: &str) -> Result<RpcAddr, ParseRpcAddrError> {
        let s = s.trim();
        let Some(hex) = s.strip_prefix(PREFIX) else {
            return Err(ParseRpcAddrError::NoPrefix {
                start: s.chars().take(PREFIX.len() + 8).collect(),
            });
        };
        if hex.is_empty() {
            return Err(ParseRpcAddrError::Empty);
        }
        if let Some((i, c)) = hex
            .chars()
            .enumerate()
            .find(|(_, c)| !c.is_ascii_hexdigit())
        {
            return Err(ParseRpcAddrError::NotHex {
                at: PREFIX.len() + i,
                found: c,
            });
        }
        // All ASCII from here: one byte per character.
        if hex.len() % 2 == 1 {
            return Err(ParseRpcAddrError::OddLength { digits: hex.len() });
        }
        if hex.len() / 2 > MAX_RPC_ADDR_LEN {
            return Err(ParseRpcAddrError::TooLong { len: hex.len() / 2 });
        }
        let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
        Ok(RpcAddr(
            hex.as_bytes()
                .chunks_exact(2)
                .map(|p| digit(p[0]) << 4 | digit(p[1]))
                .collect(),
        ))
    }
}
