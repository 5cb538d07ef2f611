//! The `search` scheduler: a budget-aware list scheduler over a simulated clock, improved by a
//! search over prefetch positions and bucket boundaries scored by the simulator.
//!
//! 1. **Base sequence.** The compute-stream program (every node but the all-gathers) in the
//!    greedy baseline's order, with reduce-scatters hoisted right after their last dependency so
//!    gradients free early. Each all-gather has a just-in-time slot (before its first user) and an
//!    earliest slot (after its deps). With every gather just in time the sequence has the least
//!    peak the planner knows; memory per slot lives in a range-add/range-max segment tree.
//! 2. **List scheduling.** Walk the sequence with the simulator's clock. Before each slot, issue
//!    the next all-gathers (FIFO in just-in-time order, as the comm stream runs them) while the
//!    segment tree says the memory from this slot up to the gather's just-in-time slot stays
//!    within the budget, optionally limited by a look-ahead horizon and by a memory-pressure rule
//!    (past half the budget, issue only when the comm stream is idle). Gathers issued at one slot
//!    form fused buckets while the comm model says they are latency-bound ([`FusePolicy`]) and
//!    the runtime can fuse them (one gathered dtype, each parameter once: `Graph::fusable`): one
//!    bucket is open per dtype at a slot, and a gather that cannot join its dtype's bucket starts
//!    the next one. The simulated buckets are the ones the runtime issues.
//!    With a FIFO comm stream, issuing a gather earlier never delays another one, so "as early as
//!    the budget allows" is the latency-hiding choice; the horizon and pressure variants trade
//!    some of it for a lower peak.
//! 3. **Search.** The variants (fusion threshold × horizon × pressure) are each simulated; the
//!    best is refined by a local search over bucket boundaries (split or merge the buckets whose
//!    waits stall the compute stream), each move scored by the simulator, within an evaluation
//!    budget that scales down with graph size.
//! 4. **Never worse.** The greedy order competes too when it fits the budget: the result is the
//!    best of all by (makespan, peak).

use super::buckets::FusePolicy;
use super::graph::{NodeKind, Stream, NONE};
use super::sim::{simulate_unchecked, validate, Problem, SimResult};
use crate::error::{Error, Result};

/// Range add / range max over slots.
#[derive(Clone, Debug)]
pub struct SegTree {
    n: usize,
    mx: Vec<i64>,
    lz: Vec<i64>,
}

impl SegTree {
    pub fn new(vals: &[i64]) -> Self {
        let n = vals.len().max(1);
        let mut t = SegTree {
            n,
            mx: vec![i64::MIN / 4; 4 * n],
            lz: vec![0; 4 * n],
        };
        t.build(1, 0, n, vals);
        t
    }

    fn build(&mut self, x: usize, l: usize, r: usize, vals: &[i64]) {
        if r - l == 1 {
            self.mx[x] = vals.get(l).copied().unwrap_or(i64::MIN / 4);
            return;
        }
        let m = (l + r) / 2;
        self.build(2 * x, l, m, vals);
        self.build(2 * x + 1, m, r, vals);
        self.mx[x] = self.mx[2 * x].max(self.mx[2 * x + 1]);
    }

    /// Add `v` to slots `[l, r)`.
    pub fn add(&mut self, l: usize, r: usize, v: i64) {
        if l < r {
            self.add_rec(1, 0, self.n, l, r, v);
        }
    }

    fn add_rec(&mut self, x: usize, xl: usize, xr: usize, l: usize, r: usize, v: i64) {
        if r <= xl || xr <= l {
            return;
        }
        if l <= xl && xr <= r {
            self.mx[x] += v;
            self.lz[x] += v;
            return;
        }
        let m = (xl + xr) / 2;
        self.add_rec(2 * x, xl, m, l, r, v);
        self.add_rec(2 * x + 1, m, xr, l, r, v);
        self.mx[x] = self.mx[2 * x].max(self.mx[2 * x + 1]) + self.lz[x];
    }

    /// Max over slots `[l, r)` (`i64::MIN/4` when empty).
    pub fn max(&self, l: usize, r: usize) -> i64 {
        if l >= r {
            return i64::MIN / 4;
        }
        self.max_rec(1, 0, self.n, l, r)
    }

