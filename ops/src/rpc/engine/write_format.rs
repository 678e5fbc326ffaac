//! The format of a WRITE with immediate (`written_responses.rs`,
//! `written_requests.rs`): the immediate (slot, generation, length), the
//! trailers a written request and a written response carry, and the room
//! sizes both sides agree on.

use crate::rpc::header::{BulkDesc, BULK_DESC_LEN, MAX_MSG_LEN};
use crate::rpc::session::SESSION_SLOTS;

/// Bits of the immediate that carry the response's length (up to
/// [`MAX_MSG_LEN`]).
const IMM_LEN_BITS: u32 = 25;

const _: () = assert!(MAX_MSG_LEN < 1 << IMM_LEN_BITS);

/// Bits that carry the slot.
const IMM_SLOT_BITS: u32 = 3;

/// Bits that carry the request number's generation (`req_num / 8`).
const IMM_GEN_BITS: u32 = 32 - IMM_LEN_BITS - IMM_SLOT_BITS;

/// The generation bits of request number `req_num`.
pub(crate) fn generation(req_num: u64) -> u32 {
    ((req_num / SESSION_SLOTS as u64) & ((1 << IMM_GEN_BITS) - 1)) as u32
}

/// The immediate of the WRITE of request `req_num`'s response of `len`
/// bytes (at most [`MAX_MSG_LEN`]).
pub(crate) fn encode_imm(req_num: u64, len: usize) -> u32 {
    let slot = (req_num % SESSION_SLOTS as u64) as u32;
    (generation(req_num) << (IMM_LEN_BITS + IMM_SLOT_BITS))
        | (slot << IMM_LEN_BITS)
        | (len as u32 & ((1 << IMM_LEN_BITS) - 1))
}

/// An immediate's slot, generation and length.
pub(crate) fn decode_imm(imm: u32) -> (usize, u32, usize) {
    let len = (imm & ((1 << IMM_LEN_BITS) - 1)) as usize;
    let slot = ((imm >> IMM_LEN_BITS) & ((1 << IMM_SLOT_BITS) - 1)) as usize;
    (slot, imm >> (IMM_LEN_BITS + IMM_SLOT_BITS), len)
}

/// The largest request written into granted room; larger ones go by READ
/// (and get no grant, so no room of their size is held for a peer).
/// Picked by measuring written requests against READ on the soft device,
/// one call at a time (`docs/benchmarks.md`, "Where one large call's time
/// goes"): they save two small trips, which outweighs the server's copy
/// of the request out of its room up to 128 KiB, tie around 256 KiB and
/// lose at 1 MiB.
pub(crate) const WRITTEN_REQUEST_MAX: usize = 128 << 10;

/// Bytes a written request carries after its message: its request
/// number (8), type (1), 3 zero bytes, and the descriptor and capacity of
/// the room it offers for its response ([`BulkDesc::encode_offer`]; a
/// capacity of 0: none).
pub(crate) const WRITE_TRAILER: usize = 12 + BULK_DESC_LEN;

/// Bytes a response WRITE carries after its message: the descriptor and
/// capacity of the room granted for its slot's next request
/// ([`BulkDesc::encode_offer`]; a capacity of 0: none). So the grant needs
/// no packet of its own (see the module's "Requests written").
pub(crate) const RESP_TRAILER: usize = BULK_DESC_LEN;

/// The largest room offered for a response whose WRITE carries a
/// [`RESP_TRAILER`]: one for a written request's response and its
/// trailer. Both sides know the offer, so they agree on the trailer; a
/// larger offer (a call by READ past [`WRITTEN_REQUEST_MAX`]) is used as
/// before, with no trailer, so its buffer is not grown (a copy of it).
pub(crate) const TRAILED_ROOM_MAX: usize = WRITTEN_REQUEST_MAX + WRITE_TRAILER + RESP_TRAILER;

/// The room to offer for a response of up to `len` bytes: `len` and the
/// trailer, unless that is past [`TRAILED_ROOM_MAX`].
pub(crate) fn response_room(len: usize) -> usize {
    if len + RESP_TRAILER <= TRAILED_ROOM_MAX {
        len + RESP_TRAILER
    } else {
        len
    }
}

/// The trailer a response WRITE into a room of `cap` bytes carries.
pub(crate) fn trailer_len(cap: usize) -> usize {
    if cap <= TRAILED_ROOM_MAX {
        RESP_TRAILER
    } else {
        0
    }
}

/// A written request's trailer.
pub(crate) fn encode_trailer(
    req_num: u64,
    req_type: u8,
    room: Option<(BulkDesc, u32)>,
) -> [u8; WRITE_TRAILER] {
    let mut t = [0u8; WRITE_TRAILER];
    t[0..8].copy_from_slice(&req_num.to_le_bytes());
    t[8] = req_type;
    let (desc, cap) = room.unwrap_or((BulkDesc { addr: 0, rkey: 0 }, 0));
    t[12..].copy_from_slice(&desc.encode_offer(cap));
    t
}

/// Decodes what [`encode_trailer`] wrote: request number, type, room.
pub(crate) fn decode_trailer(t: &[u8]) -> Option<(u64, u8, BulkDesc, u32)> {
    let t: &[u8; WRITE_TRAILER] = t.try_into().ok()?;
    if t[9..12] != [0; 3] {
        return None;
    }
    let req_num = u64::from_le_bytes(t[0..8].try_into().ok()?);
    let (desc, cap) = BulkDesc::decode_offer(&t[12..])?;
    Some((req_num, t[8], desc, cap))
}

/// The session a link's number belongs to: links are numbered
/// `count << 32 | session` on both sides (`want_link`, `on_bulk_connect`).
pub(crate) fn link_session(link: u64) -> u32 {
    link as u32
}
