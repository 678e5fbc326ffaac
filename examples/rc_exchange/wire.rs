//! The out-of-band address exchange of rdma-core's `ibv_*_pingpong`
//! programs: each side's addresses as 52-byte NUL-terminated texts
//! `LID:QPN:PSN:GID` (`%04x:%06x:%06x:` and the GID as 32 hex digits, its
//! 16 bytes in order) over TCP; the client writes its addresses, reads the
//! server's and writes `done`. The server reads the client's, connects its
//! QPs, then writes its own. On the soft device a 64-byte frame with the
//! engine address follows each side's addresses (both sides verbio).

use std::error::Error;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use verbio::provider::{Context, Gid, ProviderKind, SoftConfig};
use verbio::ErrorChain;

/// Bytes of one address message.
pub const MSG_LEN: usize = "0000:000000:000000:00000000000000000000000000000000".len() + 1;
/// Bytes of the soft device's engine address frame (NUL-padded text).
pub const SOFT_ADDR_LEN: usize = 64;

/// One QP's address, as exchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WireDest {
    pub lid: u16,
    pub qpn: u32,
    pub psn: u32,
    pub gid: Gid,
}

impl WireDest {
    /// `"%04x:%06x:%06x:%s"` with the GID as `gid_to_wire_gid` writes it,
    /// NUL-padded to [`MSG_LEN`].
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut text = format!("{:04x}:{:06x}:{:06x}:", self.lid, self.qpn, self.psn);
        for b in self.gid.0 {
            text.push_str(&format!("{b:02x}"));
        }
        let mut msg = [0u8; MSG_LEN];
        let n = text.len().min(MSG_LEN - 1);
        msg[..n].copy_from_slice(&text.as_bytes()[..n]);
        msg
    }

    /// Parses a peer's message (text up to the first NUL).
    pub fn parse(msg: &[u8]) -> Result<WireDest, String> {
        let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
        let text = std::str::from_utf8(&msg[..end])
            .map_err(|_| format!("address message is not text: {:02x?}", &msg[..end]))?;
        let bad = |what: &str| format!("bad {what} in the peer's address {text:?}");
        let mut parts = text.split(':');
        let mut field = |what: &str, max: u32| {
            parts
                .next()
                .and_then(|f| u32::from_str_radix(f, 16).ok())
                .filter(|&v| v <= max)
                .ok_or_else(|| bad(what))
        };
        let lid = field("LID", 0xffff)? as u16;
        let qpn = field("QPN", 0x00ff_ffff)?;
        let psn = field("PSN", 0x00ff_ffff)?;
        let hex = parts.next().ok_or_else(|| bad("GID"))?;
        if hex.len() != 32 || parts.next().is_some() {
            return Err(bad("GID"));
        }
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = hex
                .get(2 * i..2 * i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad("GID"))?;
        }
        Ok(WireDest {
            lid,
            qpn,
            psn,
            gid: Gid(gid),
        })
    }
}

/// What the server runs between reading the client's addresses (and
/// engine address) and writing its own: connecting its QPs.
pub type ConnectFn<'a> =
    dyn FnMut(&[WireDest], Option<SocketAddr>) -> Result<(), Box<dyn Error>> + 'a;

/// Where to exchange: `server` to connect to (client), else listen.
pub struct Oob<'a> {
    pub server: Option<&'a str>,
    pub port: u16,
    pub timeout: Duration,
}

/// `ctx`, or for the soft device, whose engine listens on loopback by
/// default, the device opened again on the unspecified address where a
/// peer on another host must reach it: always for a server (its client
/// may be anywhere), for a client unless `server` is a loopback address.
/// The address frame then names the IP the exchange's connection uses.
pub fn reachable(ctx: Context, server: Option<&str>, port: u16) -> Result<Context, Box<dyn Error>> {
    if ctx.kind() != ProviderKind::Soft {
        return Ok(ctx);
    }
    if let Some(host) = server {
        let mut addrs = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("{host}: {}", ErrorChain(&e)))?
            .peekable();
        if addrs.peek().is_some() && addrs.all(|a| a.ip().is_loopback()) {
            return Ok(ctx);
        }
    }
    let name = ctx.name().to_string();
    drop(ctx);
    Ok(Context::open_soft(SoftConfig {
        name,
        bind: SocketAddr::from(([0, 0, 0, 0], 0)),
        ..SoftConfig::default()
    })?)
}