    fn max_rec(&self, x: usize, xl: usize, xr: usize, l: usize, r: usize) -> i64 {
        if r <= xl || xr <= l {
            return i64::MIN / 4;
        }
        if l <= xl && xr <= r {
            return self.mx[x];
        }
        let m = (xl + xr) / 2;
        self.max_rec(2 * x, xl, m, l, r)
            .max(self.max_rec(2 * x + 1, m, xr, l, r))
            + self.lz[x]
    }
}

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

/// The base sequence and everything derived from it, shared by all variants.
struct Base {
    seq: Vec<u32>,
    /// Gathers in comm-stream (FIFO) order.
    fifo: Vec<u32>,
    jit: Vec<u32>,
    earliest: Vec<u32>,
    seg: SegTree,
    peak: i64,
    /// Compute-stream time before each slot, ignoring stalls.
    pc: Vec<f64>,
    /// Latest start of each gather (in `pc` time) for its wait not to stall the compute stream.
    latest_start: Vec<f64>,
}

fn build_base(p: &Problem, greedy: &[u32]) -> Base {
    let g = p.g;
    let n = g.len();
    // Compute-stream program in greedy order, reduce-scatters hoisted after their last dep.
    let mut seq: Vec<u32> = greedy
        .iter()
        .copied()
        .filter(|&v| !g.is_gather(v))
        .collect();
    {
        let mut pos = vec![0usize; n];
        for (k, &v) in seq.iter().enumerate() {
            pos[v as usize] = k;
        }
        let mut keyed: Vec<(u64, u32)> = seq
            .iter()
            .enumerate()
            .map(|(k, &v)| {
                let key = if g.kind(v) == NodeKind::ReduceScatter {
                    let last = g
                        .deps(v)
                        .iter()
                        .filter(|&&d| !g.is_gather(d))
                        .map(|&d| pos[d as usize])
                        .max();
                    match last {
                        Some(l) => 2 * l as u64 + 1,
                        None => 2 * k as u64,
                    }
                } else {
                    2 * k as u64
                };
                (key, v)
            })
            .collect();
        keyed.sort_by_key(|&(k, _)| k);
        seq = keyed.into_iter().map(|(_, v)| v).collect();
    }
    let m = seq.len();
    let mut pos = vec![NONE; n];
    for (k, &v) in seq.iter().enumerate() {
        pos[v as usize] = k as u32;
    }
    // The graph's inputs lead the sequence (the greedy order puts them first).
    let inputs = seq.iter().take_while(|&&v| g.is_input(v)).count() as u32;
    // Slot where each gather must be issued at the latest (before its first user) and earliest.
    let mut jit = vec![NONE; n];
    let mut earliest = vec![0u32; n];
    let mut gathers: Vec<u32> = Vec::new();
    // Greedy position fallback for gathers without users.
    let mut seen_non_gathers = 0u32;
    let mut greedy_slot = vec![0u32; n];
    for &v in greedy {
        if g.is_gather(v) {
            greedy_slot[v as usize] = seen_non_gathers;
        } else {
            seen_non_gathers += 1;
        }
    }
    for &v in g.topo.iter().rev() {
        if !g.is_gather(v) {
            continue;
        }
        gathers.push(v);
        let mut j = NONE;
        for &u in g.users(v) {
            let pu = if g.is_gather(u) {
                jit[u as usize]
            } else {
                pos[u as usize]
            };
            j = j.min(pu);
        }
        if j == NONE {
            j = greedy_slot[v as usize].min(m as u32);
        }
        jit[v as usize] = j;
        let mut e = 0u32;
        for &d in g.deps(v) {
            if g.is_input(d) {
                // After all the inputs, not right after its own: the gathers of one slot can
                // share a bucket, and the inputs take no time.
                e = e.max(inputs);
            } else if !g.is_gather(d) {
                e = e.max(pos[d as usize] + 1);
            }
        }
        earliest[v as usize] = e.min(j);
    }
    gathers.sort_by_key(|&v| (jit[v as usize], g.topo_rank[v as usize]));
    // Memory per slot with every gather just in time.
    let mut vals = vec![0i64; m + 1];
    let mut cur = g.base_bytes as i64;
    let mut gi = 0usize;
    for (k, val) in vals.iter_mut().enumerate() {
        while gi < gathers.len() && jit[gathers[gi] as usize] as usize == k {
            let a = &g.nodes[gathers[gi] as usize];
            cur += a.alloc as i64 - a.free as i64;
            gi += 1;
        }
        if k == m {
            *val = cur;
            break;
        }
        let node = &g.nodes[seq[k] as usize];
        *val = cur + node.alloc as i64;
        cur += node.alloc as i64 - node.free as i64;
    }
    // A gather's own allocation peak (before the slot's node) is covered: alloc >= 0 at the node.
    let seg = SegTree::new(&vals);
    // Deadlines: compute-only time at each gather's just-in-time slot, chained back through the
    // FIFO comm stream (a gather must also leave room for the ones after it).
    let mut pc = vec![0.0f64; m + 1];
    for k in 0..m {
        let v = seq[k] as usize;
        let d = if g.nodes[v].stream == Stream::Compute {
            p.dur[v]
        } else {
            0.0
        };
        pc[k + 1] = pc[k] + d;
    }
    let mut latest_start = vec![f64::INFINITY; n];
    let mut next_start = f64::INFINITY;
    for &x in gathers.iter().rev() {
        let finish = pc[jit[x as usize] as usize].min(next_start);
        let st = finish - p.dur[x as usize];
        latest_start[x as usize] = st;
        next_start = st;
    }
    let peak = seg.max(0, m + 1).max(g.base_bytes as i64);
    Base {
        seq,
        fifo: gathers,
        jit,
        earliest,
        seg,
        peak,
        pc,
        latest_start,
    }
}

