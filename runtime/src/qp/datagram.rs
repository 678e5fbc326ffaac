//! How a receive ring lays out its buffers, and who sent a datagram.
//!
//! On a UD queue pair the device writes the packet's 40-byte global route
//! header before the payload ([`GRH_LEN`]). A ring slot on UD therefore
//! posts `GRH_LEN + buf_size` bytes starting 24 bytes into the slot, so the
//! GRH fills bytes 24..64 and the payload starts on the slot's second cache
//! line (as rrppcc does); slots are whole cache lines apart.

use crate::provider::{Gid, Grh, GRH_LEN};

const CACHE_LINE: usize = 64;

/// Where the parts of one ring slot lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotGeometry {
    /// Bytes from one slot's start to the next's.
    pub(crate) stride: usize,
    /// Where the receive SGE starts in the slot.
    pub(crate) sge_off: usize,
    /// Length of the receive SGE.
    pub(crate) sge_len: usize,
    /// Where the payload starts in the slot.
    pub(crate) payload_off: usize,
    /// Largest payload.
    pub(crate) payload_cap: usize,
    /// The SGE starts with a GRH (UD).
    pub(crate) grh: bool,
}

impl SlotGeometry {
    /// RC: the whole slot is the payload.
    pub(crate) fn reliable(buf_size: usize) -> SlotGeometry {
        SlotGeometry {
            stride: buf_size,
            sge_off: 0,
            sge_len: buf_size,
            payload_off: 0,
            payload_cap: buf_size,
            grh: false,
        }
    }

    /// UD: the GRH, then up to `buf_size` payload bytes from the slot's
    /// second cache line; `None` if the sizes overflow.
    pub(crate) fn datagram(buf_size: usize) -> Option<SlotGeometry> {
        let stride = CACHE_LINE
            .checked_add(buf_size)?
            .checked_next_multiple_of(CACHE_LINE)?;
        Some(SlotGeometry {
            stride,
            sge_off: CACHE_LINE - GRH_LEN,
            sge_len: GRH_LEN + buf_size,
            payload_off: CACHE_LINE,
            payload_cap: buf_size,
            grh: true,
        })
    }

    /// The payload length of a receive that reported `byte_len` bytes, if
    /// it fits the slot (on UD `byte_len` counts the GRH).
    #[inline(always)]
    pub(crate) fn payload_len(&self, byte_len: u32) -> Option<u32> {
        let len = if self.grh {
            byte_len.checked_sub(GRH_LEN as u32)?
        } else {
            byte_len
        };
        (len as usize <= self.payload_cap).then_some(len)
    }
}

/// Who sent a datagram (from its receive completion and its GRH).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatagramSource {
    /// The sender's QP number.
    pub qpn: u32,
    /// The sender's LID (InfiniBand; 0 on RoCE and the soft device).
    pub lid: u16,
    /// The sender's GID, read from the GRH when the datagram had one.
    pub gid: Option<Gid>,
}

impl DatagramSource {
    /// The source of a completion with `src_qp`, `slid` and the `grh` flag,
    /// whose GRH area is `grh_area`.
    pub(crate) fn read(src_qp: u32, slid: u16, grh: bool, grh_area: &[u8]) -> DatagramSource {
        DatagramSource {
            qpn: src_qp,
            lid: slid,
            gid: if grh {
                Grh::parse(grh_area).map(|g| g.sgid)
            } else {
                None
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_slot_puts_the_payload_on_a_cache_line_after_the_grh() {
        let g = SlotGeometry::datagram(100).expect("fits");
        assert_eq!(g.sge_off + GRH_LEN, g.payload_off);
        assert_eq!(g.payload_off % CACHE_LINE, 0);
        assert_eq!(g.stride % CACHE_LINE, 0);
        assert!(g.sge_off + g.sge_len <= g.stride);
        assert_eq!(g.payload_len(40 + 100), Some(100));
        assert_eq!(g.payload_len(40 + 101), None);
        assert_eq!(g.payload_len(39), None);
        assert_eq!(SlotGeometry::datagram(usize::MAX), None);
        let rc = SlotGeometry::reliable(100);
        assert_eq!(rc.payload_len(100), Some(100));
        assert_eq!(rc.payload_len(101), None);
    }
}
