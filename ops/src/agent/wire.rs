//! The agent's wire codec: every message the MR-token agent exchanges over a
//! connection's SEND/RECV channel.
//!
//! Layout (explicit little-endian, version 10). Every message but a whole
//! user message or a pack of them:
//!
//! ```text
//! 0..4   magic  b"VBAG"
//! 4      version (10)
//! 5      kind
//! 6..8   reserved, must be 0
//! 8..12  body length (u32), must equal the bytes that follow
//! 12..   body (per kind, fixed fields then variable data)
//! ```
//!
//! A user message sent in one piece ([`Message::Whole`], the usual message)
//! has a short frame of its own, told apart by its first byte (never the
//! magic's `V`):
//!
//! ```text
//! 0      kind: 11 (WHOLE) or 12 (WHOLE_IMM)
//! 1..4   reserved, must be 0
//! 4..8   send credits granted (u32)
//! 8..12  immediate (u32; WHOLE_IMM only)
//! ..     the message, to the end of the received bytes
//! ```
//!
//! It has no length field (a SEND delivers its exact length), no message id
//! (only pieces of a split message need one, to be put together) and no
//! version (the connection's settings exchange checks it once).
//!
//! Several whole user messages that waited for a send credit together go
//! in one SEND, a pack ([`Message::Packed`], kind 18), also a short frame:
//!
//! ```text
//! 0      kind: 18 (PACKED)
//! 1..4   reserved, must be 0
//! 4..8   send credits granted (u32)
//! 8..    one entry per message, at least one, in send order:
//!        0..4  length (u32): bits 0..30 the message's length, bit 31 set
//!              if an immediate follows
//!        4..8  immediate (u32; only with bit 31)
//!        ..    the message
//! ```
//!
//! The entries fill the frame exactly: an entry cut short, a length past
//! the end or no entry at all is refused.
//!
//! Version 2 added `Abort` (kind 9: a sender gave up a message it had
//! started to send in pieces; the receiver discards what it reassembled) and
//! `Settings` (kind 10: each side's receive-buffer and message-size settings,
//! exchanged over the TCP side channel when a connection starts). Version 3
//! added the `grant` field to `Data`: the send credits the sender returns
//! with the piece (credits ride on data; a `Credit` message travels alone
//! only when a side owes a batch and has nothing to send). A peer of another
//! version is refused at that exchange with [`WireError::UnsupportedVersion`].
//! Version 4 sent a message in one piece with a 24-byte header (kinds 11 and
//! 12 in the long form, with a message id); version 5 gives it the 8-byte
//! short frame above. Version 6 added `ReadMe` (kind 13: a large message the
//! receiver fetches with one RDMA READ from the region its token names, and
//! releases with a `Release` of the token's id once read). Version 7 added
//! the staging ring (`staging.rs`): `StagingRing` (kind 14: a side's ring
//! of memory the peer may RDMA WRITE mid-size messages into), `Staged`
//! (kind 15: a message written into that ring at an offset, sent after
//! the WRITE, so RC delivers it once the bytes are in place) and
//! `StagingFreed` (kind 16: ring bytes the receiver took its messages out
//! of, free for the sender again). A staged message without an immediate
//! needs no `Staged`: it is one RDMA WRITE_WITH_IMM whose immediate is
//! [`STAGED_IMM_TAG`] and its length ([`staged`]); the immediate of an
//! application's `write_with_imm` in that range travels in a `WriteImm`
//! (kind 17) SEND after a plain WRITE instead. Version 8 added the pack
//! (kind 18, above): small messages that wait for a credit share one SEND,
//! one receive buffer and one credit.
//! Version 9 lets a whole user message without an immediate of its own
//! travel with no frame at all: a SEND_WITH_IMM of exactly the message's
//! bytes whose immediate is [`WHOLE_SEND_IMM_TAG`] and the credits granted
//! ([`whole_send_imm`], [`whole_send_grant`]); the agent sends no other
//! SEND with an immediate. A message of the path MTU's size is then one
//! packet, not two (the 8-byte frame header pushed a 1 KiB message over
//! rxe's 1 KiB MTU).
//! Version 10 added landing slots (`landing.rs`): `SlotGrant` (kind 19: one
//! region of the sender the peer may RDMA WRITE one message into, under a
//! key of its own, granted again only after the message written there was
//! dropped by the receiving application), and the WRITE_WITH_IMM into one,
//! whose immediate is [`SLOT_IMM_TAG`], the slot and the length
//! ([`landed`], [`landed_imm`]).
//! Version 11 lets a staged message's WRITE_WITH_IMM return send credits:
//! its immediate is then [`STAGED_GRANT_TAG`], the credits (1 to
//! [`MAX_STAGED_GRANT`]) and the length ([`staged_grant_imm`], [`staged`]),
//! so that staged messages answering each other need no `Credit` message.
//! Version 12 moves [`STAGED_GRANT_TAG`] to the top bytes 0xf0 to 0xf7,
//! whose three more bits return staged messages the writer took out of
//! its own ring and say that the message restarts at the ring's offset 0
//! ([`StagedImm`]); `StagingFreed` (kind 16) returns a count of messages,
//! no longer of bytes (the sender knows what each took), so that both
//! kinds of return add up whatever order they arrive in.
//!
//! [`decode`] never panics and never reads out of bounds, whatever the input:
//! it is a fuzz target. [`Message::encode`] writes into a caller-provided
//! buffer (a registered send buffer) without allocating.

use std::fmt;

/// `b"VBAG"`: every agent message starts with it.
pub const MAGIC: [u8; 4] = *b"VBAG";
/// The protocol version this codec speaks.
pub const VERSION: u8 = 12;
/// Size of the fixed header (of every message but [`Message::Whole`]).
pub const HEADER_LEN: usize = 12;
/// Size of a [`Message::Whole`] frame's header without an immediate (4 more
/// with one): see [`whole_overhead`].
pub const WHOLE_HEADER_LEN: usize = 8;
/// Size of a [`Message::Packed`] frame's header (its entries follow).
pub const PACKED_HEADER_LEN: usize = 8;
/// The bit of a pack entry's length word that says an immediate follows.
const PACKED_IMM_BIT: u32 = 1 << 31;
/// Largest text in an [`Message::Error`].
pub const MAX_ERROR_TEXT: usize = 256;
/// The top byte of a WRITE_WITH_IMM's immediate that marks a message
/// written into the receiver's staging ring; the low 24 bits are its
/// length (see [`staged`]).
pub const STAGED_IMM_TAG: u32 = 0xff00_0000;

/// The top five bits (top byte 0xf0 to 0xf7) of a WRITE_WITH_IMM's
/// immediate that marks a message written into the receiver's staging ring
/// and carries what the writer returns: bit 26 says the message starts at
/// the ring's offset 0 ([`StagedImm::restart`]), bits 24..26 are the
/// messages of the writer's own ring it took out and returns
/// ([`StagedImm::returned`], 0 to [`MAX_STAGED_RETURN`]), bits 21..24 the
/// send credits (0 to [`MAX_STAGED_GRANT`]), bits 0..21 the length less one
/// (at most [`MAX_STAGED_GRANT_LEN`]); see [`staged`], [`staged_grant_imm`].
pub const STAGED_GRANT_TAG: u32 = 0xf000_0000;

/// The bits of an immediate that say it is a [`STAGED_GRANT_TAG`] one.
const STAGED_GRANT_MASK: u32 = 0xf800_0000;

/// Most credits a [`STAGED_GRANT_TAG`] immediate returns.
pub const MAX_STAGED_GRANT: u32 = 7;

/// Most staged messages a [`STAGED_GRANT_TAG`] immediate returns.
pub const MAX_STAGED_RETURN: u32 = 3;

/// Longest message a [`STAGED_GRANT_TAG`] immediate names (2 MiB).
pub const MAX_STAGED_GRANT_LEN: u32 = 1 << 21;

/// What a staged message's immediate says ([`staged`], [`staged_grant_imm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedImm {
    /// The message's length.
    pub len: u32,
    /// Send credits returned.
    pub grant: u32,
    /// Staged messages the writer took out of its own ring, which it
    /// returns (the oldest not returned yet: the ring bytes they took are
    /// free for their writer again).
    pub returned: u32,
    /// The message starts at the ring's offset 0, not where the previous
    /// one ended: its writer had every earlier message returned, so the
    /// ring was empty (restarting keeps the ring bytes in use, and so the
    /// caches' working set, to the messages in flight).
    pub restart: bool,
}

/// The immediate of a staged message that says `s`: `None` unless its
/// length is 1 to [`MAX_STAGED_GRANT_LEN`], its credits at most
/// [`MAX_STAGED_GRANT`] and its returns at most [`MAX_STAGED_RETURN`] (the
/// message then goes with [`STAGED_IMM_TAG`], not restarting, and its
/// credits and returns in other messages).
#[inline(always)]
pub const fn staged_grant_imm(s: StagedImm) -> Option<u32> {
    if s.len == 0
        || s.len > MAX_STAGED_GRANT_LEN
        || s.grant > MAX_STAGED_GRANT
        || s.returned > MAX_STAGED_RETURN
    {
        None
    } else {
        Some(
            STAGED_GRANT_TAG
                | ((s.restart as u32) << 26)
                | (s.returned << 24)
                | (s.grant << 21)
                | (s.len - 1),
        )
    }
}

/// What a WRITE_WITH_IMM's immediate says of the staged message it
/// carries, if it carries [`STAGED_IMM_TAG`] (a length, nothing else) or
/// [`STAGED_GRANT_TAG`] (an application's immediate never does on the
/// wire: it goes in a [`Message::WriteImm`]).
#[inline(always)]
pub const fn staged(imm: u32) -> Option<StagedImm> {
    if imm & 0xff00_0000 == STAGED_IMM_TAG {
        Some(StagedImm {
            len: imm & !STAGED_IMM_TAG,
            grant: 0,
            returned: 0,
            restart: false,
        })
    } else if imm & STAGED_GRANT_MASK == STAGED_GRANT_TAG {
        Some(StagedImm {
            len: (imm & (MAX_STAGED_GRANT_LEN - 1)) + 1,
            grant: (imm >> 21) & MAX_STAGED_GRANT,
            returned: (imm >> 24) & MAX_STAGED_RETURN,
            restart: imm & (1 << 26) != 0,
        })
    } else {
        None
    }
}

