//! Reception: reading into the receive buffer, or a large WRITE's or
//! SEND's payload straight into its target memory.

use std::io;

use smallvec::SmallVec;

use super::super::dma::{writable_spans, Span};
use super::super::mr::MrTable;
use super::super::packet::{Header, HEADER_LEN};
use super::Conn;
use crate::provider::{AccessFlags, SgList};

/// A payload being received straight into registered memory: a WRITE's
/// into its target, a SEND's into the receive WR it completes, a READ
/// response's into the READ's SGEs.
pub(crate) struct RxDirect {
    /// The QP (the responder's; a READ response's requester): once it is
    /// in ERR, the rest is discarded.
    pub qp: std::sync::Arc<super::super::qp::QpShared>,
    pub hdr: Header,
    pub pd: u32,
    /// Where the payload goes.
    pub into: DirectInto,
    pub remaining: usize,
    /// The region went away: the rest is discarded and the request fails.
    pub broken: bool,
}

/// The memory a direct payload goes to.
pub(crate) enum DirectInto {
    /// A WRITE's target (the packet's rkey): `at` is the address of the
    /// next byte.
    Remote { at: u64 },
    /// Local SGEs (of the receive WR a SEND lands in, of the READ a
    /// response answers): `at` is the message offset of the next byte.
    Local { sges: SgList, at: u64 },
}

impl RxDirect {
    /// The registered memory the next `len` payload bytes go to, in order
    /// (`None`: the region went away, or is not writable any more).
    pub fn targets<'t>(&self, mrs: &'t MrTable, len: usize) -> Option<SmallVec<[Span<'t>; 4]>> {
        match &self.into {
            DirectInto::Remote { at } => {
                let span = mrs
                    .remote(
                        self.hdr.dst_qpn,
                        self.hdr.rkey,
                        self.pd,
                        *at,
                        len as u64,
                        AccessFlags::REMOTE_WRITE,
                    )
                    .ok()?;
                Some(smallvec::smallvec![span])
            }
            DirectInto::Local { sges, at } => writable_spans(sges, self.pd, mrs, *at, len as u64),
        }
    }

    /// Moves past `n` bytes received.
    pub fn advance(&mut self, n: usize) {
        match &mut self.into {
            DirectInto::Remote { at } | DirectInto::Local { at, .. } => *at += n as u64,
        }
        self.remaining -= n;
    }

    /// Places bytes of the payload that arrived with its header (read into
    /// the buffer) where the rest goes.
    pub fn place(&mut self, mrs: &MrTable, data: &[u8]) {
        match self.targets(mrs, data.len()) {
            Some(spans) if !self.broken => {
                let mut at = 0;
                for s in &spans {
                    s.write(&data[at..at + s.len()]);
                    at += s.len();
                }
            }
            _ => self.broken = true,
        }
        self.advance(data.len());
    }
}

/// A direct WRITE payload at least this large still to come raises the
/// socket's `SO_RCVLOWAT` (see `Conn::read_direct`).
const LOWAT_MIN: usize = 128 * 1024;
/// The highest `SO_RCVLOWAT` used.
const LOWAT_MAX: usize = 256 * 1024;
/// Bytes read into the buffer at most right after a payload that arrived
/// straight into memory (see `Conn::read_some`).
pub(crate) const RX_PEEK: usize = 4 * 1024;

