//! A request, as its handler gets it.

use super::budget::Charge;
use super::buf::MsgBuf;
use super::error::SessionId;

/// A request, as its handler gets it.
pub struct Request {
    pub(crate) req_type: u8,
    pub(crate) session: SessionId,
    /// From the endpoint's pool, which the response's buffer comes from
    /// too (no second handle on the pool per request).
    pub(crate) data: MsgBuf,
    /// Its bytes stay charged to the endpoint's request budget until the
    /// handler drops it.
    pub(crate) _charge: Charge,
}

impl Request {
    /// The request type.
    pub fn req_type(&self) -> u8 {
        self.req_type
    }

    /// The server-side session it came on.
    pub fn session(&self) -> SessionId {
        self.session
    }

    /// The request's bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The request's bytes as a message of its own, to answer with them
    /// (an echo) or to edit them into the response in place: no copy,
    /// and a large request's buffer (a READ's target) serves as the
    /// response's (exposed for the client's READ in turn). Its bytes
    /// leave the request budget, as a response's bytes are not in it.
    pub fn into_data(self) -> MsgBuf {
        self.data
    }

    /// An empty buffer from the endpoint's pool for the response.
    pub fn response(&self) -> MsgBuf {
        match self.data.pool() {
            Some(pool) => pool.msg(pool.take()),
            None => MsgBuf::from(Vec::new()),
        }
    }

    /// An empty buffer from the endpoint's pool with room for `len` bytes,
    /// for a response whose length the handler knows: a large one reuses
    /// a buffer the pool keeps instead of growing a fresh one (which on
    /// a large message costs an allocation and its page faults per call).
    pub fn response_with_capacity(&self, len: usize) -> MsgBuf {
        match self.data.pool() {
            Some(pool) => pool.msg(pool.take_for(len)),
            None => MsgBuf::from(Vec::with_capacity(len)),
        }
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("req_type", &self.req_type)
            .field("session", &self.session)
            .field("len", &self.data.len())
            .finish()
    }
}