/// The top byte of a WRITE_WITH_IMM's immediate that marks a message
/// written into one of the receiver's landing slots ([`Message::SlotGrant`]):
/// bits 21..24 are the slot, bits 0..21 the length less one (see
/// [`landed`]).
pub const SLOT_IMM_TAG: u32 = 0xfe00_0000;

/// Landing slots a side may grant at once (the slot's bits of
/// [`SLOT_IMM_TAG`]'s immediate).
pub const MAX_SLOTS: u32 = 8;

/// Longest message a landing slot carries (the length's bits of
/// [`SLOT_IMM_TAG`]'s immediate).
pub const MAX_LANDED_LEN: u32 = 1 << 21;

/// The immediate of a message of `len` bytes (1..=[`MAX_LANDED_LEN`])
/// written into landing slot `slot` (below [`MAX_SLOTS`]); `None` out of
/// those bounds.
#[inline(always)]
pub const fn landed_imm(slot: u32, len: u32) -> Option<u32> {
    if slot < MAX_SLOTS && len >= 1 && len <= MAX_LANDED_LEN {
        Some(SLOT_IMM_TAG | (slot << 21) | (len - 1))
    } else {
        None
    }
}

/// The slot and length a WRITE_WITH_IMM's immediate names if it carries
/// [`SLOT_IMM_TAG`] (an application's immediate never does on the wire:
/// it goes in a [`Message::WriteImm`]).
#[inline(always)]
pub const fn landed(imm: u32) -> Option<(u32, u32)> {
    if imm & 0xff00_0000 == SLOT_IMM_TAG {
        Some((
            (imm >> 21) & (MAX_SLOTS - 1),
            (imm & (MAX_LANDED_LEN - 1)) + 1,
        ))
    } else {
        None
    }
}

/// True if an application's WRITE_WITH_IMM immediate would look like one
/// of the agent's own (a staged message's or a landed one's): it then
/// travels in a [`Message::WriteImm`] after a plain WRITE.
#[inline(always)]
pub const fn imm_is_agents(imm: u32) -> bool {
    staged(imm).is_some() || landed(imm).is_some()
}

/// The top byte of a SEND_WITH_IMM's immediate that carries a whole user
/// message without an immediate of its own: the SEND's bytes are the
/// message (no frame), the low 24 bits the send credits granted.
pub const WHOLE_SEND_IMM_TAG: u32 = 0x0b00_0000;

/// The immediate of a frameless whole message granting `grant` credits
/// (see [`WHOLE_SEND_IMM_TAG`]); `None` if `grant` needs more than 24
/// bits (the message goes in its frame then).
#[inline(always)]
pub const fn whole_send_imm(grant: u32) -> Option<u32> {
    if grant <= !0xff00_0000 {
        Some(WHOLE_SEND_IMM_TAG | grant)
    } else {
        None
    }
}

/// The credits a SEND_WITH_IMM's immediate grants if it carries a whole
/// message ([`WHOLE_SEND_IMM_TAG`]); `None` for any other immediate.
#[inline(always)]
pub const fn whole_send_grant(imm: u32) -> Option<u32> {
    if imm & 0xff00_0000 == WHOLE_SEND_IMM_TAG {
        Some(imm & !0xff00_0000)
    } else {
        None
    }
}

/// Size of an encoded [`MrToken`].
pub const TOKEN_LEN: usize = 44;
/// Most messages a sender may have in progress in pieces at once (the
/// first piece posted, the last piece or an `Abort` not yet): a receiver
/// reassembles at most this many, each at most `max_message_len` long, and
/// disconnects a peer that starts more.
pub const MAX_SPLIT_IN_PROGRESS: usize = 8;

/// Why a frame could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the structure needs.
    #[error("truncated agent message: {what} needs {needed} bytes, got {got}")]
    Truncated {
        /// The part being read.
        what: &'static str,
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// Not an agent message.
    #[error("bad agent magic {got:02x?} (expected {MAGIC:02x?})")]
    BadMagic {
        /// The first four bytes.
        got: [u8; 4],
    },
    /// A peer speaking another protocol version.
    #[error("unsupported agent protocol version {got} (this side speaks {VERSION})")]
    UnsupportedVersion {
        /// The peer's version.
        got: u8,
    },
    /// A message kind this version does not know.
    #[error("unknown agent message kind {kind}")]
    UnknownKind {
        /// The kind byte.
        kind: u8,
    },
    /// The header's body length disagrees with the frame.
    #[error("agent message body length {declared} does not match the {actual} bytes received")]
    LengthMismatch {
        /// Length in the header.
        declared: u32,
        /// Bytes after the header.
        actual: usize,
    },
    /// A field holds a value the protocol forbids.
    #[error("invalid agent message field {field}: {reason}")]
    InvalidField {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// The output buffer cannot hold the encoded message.
    #[error("agent message needs {needed} bytes, buffer holds {capacity}")]
    BufferTooSmall {
        /// Encoded size.
        needed: usize,
        /// Buffer size.
        capacity: usize,
    },
}

/// A grant of remote access to a memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrToken {
    /// Owner-chosen id; names the grant in releases and hand-backs.
    pub token_id: u64,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key of the grant's own registration.
    pub rkey: u32,
    /// Granted access (verbs `ibv_access_flags` bits).
    pub access: u32,
    /// Deadline in milliseconds since the Unix epoch (0 = none); after it the
    /// owner refuses and deregisters the grant.
    pub deadline_ms: u64,
    /// Reserved for flags, 0 in version 1.
    pub flags: u32,
}

/// Why an allocation request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefuseCode {
    /// The owner has no memory for it.
    NoMemory,
    /// More access than the owner grants to peers.
    AccessDenied,
    /// Length or alignment out of range.
    BadLayout,
    /// Any other code (forward compatibility).
    Other(u16),
}

impl RefuseCode {
    fn to_raw(self) -> u16 {
        match self {
            RefuseCode::NoMemory => 1,
            RefuseCode::AccessDenied => 2,
            RefuseCode::BadLayout => 3,
            RefuseCode::Other(c) => c,
        }
    }
    fn from_raw(raw: u16) -> RefuseCode {
        match raw {
            1 => RefuseCode::NoMemory,
            2 => RefuseCode::AccessDenied,
            3 => RefuseCode::BadLayout,
            c => RefuseCode::Other(c),
        }
    }
}

/// Which way a memory region is handed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandOverKind {
    /// The sender grants access to its own memory (`send_local_mr`).
    Local,
    /// The sender hands back memory the receiver owns (`send_remote_mr`).
    Remote,
}

/// One agent message. `Data` borrows its payload from the decoded frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message<'a> {
    /// The receiver posted `grant` more receive buffers: the peer may send that many more messages.
    Credit {
        /// Additional messages allowed.
        grant: u32,
    },
    /// Please allocate memory I may access remotely.
    AllocRequest {
        /// Matches the response.
        req_id: u64,
        /// Bytes requested.
        len: u64,
        /// Required alignment (a power of two).
        align: u32,
        /// Requested access bits.
        access: u32,
        /// Requested lifetime in ms (0 = the owner's default).
        lifetime_ms: u32,
    },
    /// The answer to an `AllocRequest`.
    AllocResponse {
        /// The request's id.
        req_id: u64,
        /// The grant, or why not.
        result: Result<MrToken, RefuseCode>,
    },
    /// I no longer use the grant `token_id` (the owner deregisters it).
    Release {
        /// Grant id.
        token_id: u64,
    },
    /// A memory region handed over.
    HandOver {
        /// Local grant or hand-back.
        kind: HandOverKind,
        /// User tag that travels with it.
        tag: u64,
        /// The region.
        token: MrToken,
    },
    /// A user message sent in one piece (it fits one receive buffer): the
    /// usual message, with the short frame.
    Whole {
        /// Immediate data of the message, if any.
        imm: Option<u32>,
        /// Send credits returned to the receiver (0: none), as a
        /// [`Message::Credit`] would.
        grant: u32,
        /// The message.
        payload: &'a [u8],
    },
    /// A piece of a user message split in several (longer than one receive
    /// buffer). A message that fits one piece is a [`Message::Whole`]: a
    /// `Data` piece that is the whole message is refused.
    Data {
        /// Message id (per sender, increasing).
        msg_id: u64,
        /// Length of the whole message.
        total_len: u64,
        /// Offset of this piece.
        offset: u64,
        /// Immediate data of the message, if any.
        imm: Option<u32>,
        /// Send credits returned to the receiver of this piece (0: none),
        /// as a [`Message::Credit`] would.
        grant: u32,
        /// The bytes.
        payload: &'a [u8],
    },
    /// The peer reports a protocol error and closes.
    Error {
        /// Error code.
        code: u16,
        /// Human-readable text (UTF-8, at most [`MAX_ERROR_TEXT`] bytes).
        text: &'a str,
    },
    /// Orderly shutdown.
    Close,
    /// The sender gave up message `msg_id` after sending some of its pieces
    /// (its `send` was cancelled): the receiver discards the partial message.
    Abort {
        /// The abandoned message.
        msg_id: u64,
    },
    /// A side's agent settings, exchanged once over the TCP side channel
    /// before the agent starts (never over the queue pair).
    Settings(Settings),
    /// A user message of `token.len` bytes for the receiver to fetch with
    /// one RDMA READ of the region `token` names (registered by the sender
    /// for this message alone), instead of many `Data` pieces; the receiver
    /// sends a [`Message::Release`] of `token.token_id` once it has read it.
    ReadMe {
        /// Immediate data of the message, if any.
        imm: Option<u32>,
        /// The region holding the message.
        token: MrToken,
    },
    /// The sender's staging ring: `len` bytes at `addr` (remote key
    /// `rkey`) the peer may RDMA WRITE [`Message::Staged`] messages into.
    /// Sent once, when the connection starts.
    StagingRing {
        /// Start address in the sender's address space.
        addr: u64,
        /// Length in bytes.
        len: u32,
        /// Remote key (REMOTE_WRITE only).
        rkey: u32,
    },
    /// A user message of `len` bytes the sender RDMA WROTE at `offset` of
    /// the receiver's staging ring just before this SEND (RC places the
    /// WRITE's bytes first).
    Staged {
        /// Immediate data of the message, if any.
        imm: Option<u32>,
        /// Send credits returned to the receiver (0: none), as a
        /// [`Message::Credit`] would.
        grant: u32,
        /// Where the message starts in the ring.
        offset: u32,
        /// Its length.
        len: u32,
    },
    /// The receiver took `count` more of the sender's staged messages out
    /// of its staging ring (the oldest not returned yet): the ring bytes
    /// they took (with the ends skipped at a wrap) are the sender's to
    /// write again.
    StagingFreed {
        /// Messages returned.
        count: u32,
    },
    /// One landing slot of the sender (`landing.rs`): `len` bytes at
    /// `addr` (remote key `rkey`, REMOTE_WRITE only) the peer may write one
    /// message into, with one WRITE_WITH_IMM whose immediate names `slot`
    /// ([`landed_imm`]). Granted again (with a fresh key) once that
    /// message was dropped by the receiving application.
    SlotGrant {
        /// The slot (below [`MAX_SLOTS`]).
        slot: u32,
        /// Start address in the sender's address space.
        addr: u64,
        /// Length in bytes (1..=[`MAX_LANDED_LEN`]).
        len: u32,
        /// Remote key (REMOTE_WRITE only).
        rkey: u32,
    },
    /// The immediate of an application's `write_with_imm` whose value
    /// carries [`STAGED_IMM_TAG`] or [`SLOT_IMM_TAG`]: its WRITE went without one, and this
    /// SEND follows it (the receiver treats it as the WRITE_WITH_IMM's).
    WriteImm {
        /// The application's immediate.
        imm: u32,
    },
    /// Several whole user messages in one SEND (a pack): messages that
    /// waited for a send credit together, delivered in entry order.
    Packed {
        /// Send credits returned to the receiver (0: none), as a
        /// [`Message::Credit`] would.
        grant: u32,
        /// The messages (checked when decoded).
        entries: PackedEntries<'a>,
    },
}

