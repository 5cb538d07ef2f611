//! Fused prefetch buckets, chosen from the comm model (no MB knob).
//!
//! Fusing `k` all-gathers saves `k-1` latencies and delays the members that would have finished
//! first by the others' transfer time. Gathers are issued in deadline order, so the first
//! members are the urgent ones. A gather therefore joins the bucket being issued when the fused
//! bucket stays latency-bound (its transfer time is at most `factor` × latency), or when the
//! gather is tiny (transfer time at most a quarter latency: it delays the others by less than it
//! saves). The budget bounds a bucket too: every member must fit in memory from the bucket's issue
//! point on, which the scheduler checks member by member.

use super::cost::CostModel;

/// When to fuse a gather into the bucket being issued at the same program point.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusePolicy {
    /// Buckets up to this many bytes are latency-bound; 0 disables fusion.
    pub latency_bound_bytes: u64,
    /// Gathers up to this many bytes ride along with any bucket.
    pub tiny_bytes: u64,
}

impl FusePolicy {
    pub fn none() -> Self {
        FusePolicy {
            latency_bound_bytes: 0,
            tiny_bytes: 0,
        }
    }

    /// Latency-bound means a transfer time of at most `factor` latencies.
    pub fn from_cost(cost: &CostModel, factor: f64) -> Self {
        if factor <= 0.0 {
            return Self::none();
        }
        FusePolicy {
            latency_bound_bytes: cost.allgather_latency_bound_bytes(factor),
            tiny_bytes: cost.allgather_latency_bound_bytes(0.25),
        }
    }

    /// Should a gather of `bytes` join a bucket that holds `bucket_bytes` so far?
    #[inline]
    pub fn fuse(&self, bucket_bytes: u64, bytes: u64) -> bool {
        self.latency_bound_bytes > 0
            && (bucket_bytes.saturating_add(bytes) <= self.latency_bound_bytes
                || bytes <= self.tiny_bytes)
    }

    /// The fused collective is cheaper than issuing the two separately (always true with a
    /// positive latency; kept explicit so a fitted zero-latency model never fuses).
    pub fn cheaper(cost: &CostModel, a: u64, b: u64) -> bool {
        cost.allgather_us(a + b) < cost.allgather_us(a) + cost.allgather_us(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_bound_sizes_fuse() {
        let cost = CostModel::nop2p(2);
        let p = FusePolicy::from_cost(&cost, 2.0);
        // ~20 us latency at ~25 GB/s bus, W=2: about 2 MB is latency-bound.
        assert!((1 << 20..4 << 20).contains(&p.latency_bound_bytes), "{p:?}");
        assert!(p.fuse(8 << 20, 4096)); // a norm weight rides along with a matrix
        assert!(!p.fuse(4096, 8 << 20)); // but does not wait for one
        assert!(p.fuse(512 << 10, 512 << 10));
        assert!(!p.fuse(8 << 20, 8 << 20));
        assert!(!FusePolicy::none().fuse(1, 1));
        assert!(FusePolicy::cheaper(&cost, 4096, 4096));
    }
}
