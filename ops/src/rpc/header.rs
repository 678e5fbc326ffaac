//! The RPC packet header: 32 bytes, little-endian, in front of every packet.
//!
//! ```text
//!  0..2   magic  b"vR"
//!  2      version (1)
//!  3      kind (PacketKind)
//!  4      req_type
//!  5      status (responses: Status; credit returns: 0 or Status::Busy;
//!         0 otherwise)
//!  6..8   payload_len: bytes after the header in this packet
//!  8..12  dest_session: the receiver's session number
//! 12..16  src_session: the sender's session number
//! 16..24  req_num
//! 24..28  msg_len: the whole message's length (request / response);
//!         the sender's largest packet (connect / connect-ack)
//! 28..30  pkt_idx; the keepalive interval in milliseconds (connect-ack)
//! 30..32  pkt_count (requests, responses); packets in the range besides
//!         pkt_idx (credit return, request for response); the response
//!         window (connect-ack)
//! ```
//!
//! A read request or read response (the large-message path, `bulk.rs`)
//! is one packet whose payload is a [`BulkDesc`] of [`BULK_DESC_LEN`]
//! bytes: where the sender's registered copy of the message is
//! (`addr` `u64`, `rkey` `u32`, then a `u32`: in a read request the
//! capacity of that buffer the client offers for the response to be
//! written into, at most 16 MiB, 0 for none; zero in a read response);
//! `msg_len` is the message's length, `pkt_idx` 0 and `pkt_count` 1. An
//! offer carries a [`BulkDesc`] too (its last 4 bytes zero), with the
//! room offered in `msg_len`, `pkt_idx` and `pkt_count` 0. A bulk connect and
//! its ack carry the sender's RC endpoint as their payload, `req_num` the
//! client's link number and `pkt_idx` the handshake's step (0: open, 1:
//! connected).
//!
//! [`Header::decode`] checks every field it can check without session state
//! and never panics; fields a kind does not use must be zero, so every
//! decoded header re-encodes to the very same bytes.

use thiserror::Error;

/// Bytes of the header.
pub const HEADER_LEN: usize = 32;
/// The first two bytes of every packet.
pub const MAGIC: [u8; 2] = *b"vR";
/// The header version this code writes and reads.
pub const VERSION: u8 = 1;
/// Offset of the `payload_len` field (`u16`).
pub const PAYLOAD_LEN_OFFSET: usize = 6;
/// The largest message the header can describe (and the engine accepts).
pub const MAX_MSG_LEN: u32 = 1 << 24;
/// The smallest packet size (header included) a peer may announce.
pub const MIN_PACKET: u32 = 64;
/// The largest packet size (header included) a peer may announce.
pub const MAX_PACKET: u32 = HEADER_LEN as u32 + u16::MAX as u32;
/// Most packets a credit return acknowledges, or a request for response
/// asks for, at once.
pub const MAX_RANGE: usize = 64;

/// How a server answered a request (response packets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// The handler's response.
    Ok = 0,
    /// No handler is registered for the request type (empty response).
    NoHandler = 1,
    /// The handler panicked (empty response).
    HandlerPanicked = 2,
    /// The handler's response exceeds what a message may hold (empty
    /// response).
    ResponseTooLarge = 3,
    /// The request exceeds the server's
    /// [`max_msg_len`](super::RpcConfig::max_msg_len) (empty response; the
    /// server kept none of it).
    RequestTooLarge = 4,
    /// Credit returns only: the server's request memory
    /// ([`request_memory`](super::RpcConfig::request_memory)) has no room
    /// for this request now; the client takes its credits back and sends
    /// it again after its timeout.
    Busy = 5,
    /// A read request the server could not read: no RC link on the
    /// session, or the READ of the client's buffer failed (bad address,
    /// key or length, or the link broke). Empty response; no handler ran.
    ReadFailed = 6,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::NoHandler => "no handler is registered for the request type",
            Status::HandlerPanicked => "the handler panicked",
            Status::ResponseTooLarge => "the handler's response exceeds the message limit",
            Status::RequestTooLarge => "the request exceeds the server's message limit",
            Status::Busy => "the server's request memory is full",
            Status::ReadFailed => "the server could not read the request by RDMA READ",
        })
    }
}

impl Status {
    fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::NoHandler,
            2 => Status::HandlerPanicked,
            3 => Status::ResponseTooLarge,
            4 => Status::RequestTooLarge,
            5 => Status::Busy,
            6 => Status::ReadFailed,
            _ => return None,
        })
    }
}