/// The entries of a [`Message::Packed`]: at least one, filling the bytes
/// exactly (checked by [`PackedEntries::new`]). Iterating yields each
/// message's immediate and bytes, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedEntries<'a> {
    bytes: &'a [u8],
}

impl<'a> PackedEntries<'a> {
    /// Checks `bytes` as a pack's entries (see the module's layout).
    pub fn new(bytes: &'a [u8]) -> Result<PackedEntries<'a>, WireError> {
        if bytes.is_empty() {
            return Err(WireError::InvalidField {
                field: "packed",
                reason: "a pack holds at least one message",
            });
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            match split_entry(rest) {
                Ok((_, _, tail)) => rest = tail,
                Err(e) => return Err(e),
            }
        }
        Ok(PackedEntries { bytes })
    }

    /// The encoded entries.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// How many messages the pack holds.
    pub fn count(&self) -> usize {
        self.into_iter().count()
    }
}

impl<'a> IntoIterator for PackedEntries<'a> {
    type Item = (Option<u32>, &'a [u8]);
    type IntoIter = PackedIter<'a>;
    fn into_iter(self) -> PackedIter<'a> {
        PackedIter { rest: self.bytes }
    }
}

/// Iterator over a pack's messages (see [`PackedEntries`]).
#[derive(Debug, Clone)]
pub struct PackedIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for PackedIter<'a> {
    type Item = (Option<u32>, &'a [u8]);
    fn next(&mut self) -> Option<Self::Item> {
        // Checked when the entries were built; ends early, never panics,
        // should they not be well-formed.
        let (imm, payload, tail) = split_entry(self.rest).ok()?;
        self.rest = tail;
        Some((imm, payload))
    }
}

/// The first entry of a pack's `bytes`: its immediate, its message and the
/// bytes after it.
#[allow(clippy::type_complexity)]
fn split_entry(bytes: &[u8]) -> Result<(Option<u32>, &[u8], &[u8]), WireError> {
    let truncated = |needed: usize| WireError::Truncated {
        what: "packed entry",
        needed,
        got: bytes.len(),
    };
    let word = bytes.first_chunk::<4>().ok_or_else(|| truncated(4))?;
    let word = u32::from_le_bytes(*word);
    let len = (word & !PACKED_IMM_BIT) as usize;
    let (imm, at) = if word & PACKED_IMM_BIT != 0 {
        let imm = bytes.get(4..8).ok_or_else(|| truncated(8))?;
        (Some(le_u32(imm, 0)), 8usize)
    } else {
        (None, 4)
    };
    let end = at.checked_add(len).ok_or_else(|| truncated(usize::MAX))?;
    let payload = bytes.get(at..end).ok_or_else(|| truncated(end))?;
    Ok((imm, payload, &bytes[end..]))
}

/// Bytes one message of `len` bytes takes in a pack (with `imm`: an
/// immediate).
#[inline(always)]
pub const fn packed_entry_len(len: usize, imm: bool) -> usize {
    4 + if imm { 4 } else { 0 } + len
}

/// Largest message a pack entry can hold (its length word's 31 bits).
pub const MAX_PACKED_MESSAGE: usize = (PACKED_IMM_BIT - 1) as usize;

/// Appends one pack entry (`payload` with `imm`) to `out` at `at`;
/// returns the end of the entry, `None` (nothing written) if it does not
/// fit `out` or the message is longer than [`MAX_PACKED_MESSAGE`].
#[inline]
pub(crate) fn put_packed_entry(
    out: &mut [u8],
    at: usize,
    imm: Option<u32>,
    payload: &[u8],
) -> Option<usize> {
    if payload.len() > MAX_PACKED_MESSAGE {
        return None;
    }
    let end = at.checked_add(packed_entry_len(payload.len(), imm.is_some()))?;
    let e = out.get_mut(at..end)?;
    let mut word = payload.len() as u32;
    let mut n = 4;
    if let Some(imm) = imm {
        word |= PACKED_IMM_BIT;
        e[4..8].copy_from_slice(&imm.to_le_bytes());
        n = 8;
    }
    e[..4].copy_from_slice(&word.to_le_bytes());
    e[n..].copy_from_slice(payload);
    Some(end)
}

/// Writes the header of a [`Message::Packed`] frame with `grant` at the
/// start of `out`; `None` if `out` is shorter than [`PACKED_HEADER_LEN`].
#[inline]
pub(crate) fn put_packed_header(out: &mut [u8], grant: u32) -> Option<usize> {
    let h = out.get_mut(..PACKED_HEADER_LEN)?;
    h[..4].copy_from_slice(&u32::from(kind::PACKED).to_le_bytes());
    h[4..8].copy_from_slice(&grant.to_le_bytes());
    Some(PACKED_HEADER_LEN)
}

/// The agent settings each side announces when a connection starts; both
/// sides check the pair the same way (see `Rdma` connection setup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Largest message the sender of these settings accepts.
    pub max_message_len: u64,
    /// Size of each of its receive buffers (the peer's pieces must fit).
    pub recv_buf_size: u32,
    /// Credit-bearing receive buffers it posts for the peer.
    pub recv_buf_count: u32,
    /// Credits it returns per `Credit` message.
    pub credit_batch: u32,
    /// Capacity of its receive queue (work requests).
    pub max_recv_wr: u32,
}

/// Size of an encoded [`Settings`] body.
pub const SETTINGS_LEN: usize = 8 + 4 + 4 + 4 + 4;

mod kind {
    pub const CREDIT: u8 = 1;
    pub const ALLOC_REQUEST: u8 = 2;
    pub const ALLOC_RESPONSE: u8 = 3;
    pub const RELEASE: u8 = 4;
    pub const HAND_OVER: u8 = 5;
    pub const DATA: u8 = 6;
    pub const ERROR: u8 = 7;
    pub const CLOSE: u8 = 8;
    pub const ABORT: u8 = 9;
    pub const SETTINGS: u8 = 10;
    pub const WHOLE: u8 = 11;
    pub const WHOLE_IMM: u8 = 12;
    pub const READ_ME: u8 = 13;
    pub const STAGING_RING: u8 = 14;
    pub const STAGED: u8 = 15;
    pub const STAGING_FREED: u8 = 16;
    pub const WRITE_IMM: u8 = 17;
    pub const PACKED: u8 = 18;
    pub const SLOT_GRANT: u8 = 19;
}

/// Bytes of a `Data` piece before its payload: the most any user message
/// carries (a [`Message::Whole`] has [`whole_overhead`]).
pub const DATA_OVERHEAD: usize = HEADER_LEN + 8 + 8 + 8 + 4 + 4 + 4;

/// Bytes before the message in a [`Message::Whole`] frame: kind, reserved
/// and credits granted, and the immediate if there is one.
#[inline(always)]
pub const fn whole_overhead(imm: bool) -> usize {
    WHOLE_HEADER_LEN + if imm { 4 } else { 0 }
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                what: self.what,
                needed: n,
                got: self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn finish(&self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::InvalidField {
                field: self.what,
                reason: "trailing bytes after the message body",
            })
        }
    }
}

/// A bounds-checked little-endian writer.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        // Invariant: `encode` checked the total size before writing.
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
    }
}

/// An optional immediate as `has_imm: u32, imm: u32`: `(1, imm)` or
/// `(0, 0)`; anything else is refused as `field`.
fn read_opt_imm(r: &mut Reader<'_>, field: &'static str) -> Result<Option<u32>, WireError> {
    match (r.u32()?, r.u32()?) {
        (0, 0) => Ok(None),
        (1, imm) => Ok(Some(imm)),
        _ => Err(WireError::InvalidField {
            field,
            reason: "has_imm must be 1, or 0 with a zero immediate",
        }),
    }
}

