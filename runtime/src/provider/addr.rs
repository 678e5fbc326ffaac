//! Provider-defined endpoint addresses and the checks every endpoint passes.
//!
//! An [`Endpoint`] names a QP by number, LID and GID, as verbs does; what
//! else a peer needs to reach it is a [`ProviderAddr`]: opaque bytes that
//! only the endpoint's provider reads (the software device puts its
//! engine's socket address there; libibverbs routes by LID/GID and leaves
//! it empty). The layers above carry it, compare it and put it on the wire
//! length-prefixed, with the provider's [`ProviderKind::wire_tag`] beside
//! it; [`Endpoint::check`] asks the provider whether it is one a peer can
//! connect to. Adding a provider adds arms here, not above.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use thiserror::Error;

use super::{soft, Endpoint, ProviderKind};

/// The longest provider address, in bytes: a bound on what a peer can make
/// a decoder hold.
pub const MAX_ADDR_LEN: usize = 32;

/// What a peer needs, besides QP number, LID and GID, to reach an endpoint:
/// up to [`MAX_ADDR_LEN`] bytes whose meaning its provider defines (empty
/// for a provider that routes by LID/GID).
///
/// A provider addressed by an IP socket address stores it with
/// [`ProviderAddr::socket`]: a family byte (4 or 6), the port (`u16` LE),
/// the IP and, for IPv6, the scope id (`u32` LE): 7 or 23 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ProviderAddr {
    len: u8,
    bytes: [u8; MAX_ADDR_LEN],
}

const FAMILY_V4: u8 = 4;
const FAMILY_V6: u8 = 6;
const V4_LEN: usize = 1 + 2 + 4;
const V6_LEN: usize = 1 + 2 + 16 + 4;

impl ProviderAddr {
    /// No address.
    pub const NONE: ProviderAddr = ProviderAddr {
        len: 0,
        bytes: [0; MAX_ADDR_LEN],
    };

    /// An address of these bytes; `None` if there are more than
    /// [`MAX_ADDR_LEN`].
    pub fn new(bytes: &[u8]) -> Option<ProviderAddr> {
        let mut a = ProviderAddr::NONE;
        a.bytes.get_mut(..bytes.len())?.copy_from_slice(bytes);
        // MAX_ADDR_LEN fits u8.
        a.len = bytes.len() as u8;
        Some(a)
    }

    /// The address's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len).min(MAX_ADDR_LEN)]
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// True for [`ProviderAddr::NONE`].
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// An IP socket address in the form the module docs give (the IPv6 flow
    /// label is not kept).
    pub fn socket(addr: SocketAddr) -> ProviderAddr {
        let mut b = [0u8; V6_LEN];
        let len = match addr {
            SocketAddr::V4(a) => {
                b[0] = FAMILY_V4;
                b[1..3].copy_from_slice(&a.port().to_le_bytes());
                b[3..7].copy_from_slice(&a.ip().octets());
                V4_LEN
            }
            SocketAddr::V6(a) => {
                b[0] = FAMILY_V6;
                b[1..3].copy_from_slice(&a.port().to_le_bytes());
                b[3..19].copy_from_slice(&a.ip().octets());
                b[19..23].copy_from_slice(&a.scope_id().to_le_bytes());
                V6_LEN
            }
        };
        // Invariant: 7 or 23 bytes, below MAX_ADDR_LEN.
        ProviderAddr::new(&b[..len]).unwrap_or(ProviderAddr::NONE)
    }

    /// The IP socket address [`ProviderAddr::socket`] stored, if these bytes
    /// are exactly one (never panics on any bytes).
    pub fn to_socket(&self) -> Option<SocketAddr> {
        let b = self.as_bytes();
        let port = u16::from_le_bytes([*b.get(1)?, *b.get(2)?]);
        match (b.first()?, b.len()) {
            (&FAMILY_V4, V4_LEN) => Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::new(b[3], b[4], b[5], b[6]),
                port,
            ))),
            (&FAMILY_V6, V6_LEN) => {
                let ip: [u8; 16] = b[3..19].try_into().ok()?;
                let scope: [u8; 4] = b[19..23].try_into().ok()?;
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(ip),
                    port,
                    0,
                    u32::from_le_bytes(scope),
                )))
            }
            _ => None,
        }
    }
}

impl From<SocketAddr> for ProviderAddr {
    fn from(addr: SocketAddr) -> ProviderAddr {
        ProviderAddr::socket(addr)
    }
}

impl fmt::Debug for ProviderAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("ProviderAddr(none)");
        }
        if let Some(a) = self.to_socket() {
            return write!(f, "ProviderAddr({a})");
        }
        write!(f, "ProviderAddr({:02x?})", self.as_bytes())
    }
}

