//! Collective cost model: `latency + bytes * (W-1)/W / bus_bandwidth`, one link model for
//! all-gather and one for reduce-scatter.
//!
//! `bytes` is the full (gathered / unreduced) tensor size. The ring factor `(W-1)/W` turns it
//! into the bytes each rank moves, so a model fitted at one world size extrapolates to others
//! (latency is kept constant: NCCL's small-message protocols make it grow far slower than the
//! ring's W-1 steps). The two presets are weighted least-squares fits of sweeps measured on 2
//! NVIDIA H200s of one host (torch.distributed + NCCL, bf16, 20 iterations after 5 warm-ups,
//! sizes 64 KiB .. 256 MiB): with NVLink P2P, and with `NCCL_P2P_DISABLE=1` (the
//! "bandwidth-limited" preset). See docs/planner.md.
//!
//! With offload a third link carries each reduced gradient shard to the host: `host`, the
//! device-to-host copy engine, `latency + bytes / bandwidth` per rank (no ring). It has no
//! preset: the compile's profile measures it beside a GPU (docs/offload.md), and a model
//! without it simulates no host copies.

#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Measured on 2×H200 with NCCL_P2P_DISABLE=1: (full bytes, microseconds).
pub const NOP2P_2XH200_ALLGATHER: [(u64, f64); 7] = [
    (65_536, 23.08),
    (262_144, 23.01),
    (1_048_576, 41.92),
    (4_194_304, 101.86),
    (16_777_216, 346.42),
    (67_108_864, 1348.81),
    (268_435_456, 5333.26),
];
pub const NOP2P_2XH200_REDUCE_SCATTER: [(u64, f64); 7] = [
    (65_536, 26.55),
    (262_144, 24.98),
    (1_048_576, 41.12),
    (4_194_304, 101.35),
    (16_777_216, 345.43),
    (67_108_864, 1342.64),
    (268_435_456, 5330.22),
];
/// Measured on 2×H200 over NVLink (P2P on).
pub const NVLINK_2XH200_ALLGATHER: [(u64, f64); 7] = [
    (65_536, 31.86),
    (262_144, 31.54),
    (1_048_576, 31.79),
    (4_194_304, 31.67),
    (16_777_216, 54.47),
    (67_108_864, 157.29),
    (268_435_456, 547.77),
];
pub const NVLINK_2XH200_REDUCE_SCATTER: [(u64, f64); 7] = [
    (65_536, 32.44),
    (262_144, 33.15),
    (1_048_576, 32.26),
    (4_194_304, 35.99),
    (16_777_216, 50.45),
    (67_108_864, 166.06),
    (268_435_456, 586.65),
];
/// World size of the measured sweeps.
pub const MEASURED_WORLD: u32 = 2;

/// Ring factor: the fraction of the full tensor each rank sends (and receives).
#[inline]
pub fn ring_factor(world: u32) -> f64 {
    if world <= 1 {
        0.0
    } else {
        (world - 1) as f64 / world as f64
    }
}

/// `time = latency_us + bytes * ring_factor(W) / (bus_gbps * 1e3)` (1 GB/s = 1e3 bytes/us).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    pub latency_us: f64,
    /// Bus bandwidth in GB/s (bytes each rank moves per second / 1e9).
    pub bus_gbps: f64,
}

impl LinkModel {
    #[inline]
    pub fn time_us(&self, bytes: u64, world: u32) -> f64 {
        if bytes == 0 || world <= 1 {
            return 0.0;
        }
        self.latency_us + bytes as f64 * ring_factor(world) / (self.bus_gbps * 1e3)
    }

    /// Algorithm bandwidth (full bytes / time) for large messages, in GB/s.
    pub fn alg_gbps(&self, world: u32) -> f64 {
        let f = ring_factor(world);
        if f == 0.0 {
            f64::INFINITY
        } else {
            self.bus_gbps / f
        }
    }

    /// Weighted least squares of `us = a + b * bytes*(W-1)/W` over `(bytes, us)` samples, with
    /// weights `1/us^2` so that small (latency-bound) and large (bandwidth-bound) sizes count
    /// alike (relative error). A negative intercept is clamped to zero.
    pub fn fit(samples: &[(u64, f64)], world: u32) -> Result<Self> {
        let f = ring_factor(world);
        if f == 0.0 {
            return Err(Error::Invalid(
                "cannot fit a collective cost model at world size 1: nothing is communicated"
                    .into(),
            ));
        }
        Self::fit_scaled(samples, f)
    }