fn read_token(r: &mut Reader<'_>) -> Result<MrToken, WireError> {
    let token = MrToken {
        token_id: r.u64()?,
        addr: r.u64()?,
        len: r.u64()?,
        rkey: r.u32()?,
        access: r.u32()?,
        deadline_ms: r.u64()?,
        flags: r.u32()?,
    };
    if token.addr.checked_add(token.len).is_none() {
        return Err(WireError::InvalidField {
            field: "token.len",
            reason: "region wraps the address space",
        });
    }
    if token.access & !0xf != 0 {
        return Err(WireError::InvalidField {
            field: "token.access",
            reason: "unknown access bits",
        });
    }
    Ok(token)
}

fn write_token(w: &mut Writer<'_>, t: &MrToken) {
    w.put(&t.token_id.to_le_bytes());
    w.put(&t.addr.to_le_bytes());
    w.put(&t.len.to_le_bytes());
    w.put(&t.rkey.to_le_bytes());
    w.put(&t.access.to_le_bytes());
    w.put(&t.deadline_ms.to_le_bytes());
    w.put(&t.flags.to_le_bytes());
}

/// The first 8 bytes of every `Data` frame: magic, version, kind, reserved.
const DATA_HEAD: [u8; 8] = [
    MAGIC[0],
    MAGIC[1],
    MAGIC[2],
    MAGIC[3],
    VERSION,
    kind::DATA,
    0,
    0,
];

/// True if a piece at `offset` with `payload` is the whole message of
/// `total_len` bytes.
#[inline(always)]
fn is_whole(offset: u64, total_len: u64, payload: &[u8]) -> bool {
    offset == 0 && payload.len() as u64 == total_len
}

/// Decodes one frame. Never panics; every malformed input is a [`WireError`].
#[inline]
pub fn decode(frame: &[u8]) -> Result<Message<'_>, WireError> {
    match decode_data(frame) {
        Some(msg) => Ok(msg),
        None => decode_any(frame),
    }
}

/// The usual frame of all, a whole message without an immediate in the
/// short frame: its header's grant and the payload's length (the payload
/// follows the [`WHOLE_HEADER_LEN`] bytes of header); `None` for any other
/// frame. What [`decode_data`] reads from it, as two integers.
#[inline(always)]
pub(crate) fn decode_short_whole(frame: &[u8]) -> Option<(u32, usize)> {
    let (h, payload) = frame.split_first_chunk::<WHOLE_HEADER_LEN>()?;
    if le_u32(h, 0) != u32::from(kind::WHOLE) {
        return None;
    }
    Some((le_u32(h, 4), payload.len()))
}

/// The usual frames, a well-formed [`Message::Whole`] or `Data` piece,
/// read as one fixed-size header; `None` for anything else (then
/// [`decode_any`] decides, and names what is wrong).
#[inline]
pub(crate) fn decode_data(frame: &[u8]) -> Option<Message<'_>> {
    let head = le_u32(frame.first_chunk::<4>()?, 0);
    if head == u32::from(kind::WHOLE) || head == u32::from(kind::WHOLE_IMM) {
        return decode_whole(frame, head == u32::from(kind::WHOLE_IMM));
    }
    let (h, payload) = frame.split_first_chunk::<DATA_OVERHEAD>()?;
    let (u32_at, u64_at) = (|i| le_u32(h, i), |i| le_u64(h, i));
    if h[..8] != DATA_HEAD || u32_at(8) as usize != frame.len() - HEADER_LEN {
        return None;
    }
    let (msg_id, total_len, offset) = (u64_at(12), u64_at(20), u64_at(28));
    let imm = match (u32_at(36), u32_at(40)) {
        (0, 0) => None,
        (1, imm) => Some(imm),
        _ => return None,
    };
    let grant = u32_at(44);
    // A whole message has one encoding, the short one: not this.
    if offset.checked_add(payload.len() as u64)? > total_len || is_whole(offset, total_len, payload)
    {
        return None;
    }
    Some(Message::Data {
        msg_id,
        total_len,
        offset,
        imm,
        grant,
        payload,
    })
}

/// The little-endian `u32` at `h[i..i + 4]` (the caller sized `h`).
#[inline(always)]
fn le_u32(h: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]])
}

/// The little-endian `u64` at `h[i..i + 8]` (the caller sized `h`).
#[inline(always)]
fn le_u64(h: &[u8], i: usize) -> u64 {
    u64::from(le_u32(h, i)) | u64::from(le_u32(h, i + 4)) << 32
}

/// [`decode_data`] of a [`Message::Whole`] frame whose first four bytes
/// were checked (`imm`: kind `WHOLE_IMM`).
#[inline(always)]
fn decode_whole(frame: &[u8], imm: bool) -> Option<Message<'_>> {
    let overhead = whole_overhead(imm);
    let h = frame.get(..overhead)?;
    let payload = frame.get(overhead..)?;
    Some(Message::Whole {
        imm: imm.then(|| le_u32(h, 8)),
        grant: le_u32(h, 4),
        payload,
    })
}

/// Decodes any frame (see [`decode`]).
fn decode_any(frame: &[u8]) -> Result<Message<'_>, WireError> {
    let mut r = Reader {
        buf: frame,
        what: "header",
    };
    if let Some(&k @ (kind::WHOLE | kind::WHOLE_IMM)) = frame.first() {
        r.what = "whole message";
        r.u8()?;
        if r.array::<3>()? != [0; 3] {
            return Err(WireError::InvalidField {
                field: "whole.reserved",
                reason: "must be 0",
            });
        }
        let grant = r.u32()?;
        let imm = if k == kind::WHOLE_IMM {
            Some(r.u32()?)
        } else {
            None
        };
        return Ok(Message::Whole {
            imm,
            grant,
            payload: r.buf,
        });
    }
    if frame.first() == Some(&kind::PACKED) {
        r.what = "packed";
        r.u8()?;
        if r.array::<3>()? != [0; 3] {
            return Err(WireError::InvalidField {
                field: "packed.reserved",
                reason: "must be 0",
            });
        }
        let grant = r.u32()?;
        let entries = PackedEntries::new(r.buf)?;
        return Ok(Message::Packed { grant, entries });
    }
    let magic = r.array::<4>()?;
    if magic != MAGIC {
        return Err(WireError::BadMagic { got: magic });
    }
    let version = r.u8()?;
    if version != VERSION {
        return Err(WireError::UnsupportedVersion { got: version });
    }
    let kind = r.u8()?;
    if r.u16()? != 0 {
        return Err(WireError::InvalidField {
            field: "reserved",
            reason: "must be 0",
        });
    }
    let declared = r.u32()?;
    if declared as usize != r.buf.len() {
        return Err(WireError::LengthMismatch {
            declared,
            actual: r.buf.len(),
        });
    }
    let msg = match kind {
        kind::CREDIT => {
            r.what = "credit";
            Message::Credit { grant: r.u32()? }
        }
        kind::ALLOC_REQUEST => {
            r.what = "alloc request";
            let req_id = r.u64()?;
            let len = r.u64()?;
            let align = r.u32()?;
            let access = r.u32()?;
            let lifetime_ms = r.u32()?;
            if !align.is_power_of_two() {
                return Err(WireError::InvalidField {
                    field: "align",
                    reason: "not a power of two",
                });
            }
            Message::AllocRequest {
                req_id,
                len,
                align,
                access,
                lifetime_ms,
            }
        }
        kind::ALLOC_RESPONSE => {
            r.what = "alloc response";
            let req_id = r.u64()?;
            let code = r.u16()?;
            let result = if code == 0 {
                Ok(read_token(&mut r)?)
            } else {
                Err(RefuseCode::from_raw(code))
            };
            Message::AllocResponse { req_id, result }
        }
        kind::RELEASE => {
            r.what = "release";
            Message::Release { token_id: r.u64()? }
        }
        kind::HAND_OVER => {
            r.what = "hand-over";
            let kind = match r.u8()? {
                0 => HandOverKind::Local,
                1 => HandOverKind::Remote,
                _ => {
                    return Err(WireError::InvalidField {
                        field: "hand_over.kind",
                        reason: "neither local (0) nor remote (1)",
                    })
                }
            };
            let tag = r.u64()?;
            let token = read_token(&mut r)?;
            Message::HandOver { kind, tag, token }
        }
        kind::DATA => {
            r.what = "data";
            let msg_id = r.u64()?;
            let total_len = r.u64()?;
            let offset = r.u64()?;
            let has_imm = r.u32()?;
            let imm_raw = r.u32()?;
            let grant = r.u32()?;
            let imm = match has_imm {
                0 if imm_raw == 0 => None,
                0 => {
                    return Err(WireError::InvalidField {
                        field: "data.imm",
                        reason: "must be 0 without an immediate",
                    })
                }
                1 => Some(imm_raw),
                _ => {
                    return Err(WireError::InvalidField {
                        field: "data.has_imm",
                        reason: "must be 0 or 1",
                    })
                }
            };
            let payload = r.take(r.buf.len())?;
            let end = offset.checked_add(payload.len() as u64);
            if end.is_none_or(|end| end > total_len) {
                return Err(WireError::InvalidField {
                    field: "data.offset",
                    reason: "piece extends past the message length",
                });
            }
            if is_whole(offset, total_len, payload) {
                return Err(WireError::InvalidField {
                    field: "data",
                    reason: "a whole message is sent in the short frame (kind WHOLE or WHOLE_IMM)",
                });
            }
            Message::Data {
                msg_id,
                total_len,
                offset,
                imm,
                grant,
                payload,
            }
        }
        kind::WHOLE | kind::WHOLE_IMM | kind::PACKED => {
            return Err(WireError::InvalidField {
                field: "kind",
                reason: "a whole message or a pack has only the short frame",
            })
        }
        kind::ERROR => {
            r.what = "error";
            let code = r.u16()?;
            let len = r.u16()? as usize;
            if len > MAX_ERROR_TEXT {
                return Err(WireError::InvalidField {
                    field: "error.text",
                    reason: "longer than MAX_ERROR_TEXT",
                });
            }
            let text = std::str::from_utf8(r.take(len)?).map_err(|_| WireError::InvalidField {
                field: "error.text",
                reason: "not UTF-8",
            })?;
            Message::Error { code, text }
        }
        kind::CLOSE => Message::Close,
        kind::ABORT => {
            r.what = "abort";
            Message::Abort { msg_id: r.u64()? }
        }
        kind::SETTINGS => {
            r.what = "settings";
            Message::Settings(Settings {
                max_message_len: r.u64()?,
                recv_buf_size: r.u32()?,
                recv_buf_count: r.u32()?,
                credit_batch: r.u32()?,
                max_recv_wr: r.u32()?,
            })
        }
        kind::READ_ME => {
            r.what = "read-me";
            let imm = read_opt_imm(&mut r, "read_me.imm")?;
            let token = read_token(&mut r)?;
            Message::ReadMe { imm, token }
        }
        kind::STAGING_RING => {
            r.what = "staging ring";
            let addr = r.u64()?;
            let len = r.u32()?;
            let rkey = r.u32()?;
            if addr.checked_add(u64::from(len)).is_none() {
                return Err(WireError::InvalidField {
                    field: "staging_ring.len",
                    reason: "region wraps the address space",
                });
            }
            Message::StagingRing { addr, len, rkey }
        }
        kind::STAGED => {
            r.what = "staged";
            let imm = read_opt_imm(&mut r, "staged.imm")?;
            let grant = r.u32()?;
            let offset = r.u32()?;
            let len = r.u32()?;
            if offset.checked_add(len).is_none() {
                return Err(WireError::InvalidField {
                    field: "staged.len",
                    reason: "message ends past 4 GiB",
                });
            }
            Message::Staged {
                imm,
                grant,
                offset,
                len,
            }
        }
        kind::STAGING_FREED => {
            r.what = "staging freed";
            Message::StagingFreed { count: r.u32()? }
        }
        kind::WRITE_IMM => {
            r.what = "write immediate";
            Message::WriteImm { imm: r.u32()? }
        }
        kind::SLOT_GRANT => {
            r.what = "slot grant";
            let slot = r.u32()?;
            let addr = r.u64()?;
            let len = r.u32()?;
            let rkey = r.u32()?;
            if slot >= MAX_SLOTS {
                return Err(WireError::InvalidField {
                    field: "slot_grant.slot",
                    reason: "beyond the slots an immediate can name",
                });
            }
            if len == 0 || len > MAX_LANDED_LEN {
                return Err(WireError::InvalidField {
                    field: "slot_grant.len",
                    reason: "empty, or longer than an immediate can name",
                });
            }
            if addr.checked_add(u64::from(len)).is_none() {
                return Err(WireError::InvalidField {
                    field: "slot_grant.len",
                    reason: "region wraps the address space",
                });
            }
            Message::SlotGrant {
                slot,
                addr,
                len,
                rkey,
            }
        }
        kind => return Err(WireError::UnknownKind { kind }),
    };
    r.finish()?;
    Ok(msg)
}

