//! The figures of one size: perftest's bandwidth and latency arithmetic.

use serde::Serialize;

/// Samples perftest drops from the top before its latency statistics
/// (`LAT_MEASURE_TAIL`).
const LAT_MEASURE_TAIL: usize = 2;
/// The peak bandwidth is the best rate over any window of this fraction
/// of a run's completions (and at least the ops in flight: completions
/// come in bursts of up to that many).
const PEAK_WINDOWS: u64 = 16;
/// Bytes in perftest's MB.
const MIB: f64 = (1u64 << 20) as f64;

/// perftest's latency figures, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LatStats {
    /// Smallest sample.
    pub t_min: f64,
    /// Largest sample kept (the first of the dropped tail).
    pub t_max: f64,
    /// Median.
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// Standard deviation (perftest's integer truncations).
    pub t_stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl LatStats {
    /// perftest's `print_report_lat`, step by step: the `n - 1` deltas of
    /// the `n` per-post stamps, sorted; the [`LAT_MEASURE_TAIL`] largest
    /// dropped, leaving `m`; typical = the median of those `m` in whole
    /// ticks (the mean of the middle two, truncated, when `m` is even);
    /// average and stdev over the `m` (stdev with perftest's truncations to
    /// `int`); max = the first dropped sample; 99% / 99.9% = the samples at
    /// `ceil(m * p)`. Each delta is divided by `rtt_factor` (2 for
    /// ping-pongs). `None` with fewer than 5 stamps.
    pub fn of(stamps: &[u64], ticks_per_us: f64, rtt_factor: f64) -> Option<LatStats> {
        let mut delta: Vec<u64> = stamps.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
        if delta.len() <= LAT_MEASURE_TAIL + 1 {
            return None;
        }
        delta.sort_unstable();
        let m = delta.len() - LAT_MEASURE_TAIL;
        let median = if (m - 1) % 2 != 0 {
            (delta[m / 2] + delta[m / 2 - 1]) / 2
        } else {
            delta[m / 2]
        };
        let q = ticks_per_us * rtt_factor;
        let avg = delta[..m].iter().map(|&d| d as f64 / q).sum::<f64>() / m as f64;
        let var_sum: f64 = delta[..m]
            .iter()
            .map(|&d| {
                let t = (avg - d as f64 / q) as i32;
                f64::from(t).powi(2) as i32 as f64
            })
            .sum();
        let at = |p: f64| delta[((m as f64 * p).ceil() as usize).min(delta.len() - 1)] as f64 / q;
        Some(LatStats {
            t_min: delta[0] as f64 / q,
            t_max: delta[m] as f64 / q,
            t_typical: median as f64 / q,
            t_avg: avg,
            t_stdev: (var_sum / m as f64).sqrt(),
            p99: at(0.99),
            p999: at(0.999),
        })
    }
}

/// Completion progress of a bandwidth run: `(tick, messages done)` pairs,
/// the first at the first post with 0 done.
#[derive(Debug, Default)]
pub struct BwSamples {
    /// The pairs, in time order.
    pub points: Vec<(u64, u64)>,
}

impl BwSamples {
    /// Samples with room for `n` points.
    pub fn with_capacity(n: usize) -> BwSamples {
        BwSamples {
            points: Vec::with_capacity(n),
        }
    }

    /// Records that `done` messages had completed at `tick`.
    #[inline]
    pub fn push(&mut self, tick: u64, done: u64) {
        self.points.push((tick, done));
    }
}

/// Bandwidth figures of one size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BwStats {
    /// Best rate over any window of 1/16 of the run's messages (at least
    /// the ops in flight), MB/s (2^20).
    pub bw_peak_mbps: f64,
    /// Bytes over the whole run time, MB/s (2^20).
    pub bw_avg_mbps: f64,
    /// Messages per second, millions.
    pub msg_rate_mpps: f64,
}

