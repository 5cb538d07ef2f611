//! The planner's graph IR and its JSON form.
//!
//! A Python FX pass emits one JSON object per graph:
//!
//! ```json
//! {"nodes": [
//!    {"name": "ag_w", "kind": "allgather", "ds_id": 3, "bytes": 8388608, "dtype": "torch.bfloat16"},
//!    {"name": "wait_w", "kind": "wait", "ds_id": 3, "deps": [0]},
//!    {"name": "mm", "kind": "compute", "deps": [1], "duration_us": 98.0, "alloc_bytes": 33554432},
//!    {"name": "rel_w", "kind": "release", "ds_id": 3, "deps": [1, 2]}
//!  ],
//!  "budget_bytes": null, "base_bytes": 0, "world": 2}
//! ```
//!
//! `deps` are indices into `nodes`. Defaults keep the pass simple: an `allgather` allocates its
//! `bytes` (the full gathered size), a `release` frees what its matching all-gather allocated
//! (aliasing: the gathered buffer, its wait and every view of it are one allocation), every
//! other node allocates and frees nothing unless told. Collectives without `duration_us` take
//! their duration from the cost model. A `wait` or `release` is matched to the nearest ancestor
//! `allgather` (through a `wait`) with the same `ds_id`.
//!
//! An all-gather's optional `dtype` names the dtype it gathers to (any string; Python writes
//! `"torch.bfloat16"`). A fused prefetch group is one collective into one buffer, so its members
//! share one dtype (a gather without `dtype` fuses only with others without), and it gathers a
//! parameter at most once ([`Graph::fusable`]).
//!
//! Files: `spec` (the JSON form), `build` (a spec validated into a [`Graph`], and back); this file
//! holds the validated graph and what the schedulers read of it.

mod build;
mod spec;

pub use spec::{GraphSpec, NodeKind, NodeSpec, Stream};

/// The process-wide parameter id that the compiled graph's ops carry (not a registry slot).
pub type DsId = u64;

/// "No node" in the u32 index arrays.
pub const NONE: u32 = u32::MAX;

/// A validated node.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub kind: NodeKind,
    pub stream: Stream,
    /// Given duration; `None` means "from the cost model" (collectives) or zero.
    pub duration_us: Option<f64>,
    pub alloc: u64,
    pub free: u64,
    pub ds_id: Option<DsId>,
    pub bytes: u64,
    /// Index into [`Graph::dtypes`] of the gathered dtype, if the IR named one.
    pub dtype: Option<u32>,
    /// Bytes copied to the host after a reduce-scatter (offload), 0 for none.
    pub host_bytes: u64,
    /// Bytes all-reduced across the replicas after a reduce-scatter (hybrid sharding), 0 for
    /// none.
    pub replicate_bytes: u64,
}

/// A validated, indexed graph: deps and users in CSR form, a topological order, and for every
/// wait and release the all-gather it belongs to.
#[derive(Clone, Debug)]
pub struct Graph {
    pub names: Vec<String>,
    pub nodes: Vec<Node>,
    dep_off: Vec<u32>,
    dep_idx: Vec<u32>,
    use_off: Vec<u32>,
    use_idx: Vec<u32>,
    /// For waits and releases: the matching all-gather; otherwise `NONE`.
    pub gather_of: Vec<u32>,
    /// For all-gathers: the matching release, if any; otherwise `NONE`.
    pub release_of: Vec<u32>,
    /// A topological order: the input order when it is one, else the closest (smallest index first).
    pub topo: Vec<u32>,
    /// Position of each node in `topo`.
    pub topo_rank: Vec<u32>,
    pub budget_bytes: Option<u64>,
    pub base_bytes: u64,
    pub world: Option<u32>,
    /// The distinct dtype names of the IR, in order of first appearance.
    pub dtypes: Vec<String>,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    #[inline]
    pub fn deps(&self, v: u32) -> &[u32] {
        let v = v as usize;
        &self.dep_idx[self.dep_off[v] as usize..self.dep_off[v + 1] as usize]
    }

    #[inline]
    pub fn users(&self, v: u32) -> &[u32] {
        let v = v as usize;
        &self.use_idx[self.use_off[v] as usize..self.use_off[v + 1] as usize]
    }

    #[inline]
    pub fn kind(&self, v: u32) -> NodeKind {
        self.nodes[v as usize].kind
    }

    #[inline]
    pub fn is_gather(&self, v: u32) -> bool {
        self.nodes[v as usize].kind == NodeKind::Allgather
    }

    /// Whether all-gather `x` may join a fused group whose members are `members`: the same
    /// gathered dtype as theirs (both none counts as the same) and a parameter not yet in it.
    pub fn fusable(&self, members: &[u32], x: u32) -> bool {
        let n = &self.nodes[x as usize];
        members.iter().all(|&m| {
            let o = &self.nodes[m as usize];
            o.dtype == n.dtype && o.ds_id != n.ds_id
        })
    }

    /// Bytes of the largest all-gather (0 without any).
    pub fn largest_gather_bytes(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.kind == NodeKind::Allgather)
            .map(|n| n.bytes)
            .max()
            .unwrap_or(0)
    }

    /// A graph input: no deps, no time (an FX placeholder, e.g. a parameter's shard).
    pub fn is_input(&self, v: u32) -> bool {
        self.kind(v) == NodeKind::Other && self.deps(v).is_empty()
    }
}