impl Message<'_> {
    /// Size of the encoded frame.
    pub fn encoded_len(&self) -> usize {
        if let Message::Whole { imm, payload, .. } = self {
            return whole_overhead(imm.is_some()) + payload.len();
        }
        if let Message::Packed { entries, .. } = self {
            return PACKED_HEADER_LEN + entries.as_bytes().len();
        }
        HEADER_LEN
            + match self {
                Message::Credit { .. } => 4,
                Message::AllocRequest { .. } => 8 + 8 + 4 + 4 + 4,
                Message::AllocResponse { result, .. } => {
                    8 + 2 + if result.is_ok() { TOKEN_LEN } else { 0 }
                }
                Message::Release { .. } => 8,
                Message::HandOver { .. } => 1 + 8 + TOKEN_LEN,
                Message::Whole { .. } | Message::Packed { .. } => 0, // returned above
                Message::Data { payload, .. } => DATA_OVERHEAD - HEADER_LEN + payload.len(),
                Message::Error { text, .. } => 2 + 2 + text.len().min(MAX_ERROR_TEXT),
                Message::Close => 0,
                Message::Abort { .. } => 8,
                Message::Settings(_) => SETTINGS_LEN,
                Message::ReadMe { .. } => 4 + 4 + TOKEN_LEN,
                Message::StagingRing { .. } => 8 + 4 + 4,
                Message::Staged { .. } => 4 + 4 + 4 + 4 + 4,
                Message::StagingFreed { .. } => 4,
                Message::WriteImm { .. } => 4,
                Message::SlotGrant { .. } => 4 + 8 + 4 + 4,
            }
    }

    fn kind(&self) -> u8 {
        match self {
            Message::Credit { .. } => kind::CREDIT,
            Message::AllocRequest { .. } => kind::ALLOC_REQUEST,
            Message::AllocResponse { .. } => kind::ALLOC_RESPONSE,
            Message::Release { .. } => kind::RELEASE,
            Message::HandOver { .. } => kind::HAND_OVER,
            Message::Data { .. } => kind::DATA,
            Message::Whole { imm: None, .. } => kind::WHOLE,
            Message::Whole { imm: Some(_), .. } => kind::WHOLE_IMM,
            Message::Error { .. } => kind::ERROR,
            Message::Close => kind::CLOSE,
            Message::Abort { .. } => kind::ABORT,
            Message::Settings(_) => kind::SETTINGS,
            Message::ReadMe { .. } => kind::READ_ME,
            Message::StagingRing { .. } => kind::STAGING_RING,
            Message::Staged { .. } => kind::STAGED,
            Message::StagingFreed { .. } => kind::STAGING_FREED,
            Message::WriteImm { .. } => kind::WRITE_IMM,
            Message::Packed { .. } => kind::PACKED,
            Message::SlotGrant { .. } => kind::SLOT_GRANT,
        }
    }

    /// Encodes into `out`; returns the frame length. Error texts longer than
    /// [`MAX_ERROR_TEXT`] are cut at a character boundary.
    #[inline]
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, WireError> {
        match *self {
            Message::Data {
                msg_id,
                total_len,
                offset,
                imm,
                grant,
                payload,
            } => encode_data(out, msg_id, total_len, offset, imm, grant, payload),
            Message::Whole {
                imm,
                grant,
                payload,
            } => encode_whole(out, imm, grant, payload),
            Message::Packed { grant, entries } => {
                let len = self.encoded_len();
                let Some(frame) = out.get_mut(..len) else {
                    return Err(WireError::BufferTooSmall {
                        needed: len,
                        capacity: out.len(),
                    });
                };
                let n = put_packed_header(frame, grant).expect("sized above");
                frame[n..].copy_from_slice(entries.as_bytes());
                Ok(len)
            }
            _ => self.encode_other(out),
        }
    }

    /// [`Message::encode`] of every message but `Data` and `Whole` (which
    /// [`encode_data`] and [`encode_whole`] write).
    fn encode_other(&self, out: &mut [u8]) -> Result<usize, WireError> {
        let len = self.encoded_len();
        if out.len() < len {
            return Err(WireError::BufferTooSmall {
                needed: len,
                capacity: out.len(),
            });
        }
        let mut w = Writer { buf: out, pos: 0 };
        w.put(&MAGIC);
        w.put(&[VERSION, self.kind(), 0, 0]);
        w.put(&((len - HEADER_LEN) as u32).to_le_bytes());
        match self {
            Message::Credit { grant } => w.put(&grant.to_le_bytes()),
            Message::AllocRequest {
                req_id,
                len,
                align,
                access,
                lifetime_ms,
            } => {
                w.put(&req_id.to_le_bytes());
                w.put(&len.to_le_bytes());
                w.put(&align.to_le_bytes());
                w.put(&access.to_le_bytes());
                w.put(&lifetime_ms.to_le_bytes());
            }
            Message::AllocResponse { req_id, result } => {
                w.put(&req_id.to_le_bytes());
                match result {
                    Ok(token) => {
                        w.put(&0u16.to_le_bytes());
                        write_token(&mut w, token);
                    }
                    Err(code) => w.put(&code.to_raw().max(1).to_le_bytes()),
                }
            }
            Message::Release { token_id } => w.put(&token_id.to_le_bytes()),
            Message::HandOver { kind, tag, token } => {
                w.put(&[match kind {
                    HandOverKind::Local => 0,
                    HandOverKind::Remote => 1,
                }]);
                w.put(&tag.to_le_bytes());
                write_token(&mut w, token);
            }
            // `encode` writes these (encode_data, encode_whole); this
            // private function never sees them.
            Message::Data { .. } | Message::Whole { .. } | Message::Packed { .. } => {
                unreachable!("Data, Whole and Packed are encoded by encode")
            }
            Message::Error { code, text } => {
                let mut cut = text.len().min(MAX_ERROR_TEXT);
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                // Pad with spaces if the cut removed part of a character, so the
                // frame keeps the length `encoded_len` promised.
                let pad = text.len().min(MAX_ERROR_TEXT) - cut;
                w.put(&code.to_le_bytes());
                w.put(&((cut + pad) as u16).to_le_bytes());
                w.put(&text.as_bytes()[..cut]);
                for _ in 0..pad {
                    w.put(b" ");
                }
            }
            Message::Close => {}
            Message::Abort { msg_id } => w.put(&msg_id.to_le_bytes()),
            Message::Settings(st) => {
                w.put(&st.max_message_len.to_le_bytes());
                w.put(&st.recv_buf_size.to_le_bytes());
                w.put(&st.recv_buf_count.to_le_bytes());
                w.put(&st.credit_batch.to_le_bytes());
                w.put(&st.max_recv_wr.to_le_bytes());
            }
            Message::ReadMe { imm, token } => {
                w.put(&u32::from(imm.is_some()).to_le_bytes());
                w.put(&imm.unwrap_or(0).to_le_bytes());
                write_token(&mut w, token);
            }
            Message::StagingRing { addr, len, rkey } => {
                w.put(&addr.to_le_bytes());
                w.put(&len.to_le_bytes());
                w.put(&rkey.to_le_bytes());
            }
            Message::Staged {
                imm,
                grant,
                offset,
                len,
            } => {
                w.put(&u32::from(imm.is_some()).to_le_bytes());
                w.put(&imm.unwrap_or(0).to_le_bytes());
                w.put(&grant.to_le_bytes());
                w.put(&offset.to_le_bytes());
                w.put(&len.to_le_bytes());
            }
            Message::StagingFreed { count } => w.put(&count.to_le_bytes()),
            Message::WriteImm { imm } => w.put(&imm.to_le_bytes()),
            Message::SlotGrant {
                slot,
                addr,
                len,
                rkey,
            } => {
                w.put(&slot.to_le_bytes());
                w.put(&addr.to_le_bytes());
                w.put(&len.to_le_bytes());
                w.put(&rkey.to_le_bytes());
            }
        }
        debug_assert_eq!(w.pos, len);
        Ok(len)
    }
}