/// Bytes of gathers issued ahead of their just-in-time slot at any one time, in units of the
/// graph's largest gather (the prefetch window, [`super::PREFETCH_ALLOWANCE_GATHERS`]). The memory
/// budget alone did not bound it: a forward's saved activations grow to its end, so its start has
/// that much headroom, and the search filled it with gathers (a stack of 6 biased layers held 4
/// gathered where released-at-last-use holds 1).
pub const PREFETCH_WINDOW_GATHERS: i64 = super::PREFETCH_ALLOWANCE_GATHERS as i64;

/// List-schedule one variant: returns the order and the fused groups (>= 2 members).
/// A fused bucket being formed at one slot.
struct Bucket {
    members: Vec<u32>,
    bytes: u64,
    start: f64,
    end: f64,
}

fn construct(p: &Problem, base: &Base, budget: i64, v: &Variant) -> (Vec<u32>, Vec<Vec<u32>>) {
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

/// A scored candidate plan.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub order: Vec<u32>,
    pub groups: Vec<Vec<u32>>,
    pub sim: SimResult,
    pub label: String,
}

fn better(a: &SimResult, b: &SimResult) -> bool {
    // Makespans within a nanosecond count as equal; then the lower peak wins.
    if (a.makespan_us - b.makespan_us).abs() > 1e-3 {
        a.makespan_us < b.makespan_us
    } else {
        a.peak_bytes < b.peak_bytes
    }
}

fn score(p: &Problem, order: Vec<u32>, groups: Vec<Vec<u32>>, label: String) -> Result<Candidate> {
    let (group_of, _) = validate(p.g, &order, &groups)?;
    let sim = simulate_unchecked(p, &order, &groups, &group_of, false);
    Ok(Candidate {
        order,
        groups,
        sim,
        label,
    })
}

/// Variants within this fraction of the fastest makespan compete on peak memory instead.
pub const MAKESPAN_TOLERANCE: f64 = 1e-3;

/// Search options: how many simulator runs the local search may spend.
///
/// A count, not a wall-clock limit: the search must be deterministic, because every rank plans
/// its own copy of the graph and all of them must arrive at the same order and buckets (a
/// different order on one rank would pair its collectives with other ranks' different ones).
#[derive(Clone, Copy, Debug)]
pub struct SearchOptions {
    /// Maximum simulator evaluations of the local search (besides the variants).
    pub max_evals: usize,
}

impl SearchOptions {
    /// Scaled to the graph: many evaluations for small graphs, few for huge ones, so that a
    /// 10k-node graph plans in a few milliseconds and a 100k-node one well under half a second.
    pub fn for_size(n: usize) -> Self {
        SearchOptions {
            max_evals: (100_000 / n.max(1)).clamp(2, 32),
        }
    }
}

/// The variants tried for every graph.
pub fn variants(n: usize) -> Vec<Variant> {
    let inf = f64::INFINITY;
    let v = |fuse_factor: f64, horizon_us: f64, pressure: bool, alap: bool| Variant {
        fuse_factor,
        horizon_us,
        pressure,
        alap,
    };
    // As early as the budget allows (with and without buckets); as late as the deadlines allow
    // (the same overlap for less memory, when the estimates hold); "lazy" (issue only when the
    // comm stream would otherwise idle before the next slot); the memory-pressure rule.
    let mut out = vec![
        v(2.0, inf, false, false),
        v(0.0, inf, false, false),
        v(2.0, 0.0, false, true),
        v(2.0, inf, true, false),
    ];
    if n <= 5_000 {
        out.extend([
            v(8.0, inf, false, false),
            v(0.5, inf, false, false),
            v(32.0, inf, false, false),
            v(2.0, 0.0, false, false),
            v(0.0, 0.0, false, true),
            v(2.0, 200.0, false, true),
        ]);
    }
    out
}