impl fmt::Display for ProviderAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_socket() {
            Some(a) => write!(f, "{a}"),
            None if self.is_empty() => f.write_str("-"),
            None => self
                .as_bytes()
                .iter()
                .try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

impl ProviderKind {
    /// The byte that names this provider on the wire (the handshake's
    /// hello): stable across versions, never 0.
    pub fn wire_tag(self) -> u8 {
        match self {
            ProviderKind::Soft => 1,
            ProviderKind::Ibverbs => 2,
        }
    }

    /// The provider a [`ProviderKind::wire_tag`] names, if any.
    pub fn from_wire_tag(tag: u8) -> Option<ProviderKind> {
        match tag {
            1 => Some(ProviderKind::Soft),
            2 => Some(ProviderKind::Ibverbs),
            _ => None,
        }
    }
}

/// Why an endpoint is not one a peer can connect to
/// ([`Endpoint::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("invalid endpoint: {field} = {value}: {reason}")]
pub struct InvalidEndpoint {
    /// The field at fault.
    pub field: &'static str,
    /// Its value (or a number that stands for it).
    pub value: u64,
    /// Why it is refused.
    pub reason: &'static str,
}

pub(crate) fn invalid(
    field: &'static str,
    value: u64,
    reason: &'static str,
) -> Result<(), InvalidEndpoint> {
    Err(InvalidEndpoint {
        field,
        value,
        reason,
    })
}

impl Endpoint {
    /// The checks every endpoint a peer announces passes before a QP is
    /// connected to it: 24-bit QP number and PSN, and its provider's own
    /// rules for its address (the software device: a socket address one
    /// can connect to; libibverbs: no address, a LID or a GID).
    pub fn check(&self) -> Result<(), InvalidEndpoint> {
        if self.qpn > 0x00ff_ffff {
            return invalid("qpn", u64::from(self.qpn), "QP numbers have 24 bits");
        }
        if self.psn > 0x00ff_ffff {
            return invalid("psn", u64::from(self.psn), "PSNs have 24 bits");
        }
        match self.provider {
            ProviderKind::Soft => soft::check_endpoint(self),
            ProviderKind::Ibverbs => check_routed(self),
        }
    }

    /// This endpoint as it is announced to a peer over a TCP connection
    /// whose local end is `tcp`: its provider may fill in what only the
    /// connection tells (the software device: an engine bound to the
    /// unspecified address is announced at `tcp`'s IP). Anything else is
    /// announced as it is.
    pub fn announced_over(self, tcp: SocketAddr) -> Endpoint {
        match self.provider {
            ProviderKind::Soft => Endpoint {
                addr: soft::announced_addr(self.addr, tcp),
                ..self
            },
            ProviderKind::Ibverbs => self,
        }
    }
}

/// libibverbs' endpoints (here because the handshake checks them in every
/// build, also without the `ibverbs` feature): routed by LID or GID, no
/// provider address.
fn check_routed(ep: &Endpoint) -> Result<(), InvalidEndpoint> {
    if !ep.addr.is_empty() {
        return invalid(
            "addr",
            ep.addr.len() as u64,
            "this provider's endpoints carry no address",
        );
    }
    if ep.lid == 0 && ep.gid.is_zero() {
        return invalid("lid/gid", 0, "hardware endpoint with neither LID nor GID");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip_and_other_bytes_are_none() {
        for a in [
            "127.0.0.1:4791",
            "10.1.2.3:65535",
            "[::1]:7000",
            "[fe80::1%3]:18515",
        ] {
            let a: SocketAddr = a.parse().unwrap();
            let p = ProviderAddr::socket(a);
            assert_eq!(p.to_socket(), Some(a), "{p:?}");
            assert_eq!(ProviderAddr::new(p.as_bytes()), Some(p));
        }
        let v4 = ProviderAddr::socket("1.2.3.4:5".parse().unwrap());
        let mut longer = v4.as_bytes().to_vec();
        longer.push(0);
        for bad in [&[][..], &[4], &[4, 1, 0], &longer, &[6; 7], &[9; 23]] {
            let p = ProviderAddr::new(bad).unwrap();
            assert_eq!(p.to_socket(), None, "{bad:?}");
        }
        assert_eq!(ProviderAddr::new(&[0; MAX_ADDR_LEN + 1]), None);
        assert_eq!(ProviderAddr::new(&[7; MAX_ADDR_LEN]).unwrap().len(), 32);
    }

    #[test]
    fn wire_tags_name_each_provider_once() {
        for k in [ProviderKind::Soft, ProviderKind::Ibverbs] {
            assert_ne!(k.wire_tag(), 0);
            assert_eq!(ProviderKind::from_wire_tag(k.wire_tag()), Some(k));
        }
        assert_eq!(ProviderKind::from_wire_tag(0), None);
        assert_eq!(ProviderKind::from_wire_tag(3), None);
    }
}
