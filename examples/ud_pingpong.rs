//! `ud_pingpong`: UD SEND ping-pong that speaks rdma-core's
//! `ibv_ud_pingpong` protocol, so either side can be verbio or
//! `ibv_ud_pingpong` (from rdma-core's `ibverbs-utils`).
//!
//! Out of band, over TCP (port 18515 by default), each side sends its
//! address as `ibv_ud_pingpong` does: a 52-byte NUL-terminated text
//! `LID:QPN:PSN:GID` (`%04x:%06x:%06x:` and the GID as 32 hex digits, its
//! 16 bytes in order); the client writes its address, reads the server's
//! and writes `done`. Then the client sends `--size` bytes, the server
//! answers with the same bytes, `--iters` times; datagrams carry Q_Key
//! 0x11111111 and every receive buffer has 40 bytes of room for the GRH
//! before the payload.
//!
//! Checked on every datagram: the status, the length, the sender's QP
//! number and (with a GID) the sender's GID in the GRH, and the data:
//! verbio's client sends a different pattern each round trip and expects
//! it back; verbio's server answers with what it received and expects
//! either verbio's patterns or, from `ibv_ud_pingpong` (which answers with
//! the payload it last received), the same bytes every time.
//!
//! ```text
//! ibv_ud_pingpong -d rxe0 -g 1 &          # rdma-core server
//! cargo run --example ud_pingpong --features ibverbs -- -d rxe0 -g 1 127.0.0.1
//! cargo run --example ud_pingpong --features ibverbs -- -d rxe0 -g 1 &
//! ibv_ud_pingpong -d rxe0 -g 1 127.0.0.1  # rdma-core client
//! ```
//!
//! The device is `-d`, else `VERBIO_DEVICE`, else the first ibverbs device
//! with an active port, else the software device (both sides verbio: the
//! soft device's engine address follows each side's 52-byte address).
//! `scripts/rxe-test.sh` runs both pairings against `ibv_ud_pingpong` in the
//! rxe VM.

mod cli;

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::error::Error;
use std::io::{Read, Write};
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

use verbio::provider::{
    open_device, AccessFlags, AddressHandle, AhAttr, Completion, Context, Cq, Endpoint, Gid, Grh,
    Mr, Pd, ProviderKind, Qp, QpCaps, RecvWr, SendFlags, SendOp, SendWr, SgList, Sge, UdAttr,
    UdDest, WcOpcode, WcStatus, DEFAULT_QKEY, GRH_LEN,
};

/// UD ping-pong, wire-compatible with rdma-core's `ibv_ud_pingpong`.
#[derive(Parser)]
struct Args {
    /// Server to connect to; without it, serve and wait for a client.
    server: Option<String>,
    /// TCP port of the address exchange.
    #[arg(short, long, default_value_t = 18515)]
    port: u16,
    /// RDMA device (e.g. rxe0).
    #[arg(short = 'd', long = "ib-dev")]
    device: Option<String>,
    /// Port of the RDMA device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// Message size in bytes (at most the port's MTU).
    #[arg(short, long, default_value_t = 1024, value_parser = cli::at_least_one)]
    size: usize,
    /// Receives kept posted.
    #[arg(short, long = "rx-depth", default_value_t = 500)]
    rx_depth: u32,
    /// Round trips.
    #[arg(short = 'n', long, default_value_t = 1000)]
    iters: usize,
    /// Service level of the datagrams.
    #[arg(short = 'l', long, default_value_t = 0)]
    sl: u8,
    /// Local GID index; without it no GID is sent and datagrams carry no
    /// GRH (InfiniBand only: RoCE needs one).
    #[arg(short = 'g', long = "gid-idx")]
    gid_idx: Option<u8>,
    /// Seconds to wait for any one completion or the address exchange.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
}

/// Bytes of the address message, as `ibv_ud_pingpong` sizes it.
const MSG_LEN: usize = "0000:000000:000000:00000000000000000000000000000000".len() + 1;
/// Bytes of the soft device's engine address frame (NUL-padded text).
const SOFT_ADDR_LEN: usize = 64;
/// The work-request id of sends (receives use their slot index).
const SEND_ID: u64 = u64::MAX;

/// One side's address, as exchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WireDest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: Gid,
}