/// A local move: a new order, new groups and what was done.
type Move = (Vec<u32>, Vec<Vec<u32>>, &'static str);

/// Local search over bucket boundaries: for the buckets (and lone gathers) whose waits stall the
/// compute stream the most, try splitting the bucket in two, and pulling the next all-gather of
/// the comm stream forward into it (an earlier prefetch of that gather, fused). Each move is
/// scored by the simulator and kept if it is faster within the budget.
fn refine_buckets(
    p: &Problem,
    best: &mut Candidate,
    budget: u64,
    opts: &SearchOptions,
) -> Result<usize> {
    let g = p.g;
    let mut evals = 0usize;
    let mut improved = true;
    let out_of_time = |evals: usize| evals >= opts.max_evals;
    while improved && !out_of_time(evals) {
        improved = false;
        let n = g.len();
        let mut group_of = vec![NONE; n];
        for (gi, grp) in best.groups.iter().enumerate() {
            for &m in grp {
                group_of[m as usize] = gi as u32;
            }
        }
        // Stall before each all-gather's wait.
        let sim = &best.sim;
        let mut stalls: Vec<(f64, u32)> = Vec::new();
        for v in 0..n as u32 {
            if !g.is_gather(v) {
                continue;
            }
            let mut stall = 0.0f64;
            for &u in g.users(v) {
                if g.kind(u) == NodeKind::Wait {
                    stall = stall.max(sim.end_us[v as usize] - sim.start_us[u as usize]);
                }
            }
            if stall > 1e-6 {
                stalls.push((stall, v));
            }
        }
        stalls.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut pos = vec![0usize; n];
        for (k, &v) in best.order.iter().enumerate() {
            pos[v as usize] = k;
        }
        for &(_, v) in stalls.iter().take(4) {
            if out_of_time(evals) {
                break;
            }
            let gi = group_of[v as usize];
            let members: Vec<u32> = if gi == NONE {
                vec![v]
            } else {
                best.groups[gi as usize].clone()
            };
            let mut moves: Vec<Move> = Vec::new();
            // Split.
            if members.len() >= 2 {
                let mid = members.len() / 2;
                let mut groups = best.groups.clone();
                groups.swap_remove(gi as usize);
                for part in [&members[..mid], &members[mid..]] {
                    if part.len() >= 2 {
                        groups.push(part.to_vec());
                    }
                }
                moves.push((best.order.clone(), groups, "split"));
            }
            // Pull the preceding comm-stream gather's bucket together with this one: issue this
            // bucket at the previous bucket's slot (an earlier prefetch), fused.
            let first = members.iter().map(|&m| pos[m as usize]).min().unwrap();
            if let Some(prev_pos) = (0..first).rev().find(|&k| g.is_gather(best.order[k])) {
                let prev = best.order[prev_pos];
                let pg = group_of[prev as usize];
                let prev_members: Vec<u32> = if pg == NONE {
                    vec![prev]
                } else {
                    best.groups[pg as usize].clone()
                };
                let last_prev = prev_members.iter().map(|&m| pos[m as usize]).max().unwrap();
                let mut order: Vec<u32> = Vec::with_capacity(n);
                let set: std::collections::HashSet<u32> = members.iter().copied().collect();
                for (k, &x) in best.order.iter().enumerate() {
                    if set.contains(&x) {
                        continue;
                    }
                    order.push(x);
                    if k == last_prev {
                        order.extend(members.iter().copied());
                    }
                }
                let mut groups: Vec<Vec<u32>> = best
                    .groups
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i as u32 != gi && i as u32 != pg)
                    .map(|(_, grp)| grp.clone())
                    .collect();
                let mut merged = prev_members.clone();
                merged.extend(members.iter().copied());
                groups.push(merged);
                moves.push((order, groups, "pull"));
            }
            for (order, groups, what) in moves {
                if out_of_time(evals) {
                    break;
                }
                evals += 1;
                if validate(g, &order, &groups).is_err()
                    || super::sim::recount_peak(g, &order, &groups) > budget
                {
                    continue;
                }
                let cand = score(p, order, groups, format!("{} +{what}", best.label))?;
                if better(&cand.sim, &best.sim) && cand.sim.peak_bytes <= budget {
                    *best = cand;
                    improved = true;
                    break;
                }
            }
            if improved {
                break;
            }
        }
    }
    Ok(evals)
}

