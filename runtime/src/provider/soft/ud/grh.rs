//! The 40 bytes at the start of every UD receive buffer, as rxe writes
//! them (`rxe_resp.c`, the UD branch of its SEND data placement): for RoCE
//! v2 over IPv4, 20 zero bytes and then the packet's IPv4 header; over
//! IPv6, the packet's IPv6 header. The soft device builds the header its
//! datagram would have had as a RoCE v2 packet between the two engines'
//! GIDs: UDP, don't-fragment, the address handle's hop limit as TTL, the
//! length of IP + UDP + BTH + DETH (+ immediate) + padded payload + ICRC.

use crate::provider::{Gid, GRH_LEN};

/// UDP header bytes.
const UDP: usize = 8;
/// RoCE base transport header bytes.
const BTH: usize = 12;
/// Datagram extended transport header bytes.
const DETH: usize = 8;
/// Immediate data bytes.
const IMM: usize = 4;
/// Invariant CRC bytes.
const ICRC: usize = 4;
/// IP protocol number of UDP.
const IPPROTO_UDP: u8 = 17;

fn ipv4(g: &Gid) -> Option<[u8; 4]> {
    let b = &g.0;
    (b[..10].iter().all(|&x| x == 0) && b[10] == 0xff && b[11] == 0xff)
        .then(|| [b[12], b[13], b[14], b[15]])
}

/// The GRH area of a datagram from `sgid` to `dgid` with `payload` bytes
/// (`imm`: it carried immediate data). `id`: the IPv4 identification.
pub(crate) fn build(
    sgid: &Gid,
    dgid: &Gid,
    hop_limit: u8,
    payload: usize,
    imm: bool,
    id: u16,
) -> [u8; GRH_LEN] {
    let pad = payload.wrapping_neg() & 3;
    let transport = UDP + BTH + DETH + if imm { IMM } else { 0 } + payload + pad + ICRC;
    let mut g = [0u8; GRH_LEN];
    match (ipv4(sgid), ipv4(dgid)) {
        (Some(src), Some(dst)) => {
            let h = &mut g[20..];
            h[0] = 0x45;
            // (Datagrams are at most one MTU: the length fits.)
            h[2..4].copy_from_slice(&((20 + transport) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&id.to_be_bytes());
            // Don't fragment.
            h[6] = 0x40;
            h[8] = hop_limit;
            h[9] = IPPROTO_UDP;
            h[12..16].copy_from_slice(&src);
            h[16..20].copy_from_slice(&dst);
            let sum = checksum(h);
            h[10..12].copy_from_slice(&sum.to_be_bytes());
        }
        _ => {
            g[0] = 0x60;
            g[4..6].copy_from_slice(&(transport as u16).to_be_bytes());
            g[6] = IPPROTO_UDP;
            g[7] = hop_limit;
            g[8..24].copy_from_slice(&sgid.0);
            g[24..40].copy_from_slice(&dgid.0);
        }
    }
    g
}

/// The IPv4 header checksum (RFC 791: ones' complement of the ones'
/// complement sum of the 16-bit words, the checksum field taken as 0).
fn checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = h
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::Grh;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(a: [u8; 4]) -> Gid {
        Gid(Ipv4Addr::from(a).to_ipv6_mapped().octets())
    }

    #[test]
    fn ipv4_form_is_twenty_zero_bytes_and_a_valid_ipv4_header() {
        let (s, d) = (v4([10, 0, 0, 1]), v4([10, 0, 0, 2]));
        let g = build(&s, &d, 64, 32, false, 0x1234);
        assert!(g[..20].iter().all(|&b| b == 0));
        let h = &g[20..];
        assert_eq!(h[0], 0x45);
        // 20 IP + 8 UDP + 12 BTH + 8 DETH + 32 payload + 4 ICRC.
        assert_eq!(u16::from_be_bytes([h[2], h[3]]), 84);
        assert_eq!(u16::from_be_bytes([h[4], h[5]]), 0x1234);
        assert_eq!(u16::from_be_bytes([h[6], h[7]]), 0x4000);
        assert_eq!((h[8], h[9]), (64, 17));
        assert_eq!(&h[12..16], &[10, 0, 0, 1]);
        assert_eq!(&h[16..20], &[10, 0, 0, 2]);
        // A correct checksum makes the header sum to 0xffff.
        assert_eq!(checksum(h), 0);
        assert_eq!(Grh::parse(&g), Some(Grh { sgid: s, dgid: d }));
        // Immediate data and padding count.
        let g = build(&s, &d, 1, 3, true, 0);
        assert_eq!(
            u16::from_be_bytes([g[22], g[23]]),
            20 + 8 + 12 + 8 + 4 + 4 + 4
        );
    }

    #[test]
    fn ipv6_form_is_an_ipv6_header() {
        let s = Gid(Ipv6Addr::LOCALHOST.octets());
        let d = Gid("fe80::2".parse::<Ipv6Addr>().expect("literal").octets());
        let g = build(&s, &d, 5, 10, false, 0);
        assert_eq!(g[0] >> 4, 6);
        assert_eq!(u16::from_be_bytes([g[4], g[5]]), 8 + 12 + 8 + 12 + 4);
        assert_eq!((g[6], g[7]), (17, 5));
        assert_eq!(Grh::parse(&g), Some(Grh { sgid: s, dgid: d }));
    }
}