    /// The fit of a point-to-point copy, `us = a + b * bytes` (the host link): every byte of
    /// the sample moves.
    pub fn fit_copy(samples: &[(u64, f64)]) -> Result<Self> {
        Self::fit_scaled(samples, 1.0)
    }

    /// The fit of a ring all-reduce across `ranks`, `us = a + b * 2 bytes (r - 1) / r`, over
    /// `(bytes each rank sums, us)` samples: the link that [`LinkModel::all_reduce_us`] times.
    pub fn fit_all_reduce(samples: &[(u64, f64)], ranks: u32) -> Result<Self> {
        let f = 2.0 * ring_factor(ranks);
        if f == 0.0 {
            return Err(Error::Invalid(
                "cannot fit an all-reduce cost model across one rank: nothing is communicated"
                    .into(),
            ));
        }
        Self::fit_scaled(samples, f)
    }

    /// The ring all-reduce of `bytes` (each rank's tensor) across `ranks`: a reduce-scatter and
    /// an all-gather, (r - 1) / r of the bytes each. 0 for no bytes or one rank.
    #[inline]
    pub fn all_reduce_us(&self, bytes: u64, ranks: u32) -> f64 {
        if bytes == 0 || ranks <= 1 {
            return 0.0;
        }
        self.latency_us + 2.0 * bytes as f64 * ring_factor(ranks) / (self.bus_gbps * 1e3)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("LinkModel serializes")
    }

    /// A copy's time: `latency_us + bytes / bandwidth`, 0 for no bytes.
    #[inline]
    pub fn copy_us(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        self.latency_us + bytes as f64 / (self.bus_gbps * 1e3)
    }

    fn fit_scaled(samples: &[(u64, f64)], f: f64) -> Result<Self> {
        let pts: Vec<(f64, f64)> = samples
            .iter()
            .filter(|(b, us)| *b > 0 && us.is_finite() && *us > 0.0)
            .map(|&(b, us)| (b as f64 * f, us))
            .collect();
        let distinct = {
            let mut xs: Vec<u64> = pts.iter().map(|p| p.0 as u64).collect();
            xs.sort_unstable();
            xs.dedup();
            xs.len()
        };
        if distinct < 2 {
            return Err(Error::Invalid(format!(
                "cannot fit a collective cost model from {} usable samples: measure at least two different \
                 sizes with positive times",
                pts.len()
            )));
        }
        let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(x, y) in &pts {
            let w = 1.0 / (y * y);
            sw += w;
            sx += w * x;
            sy += w * y;
            sxx += w * x * x;
            sxy += w * x * y;
        }
        let det = sw * sxx - sx * sx;
        let mut b = (sw * sxy - sx * sy) / det;
        let mut a = (sy - b * sx) / sw;
        if a < 0.0 {
            a = 0.0;
            b = sxy / sxx;
        }
        if !(b.is_finite() && b > 0.0) {
            return Err(Error::Invalid(
                "collective cost fit gave a non-positive bandwidth: the sweep's times do not grow with size; \
                 measure larger sizes"
                    .into(),
            ));
        }
        Ok(LinkModel {
            latency_us: a,
            bus_gbps: 1.0 / (b * 1e3),
        })
    }
}

/// Costs of the collectives of one data-parallel group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    #[serde(default)]
    pub name: String,
    pub world: u32,
    pub allgather: LinkModel,
    pub reduce_scatter: LinkModel,
    /// The device-to-host copy of offload's gradients, if measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<LinkModel>,
    /// Hybrid sharding: the replicas each gradient shard is all-reduced across (1: none).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: u32,
    /// The link between replicas (between nodes), if known; the reduce-scatter's link stands
    /// in for it otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter: Option<LinkModel>,
}

fn one() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

impl CostModel {
    /// NVLink between 2 H200s (P2P on), fitted from the measured sweep; the analytic default.
    pub fn nvlink(world: u32) -> Self {
        CostModel {
            name: "nvlink".into(),
            world,
            allgather: LinkModel::fit(&NVLINK_2XH200_ALLGATHER, MEASURED_WORLD)
                .expect("measured fit"),
            reduce_scatter: LinkModel::fit(&NVLINK_2XH200_REDUCE_SCATTER, MEASURED_WORLD)
                .expect("measured fit"),
            host: None,
            replicas: 1,
            inter: None,
        }
    }

