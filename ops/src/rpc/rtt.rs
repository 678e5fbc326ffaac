//! Round-trip estimate of a client session (as TCP's, RFC 6298): the
//! retransmission timeout a slot waits before resending is the smoothed
//! round trip plus four times its variation, at least [`RpcConfig::rto`]
//! and at most [`MAX_RTO_FACTOR`] times it. A server that answers slowly
//! but surely (a window of calls queued at its handlers) then gets no
//! spurious resends once its round trip is learned.
//!
//! [`RpcConfig::rto`]: super::RpcConfig::rto

/// The learned timeout is at most this many times the configured `rto`.
/// It applies to a slot's first resend only (later ones wait `rto`), so a
/// peer that vanished is still given up within about
/// `rto * (MAX_RTO_FACTOR + max_retries)`.
pub(crate) const MAX_RTO_FACTOR: u64 = 4;

/// Smoothed round trip and its mean deviation, in eighths of a timer tick
/// (samples are whole ticks).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RttEstimator {
    /// Smoothed round trip (eighths of a tick); 0 before the first sample.
    srtt: u64,
    /// Mean deviation (eighths of a tick).
    rttvar: u64,
    /// Whether a sample was taken.
    sampled: bool,
}

impl RttEstimator {
    /// Takes a round-trip sample of `ticks`.
    pub(crate) fn sample(&mut self, ticks: u64) {
        let r = ticks.saturating_mul(8);
        if !self.sampled {
            self.sampled = true;
            self.srtt = r;
            self.rttvar = r / 2;
            return;
        }
        let delta = self.srtt.abs_diff(r);
        self.rttvar = self.rttvar - self.rttvar / 4 + delta / 4;
        self.srtt = self.srtt - self.srtt / 8 + r / 8;
    }

    /// The timeout in ticks: `srtt + max(1 tick, 4 * rttvar)` (the tick is
    /// the clock's granularity) rounded up, within
    /// `floor..=floor * MAX_RTO_FACTOR`.
    pub(crate) fn rto(&self, floor: u64) -> u64 {
        let spread = self.rttvar.saturating_mul(4).max(8);
        let est = self.srtt.saturating_add(spread).div_ceil(8);
        est.clamp(floor, floor.saturating_mul(MAX_RTO_FACTOR))
    }
}
