//! Which way a message goes: in datagrams, as one SEND over the
//! session's RC link (`link_send.rs`), or by READ or WRITE
//! (`read_path.rs`, `written_responses.rs`, `written_requests.rs`).

use crate::rpc::config::RpcConfig;
use crate::rpc::header::{packets_for, HEADER_LEN};

use super::Core;

/// Whether a message of `len` bytes on a session of `max_payload`-byte
/// packets goes by READ or WRITE ([`Core::is_bulk`]), for callers holding
/// a session: `max_link_packet` is the transport's
/// ([`Bulk::max_link_packet`](crate::rpc::Bulk::max_link_packet)), `has_bulk`
/// whether it has a large-message
/// path.
pub(crate) fn goes_bulk(
    config: &RpcConfig,
    max_link_packet: usize,
    has_bulk: bool,
    len: usize,
    max_payload: usize,
) -> bool {
    if !has_bulk || config.read_threshold == usize::MAX {
        return false;
    }
    if len >= config.read_threshold {
        return true;
    }
    // Below the threshold, over the link by SEND when the session's
    // credits and the response window cover the message's packets, and
    // one link packet carries it (`link_send.rs`); else by READ or WRITE,
    // not in datagrams.
    let in_one_go = config.session_credits.min(config.response_window);
    len > max_payload
        && (len > max_link_packet.saturating_sub(HEADER_LEN)
            || packets_for(len, max_payload) > in_one_go)
}

impl<P: Clone> Core<P> {
    /// Whether messages of `len` bytes on a session of `max_payload`-byte
    /// packets go by READ or WRITE (when a link is ready): from the READ
    /// threshold on, and below it those larger than one link packet or
    /// with more packets than the session's credits or the response
    /// window cover (they would not go over the link in one go,
    /// `link_send.rs`).
    pub(crate) fn is_bulk(&self, len: usize, max_payload: usize) -> bool {
        goes_bulk(
            &self.config,
            self.max_link_packet(),
            self.bulk.is_some(),
            len,
            max_payload,
        )
    }
}

/// Whether a message of `len` bytes (in `n` packets) goes over the
/// session's link `ready` (its
/// [`Session::link_ready`](crate::rpc::session::Session::link_ready)) by SEND:
/// larger
/// than one packet, below the READ threshold, fitting the link's packet;
/// returns the link.
pub(crate) fn link_for(
    ready: Option<u64>,
    n: usize,
    len: usize,
    read_threshold: usize,
    max_link_packet: usize,
) -> Option<u64> {
    if n < 2 || len >= read_threshold || HEADER_LEN + len > max_link_packet {
        return None;
    }
    ready
}

impl<P: Clone> Core<P> {
    /// The largest packet the links carry (0: none).
    pub(crate) fn max_link_packet(&self) -> usize {
        self.bulk.as_ref().map_or(0, |b| b.max_link_packet())
    }
}