/// Encodes a `Data` piece into `out` as one fixed-size header and its
/// payload (see [`Message::encode`]).
#[inline]
fn encode_data(
    out: &mut [u8],
    msg_id: u64,
    total_len: u64,
    offset: u64,
    imm: Option<u32>,
    grant: u32,
    payload: &[u8],
) -> Result<usize, WireError> {
    let len = DATA_OVERHEAD + payload.len();
    let Some(frame) = out.get_mut(..len) else {
        return Err(WireError::BufferTooSmall {
            needed: len,
            capacity: out.len(),
        });
    };
    if offset
        .checked_add(payload.len() as u64)
        .is_none_or(|end| end > total_len)
    {
        return Err(WireError::InvalidField {
            field: "data.offset",
            reason: "piece extends past the message length",
        });
    }
    if is_whole(offset, total_len, payload) {
        return Err(WireError::InvalidField {
            field: "data",
            reason: "a whole message is a Message::Whole",
        });
    }
    let (h, body) = frame
        .split_first_chunk_mut::<DATA_OVERHEAD>()
        .expect("sized above");
    put_data_header(h, msg_id, total_len, offset, imm, grant, payload.len());
    body.copy_from_slice(payload);
    Ok(len)
}

/// Encodes a [`Message::Whole`] into `out` (see [`Message::encode`]).
#[inline]
fn encode_whole(
    out: &mut [u8],
    imm: Option<u32>,
    grant: u32,
    payload: &[u8],
) -> Result<usize, WireError> {
    let len = whole_overhead(imm.is_some()) + payload.len();
    let Some(frame) = out.get_mut(..len) else {
        return Err(WireError::BufferTooSmall {
            needed: len,
            capacity: out.len(),
        });
    };
    let n = put_whole_header(frame, imm, grant).expect("sized above");
    frame[n..].copy_from_slice(payload);
    Ok(len)
}

/// Writes the header of a [`Message::Whole`] frame (kind `WHOLE`, or
/// `WHOLE_IMM` with `imm`) at the start of `out`; returns its length
/// ([`whole_overhead`]; the message follows it), `None` if `out` is shorter
/// than that.
#[inline(always)]
pub(crate) fn put_whole_header(out: &mut [u8], imm: Option<u32>, grant: u32) -> Option<usize> {
    let n = whole_overhead(imm.is_some());
    let h = out.get_mut(..n)?;
    let kind = if imm.is_some() {
        kind::WHOLE_IMM
    } else {
        kind::WHOLE
    };
    h[..4].copy_from_slice(&u32::from(kind).to_le_bytes());
    h[4..8].copy_from_slice(&grant.to_le_bytes());
    if let Some(imm) = imm {
        h[8..12].copy_from_slice(&imm.to_le_bytes());
    }
    Some(n)
}

/// Writes the fixed header of a `Data` piece of `payload_len` bytes (its
/// payload follows it on the wire) at `offset` of a message of `total_len`
/// bytes into `h`; the caller has checked that the piece lies within the
/// message, as [`Message::encode`] does.
#[inline(always)]
pub(crate) fn put_data_header(
    h: &mut [u8; DATA_OVERHEAD],
    msg_id: u64,
    total_len: u64,
    offset: u64,
    imm: Option<u32>,
    grant: u32,
    payload_len: usize,
) {
    h[..8].copy_from_slice(&DATA_HEAD);
    h[8..12].copy_from_slice(&((DATA_OVERHEAD - HEADER_LEN + payload_len) as u32).to_le_bytes());
    h[12..20].copy_from_slice(&msg_id.to_le_bytes());
    h[20..28].copy_from_slice(&total_len.to_le_bytes());
    h[28..36].copy_from_slice(&offset.to_le_bytes());
    h[36..40].copy_from_slice(&u32::from(imm.is_some()).to_le_bytes());
    h[40..44].copy_from_slice(&imm.unwrap_or(0).to_le_bytes());
    h[44..48].copy_from_slice(&grant.to_le_bytes());
}

