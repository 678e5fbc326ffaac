//! [`RecvMsg`]: a received message. A message that fit in one receive
//! buffer is handed over zero-copy (the buffer itself, the agent reposts a
//! fresh one); a reassembled message is one contiguous vector.

use std::ops::Deref;

use verbio_runtime::buf::{LocalBuf, Slice};

/// Where the bytes are.
#[derive(Debug)]
pub(crate) enum Body {
    /// The payload inside the receive buffer it arrived in.
    Buf(Slice<LocalBuf>),
    /// Reassembled from pieces.
    Vec(Vec<u8>),
}

/// A received message and its immediate (`None` if sent without one).
#[derive(Debug)]
pub struct RecvMsg {
    pub(crate) body: Body,
    pub(crate) imm: Option<u32>,
}

impl RecvMsg {
    /// What this message counts for in the unread backlog: the receive
    /// buffer it holds (of `recv_buf_size` bytes) or its reassembled length.
    pub(crate) fn charge(&self, recv_buf_size: usize) -> u64 {
        match &self.body {
            Body::Buf(_) => recv_buf_size as u64,
            Body::Vec(v) => v.len() as u64,
        }
    }

    /// The immediate of `send_with_imm`.
    pub fn imm(&self) -> Option<u32> {
        self.imm
    }

    /// True if the bytes are still in the receive buffer they arrived in.
    pub fn is_zero_copy(&self) -> bool {
        matches!(self.body, Body::Buf(_))
    }

    /// The bytes as a vector (a copy unless reassembled).
    pub fn into_vec(self) -> Vec<u8> {
        match self.body {
            Body::Buf(s) => s.to_vec(),
            Body::Vec(v) => v,
        }
    }
}

impl Deref for RecvMsg {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.body {
            Body::Buf(s) => s,
            Body::Vec(v) => v,
        }
    }
}