/// Outcome of the search, with what it tried.
#[derive(Clone, Debug)]
pub struct SearchResult {
    pub best: Candidate,
    /// Peak of the just-in-time base sequence (the least peak the planner knows for it).
    pub base_peak: u64,
    pub evals: usize,
}

/// Run the search within `budget`; `greedy` is the baseline order (and its simulation).
pub fn search(
    p: &Problem,
    budget: u64,
    greedy: &Candidate,
    opts: &SearchOptions,
) -> Result<SearchResult> {
    let base = build_base(p, &greedy.order);

    let base_peak = base.peak.max(0) as u64;
    let minimal = base_peak.min(greedy.sim.peak_bytes);
    if budget < minimal {
        return Err(Error::BudgetInfeasible {
            budget,
            minimal,
            base: 0,
        });
    }
    let greedy_fits = greedy.sim.peak_bytes <= budget;
    let mut evals = 0usize;
    let mut pool: Vec<Candidate> = Vec::new();
    if base_peak <= budget {
        let b = budget.min(i64::MAX as u64) as i64;
        let vs = variants(p.len());
        let run = |v: &Variant| -> Result<Candidate> {
            let (order, groups) = construct(p, &base, b, v);
            score(p, order, groups, v.label())
        };
        // The variants are independent: run them on the cores there are.
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
        let cands: Vec<Result<Candidate>> = if threads > 1 && p.len() >= 2_000 {
            let chunk = vs.len().div_ceil(threads.min(vs.len()));
            std::thread::scope(|sc| {
                let handles: Vec<_> = vs
                    .chunks(chunk)
                    .map(|part| sc.spawn(move || part.iter().map(run).collect::<Vec<_>>()))
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("planner variant thread panicked"))
                    .collect()
            })
        } else {
            vs.iter().map(run).collect()
        };
        for cand in cands {
            let cand = cand?;
            evals += 1;
            // Cannot happen by construction; never return an over-budget plan.
            if cand.sim.peak_bytes <= budget {
                pool.push(cand);
            }
        }
    }
    // Among variants within MAKESPAN_TOLERANCE of the fastest, the least peak (then the fastest).
    let fastest = pool
        .iter()
        .map(|c| c.sim.makespan_us)
        .fold(f64::INFINITY, f64::min);
    let pick = pool
        .iter()
        .filter(|c| c.sim.makespan_us <= fastest * (1.0 + MAKESPAN_TOLERANCE) + 1e-3)
        .min_by(|a, b| {
            (a.sim.peak_bytes, a.sim.makespan_us)
                .partial_cmp(&(b.sim.peak_bytes, b.sim.makespan_us))
                .expect("finite makespans")
        })
        .cloned();
    let best_variant = pool
        .into_iter()
        .reduce(|a, b| if better(&b.sim, &a.sim) { b } else { a });
    // Never worse than greedy: fall back to the fastest variant, then to greedy itself.
    let mut best = match (pick, best_variant) {
        (Some(pk), _) if !greedy_fits || pk.sim.makespan_us <= greedy.sim.makespan_us + 1e-3 => pk,
        (_, Some(bv)) if !greedy_fits || bv.sim.makespan_us <= greedy.sim.makespan_us + 1e-3 => bv,
        _ if greedy_fits => greedy.clone(),
        _ => {
            unreachable!("the greedy order or the base sequence fits a budget >= the minimal peak")
        }
    };
    evals += refine_buckets(p, &mut best, budget, opts)?;
    Ok(SearchResult {
        best,
        base_peak,
        evals,
    })
}

#[cfg(test)]
mod tests {
    use super::super::graph::{Graph, GraphSpec, NodeKind, NodeSpec};
    use super::super::{plan, CostModel, Scheduler};

