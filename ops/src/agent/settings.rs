//! The agent settings exchange: when a connection starts, each side sends
//! its [`Settings`] over the TCP side channel and reads the peer's. Both
//! sides then run the same checks on the pair, so an incompatible pair is
//! refused on both sides with the same [`AgentError::Incompatible`];
//! everything else is negotiated: message pieces are sized for the peer's
//! receive buffers, the largest message sent is the smaller maximum of the
//! two sides, and the control reserve of receive buffers is sized for the
//! peer's credit returns.

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use verbio_runtime::{timeout, TcpStream};

use super::error::{AgentError, CloseReason};
use super::flow::reserve_for;
use super::wire::{decode, Message, Settings, DATA_OVERHEAD, HEADER_LEN, MAX_ERROR_TEXT};

/// Smallest receive buffer: holds every control frame (the largest, an
/// `AllocResponse` with its token, is 66 bytes) and a data header with a
/// useful payload.
pub const MIN_RECV_BUF_SIZE: usize = 128;

/// Largest settings frame body read from a peer.
const MAX_SETTINGS_BODY: usize = 256;

/// What one side uses after the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Negotiated {
    /// Payload bytes of one `Data` piece (fits the peer's receive buffers).
    pub(crate) piece_len: usize,
    /// Largest message this side sends (the smaller of both maxima).
    pub(crate) max_send_len: usize,
    /// Receive buffers this side posts: its credits plus the reserve for
    /// the peer's uncredited control messages.
    pub(crate) posted_recvs: u32,
    /// Longest `Error` text that fits the peer's receive buffers.
    pub(crate) max_error_text: usize,
    /// The send credits the peer grants in all (its `recv_buf_count`).
    pub(crate) send_window: u32,
    /// A sender with this many credits at hand or fewer has a backlog: its
    /// whole messages join packs (`packing.rs`) and none goes INLINE past
    /// them ([`backlog_at`]).
    pub(crate) backlog_at: u32,
}

/// Credits spent (messages in flight, unanswered) from which a sender has
/// a backlog, at most: half of the window a peer grants by default before
/// it grew to [`DEFAULT_RECV_BUF_COUNT`](super::DEFAULT_RECV_BUF_COUNT)
/// 128, so that a stream of small messages packs as early as it did with
/// a window of 64 (waiting for half of 128 to be spent sent a window of
/// 64-byte messages 10-25 % slower, in more SENDs; docs/benchmarks.md).
pub(crate) const BACKLOG_SPENT: u32 = 32;

/// [`Negotiated::backlog_at`] for a peer that grants `window` credits:
/// half of them spent, or [`BACKLOG_SPENT`] if fewer.
pub(crate) fn backlog_at(window: u32) -> u32 {
    window - (window / 2).min(BACKLOG_SPENT)
}

/// A refused setting: its name, why, and how to read it from a side's settings.
type Refusal = (&'static str, &'static str, fn(&Settings) -> u64);

/// Checks the settings of one side in isolation.
fn valid(s: &Settings) -> Result<(), Refusal> {
    if (s.recv_buf_size as usize) < MIN_RECV_BUF_SIZE {
        return Err((
            "recv_buf_size",
            "smaller than the protocol minimum (MIN_RECV_BUF_SIZE)",
            |s| s.recv_buf_size.into(),
        ));
    }
    if s.recv_buf_count == 0 || s.credit_batch == 0 || s.credit_batch > s.recv_buf_count {
        return Err((
            "credit_batch",
            "need 1 <= credit_batch <= recv_buf_count",
            |s| s.credit_batch.into(),
        ));
    }
    if s.max_message_len == 0 {
        return Err(("max_message_len", "must be at least 1", |s| {
            s.max_message_len
        }));
    }
    Ok(())
}

/// Receive buffers side `a` must post when its peer is `b`.
fn posted_by(a: &Settings, b: &Settings) -> u64 {
    u64::from(a.recv_buf_count) + u64::from(reserve_for(b.recv_buf_count, b.credit_batch))
}