/// What a packet is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PacketKind {
    /// A packet of a request message (client to server).
    Request = 1,
    /// A packet of a response message (server to client).
    Response = 2,
    /// Server to client: request packets `pkt_idx - pkt_count ..= pkt_idx`
    /// arrived (returns their credits). For the last request packet it says
    /// the handler is running.
    CreditReturn = 3,
    /// Client to server: send response packets `pkt_idx ..= pkt_idx +
    /// pkt_count` (`pkt_idx >= 1`).
    RequestForResponse = 4,
    /// Client to server: open a session; the payload is the client's
    /// transport address, `msg_len` its largest packet, `req_num` the
    /// client endpoint's random incarnation number.
    Connect = 5,
    /// Server to client: the session is open; `src_session` is the server's
    /// session number, `msg_len` the packet size both use, `req_num` the
    /// connect's incarnation number, `pkt_count` the server's response
    /// window (response packets it sends unasked; 0 or 1: only the first),
    /// `pkt_idx` the keepalive interval: the client pings a session it
    /// holds every this many milliseconds (0: the server does not close
    /// idle sessions, no pings).
    ConnectAck = 6,
    /// Either side: the session is closed.
    Disconnect = 7,
    /// Client to server: the client still holds the session (a keepalive:
    /// it keeps the server from closing it as idle); no answer.
    Ping = 8,
    /// Client to server: open (`pkt_idx` 0) or confirm (`pkt_idx` 1, the
    /// client's end is connected) the session's RC link for large
    /// messages; the payload is the client's RC endpoint, `req_num` the
    /// client's link number.
    BulkConnect = 9,
    /// Server to client: the answer to a bulk connect (same `pkt_idx` and
    /// `req_num`); the payload is the server's RC endpoint.
    BulkConnectAck = 10,
    /// Client to server: a whole request the server reads by RDMA READ
    /// from the client's buffer; the payload is its [`BulkDesc`].
    ReadRequest = 11,
    /// Server to client: a whole response the client reads by RDMA READ
    /// from the server's buffer; the payload is its [`BulkDesc`].
    ReadResponse = 12,
    /// Client to server: a buffer of `msg_len` bytes the client offers
    /// for request `req_num`'s response, to be written into by RDMA
    /// WRITE with immediate (sent ahead of a request that does not carry
    /// an offer of its own: one in packets, or a read request whose own
    /// buffer is too small); the payload is its [`BulkDesc`].
    Offer = 13,
}

impl PacketKind {
    fn from_u8(v: u8) -> Option<PacketKind> {
        Some(match v {
            1 => PacketKind::Request,
            2 => PacketKind::Response,
            3 => PacketKind::CreditReturn,
            4 => PacketKind::RequestForResponse,
            5 => PacketKind::Connect,
            6 => PacketKind::ConnectAck,
            7 => PacketKind::Disconnect,
            8 => PacketKind::Ping,
            9 => PacketKind::BulkConnect,
            10 => PacketKind::BulkConnectAck,
            11 => PacketKind::ReadRequest,
            12 => PacketKind::ReadResponse,
            13 => PacketKind::Offer,
            _ => return None,
        })
    }
}

/// A decoded packet header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// What the packet is.
    pub kind: PacketKind,
    /// The request type (requests and responses; 0 otherwise).
    pub req_type: u8,
    /// How the server answered (responses; [`Status::Busy`] or
    /// [`Status::Ok`] for credit returns; [`Status::Ok`] otherwise).
    pub status: Status,
    /// Bytes after the header.
    pub payload_len: u16,
    /// The receiver's session number.
    pub dest_session: u32,
    /// The sender's session number.
    pub src_session: u32,
    /// The request number (slot index + a multiple of the slot count).
    pub req_num: u64,
    /// Message length (requests, responses) or packet size (connect, connect-ack).
    pub msg_len: u32,
    /// Index of this packet in its message (or the packet acknowledged / asked for).
    pub pkt_idx: u16,
    /// Packets in the message (requests, responses); packets in the range
    /// besides `pkt_idx`, below [`MAX_RANGE`] (credit returns: the range
    /// ends at `pkt_idx`; requests for response: it starts there); 0
    /// otherwise.
    pub pkt_count: u16,
}