/// The exchange: `ours` (all `slots` of them: `ibv_srq_pingpong` sends
/// 256, zeros past its QPs) for the peer's as many; `connect` runs on the
/// server between reading the client's and writing its own.
pub fn exchange(
    oob: &Oob<'_>,
    ours: &[WireDest],
    slots: usize,
    our_soft: Option<SocketAddr>,
    connect: &mut ConnectFn<'_>,
) -> Result<(Vec<WireDest>, Option<SocketAddr>), Box<dyn Error>> {
    let mut stream = match oob.server {
        Some(host) => {
            let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, oob.port))?
                .next()
                .ok_or_else(|| format!("{host}: no address"))?;
            // The server may not listen yet: retry until the limit, and
            // say so once, so a silent wait is not mistaken for a hang.
            let deadline = Instant::now() + oob.timeout;
            let mut said = false;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
                    Ok(s) => break s,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::ConnectionRefused && !left.is_zero() =>
                    {
                        if !said {
                            eprintln!(
                                "waiting for the server at {addr} (connection refused; \
                                 retrying for {:.1} s more, --timeout)",
                                left.as_secs_f64()
                            );
                            said = true;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        return Err(format!(
                            "no server at {addr}: connection refused for {:?}",
                            oob.timeout
                        )
                        .into())
                    }
                    Err(e) => {
                        return Err(format!("connecting to {addr}: {}", ErrorChain(&e)).into())
                    }
                }
            }
        }
        None => {
            let listener = TcpListener::bind(("0.0.0.0", oob.port))
                .map_err(|e| format!("listening on port {}: {e}", oob.port))?;
            listener.accept()?.0
        }
    };
    stream.set_read_timeout(Some(oob.timeout))?;
    // An engine on the unspecified address is reached at the IP this
    // connection leaves from (the peer refuses 0.0.0.0).
    // Its GID (the IPv4-mapped engine IP) names that IP too: (the GID
    // of 0.0.0.0, the GID of the reached IP).
    let mut gid_swap = None;
    let our_soft = match our_soft {
        Some(a) if a.ip().is_unspecified() => {
            let ip = stream.local_addr()?.ip();
            if let std::net::IpAddr::V4(v4) = ip {
                let gid = |ip: std::net::Ipv4Addr| Gid(ip.to_ipv6_mapped().octets());
                gid_swap = Some((gid(std::net::Ipv4Addr::UNSPECIFIED), gid(v4)));
            }
            Some(SocketAddr::new(ip, a.port()))
        }
        other => other,
    };
    let write_ours = |s: &mut TcpStream| -> std::io::Result<()> {
        let mut out = Vec::with_capacity(slots * MSG_LEN + SOFT_ADDR_LEN);
        for i in 0..slots {
            let mut d = ours.get(i).copied().unwrap_or_default();
            match gid_swap {
                Some((unspecified, reached)) if d.gid == unspecified => d.gid = reached,
                _ => {}
            }
            out.extend_from_slice(&d.encode());
        }
        if let Some(a) = our_soft {
            let mut frame = [0u8; SOFT_ADDR_LEN];
            let text = a.to_string();
            frame[..text.len()].copy_from_slice(text.as_bytes());
            out.extend_from_slice(&frame);
        }
        s.write_all(&out)
    };
    let read_theirs =
        |s: &mut TcpStream| -> Result<(Vec<WireDest>, Option<SocketAddr>), Box<dyn Error>> {
            let mut dests = Vec::with_capacity(slots);
            for i in 0..slots {
                let mut msg = [0u8; MSG_LEN];
                s.read_exact(&mut msg)
                    .map_err(|e| format!("reading the peer's address {i}: {}", ErrorChain(&e)))?;
                dests.push(WireDest::parse(&msg)?);
            }
            let soft = match our_soft {
                None => None,
                Some(_) => {
                    let mut frame = [0u8; SOFT_ADDR_LEN];
                    s.read_exact(&mut frame).map_err(|e| {
                        format!("reading the peer's soft engine address: {}", ErrorChain(&e))
                    })?;
                    let end = frame.iter().position(|&b| b == 0).unwrap_or(SOFT_ADDR_LEN);
                    let text = std::str::from_utf8(&frame[..end]).unwrap_or("");
                    Some(
                        text.parse()
                            .map_err(|_| format!("bad soft engine address {text:?}"))?,
                    )
                }
            };
            Ok((dests, soft))
        };
    if oob.server.is_some() {
        write_ours(&mut stream)?;
        let theirs = read_theirs(&mut stream)?;
        stream.write_all(b"done\0")?;
        Ok(theirs)
    } else {
        let theirs = read_theirs(&mut stream)?;
        connect(&theirs.0, theirs.1)?;
        write_ours(&mut stream)?;
        let mut done = [0u8; 5];
        stream
            .read_exact(&mut done)
            .map_err(|e| format!("reading the client's done: {}", ErrorChain(&e)))?;
        Ok(theirs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_message_matches_the_pingpongs() {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 77, 0, 1]);
        let d = WireDest {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: Gid(gid),
        };
        let msg = d.encode();
        assert_eq!(msg.len(), 52);
        assert_eq!(
            &msg[..51],
            b"0000:000011:abcdef:00000000000000000000ffff0a4d0001"
        );
        assert_eq!(msg[51], 0);
        assert_eq!(WireDest::parse(&msg), Ok(d));
        assert!(WireDest::parse(b"0000:000011:abcdef:00ff\0").is_err());
        assert!(WireDest::parse(b"zz:1:2:00000000000000000000ffff0a4d0001\0").is_err());
        assert!(WireDest::parse(&[0xff; 52]).is_err());
    }
}