/// Checks the pair (the same on both sides, whichever is `own`) and derives
/// what this side uses.
pub(crate) fn negotiate(own: &Settings, peer: &Settings) -> Result<Negotiated, AgentError> {
    if let Err((setting, reason, _)) = valid(own) {
        return Err(AgentError::Config { setting, reason });
    }
    if let Err((setting, reason, value)) = valid(peer) {
        return Err(AgentError::Incompatible {
            setting,
            local: value(own),
            peer: value(peer),
            reason,
        });
    }
    // Both directions, in a fixed order, so both sides refuse alike.
    let own_need = posted_by(own, peer);
    if own_need > u64::from(own.max_recv_wr) {
        return Err(AgentError::Incompatible {
            setting: "max_recv_wr",
            local: u64::from(own.max_recv_wr),
            peer: own_need,
            reason: "this side's receive queue cannot hold its buffers plus the reserve \
                     for the peer's credit returns (raise max_recv_wr, or use the peer's \
                     recv_buf_count / credit_batch)",
        });
    }
    let peer_need = posted_by(peer, own);
    if peer_need > u64::from(peer.max_recv_wr) {
        return Err(AgentError::Incompatible {
            setting: "max_recv_wr",
            local: peer_need,
            peer: u64::from(peer.max_recv_wr),
            reason: "the peer's receive queue cannot hold its buffers plus the reserve \
                     for this side's credit returns (raise its max_recv_wr, or use its \
                     recv_buf_count / credit_batch)",
        });
    }
    let peer_buf = peer.recv_buf_size as usize;
    let max_send_len = usize::try_from(peer.max_message_len)
        .unwrap_or(usize::MAX)
        .min(usize::try_from(own.max_message_len).unwrap_or(usize::MAX));
    Ok(Negotiated {
        // `valid` checked peer_buf >= MIN_RECV_BUF_SIZE > DATA_OVERHEAD.
        piece_len: peer_buf - DATA_OVERHEAD,
        max_send_len,
        // Checked against max_recv_wr, a u32, just above.
        posted_recvs: own_need as u32,
        // Error frame: header, code (2), text length (2), text.
        max_error_text: (peer_buf - HEADER_LEN - 4).min(MAX_ERROR_TEXT),
        send_window: peer.recv_buf_count,
        backlog_at: backlog_at(peer.recv_buf_count),
    })
}

/// `own` as the settings frame a connection manager's private data carries
/// (36 bytes: within the 56 a connect request has).
pub(crate) fn settings_frame(own: &Settings) -> Result<Vec<u8>, AgentError> {
    let mut out = vec![0u8; HEADER_LEN + super::wire::SETTINGS_LEN];
    Message::Settings(*own)
        .encode(&mut out)
        .map_err(|e| AgentError::Closed(CloseReason::Malformed(e)))?;
    Ok(out)
}

/// The peer's settings from its connection manager private data: a
/// settings frame, possibly followed by padding (RDMA CM pads private data
/// with zeros to its field's size).
pub(crate) fn settings_from_private(data: &[u8]) -> Result<Settings, AgentError> {
    if data.len() < HEADER_LEN {
        return Err(AgentError::Closed(CloseReason::Violation(
            "the peer's connection request or accept carries no agent settings",
        )));
    }
    let body = u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize;
    if body > MAX_SETTINGS_BODY || HEADER_LEN + body > data.len() {
        return Err(match decode(&data[..HEADER_LEN]) {
            Err(e) => AgentError::Closed(CloseReason::Malformed(e)),
            Ok(_) => AgentError::Closed(CloseReason::Violation(
                "settings frame longer than the private data",
            )),
        });
    }
    match decode(&data[..HEADER_LEN + body]) {
        Ok(Message::Settings(s)) => Ok(s),
        Ok(_) => Err(AgentError::Closed(CloseReason::Violation(
            "expected the peer's agent settings",
        ))),
        Err(e) => Err(AgentError::Closed(CloseReason::Malformed(e))),
    }
}