/// Why a packet header was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum HeaderError {
    /// Fewer bytes than a header.
    #[error("packet of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated {
        /// Bytes received.
        len: usize,
    },
    /// Not an RPC packet.
    #[error("bad magic {found:02x?}, expected {MAGIC:02x?}")]
    BadMagic {
        /// The first two bytes.
        found: [u8; 2],
    },
    /// A header version this code does not read.
    #[error("header version {found}, this endpoint reads version {VERSION}")]
    UnsupportedVersion {
        /// The version byte.
        found: u8,
    },
    /// An unknown packet kind.
    #[error("unknown packet kind {found}")]
    UnknownKind {
        /// The kind byte.
        found: u8,
    },
    /// The packet's length disagrees with `payload_len`.
    #[error("header says {declared} payload bytes, the packet carries {actual}")]
    LengthMismatch {
        /// `payload_len`.
        declared: u16,
        /// Bytes after the header.
        actual: usize,
    },
    /// A field the packet kind does not use is not zero.
    #[error("{kind:?} packet: field {field} must be 0, is {value}")]
    UnusedFieldSet {
        /// The packet kind.
        kind: PacketKind,
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A field is out of its range.
    #[error("{kind:?} packet: {field} = {value} is out of range ({expected})")]
    OutOfRange {
        /// The packet kind.
        kind: PacketKind,
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The allowed range, in words.
        expected: &'static str,
    },
}

impl Header {
    /// A header with every field zero but `kind`.
    pub const fn new(kind: PacketKind) -> Header {
        Header {
            kind,
            req_type: 0,
            status: Status::Ok,
            payload_len: 0,
            dest_session: 0,
            src_session: 0,
            req_num: 0,
            msg_len: 0,
            pkt_idx: 0,
            pkt_count: 0,
        }
    }