impl fmt::Display for HandOverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HandOverKind::Local => "local",
            HandOverKind::Remote => "remote",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `decode_short_whole` says of `frame`, by `decode_data`: the
    /// grant and payload length of a whole message without an immediate.
    fn short_whole_by_decode_data(frame: &[u8]) -> Option<(u32, usize)> {
        match decode_data(frame)? {
            Message::Whole {
                imm: None,
                grant,
                payload,
            } => Some((grant, payload.len())),
            _ => None,
        }
    }

    #[test]
    fn the_short_whole_decoder_agrees_with_decode_data() {
        let mut frames: Vec<Vec<u8>> = samples()
            .iter()
            .map(|m| {
                let mut b = vec![0u8; m.encoded_len()];
                let n = m.encode(&mut b).unwrap();
                b.truncate(n);
                b
            })
            .collect();
        for (imm, grant, len) in [(None, 0, 0), (None, 3, 64), (Some(9), 1, 64), (None, 7, 1)] {
            let mut b = vec![0u8; whole_overhead(imm.is_some()) + len];
            put_whole_header(&mut b, imm, grant).unwrap();
            frames.push(b);
        }
        // Every prefix, and each header byte changed, of every frame.
        let mut all = Vec::new();
        for f in &frames {
            for n in 0..=f.len().min(16) {
                all.push(f[..n].to_vec());
            }
            for i in 0..f.len().min(12) {
                let mut g = f.clone();
                g[i] ^= 0x01;
                all.push(g);
            }
            all.push(f.clone());
        }
        let mut shorts = 0;
        for f in &all {
            let short = decode_short_whole(f);
            assert_eq!(short, short_whole_by_decode_data(f), "frame {f:?}");
            shorts += usize::from(short.is_some());
        }
        assert!(
            shorts >= 3,
            "the whole messages without an immediate decode"
        );
    }

    fn token() -> MrToken {
        MrToken {
            token_id: 7,
            addr: 0x7f00_0000_1000,
            len: 4096,
            rkey: 0xdead_beef,
            access: 0b0110,
            deadline_ms: 1_800_000_000_000,
            flags: 0,
        }
    }

    fn samples() -> Vec<Message<'static>> {
        vec![
            Message::Credit { grant: 16 },
            Message::AllocRequest {
                req_id: 1,
                len: 1 << 20,
                align: 8,
                access: 0b0110,
                lifetime_ms: 5000,
            },
            Message::AllocResponse {
                req_id: 1,
                result: Ok(token()),
            },
            Message::AllocResponse {
                req_id: 2,
                result: Err(RefuseCode::AccessDenied),
            },
            Message::Release { token_id: 7 },
            Message::HandOver {
                kind: HandOverKind::Local,
                tag: 3,
                token: token(),
            },
            Message::HandOver {
                kind: HandOverKind::Remote,
                tag: 4,
                token: token(),
            },
            Message::Data {
                msg_id: 9,
                total_len: 10,
                offset: 5,
                imm: Some(0xabcd),
                grant: 3,
                payload: b"hello",
            },
            Message::Data {
                msg_id: u64::MAX,
                total_len: 10,
                offset: 0,
                imm: None,
                grant: u32::MAX,
                payload: b"first",
            },
            Message::Whole {
                imm: None,
                grant: 0,
                payload: b"",
            },
            Message::Whole {
                imm: None,
                grant: 2,
                payload: b"whole",
            },
            Message::Whole {
                imm: Some(u32::MAX),
                grant: u32::MAX,
                payload: b"whole",
            },
            Message::Error {
                code: 2,
                text: "bad token",
            },
            Message::Close,
            Message::Abort { msg_id: 11 },
            Message::Settings(Settings {
                max_message_len: 64 << 20,
                recv_buf_size: 4096,
                recv_buf_count: 16,
                credit_batch: 4,
                max_recv_wr: 128,
            }),
            Message::ReadMe {
                imm: None,
                token: token(),
            },
            Message::ReadMe {
                imm: Some(0),
                token: token(),
            },
            Message::StagingRing {
                addr: 0x7f00_0010_0000,
                len: 1 << 20,
                rkey: 0x1234,
            },
            Message::Staged {
                imm: None,
                grant: 0,
                offset: 0,
                len: 65536,
            },
            Message::Staged {
                imm: Some(u32::MAX),
                grant: 16,
                offset: u32::MAX - 1,
                len: 1,
            },
            Message::StagingFreed { count: 1 << 18 },
            Message::WriteImm { imm: u32::MAX },
            Message::SlotGrant {
                slot: MAX_SLOTS - 1,
                addr: 0x7f00_0020_0000,
                len: MAX_LANDED_LEN,
                rkey: 0x5678,
            },
            Message::Packed {
                grant: 5,
                entries: PackedEntries::new(PACK).unwrap(),
            },
        ]
    }

    /// A pack's entries: "abc", "hi" with the immediate 0x1234_5678, and
    /// an empty message.
    const PACK: &[u8] = b"\x03\x00\x00\x00abc\x02\x00\x00\x80\x78\x56\x34\x12hi\x00\x00\x00\x00";

    #[test]
    fn a_pack_holds_its_messages_in_order() {
        let mut buf = [0u8; 64];
        let mut at = PACKED_HEADER_LEN;
        for (imm, m) in [(None, &b"abc"[..]), (Some(0x1234_5678), b"hi"), (None, b"")] {
            at = put_packed_entry(&mut buf, at, imm, m).unwrap();
        }
        put_packed_header(&mut buf, 7).unwrap();
        let Message::Packed { grant, entries } = decode(&buf[..at]).unwrap() else {
            panic!("not a pack");
        };
        assert_eq!(grant, 7);
        assert_eq!(entries.as_bytes(), PACK);
        let got: Vec<_> = entries.into_iter().collect();
        assert_eq!(
            got,
            [
                (None, &b"abc"[..]),
                (Some(0x1234_5678), &b"hi"[..]),
                (None, &b""[..])
            ]
        );
        assert_eq!(entries.count(), 3);
        // An entry that does not fit the buffer is not written.
        assert_eq!(put_packed_entry(&mut buf, 60, None, b"12345"), None);
    }

    #[test]
    fn a_bad_pack_is_refused_whole() {
        let mut frame = vec![18u8, 0, 0, 0, 1, 0, 0, 0];
        frame.extend_from_slice(PACK);
        assert!(decode(&frame).is_ok());
        // No entry at all.
        assert!(matches!(
            decode(&frame[..PACKED_HEADER_LEN]),
            Err(WireError::InvalidField {
                field: "packed",
                ..
            })
        ));
        // Cut anywhere inside an entry (or its length word).
        for cut in PACKED_HEADER_LEN + 1..frame.len() {
            let cuts_entry = ![PACKED_HEADER_LEN + 7, PACKED_HEADER_LEN + 17].contains(&cut);
            assert_eq!(
                decode(&frame[..cut]).is_err(),
                cuts_entry,
                "cut at {cut}: {:?}",
                decode(&frame[..cut])
            );
        }
        // A length past the end of the frame (and the largest one).
        for len in [4u32, 0x7fff_ffff, u32::MAX] {
            let mut bad = frame.clone();
            bad[PACKED_HEADER_LEN..PACKED_HEADER_LEN + 4].copy_from_slice(&len.to_le_bytes());
            assert!(
                matches!(decode(&bad), Err(WireError::Truncated { .. })),
                "{len:#x}"
            );
        }
        // Trailing bytes that are no whole entry.
        let mut bad = frame.clone();
        bad.extend_from_slice(&[1, 0]);
        assert!(decode(&bad).is_err());
        // Reserved bytes.
        let mut bad = frame.clone();
        bad[2] = 1;
        assert!(matches!(
            decode(&bad),
            Err(WireError::InvalidField {
                field: "packed.reserved",
                ..
            })
        ));
        // The long form of the kind does not exist.
        let mut long = Vec::from(MAGIC);
        long.extend_from_slice(&[VERSION, kind::PACKED, 0, 0, 0, 0, 0, 0]);
        assert!(decode(&long).is_err());
    }

    #[test]
    fn garbage_packs_never_panic_and_decode_only_when_well_formed() {
        // Random frames of kind 18: every one either decodes to entries
        // that fill it exactly or is refused.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut ok = 0;
        for _ in 0..20_000 {
            // A well-formed pack of a few entries...
            let mut frame = vec![0u8; 256];
            let mut at = PACKED_HEADER_LEN;
            for _ in 0..1 + next() % 4 {
                let imm = (next() % 2 == 0).then(|| next() as u32);
                let m = vec![next() as u8; (next() % 20) as usize];
                at = put_packed_entry(&mut frame, at, imm, &m).unwrap();
            }
            put_packed_header(&mut frame, next() as u32).unwrap();
            frame.truncate(at);
            // ...then bytes changed, cut or added.
            for _ in 0..next() % 3 {
                let i = (next() as usize) % frame.len();
                frame[i] = match next() % 3 {
                    0 => next() as u8,
                    1 => 0x80,
                    _ => (next() % 4) as u8,
                };
            }
            match next() % 4 {
                0 => frame.truncate((next() as usize) % (frame.len() + 1)),
                1 => frame.extend((0..next() % 6).map(|_| next() as u8)),
                _ => {}
            }
            if let Ok(Message::Packed { entries, .. }) = decode(&frame) {
                ok += 1;
                let total: usize = entries
                    .into_iter()
                    .map(|(imm, m)| packed_entry_len(m.len(), imm.is_some()))
                    .sum();
                assert_eq!(total + PACKED_HEADER_LEN, frame.len(), "{frame:02x?}");
            }
        }
        assert!(ok > 100, "some random packs are well-formed ({ok})");
    }

    #[test]
    fn a_read_me_with_a_bad_immediate_flag_is_refused() {
        let mut buf = [0u8; 128];
        let n = Message::ReadMe {
            imm: None,
            token: token(),
        }
        .encode(&mut buf)
        .unwrap();
        buf[HEADER_LEN] = 2; // has_imm
        assert!(matches!(
            decode(&buf[..n]),
            Err(WireError::InvalidField {
                field: "read_me.imm",
                ..
            })
        ));
        buf[HEADER_LEN] = 0;
        buf[HEADER_LEN + 4] = 1; // an immediate without the flag
        assert!(decode(&buf[..n]).is_err());
    }

    #[test]
    fn every_message_round_trips() {
        let mut buf = [0u8; 512];
        for m in samples() {
            let n = m.encode(&mut buf).unwrap();
            assert_eq!(n, m.encoded_len());
            assert_eq!(decode(&buf[..n]).unwrap(), m, "{m:?}");
        }
    }

    #[test]
    fn a_frameless_whole_message_s_immediate_carries_its_grant() {
        for grant in [0, 1, 64, 0x00ff_ffff] {
            let imm = whole_send_imm(grant).expect("fits 24 bits");
            assert_eq!(imm >> 24, 0x0b);
            assert_eq!(whole_send_grant(imm), Some(grant));
        }
        assert_eq!(
            whole_send_imm(0x0100_0000),
            None,
            "too many credits for 24 bits"
        );
        assert_eq!(whole_send_grant(0), None);
        assert_eq!(whole_send_grant(STAGED_IMM_TAG | 5), None);
        assert_eq!(whole_send_grant(0x0c00_0001), None);
    }

    #[test]
    fn a_landed_message_s_immediate_names_its_slot_and_length() {
        for (slot, len) in [(0, 1), (MAX_SLOTS - 1, MAX_LANDED_LEN), (3, 65_536)] {
            let imm = landed_imm(slot, len).expect("within bounds");
            assert_eq!(imm >> 24, 0xfe);
            assert_eq!(landed(imm), Some((slot, len)));
            assert!(imm_is_agents(imm));
            assert_eq!(staged(imm), None);
            assert_eq!(whole_send_grant(imm), None);
        }
        assert_eq!(landed_imm(MAX_SLOTS, 1), None, "slot beyond the bits");
        assert_eq!(landed_imm(0, 0), None, "empty");
        assert_eq!(landed_imm(0, MAX_LANDED_LEN + 1), None, "too long");
        assert_eq!(landed(STAGED_IMM_TAG | 5), None);
        assert_eq!(landed(0xfd00_0000), None);
        assert!(imm_is_agents(STAGED_IMM_TAG));
        assert!(!imm_is_agents(0x0b00_0001));
    }

    #[test]
    fn a_staged_message_s_immediate_names_its_length_credits_returns_and_restart() {
        for len in [1, 2, 4097, 65_536, MAX_STAGED_GRANT_LEN] {
            for grant in 0..=MAX_STAGED_GRANT {
                for returned in 0..=MAX_STAGED_RETURN {
                    for restart in [false, true] {
                        let s = StagedImm {
                            len,
                            grant,
                            returned,
                            restart,
                        };
                        let imm = staged_grant_imm(s).expect("within bounds");
                        assert_eq!(imm >> 27, 0x1e, "top byte 0xf0 to 0xf7");
                        assert_eq!(staged(imm), Some(s));
                        assert!(imm_is_agents(imm));
                        assert_eq!(landed(imm), None);
                        assert_eq!(whole_send_grant(imm), None);
                    }
                }
            }
        }
        let s = |len, grant, returned| StagedImm {
            len,
            grant,
            returned,
            restart: false,
        };
        assert_eq!(staged_grant_imm(s(0, 1, 0)), None, "empty");
        assert_eq!(
            staged_grant_imm(s(MAX_STAGED_GRANT_LEN + 1, 1, 0)),
            None,
            "too long"
        );
        assert_eq!(
            staged_grant_imm(s(10, MAX_STAGED_GRANT + 1, 0)),
            None,
            "too many credits"
        );
        assert_eq!(
            staged_grant_imm(s(10, 0, MAX_STAGED_RETURN + 1)),
            None,
            "too many returns"
        );
        assert_eq!(staged(STAGED_IMM_TAG | 70_000), Some(s(70_000, 0, 0)));
        assert_eq!(staged(STAGED_GRANT_TAG), Some(s(1, 0, 0)));
        assert_eq!(staged(0xfc00_0005), None);
        assert_eq!(staged(0xef00_0005), None);
        assert_eq!(staged(0xf800_0005), None);
        assert!(imm_is_agents(0xf712_3456));
        assert!(
            !imm_is_agents(0xfd12_3456),
            "version 11's tag is an application's since version 12"
        );
    }

    #[test]
    fn a_slot_grant_out_of_bounds_is_refused() {
        let mut buf = [0u8; 64];
        for (slot, addr, len, field) in [
            (MAX_SLOTS, 0x1000, 64, "slot_grant.slot"),
            (0, 0x1000, 0, "slot_grant.len"),
            (0, 0x1000, MAX_LANDED_LEN + 1, "slot_grant.len"),
            (0, u64::MAX - 10, 64, "slot_grant.len"),
        ] {
            let m = Message::SlotGrant {
                slot,
                addr,
                len,
                rkey: 7,
            };
            let n = m.encode(&mut buf).unwrap();
            assert!(
                matches!(decode(&buf[..n]), Err(WireError::InvalidField { field: f, .. }) if f == field),
                "{m:?}"
            );
        }
    }

    #[test]
    fn a_whole_message_goes_in_the_short_frame_only() {
        let mut buf = [0u8; 128];
        for imm in [None, Some(0x1234_5678)] {
            let m = Message::Whole {
                imm,
                grant: 9,
                payload: b"abc",
            };
            let n = m.encode(&mut buf).unwrap();
            assert_eq!(n, whole_overhead(imm.is_some()) + 3);
            assert_eq!(n, if imm.is_some() { 15 } else { 11 });
            let kind = if imm.is_some() {
                kind::WHOLE_IMM
            } else {
                kind::WHOLE
            };
            assert_eq!(buf[..4], [kind, 0, 0, 0]);
            assert_eq!(buf[4..8], 9u32.to_le_bytes());
            assert_eq!(decode_data(&buf[..n]), Some(m));
            assert_eq!(decode_any(&buf[..n]), Ok(m));
            // Nonzero reserved bytes are refused, by both decoders.
            let mut bad = buf;
            bad[2] = 1;
            assert_eq!(decode_data(&bad[..n]), None);
            assert!(matches!(
                decode(&bad[..n]),
                Err(WireError::InvalidField {
                    field: "whole.reserved",
                    ..
                })
            ));
            // The long form of a whole message is not its encoding: refused
            // (one encoding per message), as a `Data` piece that is whole,
            // and as kind WHOLE with the long header.
            let mut long = [0u8; DATA_OVERHEAD + 3];
            let (h, body) = long.split_first_chunk_mut::<DATA_OVERHEAD>().unwrap();
            put_data_header(h, 0x0102_0304_0506_0708, 3, 0, imm, 9, 3);
            body.copy_from_slice(b"abc");
            assert_eq!(decode_data(&long), None);
            assert!(matches!(
                decode(&long),
                Err(WireError::InvalidField { field: "data", .. })
            ));
            long[5] = kind;
            assert!(matches!(
                decode(&long),
                Err(WireError::InvalidField { field: "kind", .. })
            ));
            let whole_piece = Message::Data {
                msg_id: 1,
                total_len: 3,
                offset: 0,
                imm,
                grant: 0,
                payload: b"abc",
            };
            assert!(matches!(
                whole_piece.encode(&mut buf),
                Err(WireError::InvalidField { field: "data", .. })
            ));
        }
        // A piece of a longer message keeps the long form.
        let piece = Message::Data {
            msg_id: 1,
            total_len: 4,
            offset: 0,
            imm: None,
            grant: 0,
            payload: b"abc",
        };
        assert_eq!(piece.encode(&mut buf), Ok(DATA_OVERHEAD + 3));
        assert_eq!(buf[5], kind::DATA);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let mut buf = [0u8; 512];
        for m in samples() {
            let n = m.encode(&mut buf).unwrap();
            if let Message::Whole { imm, .. } = m {
                // No length field: the frame is the bytes a SEND delivered
                // (exact), so a cut inside the message is a shorter message,
                // a cut inside the header an error.
                let head = whole_overhead(imm.is_some());
                for cut in 0..n {
                    match decode(&buf[..cut]) {
                        Ok(Message::Whole { payload, .. }) if cut >= head => {
                            assert_eq!(payload, &buf[head..cut]);
                        }
                        Err(WireError::Truncated { .. }) if cut < head => {}
                        other => panic!("{m:?} cut at {cut}: {other:?}"),
                    }
                }
                continue;
            }
            if let Message::Packed { entries, .. } = m {
                // No length field either: a cut at the end of an entry is
                // a pack of fewer messages; anywhere else, an error.
                let mut ends = Vec::new();
                let mut end = PACKED_HEADER_LEN;
                for (imm, msg) in entries {
                    end += packed_entry_len(msg.len(), imm.is_some());
                    ends.push(end);
                }
                for cut in 0..n {
                    let res = decode(&buf[..cut]);
                    match res {
                        Ok(Message::Packed { .. }) if ends.contains(&cut) => {}
                        Err(_) if !ends.contains(&cut) => {}
                        other => panic!("{m:?} cut at {cut}: {other:?}"),
                    }
                }
                continue;
            }
            for cut in 0..n {
                assert!(decode(&buf[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            // One extra byte: the header length no longer matches.
            assert!(matches!(
                decode(&buf[..n + 1]),
                Err(WireError::LengthMismatch { .. })
            ));
        }
    }

    #[test]
    fn header_errors_are_named() {
        let mut buf = [0u8; 64];
        let n = Message::Credit { grant: 1 }.encode(&mut buf).unwrap();
        let mut bad = buf;
        bad[0] = b'X';
        assert!(matches!(decode(&bad[..n]), Err(WireError::BadMagic { .. })));
        let mut bad = buf;
        for old in [1, 2] {
            bad[4] = old; // a peer of an earlier version
            assert_eq!(
                decode(&bad[..n]),
                Err(WireError::UnsupportedVersion { got: old })
            );
        }
        let mut bad = buf;
        bad[5] = 99;
        assert_eq!(decode(&bad[..n]), Err(WireError::UnknownKind { kind: 99 }));
        assert!(matches!(
            Message::Close.encode(&mut [0u8; 4]),
            Err(WireError::BufferTooSmall { .. })
        ));
    }

    #[test]
    fn semantic_field_checks() {
        let mut buf = [0u8; 512];
        // A data piece past the message end is refused on both sides.
        let bad = Message::Data {
            msg_id: 1,
            total_len: 3,
            offset: 1,
            imm: None,
            grant: 0,
            payload: b"abc",
        };
        assert!(bad.encode(&mut buf).is_err());
        // A token whose region wraps around the address space.
        let mut t = token();
        t.addr = u64::MAX - 1;
        let n = Message::Release { token_id: 0 }.encode(&mut buf).unwrap();
        assert!(decode(&buf[..n]).is_ok());
        let n = Message::HandOver {
            kind: HandOverKind::Local,
            tag: 0,
            token: t,
        }
        .encode(&mut buf)
        .unwrap();
        assert!(matches!(
            decode(&buf[..n]),
            Err(WireError::InvalidField {
                field: "token.len",
                ..
            })
        ));
        // Over-long error text is cut to the limit at a char boundary.
        let long = "é".repeat(200);
        let m = Message::Error {
            code: 1,
            text: &long,
        };
        let n = m.encode(&mut buf).unwrap();
        match decode(&buf[..n]).unwrap() {
            Message::Error { text, .. } => assert!(text.len() == MAX_ERROR_TEXT),
            other => panic!("{other:?}"),
        }
    }

    /// xorshift64*: deterministic pseudo-random bytes without dependencies.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    #[test]
    fn decode_never_panics_on_random_or_mutated_input() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut frames = Vec::new();
        let mut buf = [0u8; 512];
        for m in samples() {
            let n = m.encode(&mut buf).unwrap();
            frames.push(buf[..n].to_vec());
        }
        let mut ok = 0usize;
        for i in 0..200_000 {
            let mut input = if i % 2 == 0 {
                frames[(rng.next() as usize) % frames.len()].clone()
            } else {
                let len = (rng.next() % 96) as usize;
                let mut v: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                if len >= 6 && rng.next() % 2 == 0 {
                    v[..4].copy_from_slice(&MAGIC);
                    v[4] = VERSION;
                    v[5] = (rng.next() % 13) as u8;
                } else if len >= 4 && rng.next() % 4 == 0 {
                    v[..4].copy_from_slice(&[11 + (rng.next() % 2) as u8, 0, 0, 0]);
                }
                v
            };
            let flips = rng.next() % 4;
            for _ in 0..flips {
                if input.is_empty() {
                    break;
                }
                let at = (rng.next() as usize) % input.len();
                input[at] = rng.next() as u8;
            }
            if rng.next() % 8 == 0 && !input.is_empty() {
                let keep = (rng.next() as usize) % input.len();
                input.truncate(keep);
            }
            if let Ok(m) = decode(&input) {
                ok += 1;
                // Whatever decodes re-encodes to the same bytes.
                let n = m.encode(&mut buf).unwrap();
                assert_eq!(&buf[..n], &input[..], "{m:?}");
            }
        }
        assert!(
            ok > 1000,
            "the mutator should keep many frames valid ({ok})"
        );
    }

    #[test]
    fn the_data_fast_path_agrees_with_the_general_decoder() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut buf = [0u8; 128];
        let mut fast = 0usize;
        for i in 0..100_000u64 {
            let payload = [0xa5u8; 16];
            let plen = (rng.next() % 17) as usize;
            let imm = (i % 3 == 0).then_some(rng.next() as u32);
            let grant = (rng.next() % 3) as u32;
            let m = if i % 4 == 0 {
                Message::Whole {
                    imm,
                    grant,
                    payload: &payload[..plen],
                }
            } else {
                Message::Data {
                    msg_id: rng.next() % 4,
                    total_len: plen as u64 + rng.next() % 3,
                    offset: rng.next() % 3,
                    imm,
                    grant,
                    payload: &payload[..plen],
                }
            };
            let mut input = match m.encode(&mut buf) {
                Ok(n) => buf[..n].to_vec(),
                // The piece ends past its message (or is the whole of it):
                // write the frame's header as it would be, the mutations
                // below may break it.
                Err(_) => {
                    let mut v = vec![0u8; DATA_OVERHEAD + plen];
                    let (h, body) = v.split_first_chunk_mut::<DATA_OVERHEAD>().unwrap();
                    put_data_header(h, 1, plen as u64, 0, imm, grant, plen);
                    body.copy_from_slice(&payload[..plen]);
                    v
                }
            };
            // Small values at field boundaries (flags, lengths, offsets).
            for _ in 0..rng.next() % 3 {
                let at = (rng.next() as usize) % input.len();
                input[at] = (rng.next() % 3) as u8;
            }
            if rng.next() % 16 == 0 {
                let keep = (rng.next() as usize) % input.len();
                input.truncate(keep);
            }
            let general = decode_any(&input);
            match decode_data(&input) {
                Some(m) => {
                    fast += 1;
                    assert_eq!(Ok(m), general, "{input:02x?}");
                }
                None => assert!(
                    !matches!(general, Ok(Message::Data { .. } | Message::Whole { .. })),
                    "the fast path refused a valid data frame: {input:02x?}"
                ),
            }
            assert_eq!(decode(&input), general);
        }
        assert!(fast > 10_000, "most frames stay valid ({fast})");
    }
}
