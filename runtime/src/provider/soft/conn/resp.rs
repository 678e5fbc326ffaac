//! The responses a responder owes on a connection, sent in order (and
//! the probes that must follow them, see `probe.rs`).

/// A response the responder owes, sent in order.
#[derive(Debug)]
pub(crate) enum Resp {
    Ack {
        dst: u32,
        src: u32,
        psn: u32,
    },
    Nak {
        dst: u32,
        src: u32,
        psn: u32,
        syndrome: u8,
        timer: u8,
    },
    Atomic {
        dst: u32,
        src: u32,
        psn: u32,
        orig: u64,
    },
    Read(ReadJob),
    /// A probe this engine sends (see `probe.rs`).
    Ping {
        seq: u64,
    },
    /// The answer to the peer's probe.
    Pong {
        seq: u64,
    },
}

/// An RDMA READ being answered, segment by segment.
#[derive(Debug)]
pub(crate) struct ReadJob {
    /// Its last segment sent from memory (see `requester::gen_resp`):
    /// once that memory went away mid-segment, the READ is refused.
    pub zc: Option<super::TxMemRef>,
    pub dst: u32,
    pub src: u32,
    pub psn: u32,
    pub pd: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}