impl WireDest {
    /// `"%04x:%06x:%06x:%s"` with the GID as `gid_to_wire_gid` writes it,
    /// NUL-padded to [`MSG_LEN`].
    fn encode(&self) -> [u8; MSG_LEN] {
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
    fn parse(msg: &[u8]) -> Result<WireDest, String> {
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

/// The out-of-band exchange: our address for the peer's (and, on the soft
/// device, the engine addresses).
fn exchange(
    args: &Args,
    ours: &WireDest,
    our_soft: Option<SocketAddr>,
) -> Result<(WireDest, Option<SocketAddr>), Box<dyn Error>> {
    let limit = Duration::from_secs(args.timeout);
    let mut stream = match &args.server {
        Some(host) => {
            let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), args.port))?
                .next()
                .ok_or_else(|| format!("{host}: no address"))?;
            TcpStream::connect_timeout(&addr, limit)
                .map_err(|e| format!("connecting to {addr}: {e}"))?
        }
        None => {
            let listener = TcpListener::bind(("0.0.0.0", args.port))
                .map_err(|e| format!("listening on port {}: {e}", args.port))?;
            listener.accept()?.0
        }
    };
    stream.set_read_timeout(Some(limit))?;
    let write_ours = |s: &mut TcpStream| -> std::io::Result<()> {
        s.write_all(&ours.encode())?;
        if let Some(a) = our_soft {
            let mut frame = [0u8; SOFT_ADDR_LEN];
            let text = a.to_string();
            frame[..text.len()].copy_from_slice(text.as_bytes());
            s.write_all(&frame)?;
        }
        Ok(())
    };
    let read_theirs =
        |s: &mut TcpStream| -> Result<(WireDest, Option<SocketAddr>), Box<dyn Error>> {
            let mut msg = [0u8; MSG_LEN];
            s.read_exact(&mut msg)
                .map_err(|e| format!("reading the peer's address: {e}"))?;
            let dest = WireDest::parse(&msg)?;
            let soft = match our_soft {
                None => None,
                Some(_) => {
                    let mut frame = [0u8; SOFT_ADDR_LEN];
                    s.read_exact(&mut frame)
                        .map_err(|e| format!("reading the peer's soft engine address: {e}"))?;
                    let end = frame.iter().position(|&b| b == 0).unwrap_or(SOFT_ADDR_LEN);
                    let text = std::str::from_utf8(&frame[..end]).unwrap_or("");
                    Some(
                        text.parse()
                            .map_err(|_| format!("bad soft engine address {text:?}"))?,
                    )
                }
            };
            Ok((dest, soft))
        };
    if args.server.is_some() {
        write_ours(&mut stream)?;
        let theirs = read_theirs(&mut stream)?;
        stream.write_all(b"done\0")?;
        Ok(theirs)
    } else {
        let theirs = read_theirs(&mut stream)?;
        write_ours(&mut stream)?;
        let mut done = [0u8; 5];
        stream
            .read_exact(&mut done)
            .map_err(|e| format!("reading the client's done: {e}"))?;
        Ok(theirs)
    }
}

/// The payload verbio's client sends in round trip `i`.
fn pattern(i: usize, out: &mut [u8]) {
    for (j, b) in out.iter_mut().enumerate() {
        *b = (i.wrapping_mul(131) ^ j.wrapping_mul(7)) as u8;
    }
}

/// A UD QP with its CQ, registered buffers (a GRH + payload slot per
/// receive, one payload area for sends) and the peer's address handle.
struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    // Deregistered before `mem` is freed (field order).
    mr: Mr,
    /// The device writes receive slots while others are read: the bytes
    /// are only reached through raw pointers into these cells.
    mem: Box<[UnsafeCell<u8>]>,
    slot: usize,
    slots: usize,
    size: usize,
    inline: bool,
    recvs: VecDeque<Completion>,
    sends_done: usize,
    limit: Duration,
}

impl Side {
    fn new(ctx: Context, args: &Args) -> Result<Side, Box<dyn Error>> {
        let port = ctx.query_port(args.ib_port)?;
        let mtu = port.active_mtu.bytes() as usize;
        if args.size > mtu {
            return Err(format!("size {} is larger than the port's MTU {mtu}", args.size).into());
        }
        let slots = args.rx_depth.max(1) as usize;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(args.rx_depth + 2, None)?;
        let qp = pd.create_ud_qp(
            &cq,
            &cq,
            QpCaps {
                max_send_wr: 2,
                max_recv_wr: args.rx_depth.max(1),
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
        )?;
        qp.modify_ud_to_rts(&UdAttr {
            port: args.ib_port,
            sq_psn: random_psn(),
            ..UdAttr::default()
        })?;
        let slot = GRH_LEN + args.size;
        let mem: Box<[UnsafeCell<u8>]> = (0..slot * slots + args.size)
            .map(|_| UnsafeCell::new(0x7b))
            .collect();
        // SAFETY: the boxed slice's heap memory does not move and outlives
        // `mr` (dropped first, field order); the device writes it only
        // through posted receives, whose slots are read after their
        // completions, and reads the send area only while a send is
        // outstanding, during which it is not written.
        let mr = unsafe {
            pd.reg_mr(
                UnsafeCell::raw_get(mem.as_ptr()),
                mem.len(),
                AccessFlags::LOCAL_WRITE,
            )
        }?;
        let inline = qp.caps().max_inline_data as usize >= args.size;
        let side = Side {
            ctx,
            pd,
            cq,
            qp,
            mr,
            mem,
            slot,
            slots,
            size: args.size,
            inline,
            recvs: VecDeque::new(),
            sends_done: 0,
            limit: Duration::from_secs(args.timeout),
        };
        for s in 0..slots {
            side.post_recv(s)?;
        }
        Ok(side)
    }

    fn post_recv(&self, s: usize) -> Result<(), Box<dyn Error>> {
        let mut sg_list = SgList::new();
        sg_list.push(Sge {
            addr: self.base() as u64 + (s * self.slot) as u64,
            length: self.slot as u32,
            lkey: self.mr.lkey(),
        });
        // SAFETY: slot `s` lies in `mem`, registered by `mr`; nothing reads
        // or writes it until its completion is polled (see `Side::new`).
        unsafe {
            self.qp.post_recv(&[RecvWr {
                wr_id: s as u64,
                sg_list,
            }])
        }?;
        Ok(())
    }

    /// Start of the registered memory.
    fn base(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.mem.as_ptr())
    }