/// Sends `own` over `stream` and reads the peer's settings, within `limit`.
pub(crate) async fn exchange(
    stream: &mut TcpStream,
    own: &Settings,
    limit: Duration,
) -> Result<Settings, AgentError> {
    let msg = Message::Settings(*own);
    let mut out = [0u8; HEADER_LEN + super::wire::SETTINGS_LEN];
    // The buffer is exactly `encoded_len` bytes; a Settings frame has no
    // field encode could refuse.
    msg.encode(&mut out)
        .map_err(|e| AgentError::Closed(CloseReason::Malformed(e)))?;
    let io = |stage: &'static str| move |source| AgentError::SettingsExchange { stage, source };
    let run = async {
        stream
            .write_all(&out)
            .await
            .map_err(io("sending this side's settings"))?;
        stream
            .flush()
            .await
            .map_err(io("sending this side's settings"))?;
        let mut frame = vec![0u8; HEADER_LEN];
        stream
            .read_exact(&mut frame)
            .await
            .map_err(io("reading the peer's settings header"))?;
        let body = u32::from_le_bytes([frame[8], frame[9], frame[10], frame[11]]) as usize;
        if body > MAX_SETTINGS_BODY {
            // Decoding the header alone names the problem (bad magic,
            // version, or the length mismatch of an oversized body).
            return Err(match decode(&frame) {
                Err(e) => AgentError::Closed(CloseReason::Malformed(e)),
                Ok(_) => AgentError::Closed(CloseReason::Violation("oversized settings frame")),
            });
        }
        frame.resize(HEADER_LEN + body, 0);
        stream
            .read_exact(&mut frame[HEADER_LEN..])
            .await
            .map_err(io("reading the peer's settings"))?;
        match decode(&frame) {
            Ok(Message::Settings(s)) => Ok(s),
            Ok(_) => Err(AgentError::Closed(CloseReason::Violation(
                "expected the peer's agent settings",
            ))),
            Err(e) => Err(AgentError::Closed(CloseReason::Malformed(e))),
        }
    };
    match timeout(limit, run).await {
        Ok(r) => r,
        Err(_) => Err(AgentError::Timeout {
            what: "agent settings exchange",
            after: limit,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(size: u32, count: u32, batch: u32, wr: u32, max: u64) -> Settings {
        Settings {
            max_message_len: max,
            recv_buf_size: size,
            recv_buf_count: count,
            credit_batch: batch,
            max_recv_wr: wr,
        }
    }

    #[test]
    fn settings_ride_in_private_data_with_padding() {
        let own = s(4096, 16, 4, 64, 1 << 20);
        let mut frame = settings_frame(&own).unwrap();
        assert!(frame.len() <= 56, "fits an RDMA CM connect request");
        assert_eq!(settings_from_private(&frame).unwrap(), own);
        frame.resize(56, 0);
        assert_eq!(settings_from_private(&frame).unwrap(), own);
        assert!(settings_from_private(&frame[..20]).is_err());
        assert!(settings_from_private(&[]).is_err());
        assert!(settings_from_private(&[0u8; 56]).is_err());
        let mut x: u32 = 12345;
        for _ in 0..2000 {
            let mut b = frame.clone();
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let i = (x as usize) % b.len();
            b[i] = (x >> 8) as u8;
            let _ = settings_from_private(&b);
        }
    }

    #[test]
    fn sizes_are_negotiated() {
        let a = s(4096, 16, 4, 64, 1 << 20);
        let b = s(256, 16, 4, 64, 1 << 10);
        let na = negotiate(&a, &b).unwrap();
        assert_eq!(
            na.piece_len,
            256 - DATA_OVERHEAD,
            "pieces fit the peer's buffers"
        );
        assert_eq!(na.max_send_len, 1 << 10);
        assert_eq!(na.posted_recvs, 16 + reserve_for(16, 4));
        assert_eq!(na.max_error_text, 256 - HEADER_LEN - 4);
        let nb = negotiate(&b, &a).unwrap();
        assert_eq!(nb.piece_len, 4096 - DATA_OVERHEAD);
        assert_eq!(nb.max_send_len, 1 << 10);
        assert_eq!(nb.max_error_text, MAX_ERROR_TEXT);
    }

    #[test]
    fn the_reserve_follows_the_peers_batches() {
        // The peer returns credits one by one: this side needs a larger reserve.
        let a = s(4096, 16, 4, 64, 1 << 20);
        let b = s(4096, 32, 1, 64, 1 << 20);
        assert_eq!(
            negotiate(&a, &b).unwrap().posted_recvs,
            16 + reserve_for(32, 1)
        );
    }

    #[test]
    fn incompatible_pairs_are_refused_alike_on_both_sides() {
        let a = s(4096, 16, 4, 23, 1 << 20);
        let b = s(4096, 64, 1, 200, 1 << 20);
        let ea = negotiate(&a, &b).unwrap_err();
        let eb = negotiate(&b, &a).unwrap_err();
        for e in [&ea, &eb] {
            assert!(
                matches!(
                    e,
                    AgentError::Incompatible {
                        setting: "max_recv_wr",
                        ..
                    }
                ),
                "{e}"
            );
        }
        let tiny = s(64, 16, 4, 64, 1 << 20);
        let e = negotiate(&a, &tiny).unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Incompatible {
                    setting: "recv_buf_size",
                    ..
                }
            ),
            "{e}"
        );
    }
}
