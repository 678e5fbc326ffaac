//! The responses a responder owes on a connection, sent in order.

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
}

/// An RDMA READ being answered, segment by segment.
#[derive(Debug)]
pub(crate) struct ReadJob {
    pub dst: u32,
    pub src: u32,
    pub psn: u32,
    pub pd: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}