    /// The send area (payload of the next send); only between sends.
    fn send_area(&mut self) -> &mut [u8] {
        let start = self.slots * self.slot;
        // SAFETY: in bounds of `mem`; `&mut self` and the loop's order (the
        // previous send's completion is polled before the next payload is
        // written) leave no other access to these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.base().add(start), self.size) }
    }

    /// Receive slot `s` (GRH area, then payload); only after its completion
    /// and before it is reposted.
    fn slot(&self, s: usize) -> &[u8] {
        assert!(s < self.slots);
        // SAFETY: in bounds of `mem`; the device is done with slot `s`
        // (its completion was polled) and nothing writes it until
        // `post_recv(s)`, which callers do after the last read.
        unsafe { std::slice::from_raw_parts(self.base().add(s * self.slot), self.slot) }
    }

    /// Copies the payload of slot `s` into the send area.
    fn echo(&mut self, s: usize) {
        let payload = self.slot(s)[GRH_LEN..].as_ptr();
        let dst = self.send_area().as_mut_ptr();
        // SAFETY: both ranges are `size` bytes inside `mem`, disjoint (the
        // send area follows the slots), and accessible as `slot` and
        // `send_area` say.
        unsafe { std::ptr::copy_nonoverlapping(payload, dst, self.size) };
    }

    fn post_send(&self, dest: UdDest) -> Result<(), Box<dyn Error>> {
        let start = self.slots * self.slot;
        let mut sg_list = SgList::new();
        sg_list.push(Sge {
            addr: self.base() as u64 + start as u64,
            length: self.size as u32,
            lkey: self.mr.lkey(),
        });
        let mut flags = SendFlags::SIGNALED;
        if self.inline {
            flags |= SendFlags::INLINE;
        }
        // SAFETY: the send area lies in `mem`, registered by `mr`; it is not
        // written until this send's completion is polled.
        unsafe {
            self.qp.post_send(&[SendWr {
                wr_id: SEND_ID,
                sg_list,
                op: SendOp::SendTo { dest, imm: None },
                flags,
            }])
        }?;
        Ok(())
    }

    /// Polls until `ready` holds; every completion must be a success.
    fn poll_until(&mut self, ready: impl Fn(&Side) -> bool) -> Result<(), Box<dyn Error>> {
        let deadline = Instant::now() + self.limit;
        let mut wcs = [Completion::EMPTY; 16];
        while !ready(self) {
            let n = self.cq.poll(&mut wcs)?;
            for c in &wcs[..n] {
                if c.status != WcStatus::Success {
                    return Err(format!("completion failed: {c:?}").into());
                }
                match c.opcode {
                    WcOpcode::Recv => self.recvs.push_back(*c),
                    _ => self.sends_done += 1,
                }
            }
            if n == 0 && Instant::now() > deadline {
                return Err(format!(
                    "no completion for {:?} (a datagram lost, or the peer gone)",
                    self.limit
                )
                .into());
            }
        }
        Ok(())
    }