    /// Writes the header into `out[..HEADER_LEN]`.
    #[inline]
    pub fn encode_into(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..2].copy_from_slice(&MAGIC);
        out[2] = VERSION;
        out[3] = self.kind as u8;
        out[4] = self.req_type;
        out[5] = self.status as u8;
        out[6..8].copy_from_slice(&self.payload_len.to_le_bytes());
        out[8..12].copy_from_slice(&self.dest_session.to_le_bytes());
        out[12..16].copy_from_slice(&self.src_session.to_le_bytes());
        out[16..24].copy_from_slice(&self.req_num.to_le_bytes());
        out[24..28].copy_from_slice(&self.msg_len.to_le_bytes());
        out[28..30].copy_from_slice(&self.pkt_idx.to_le_bytes());
        out[30..32].copy_from_slice(&self.pkt_count.to_le_bytes());
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        self.encode_into(&mut out);
        out
    }

    /// Decodes and checks the header of the whole packet `packet`, and
    /// returns it with the payload.
    #[inline(always)]
    pub fn decode(packet: &[u8]) -> Result<(Header, &[u8]), HeaderError> {
        let Some((head, payload)) = packet.split_first_chunk::<HEADER_LEN>() else {
            return Err(HeaderError::Truncated { len: packet.len() });
        };
        let h = Header::decode_header(head)?;
        if usize::from(h.payload_len) != payload.len() {
            return Err(HeaderError::LengthMismatch {
                declared: h.payload_len,
                actual: payload.len(),
            });
        }
        Ok((h, payload))
    }

    /// Decodes and checks a header alone (not its length against a packet).
    #[inline(always)]
    pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<Header, HeaderError> {
        let found = [b[0], b[1]];
        if found != MAGIC {
            return Err(HeaderError::BadMagic { found });
        }
        if b[2] != VERSION {
            return Err(HeaderError::UnsupportedVersion { found: b[2] });
        }
        let Some(kind) = PacketKind::from_u8(b[3]) else {
            return Err(HeaderError::UnknownKind { found: b[3] });
        };
        let u16_at = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let mut req_num = [0u8; 8];
        req_num.copy_from_slice(&b[16..24]);
        let Some(status) = Status::from_u8(b[5]) else {
            return Err(HeaderError::OutOfRange {
                kind,
                field: "status",
                value: b[5].into(),
                expected: "0 to 6",
            });
        };
        let h = Header {
            kind,
            req_type: b[4],
            status,
            payload_len: u16_at(6),
            dest_session: u32_at(8),
            src_session: u32_at(12),
            req_num: u64::from_le_bytes(req_num),
            msg_len: u32_at(24),
            pkt_idx: u16_at(28),
            pkt_count: u16_at(30),
        };
        match kind {
            PacketKind::Response if status == Status::Busy => {
                return Err(HeaderError::OutOfRange {
                    kind,
                    field: "status",
                    value: b[5].into(),
                    expected: "0 to 4 or 6 (busy is for credit returns)",
                })
            }
            PacketKind::Response => {}
            PacketKind::CreditReturn if matches!(status, Status::Ok | Status::Busy) => {}
            _ => h.zero("status", b[5].into())?,
        }
        // A request's or a successful response's packet, as most are:
        // its rules checked here (`validate` checks them again, and names
        // the one broken, only for a packet that breaks one or is of
        // another kind).
        let data_ok = matches!(h.kind, PacketKind::Request | PacketKind::Response)
            && h.status == Status::Ok
            && h.msg_len <= MAX_MSG_LEN
            && h.pkt_idx < h.pkt_count
            && u32::from(h.payload_len) <= h.msg_len;
        if !data_ok {
            h.validate()?;
        }
        Ok(h)
    }

    fn unused(&self, field: &'static str, value: u64) -> HeaderError {
        HeaderError::UnusedFieldSet {
            kind: self.kind,
            field,
            value,
        }
    }

    fn zero(&self, field: &'static str, value: u64) -> Result<(), HeaderError> {
        if value == 0 {
            Ok(())
        } else {
            Err(self.unused(field, value))
        }
    }

    fn range(
        &self,
        ok: bool,
        field: &'static str,
        value: u64,
        expected: &'static str,
    ) -> Result<(), HeaderError> {
        if ok {
            Ok(())
        } else {
            Err(HeaderError::OutOfRange {
                kind: self.kind,
                field,
                value,
                expected,
            })
        }
    }

    /// Checks the fields against the kind's rules.
    fn validate(&self) -> Result<(), HeaderError> {
        match self.kind {
            PacketKind::Request | PacketKind::Response => {
                self.range(
                    self.msg_len <= MAX_MSG_LEN,
                    "msg_len",
                    self.msg_len.into(),
                    "at most 16 MiB",
                )?;
                self.range(
                    self.pkt_count >= 1,
                    "pkt_count",
                    self.pkt_count.into(),
                    "at least 1",
                )?;
                self.range(
                    self.pkt_idx < self.pkt_count,
                    "pkt_idx",
                    self.pkt_idx.into(),
                    "below pkt_count",
                )?;
                self.range(
                    u32::from(self.payload_len) <= self.msg_len,
                    "payload_len",
                    self.payload_len.into(),
                    "at most msg_len",
                )?;
                if self.status != Status::Ok {
                    self.zero("msg_len of an error response", self.msg_len.into())?;
                }
                Ok(())
            }
            PacketKind::CreditReturn | PacketKind::RequestForResponse => {
                self.zero("req_type", self.req_type.into())?;
                self.zero("payload_len", self.payload_len.into())?;
                self.zero("msg_len", self.msg_len.into())?;
                self.range(
                    usize::from(self.pkt_count) < MAX_RANGE,
                    "pkt_count",
                    self.pkt_count.into(),
                    "below 64 (packets in the range besides pkt_idx)",
                )?;
                if self.kind == PacketKind::RequestForResponse {
                    self.range(
                        self.pkt_idx >= 1,
                        "pkt_idx",
                        self.pkt_idx.into(),
                        "at least 1",
                    )?;
                    self.range(
                        self.pkt_idx.checked_add(self.pkt_count).is_some(),
                        "pkt_count",
                        self.pkt_count.into(),
                        "with pkt_idx at most 65535",
                    )
                } else {
                    self.range(
                        self.pkt_count <= self.pkt_idx,
                        "pkt_count",
                        self.pkt_count.into(),
                        "at most pkt_idx",
                    )
                }
            }
            PacketKind::Connect | PacketKind::ConnectAck => {
                self.zero("req_type", self.req_type.into())?;
                if self.kind == PacketKind::Connect {
                    self.zero("pkt_idx", self.pkt_idx.into())?;
                    self.zero("pkt_count", self.pkt_count.into())?;
                } else {
                    self.range(
                        usize::from(self.pkt_count) <= MAX_RANGE,
                        "pkt_count",
                        self.pkt_count.into(),
                        "at most 64 (the server's response window)",
                    )?;
                }
                self.range(
                    (MIN_PACKET..=MAX_PACKET).contains(&self.msg_len),
                    "msg_len",
                    self.msg_len.into(),
                    "a packet size from 64 to 65567",
                )?;
                if self.kind == PacketKind::Connect {
                    self.zero("dest_session", self.dest_session.into())?;
                    self.range(
                        self.payload_len >= 1,
                        "payload_len",
                        self.payload_len.into(),
                        "at least 1 (the address)",
                    )
                } else {
                    self.zero("payload_len", self.payload_len.into())
                }
            }
            PacketKind::ReadRequest | PacketKind::ReadResponse => {
                if self.kind == PacketKind::ReadResponse {
                    self.zero("req_type", self.req_type.into())?;
                }
                self.range(
                    (1..=MAX_MSG_LEN).contains(&self.msg_len),
                    "msg_len",
                    self.msg_len.into(),
                    "from 1 to 16 MiB",
                )?;
                self.zero("pkt_idx", self.pkt_idx.into())?;
                self.range(
                    self.pkt_count == 1,
                    "pkt_count",
                    self.pkt_count.into(),
                    "1 (one descriptor)",
                )?;
                self.range(
                    usize::from(self.payload_len) == BULK_DESC_LEN,
                    "payload_len",
                    self.payload_len.into(),
                    "16 (a descriptor)",
                )
            }
            PacketKind::Offer => {
                self.zero("req_type", self.req_type.into())?;
                self.range(
                    (1..=MAX_MSG_LEN).contains(&self.msg_len),
                    "msg_len",
                    self.msg_len.into(),
                    "from 1 to 16 MiB (the room offered)",
                )?;
                self.zero("pkt_idx", self.pkt_idx.into())?;
                self.zero("pkt_count", self.pkt_count.into())?;
                self.range(
                    usize::from(self.payload_len) == BULK_DESC_LEN,
                    "payload_len",
                    self.payload_len.into(),
                    "16 (a descriptor)",
                )
            }
            PacketKind::BulkConnect | PacketKind::BulkConnectAck => {
                self.zero("req_type", self.req_type.into())?;
                self.zero("msg_len", self.msg_len.into())?;
                self.zero("pkt_count", self.pkt_count.into())?;
                self.range(self.pkt_idx <= 1, "pkt_idx", self.pkt_idx.into(), "0 or 1")?;
                self.range(
                    self.payload_len >= 1,
                    "payload_len",
                    self.payload_len.into(),
                    "at least 1 (the RC endpoint)",
                )
            }
            PacketKind::Disconnect | PacketKind::Ping => {
                self.zero("req_type", self.req_type.into())?;
                self.zero("payload_len", self.payload_len.into())?;
                self.zero("req_num", self.req_num)?;
                self.zero("msg_len", self.msg_len.into())?;
                self.zero("pkt_idx", self.pkt_idx.into())?;
                self.zero("pkt_count", self.pkt_count.into())
            }
        }
    }
}

