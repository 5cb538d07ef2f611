//! List scheduling of one variant (step 2 of the search): walk the base sequence on the
//! simulator's clock and issue each all-gather as early as the budget, the prefetch window and the
//! variant's rules allow, fusing the gathers issued at one slot into buckets. Separate from the
//! search loop, which runs every variant and picks among them.

use super::base::Base;
use crate::plan::buckets::FusePolicy;
use crate::plan::graph::{NodeKind, Stream, NONE};
use crate::plan::sim::Problem;
use crate::plan::PREFETCH_ALLOWANCE_GATHERS;

/// One list-scheduling variant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Variant {
    /// Fusion threshold in latencies (0: no fusion).
    pub fuse_factor: f64,
    /// Issue a gather only while the comm queue reaches at most this far ahead of the compute
    /// clock (microseconds; infinite: as early as the budget allows).
    pub horizon_us: f64,
    /// Past half the budget, issue only when the comm stream is idle.
    pub pressure: bool,
    /// As late as possible: postpone a gather while it can still start by its latest start time
    /// (deadlines from compute-only time to its wait, chained back through the FIFO comm
    /// stream) minus `horizon_us`, which is then a safety margin instead of a queue limit.
    pub alap: bool,
}

impl Variant {
    pub fn label(&self) -> String {
        let h = if self.horizon_us.is_finite() {
            format!("{:.0}us", self.horizon_us)
        } else {
            "inf".into()
        };
        format!(
            "fuse={} {}={} pressure={}",
            self.fuse_factor,
            if self.alap { "alap_margin" } else { "horizon" },
            h,
            self.pressure
        )
    }
}

/// Bytes of gathers issued ahead of their just-in-time slot at any one time, in units of the
/// graph's largest gather (the prefetch window, [`PREFETCH_ALLOWANCE_GATHERS`]). The memory
/// budget alone did not bound it: a forward's saved activations grow to its end, so its start has
/// that much headroom, and the search filled it with gathers (a stack of 6 biased layers held 4
/// gathered where released-at-last-use holds 1).
pub const PREFETCH_WINDOW_GATHERS: i64 = PREFETCH_ALLOWANCE_GATHERS as i64;

/// A fused bucket being formed at one slot.
struct Bucket {
    members: Vec<u32>,
    bytes: u64,
    start: f64,
    end: f64,
}

/// List-schedule one variant: returns the order and the fused groups (>= 2 members).
pub(super) fn construct(
    p: &Problem,
    base: &Base,
    budget: i64,
    v: &Variant,
) -> (Vec<u32>, Vec<Vec<u32>>) {
    let g = p.g;
    let n = g.len();
    let m = base.seq.len();
    let policy = FusePolicy::from_cost(&p.cost, v.fuse_factor);
    let mut seg = base.seg.clone();
    let mut order = Vec::with_capacity(n);
    let mut groups: Vec<Vec<u32>> = Vec::new();
    let mut end = vec![0.0f64; n];
    let mut free = [0.0f64; 3];
    let c = Stream::Compute.index();
    let agi = Stream::Allgather.index();
    let mut j = 0usize;
    let half = budget / 2;
    let largest = base
        .fifo
        .iter()
        .map(|&x| g.nodes[x as usize].alloc as i64)
        .max()
        .unwrap_or(0);
    let window = PREFETCH_WINDOW_GATHERS * largest;
    // Bytes issued early and not yet at their slot; `due[k]`: those whose slot is k.
    let mut early = 0i64;
    let mut due = vec![0i64; m + 1];
    for k in 0..=m {
        early -= due[k];
        let now = free[c];
        // Compute time until the next slot (an estimate: the node may also wait on a gather).
        let step = if k < m && g.nodes[base.seq[k] as usize].stream == Stream::Compute {
            p.dur[base.seq[k] as usize]
        } else {
            0.0
        };
        // The buckets issued at this slot, in issue order: at most one open per gathered dtype.
        let mut open: Vec<Bucket> = Vec::new();
        while j < base.fifo.len() {
            let x = base.fifo[j];
            let jx = base.jit[x as usize] as usize;
            let forced = jx <= k;
            let alloc = g.nodes[x as usize].alloc as i64;
            let bytes = g.nodes[x as usize].bytes;
            let dtype = g.nodes[x as usize].dtype;
            let same = open
                .iter()
                .position(|b| g.nodes[b.members[0] as usize].dtype == dtype);
            let joins = same.is_some_and(|i| {
                policy.fuse(open[i].bytes, bytes) && g.fusable(&open[i].members, x)
            });
            if !forced {
                if base.earliest[x as usize] as usize > k {
                    break;
                }
                if seg.max(k, jx) + alloc > budget || early + alloc > window {
                    break;
                }
                // A latency-bound gather may always ride along with a bucket being issued.
                let rides = joins;
                // Horizon: the comm queue already reaches past the next slot by this much.
                let queued = free[agi].max(now) - now - step;
                if !rides && !v.alap && v.horizon_us.is_finite() && queued > v.horizon_us {
                    break;
                }
                if !rides && v.alap {
                    // Could it still start in time if issued at the next slot?
                    let delay = now - base.pc[k];
                    let next = base.pc[(k + 1).min(m)];
                    let postponed = (free[agi] - delay).max(next);
                    if postponed + v.horizon_us <= base.latest_start[x as usize] {
                        break;
                    }
                }
                if !rides && v.pressure && free[agi] > now && seg.max(k, k + 1) > half {
                    break;
                }
            }
            let mut ready = now;
            for &d in g.deps(x) {
                ready = ready.max(end[d as usize]);
            }
            match same {
                Some(i) if joins => {
                    // The bucket grows; it and the buckets issued after it end later.
                    let b = &mut open[i];
                    b.members.push(x);
                    b.bytes += bytes;
                    b.start = b.start.max(ready);
                    let delta = b.start + p.group_dur(&b.members) - b.end;
                    for b in &mut open[i..] {
                        b.end += delta;
                        for &y in &b.members {
                            end[y as usize] = b.end;
                        }
                    }
                    free[agi] += delta;
                }
                _ => {
                    // A new bucket; the one of this dtype, if any, is complete.
                    if let Some(i) = same {
                        let done = open.remove(i);
                        if done.members.len() > 1 {
                            groups.push(done.members);
                        }
                    }
                    let start = ready.max(free[agi]);
                    let en = start + p.dur[x as usize];
                    end[x as usize] = en;
                    free[agi] = en;
                    open.push(Bucket {
                        members: vec![x],
                        bytes,
                        start,
                        end: en,
                    });
                }
            }
            if !forced {
                seg.add(k, jx, alloc);
                early += alloc;
                due[jx] += alloc;
            }
            order.push(x);
            j += 1;
        }
        groups.extend(
            open.into_iter()
                .filter(|b| b.members.len() > 1)
                .map(|b| b.members),
        );
        if k == m {
            break;
        }
        let y = base.seq[k];
        let node = &g.nodes[y as usize];
        let s = node.stream.index();
        let mut ready = 0.0f64;
        for &d in g.deps(y) {
            ready = ready.max(end[d as usize]);
        }
        let ga = g.gather_of[y as usize];
        if node.kind == NodeKind::Wait && ga != NONE {
            ready = ready.max(end[ga as usize]);
        }
        if node.stream != Stream::Compute {
            ready = ready.max(free[c]);
        }
        let st = ready.max(free[s]);
        end[y as usize] = st + p.dur[y as usize];
        free[s] = end[y as usize];
        order.push(y);
    }
    (order, groups)
}