impl Conn {
    /// Reads the rest of a direct payload straight into registered
    /// memory (or into the buffer, discarded, if the region went away).
    /// Returns bytes read (0 = end of stream) and whether the read was full.
    ///
    /// The read that ends the payload also offers the empty buffer
    /// `RX_PEEK` bytes for what follows (one `readv`): the next packet's
    /// first bytes land there (`rx_end`; not counted in the bytes
    /// returned), and a read that does not fill them found the socket
    /// drained (not full), so no read follows only to find it so. (Each
    /// payload into memory cost a `recvfrom` that failed with EAGAIN.)
    pub fn read_direct(&mut self, mrs: &MrTable) -> io::Result<(usize, bool)> {
        let Some(d) = &mut self.rx_direct else {
            return Ok((0, false));
        };
        let want = d.remaining;
        let Some(wire) = &self.stream else {
            return Ok((0, false));
        };
        let fd = wire.fd();
        if d.qp.state() == crate::provider::QpState::Err {
            d.broken = true;
        }
        let target = if d.broken { None } else { d.targets(mrs, want) };
        // (The buffer holds nothing while a payload arrives into memory.)
        let after = if self.rx_start == self.rx_end {
            self.rx.len().min(RX_PEEK)
        } else {
            0
        };
        let mut more = 0;
        let r = match target {
            Some(spans) => {
                let mut iov: SmallVec<[libc::iovec; 5]> = spans
                    .iter()
                    .map(|s| libc::iovec {
                        iov_base: s.as_ptr().cast(),
                        iov_len: s.len(),
                    })
                    .collect();
                if after > 0 {
                    self.rx_start = 0;
                    self.rx_end = 0;
                    iov.push(libc::iovec {
                        iov_base: self.rx.as_mut_ptr().cast(),
                        iov_len: after,
                    });
                    more = after;
                }
                // SAFETY: each iovec but a last one of `after` bytes is a
                // span of `want` bytes in all of registered, writable memory
                // (`Span`'s invariant: the MR table stays locked during the
                // call); that last one is the start of the receive buffer,
                // which holds at least `after` bytes; the fd stays open
                // while `wire` lives.
                unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) }
            }
            None => {
                d.broken = true;
                let n = want.min(self.rx.len());
                // SAFETY: the buffer holds at least `n` bytes.
                unsafe { libc::read(fd, self.rx.as_mut_ptr().cast(), n) }
            }
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let got = r as usize;
        let r = got.min(want);
        let next = got - r;
        d.advance(r);
        if d.remaining == 0 {
            // The next packet's first bytes, if any, wait in the buffer. A
            // short read of them that drained the socket keeps the short
            // read for the rest (as `read_some`'s).
            if more > 0 {
                self.rx_end = next;
            }
            self.rx_peek = more == 0 || next < more;
        }
        // While much of a payload is still to come, the socket reports
        // input only once a large part of it is there: fewer wake-ups and
        // larger reads, as a blocking reader gets. Never more than what is
        // still to come (the last part must wake us), and back to 1 byte
        // once the payload is in (packet headers).
        let lowat = if d.remaining >= LOWAT_MIN {
            d.remaining.min(LOWAT_MAX)
        } else {
            1
        };
        if r > 0 && lowat != self.rcvlowat {
            self.set_rcvlowat(fd, lowat);
        }
        Ok((r, got == want + more))
    }

    /// Sets the socket's `SO_RCVLOWAT` (Linux re-checks readiness at once,
    /// so lowering it never strands data already there).
    fn set_rcvlowat(&mut self, fd: std::os::fd::RawFd, n: usize) {
        let v = n.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: `v` is a live c_int of the size passed; `fd` is the open
        // socket of this connection.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            self.rcvlowat = n;
        } else {
            tracing::debug!(error = %io::Error::last_os_error(), "soft engine: SO_RCVLOWAT");
        }
    }

    /// Reads once into the receive buffer: bytes read (0 = end of stream)
    /// and whether the read filled all the space offered.
    pub fn read_some(&mut self) -> io::Result<(usize, bool)> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx.len() - self.rx_start < self.rx_need.max(HEADER_LEN)
            || self.rx_end == self.rx.len()
        {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        if self.rx.len() < self.rx_need {
            self.rx.resize(self.rx_need, 0);
        }
        let end = self.rx_end;
        // Right after a payload that arrived straight into memory, the
        // next packet is often another large one (a stream of them, or the
        // answer to one): reading a whole buffer's worth would take much
        // of its payload into the buffer, to be copied again from there.
        // One short read first; if it fills, the next read takes the rest
        // (`full`), so a run of small packets costs one read more.
        // The short read is spent only once it filled: the read right
        // after a payload is usually the one that finds the socket drained
        // (EAGAIN), and one that drains it reads what there was (a READ
        // request, an ACK, a datagram: a large call's small trips), and
        // the next packet's bytes, often a large one again, come after it.
        let peek = std::mem::take(&mut self.rx_peek);
        let mut space = self.rx.len() - end;
        let short = peek && end == 0 && space > RX_PEEK.max(self.rx_need);
        if short {
            space = RX_PEEK.max(self.rx_need);
        }
        let Some(wire) = &self.stream else {
            return Err(io::ErrorKind::WouldBlock.into());
        };
        let buf = &mut self.rx[end..end + space];
        // SAFETY: reads into a live, writable byte slice; the fd stays open
        // while `wire` lives. A plain system call (the socket is
        // non-blocking; `recv` is not a cancellation point here: no thread
        // is cancelled, so libc's wrapper would only add work).
        let r = unsafe {
            libc::syscall(
                libc::SYS_recvfrom,
                wire.fd(),
                buf.as_mut_ptr(),
                buf.len(),
                0,
                std::ptr::null_mut::<libc::sockaddr>(),
                std::ptr::null_mut::<libc::socklen_t>(),
            )
        };
        if r < 0 {
            self.rx_peek = peek;
            return Err(io::Error::last_os_error());
        }
        let n = r as usize;
        self.rx_end += n;
        // (A short read that drained the socket keeps it for the next.)
        self.rx_peek = short && n > 0 && n < space;
        Ok((n, n == space))
    }
}

#[cfg(test)]
#[path = "rx_tests.rs"]
mod tests;