    /// `layers` ops, each using a weight (bf16) and a bias (f32), every parameter gathered right
    /// before its op and released after it; `tied` names the weight of layers 0 and 1 as one
    /// parameter, gathered twice.
    fn layered(layers: usize, tied: bool) -> Graph {
        let mut s = GraphSpec {
            world: Some(2),
            ..GraphSpec::default()
        };
        let mut prev: Option<usize> = None;
        for l in 0..layers {
            let mut waits = Vec::new();
            let params = [
                (
                    if tied && l == 1 { 0 } else { 2 * l as u64 },
                    64 << 10,
                    "torch.bfloat16",
                ),
                (2 * l as u64 + 1, 4 << 10, "torch.float32"),
            ];
            for (ds, bytes, dtype) in params {
                let ag = s.push(NodeSpec {
                    ds_id: Some(ds),
                    bytes,
                    dtype: Some(dtype.into()),
                    ..NodeSpec::new(format!("ag{l}.{ds}"), NodeKind::Allgather)
                }) as usize;
                let w = s.push(NodeSpec {
                    ds_id: Some(ds),
                    deps: vec![ag],
                    ..NodeSpec::new(format!("wait{l}.{ds}"), NodeKind::Wait)
                }) as usize;
                waits.push((ds, w));
            }
            let mut deps: Vec<usize> = waits.iter().map(|w| w.1).collect();
            deps.extend(prev);
            let op = s.push(NodeSpec {
                deps,
                duration_us: Some(1.0), // latency-bound gathers: fusing pays
                alloc_bytes: Some(1 << 10),
                ..NodeSpec::new(format!("op{l}"), NodeKind::Compute)
            }) as usize;
            for (ds, w) in waits {
                s.push(NodeSpec {
                    ds_id: Some(ds),
                    deps: vec![w, op],
                    ..NodeSpec::new(format!("rel{l}.{ds}"), NodeKind::Release)
                });
            }
            prev = Some(op);
        }
        Graph::new(s).unwrap()
    }

    #[test]
    fn mixed_dtypes_never_share_a_group() {
        let g = layered(6, false);
        let cost = CostModel::nvlink(2);
        let p = plan(&g, Scheduler::Search, Some(1 << 30), &cost).unwrap();
        assert!(!p.groups.is_empty(), "the gathers still fuse, per dtype");
        for grp in &p.groups {
            assert!(grp.len() >= 2, "{grp:?}");
            let d0 = g.nodes[grp[0] as usize].dtype;
            assert!(
                grp.iter().all(|&m| g.nodes[m as usize].dtype == d0),
                "mixed dtypes in {:?}",
                grp.iter()
                    .map(|&m| &g.names[m as usize])
                    .collect::<Vec<_>>()
            );
        }
        // Both dtypes are fused (one bucket open per dtype at a slot).
        let fused: std::collections::HashSet<_> = p
            .groups
            .iter()
            .map(|grp| g.nodes[grp[0] as usize].dtype)
            .collect();
        assert_eq!(fused.len(), 2, "{:?}", p.groups);
    }

    #[test]
    fn a_parameter_is_never_twice_in_one_group() {
        let cost = CostModel::nvlink(2);
        // Untied, the weights of layers 0 and 1 are fused together...
        let g = layered(6, false);
        let p = plan(&g, Scheduler::Search, Some(1 << 30), &cost).unwrap();
        let name = |g: &Graph, v: u32| g.names[v as usize].clone();
        let together = |g: &Graph, groups: &[Vec<u32>], a: &str, b: &str| {
            groups.iter().any(|grp| {
                grp.iter().any(|&m| name(g, m) == a) && grp.iter().any(|&m| name(g, m) == b)
            })
        };
        assert!(together(&g, &p.groups, "ag0.0", "ag1.2"), "{:?}", p.groups);
        // ...tied, the two gathers of one parameter are not.
        let g = layered(6, true);
        let p = plan(&g, Scheduler::Search, Some(1 << 30), &cost).unwrap();
        assert!(!together(&g, &p.groups, "ag0.0", "ag1.0"), "{:?}", p.groups);
        for grp in &p.groups {
            let mut ids: Vec<_> = grp.iter().map(|&m| g.nodes[m as usize].ds_id).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), grp.len(), "{grp:?}");
        }
    }

    #[test]
    fn the_ir_dtype_round_trips() {
        let g = layered(2, false);
        assert_eq!(g.dtypes, vec!["torch.bfloat16", "torch.float32"]);
        let spec = g.to_spec();
        assert_eq!(spec.nodes[0].dtype.as_deref(), Some("torch.bfloat16"));
        assert!(spec.to_json().contains("\"dtype\":\"torch.float32\""));
        let back = Graph::new(GraphSpec::from_json(&spec.to_json()).unwrap()).unwrap();
        assert_eq!(back.nodes, g.nodes);
    }
}