    /// The bandwidth-limited model: 2 H200s with NCCL_P2P_DISABLE=1 (through host memory).
    pub fn nop2p(world: u32) -> Self {
        CostModel {
            name: "nop2p".into(),
            world,
            allgather: LinkModel::fit(&NOP2P_2XH200_ALLGATHER, MEASURED_WORLD)
                .expect("measured fit"),
            reduce_scatter: LinkModel::fit(&NOP2P_2XH200_REDUCE_SCATTER, MEASURED_WORLD)
                .expect("measured fit"),
            host: None,
            replicas: 1,
            inter: None,
        }
    }

    /// `"nvlink"` (also `"default"`) or `"nop2p"` (also `"bandwidth_limited"`).
    pub fn preset(name: &str, world: u32) -> Result<Self> {
        if world == 0 {
            return Err(Error::InvalidWorldSize(0));
        }
        match name {
            "nvlink" | "default" | "analytic" => Ok(Self::nvlink(world)),
            "nop2p" | "bandwidth_limited" | "bandwidth-limited" => Ok(Self::nop2p(world)),
            other => Err(Error::Invalid(format!(
                "unknown cost model preset '{other}'; use 'nvlink' (default) or 'nop2p' (bandwidth-limited), or pass \
                 a fitted model as JSON"
            ))),
        }
    }

    /// Fit both collectives from a sweep of `(full bytes, us)` samples.
    pub fn fit(
        allgather: &[(u64, f64)],
        reduce_scatter: &[(u64, f64)],
        world: u32,
    ) -> Result<Self> {
        Ok(CostModel {
            name: "fitted".into(),
            world,
            allgather: LinkModel::fit(allgather, world)?,
            reduce_scatter: LinkModel::fit(reduce_scatter, world)?,
            host: None,
            replicas: 1,
            inter: None,
        })
    }

    /// The same link models at another world size.
    pub fn with_world(&self, world: u32) -> Self {
        CostModel {
            world,
            ..self.clone()
        }
    }

    pub fn from_json(s: &str) -> Result<Self> {
        let m: CostModel = serde_json::from_str(s)
            .map_err(|e| Error::Invalid(format!("invalid cost model JSON: {e}")))?;
        let links = [
            ("allgather", Some(&m.allgather)),
            ("reduce_scatter", Some(&m.reduce_scatter)),
            ("host", m.host.as_ref()),
            ("inter", m.inter.as_ref()),
        ];
        for (what, l) in links.iter().filter_map(|(w, l)| l.map(|l| (w, l))) {
            if !(l.latency_us.is_finite()
                && l.latency_us >= 0.0
                && l.bus_gbps.is_finite()
                && l.bus_gbps > 0.0)
            {
                return Err(Error::Invalid(format!(
                    "cost model {what}: latency_us must be >= 0 and bus_gbps > 0 (got {} and {})",
                    l.latency_us, l.bus_gbps
                )));
            }
        }
        if m.world == 0 || m.replicas == 0 {
            return Err(Error::InvalidWorldSize(0));
        }
        Ok(m)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("CostModel serializes")
    }

    #[inline]
    pub fn allgather_us(&self, bytes: u64) -> f64 {
        self.allgather.time_us(bytes, self.world)
    }

    #[inline]
    pub fn reduce_scatter_us(&self, bytes: u64) -> f64 {
        self.reduce_scatter.time_us(bytes, self.world)
    }

    /// The all-reduce of `bytes` (one reduced shard) across the replicas, over the `inter` link
    /// (the reduce-scatter's where none is known). 0 with one replica.
    #[inline]
    pub fn all_reduce_us(&self, bytes: u64) -> f64 {
        let link = self.inter.as_ref().unwrap_or(&self.reduce_scatter);
        link.all_reduce_us(bytes, self.replicas)
    }

    /// The host copy of `bytes` after a reduce-scatter; 0 without a host link.
    #[inline]
    pub fn host_copy_us(&self, bytes: u64) -> f64 {
        self.host.map_or(0.0, |l| l.copy_us(bytes))
    }

    /// Largest fused all-gather payload whose transfer time is at most `factor` latencies: below it
    /// a collective is latency-bound and fusing saves a real fraction of its cost.
    pub fn allgather_latency_bound_bytes(&self, factor: f64) -> u64 {
        let f = ring_factor(self.world);
        if f == 0.0 {
            return u64::MAX;
        }
        (factor * self.allgather.latency_us * self.allgather.bus_gbps * 1e3 / f) as u64
    }
}

impl Default for CostModel {
    fn default() -> Self {
        Self::nvlink(MEASURED_WORLD)
    }
}