impl BwStats {
    /// The figures for `size`-byte messages from `samples` (ticks at
    /// `ticks_per_us`), with up to `in_flight` ops outstanding at a time.
    /// `None` without at least one completed message.
    pub fn of(
        size: usize,
        samples: &BwSamples,
        ticks_per_us: f64,
        in_flight: u64,
    ) -> Option<BwStats> {
        let p = &samples.points;
        let (&(t0, d0), &(t1, d1)) = (p.first()?, p.last()?);
        let msgs = d1.checked_sub(d0).filter(|&m| m > 0)?;
        let secs = |ticks: u64| (ticks as f64 / ticks_per_us / 1e6).max(f64::MIN_POSITIVE);
        let total = secs(t1.wrapping_sub(t0));
        let avg = msgs as f64 * size as f64 / total;
        let window = (msgs / PEAK_WINDOWS).max(in_flight).clamp(1, msgs);
        let mut peak = avg;
        let mut j = 0;
        for i in 0..p.len() {
            // The first point at least `window` messages after point i.
            j = j.max(i + 1);
            while j < p.len() && p[j].1 - p[i].1 < window {
                j += 1;
            }
            if j == p.len() {
                break;
            }
            let rate = (p[j].1 - p[i].1) as f64 * size as f64 / secs(p[j].0.wrapping_sub(p[i].0));
            peak = peak.max(rate);
        }
        Some(BwStats {
            bw_peak_mbps: peak / MIB,
            bw_avg_mbps: avg / MIB,
            msg_rate_mpps: msgs as f64 / total / 1e6,
        })
    }
}

/// MB/s (2^20 bytes) to Gbit/s.
pub fn mbps_to_gbits(mbps: f64) -> f64 {
    mbps * MIB * 8.0 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_matches_perftest_arithmetic() {
        // Stamps 10 ticks apart except two outliers; 1 tick per us.
        let mut stamps = vec![0u64];
        for i in 1..=10u64 {
            let d = match i {
                4 => 100,
                7 => 50,
                _ => 10,
            };
            stamps.push(stamps.last().copied().unwrap_or(0) + d);
        }
        let s = LatStats::of(&stamps, 1.0, 1.0).expect("enough samples");
        // The two largest (100, 50) are dropped: eight samples of 10 remain.
        assert_eq!(
            (s.t_min, s.t_typical, s.t_avg, s.t_stdev),
            (10.0, 10.0, 10.0, 0.0)
        );
        assert_eq!(s.t_max, 50.0);
        // Ping-pong: half the round trip.
        let half = LatStats::of(&stamps, 1.0, 2.0).expect("enough samples");
        assert_eq!(half.t_typical, 5.0);
        assert!(LatStats::of(&[0, 1, 2, 3], 1.0, 1.0).is_none());
    }

    #[test]
    fn bandwidth_average_and_peak() {
        // 1 tick per us; 1 MiB messages; 16 done at 1 s, then 16 more in 0.5 s.
        let mut s = BwSamples::default();
        s.push(0, 0);
        for k in 1..=16u64 {
            s.push(k * 62_500, k);
        }
        for k in 1..=16u64 {
            s.push(1_000_000 + k * 31_250, 16 + k);
        }
        let b = BwStats::of(1 << 20, &s, 1.0, 1).expect("some done");
        assert!((b.bw_avg_mbps - 32.0 / 1.5).abs() < 1e-9, "{b:?}");
        assert!((b.bw_peak_mbps - 32.0).abs() < 1e-9, "{b:?}");
        assert!((b.msg_rate_mpps - 32.0 / 1.5 / 1e6).abs() < 1e-12);
        assert!(BwStats::of(8, &BwSamples::default(), 1.0, 1).is_none());
        // A window of at least the ops in flight: the whole run here.
        let all = BwStats::of(1 << 20, &s, 1.0, 64).expect("some done");
        assert!((all.bw_peak_mbps - all.bw_avg_mbps).abs() < 1e-9);
    }

    #[test]
    fn gbits_conversion() {
        assert!((mbps_to_gbits(1000.0) - 8.388608).abs() < 1e-9);
    }
}