    /// The next received datagram, checked against the peer; returns its
    /// slot (not yet reposted).
    fn next_datagram(&mut self, peer: &Endpoint) -> Result<usize, Box<dyn Error>> {
        self.poll_until(|s| !s.recvs.is_empty())?;
        let c = self.recvs.pop_front().expect("a receive completion");
        let s = usize::try_from(c.wr_id)
            .ok()
            .filter(|&s| s < self.slots)
            .ok_or_else(|| format!("receive completion for unknown slot {}", c.wr_id))?;
        if c.byte_len as usize != self.slot {
            return Err(format!(
                "received {} bytes, expected {} (40 of GRH + {})",
                c.byte_len, self.slot, self.size
            )
            .into());
        }
        if c.src_qp != peer.qpn {
            return Err(format!(
                "datagram from QP {:#x}, not the peer's {:#x}",
                c.src_qp, peer.qpn
            )
            .into());
        }
        if !peer.gid.is_zero() {
            let grh = Grh::parse(&self.slot(s)[..GRH_LEN]).filter(|_| c.grh);
            match grh {
                Some(g) if g.sgid == peer.gid => {}
                other => {
                    return Err(format!("GRH {other:?}: expected source GID {}", peer.gid).into())
                }
            }
        }
        Ok(s)
    }
}

fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    (h.finish() as u32) & 0x00ff_ffff
}

/// What verbio's server has seen from its client so far.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ClientKind {
    /// Round trip `i` carried [`pattern`]`(i)`.
    Patterns,
    /// Every datagram repeats the first (`ibv_ud_pingpong`'s client).
    Echo,
}

fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    let ctx = open_device(args.device.as_deref())?;
    tracing::info!(device = ctx.name(), kind = %ctx.kind(), "opened the RDMA device");
    let soft = ctx.kind() == ProviderKind::Soft;
    let mut side = Side::new(ctx, args)?;
    // The soft device has one GID (index 0), which it always sends.
    let gid_index = args.gid_idx.or(soft.then_some(0));
    let local = side.qp.endpoint(gid_index.unwrap_or(0))?;
    let ours = WireDest {
        lid: local.lid,
        qpn: local.qpn,
        psn: local.psn,
        gid: if gid_index.is_some() {
            local.gid
        } else {
            Gid([0; 16])
        },
    };
    println!(
        "  local address:  LID {:#06x}, QPN {:#08x}, PSN {:#08x}: GID {}",
        ours.lid,
        ours.qpn,
        ours.psn,
        Ipv6Addr::from(ours.gid.0)
    );
    let (theirs, their_soft) = exchange(args, &ours, local.soft_addr)?;
    println!(
        "  remote address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
        theirs.lid,
        theirs.qpn,
        theirs.psn,
        Ipv6Addr::from(theirs.gid.0)
    );
    let peer = Endpoint {
        provider: side.ctx.kind(),
        qpn: theirs.qpn,
        psn: theirs.psn,
        lid: theirs.lid,
        gid: theirs.gid,
        mtu: local.mtu,
        soft_addr: their_soft,
    };
    let ah: AddressHandle = side.pd.create_ah(&AhAttr {
        hop_limit: 64,
        sl: args.sl,
        port: args.ib_port,
        ..AhAttr::to_endpoint(&peer, gid_index.unwrap_or(0))
    })?;
    let dest = UdDest {
        ah: ah.raw(),
        remote_qpn: peer.qpn,
        remote_qkey: DEFAULT_QKEY,
    };
    let client = args.server.is_some();
    let size = args.size;
    let mut expect = vec![0u8; size];
    let mut kind = None;
    let start = Instant::now();
    for i in 0..args.iters {
        if client {
            pattern(i, side.send_area());
            side.post_send(dest)?;
            let s = side.next_datagram(&peer)?;
            pattern(i, &mut expect);
            if side.slot(s)[GRH_LEN..] != expect[..] {
                return Err(format!("round trip {i}: the reply is not the message sent").into());
            }
            side.post_recv(s)?;
            side.poll_until(|s| s.sends_done > i)?;
        } else {
            let s = side.next_datagram(&peer)?;
            let got = &side.slot(s)[GRH_LEN..];
            let k = *kind.get_or_insert_with(|| {
                pattern(0, &mut expect);
                if got == &expect[..] {
                    ClientKind::Patterns
                } else {
                    expect.copy_from_slice(got);
                    ClientKind::Echo
                }
            });
            if k == ClientKind::Patterns {
                pattern(i, &mut expect);
            }
            if got != &expect[..] {
                return Err(format!("round trip {i}: unexpected data from the client").into());
            }
            side.echo(s);
            side.post_recv(s)?;
            side.post_send(dest)?;
            side.poll_until(|s| s.sends_done > i)?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = (size * args.iters * 2) as f64;
    println!(
        "{} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as u64,
        bytes * 8.0 / secs / 1e6
    );
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        args.iters,
        secs * 1e6 / args.iters as f64
    );
    println!(
        "ud_pingpong: {} round trips of {size} B, data checked{}",
        args.iters,
        match kind {
            Some(ClientKind::Echo) => " (the client echoes)",
            _ => "",
        }
    );
    Ok(())
}

fn main() -> ExitCode {
    cli::init_tracing();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ud_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_message_matches_ud_pingpong() {
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