/// Bytes of a [`BulkDesc`] on the wire.
pub const BULK_DESC_LEN: usize = 16;

/// Where a message waits to be read by RDMA READ: the payload of a read
/// request or read response. The length is the header's `msg_len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BulkDesc {
    /// The address of the message in the sender's memory.
    pub addr: u64,
    /// The remote key of its registration.
    pub rkey: u32,
}

impl BulkDesc {
    /// The descriptor's bytes.
    pub fn encode(&self) -> [u8; BULK_DESC_LEN] {
        let mut out = [0u8; BULK_DESC_LEN];
        out[0..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        out
    }

    /// Decodes a descriptor: `None` unless `b` is [`BULK_DESC_LEN`] bytes
    /// with its last 4 zero.
    pub fn decode(b: &[u8]) -> Option<BulkDesc> {
        let b: &[u8; BULK_DESC_LEN] = b.try_into().ok()?;
        if b[12..16] != [0; 4] {
            return None;
        }
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&b[0..8]);
        Some(BulkDesc {
            addr: u64::from_le_bytes(addr),
            rkey: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        })
    }
}

impl BulkDesc {
    /// A read request's descriptor, with the capacity of the buffer the
    /// client offers for the response in its last 4 bytes (the request's
    /// own buffer, which the server may then WRITE the response into; 0:
    /// no offer).
    pub fn encode_offer(&self, offer: u32) -> [u8; BULK_DESC_LEN] {
        let mut out = self.encode();
        out[12..16].copy_from_slice(&offer.to_le_bytes());
        out
    }

    /// Decodes a read request's descriptor and offered capacity: `None`
    /// unless `b` is [`BULK_DESC_LEN`] bytes and the offer is at most
    /// [`MAX_MSG_LEN`].
    pub fn decode_offer(b: &[u8]) -> Option<(BulkDesc, u32)> {
        let b: &[u8; BULK_DESC_LEN] = b.try_into().ok()?;
        let offer = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if offer > MAX_MSG_LEN {
            return None;
        }
        let mut desc = *b;
        desc[12..16].fill(0);
        Some((BulkDesc::decode(&desc)?, offer))
    }
}

/// Packets needed for a message of `msg_len` bytes with `max_payload` bytes
/// per packet (an empty message takes one packet).
#[inline]
pub fn packets_for(msg_len: usize, max_payload: usize) -> usize {
    if msg_len <= max_payload {
        // One packet (the common case): no division.
        return 1;
    }
    msg_len.div_ceil(max_payload.max(1))
}
