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

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The process-wide parameter id that the compiled graph's ops carry (not a registry slot).
pub type DsId = u64;

/// "No node" in the u32 index arrays.
pub const NONE: u32 = u32::MAX;

/// What a node does; it decides the default stream and the memory defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    Compute,
    Allgather,
    Wait,
    Release,
    ReduceScatter,
    Other,
}

impl NodeKind {
    pub fn default_stream(self) -> Stream {
        match self {
            NodeKind::Allgather => Stream::Allgather,
            NodeKind::ReduceScatter => Stream::ReduceScatter,
            _ => Stream::Compute,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            NodeKind::Compute => "compute",
            NodeKind::Allgather => "allgather",
            NodeKind::Wait => "wait",
            NodeKind::Release => "release",
            NodeKind::ReduceScatter => "reduce_scatter",
            NodeKind::Other => "other",
        }
    }
}

/// The three device streams of the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Compute = 0,
    Allgather = 1,
    ReduceScatter = 2,
}

impl Stream {
    pub const ALL: [Stream; 3] = [Stream::Compute, Stream::Allgather, Stream::ReduceScatter];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Allgather => "allgather",
            Stream::ReduceScatter => "reduce_scatter",
        }
    }
}

/// One node as it appears in the JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    pub kind: NodeKind,
    #[serde(default)]
    pub deps: Vec<usize>,
    /// Device time in microseconds. Optional for collectives (the cost model fills it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<f64>,
    /// Defaults to the kind's stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<Stream>,
    /// Bytes this node allocates (`allgather`: defaults to `bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alloc_bytes: Option<u64>,
    /// Bytes this node frees (`release`: defaults to its all-gather's allocation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    /// Parameter id of all-gather, wait and release nodes (and reduce-scatters, for reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ds_id: Option<DsId>,
    /// Payload of a collective: full gathered bytes for an all-gather, full gradient bytes for a
    /// reduce-scatter.
    #[serde(default)]
    pub bytes: u64,
    /// The dtype an all-gather gathers to: only gathers of one dtype fuse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
}

impl NodeSpec {
    pub fn new(name: impl Into<String>, kind: NodeKind) -> Self {
        NodeSpec {
            name: name.into(),
            kind,
            deps: Vec::new(),
            duration_us: None,
            stream: None,
            alloc_bytes: None,
            free_bytes: None,
            ds_id: None,
            bytes: 0,
            dtype: None,
        }
    }
}

/// A whole graph as it appears in the JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GraphSpec {
    pub nodes: Vec<NodeSpec>,
    /// Memory budget for the plan (bytes, including `base_bytes`); `None` lets the caller decide.
    #[serde(default)]
    pub budget_bytes: Option<u64>,
    /// Memory already live when the graph starts (e.g. saved activations of the forward).
    #[serde(default)]
    pub base_bytes: u64,
    /// Data-parallel world size the graph was captured with.
    #[serde(default)]
    pub world: Option<u32>,
}

impl GraphSpec {
    pub fn from_json(s: &str) -> Result<Self> {
        serde_json::from_str(s)
            .map_err(|e| Error::Invalid(format!("invalid planner graph JSON: {e}")))
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("GraphSpec serializes")
    }

    /// Append a node and return its index.
    pub fn push(&mut self, node: NodeSpec) -> u32 {
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
    }
}

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
    pub fn from_json(s: &str) -> Result<Self> {
        Self::new(GraphSpec::from_json(s)?)
    }

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

    /// Validate a spec: dep indices in range, finite non-negative durations, no cycle, ds_id on
    /// collectives, and a matching all-gather for every wait and release.
    pub fn new(spec: GraphSpec) -> Result<Self> {
        let n = spec.nodes.len();
        if n >= NONE as usize {
            return Err(Error::Invalid(format!(
                "planner graph has {n} nodes; at most {} are supported",
                NONE - 1
            )));
        }
        let mut names = Vec::with_capacity(n);
        let mut nodes = Vec::with_capacity(n);
        let mut dep_off = Vec::with_capacity(n + 1);
        let mut dep_idx = Vec::new();
        dep_off.push(0u32);
        let mut indeg = vec![0u32; n];
        let mut dtypes: Vec<String> = Vec::new();
        for (i, ns) in spec.nodes.iter().enumerate() {
            if let Some(d) = ns.duration_us {
                if !d.is_finite() || d < 0.0 {
                    return Err(Error::Invalid(format!(
                        "node '{}' (#{i}) has duration_us {d}; durations must be finite and >= 0",
                        ns.name
                    )));
                }
            }
            if matches!(
                ns.kind,
                NodeKind::Allgather | NodeKind::Wait | NodeKind::Release
            ) && ns.ds_id.is_none()
            {
                return Err(Error::Invalid(format!(
                    "{} node '{}' (#{i}) has no ds_id; all-gather, wait and release nodes must name their parameter",
                    ns.kind.as_str(),
                    ns.name
                )));
            }
            let start = dep_idx.len();
            for &d in &ns.deps {
                if d >= n {
                    return Err(Error::Invalid(format!(
                        "node '{}' (#{i}) depends on node #{d}, but the graph has only {n} nodes",
                        ns.name
                    )));
                }
                if d == i {
                    return Err(Error::Invalid(format!(
                        "the planner graph has a cycle: node '{}' (#{i}) depends on itself",
                        ns.name
                    )));
                }
                if !dep_idx[start..].contains(&(d as u32)) {
                    dep_idx.push(d as u32);
                }
            }
            let k = dep_idx.len();
            indeg[i] = (k - start) as u32;
            dep_off.push(dep_idx.len() as u32);
            names.push(ns.name.clone());
            let alloc = match ns.alloc_bytes {
                Some(a) => a,
                None if ns.kind == NodeKind::Allgather => ns.bytes,
                None => 0,
            };
            let dtype = ns.dtype.as_ref().map(|d| {
                let k = dtypes.iter().position(|x| x == d).unwrap_or_else(|| {
                    dtypes.push(d.clone());
                    dtypes.len() - 1
                });
                k as u32
            });
            nodes.push(Node {
                kind: ns.kind,
                stream: ns.stream.unwrap_or(ns.kind.default_stream()),
                duration_us: ns.duration_us,
                alloc,
                free: ns.free_bytes.unwrap_or(0),
                ds_id: ns.ds_id,
                bytes: ns.bytes,
                dtype,
            });
        }
        // Users (CSR).
        let mut use_cnt = vec![0u32; n + 1];
        for &d in &dep_idx {
            use_cnt[d as usize + 1] += 1;
        }
        for i in 0..n {
            use_cnt[i + 1] += use_cnt[i];
        }
        let use_off = use_cnt.clone();
        let mut fill = use_cnt;
        let mut use_idx = vec![0u32; dep_idx.len()];
        for v in 0..n {
            for &d in &dep_idx[dep_off[v] as usize..dep_off[v + 1] as usize] {
                use_idx[fill[d as usize] as usize] = v as u32;
                fill[d as usize] += 1;
            }
        }
        // Topological order: the input order when valid, else Kahn with smallest index first.
        let input_is_topo = (0..n).all(|v| {
            dep_idx[dep_off[v] as usize..dep_off[v + 1] as usize]
                .iter()
                .all(|&d| (d as usize) < v)
        });
        let topo: Vec<u32> = if input_is_topo {
            (0..n as u32).collect()
        } else {
            let mut heap = std::collections::BinaryHeap::new();
            for (v, &d) in indeg.iter().enumerate() {
                if d == 0 {
                    heap.push(std::cmp::Reverse(v as u32));
                }
            }
            let mut out = Vec::with_capacity(n);
            while let Some(std::cmp::Reverse(v)) = heap.pop() {
                out.push(v);
                for &u in &use_idx[use_off[v as usize] as usize..use_off[v as usize + 1] as usize] {
                    indeg[u as usize] -= 1;
                    if indeg[u as usize] == 0 {
                        heap.push(std::cmp::Reverse(u));
                    }
                }
            }
            if out.len() < n {
                let v = (0..n).find(|&v| indeg[v] > 0).unwrap();
                return Err(Error::Invalid(format!(
                    "the planner graph has a cycle through node '{}' (#{v}); deps must form a DAG",
                    names[v]
                )));
            }
            out
        };
        let mut topo_rank = vec![0u32; n];
        for (r, &v) in topo.iter().enumerate() {
            topo_rank[v as usize] = r as u32;
        }
        let mut g = Graph {
            names,
            nodes,
            dep_off,
            dep_idx,
            use_off,
            use_idx,
            gather_of: vec![NONE; n],
            release_of: vec![NONE; n],
            topo,
            topo_rank,
            budget_bytes: spec.budget_bytes,
            base_bytes: spec.base_bytes,
            world: spec.world,
            dtypes,
        };
        g.match_gathers(&spec)?;
        Ok(g)
    }

    /// Pair every wait and release with its all-gather: the nearest ancestor all-gather with the
    /// same ds_id, searched breadth-first (a release usually names the wait, a wait the gather).
    fn match_gathers(&mut self, spec: &GraphSpec) -> Result<()> {
        let n = self.len();
        let mut stamp = vec![0u32; n];
        let mut epoch = 0u32;
        let mut queue: std::collections::VecDeque<u32> = std::collections::VecDeque::new();
        for t in 0..n {
            let v = self.topo[t];
            let kind = self.kind(v);
            if !matches!(kind, NodeKind::Wait | NodeKind::Release) {
                continue;
            }
            let ds = self.nodes[v as usize].ds_id;
            epoch += 1;
            queue.clear();
            queue.push_back(v);
            stamp[v as usize] = epoch;
            let mut found = NONE;
            'bfs: while let Some(x) = queue.pop_front() {
                for &d in self.deps(x) {
                    if stamp[d as usize] == epoch {
                        continue;
                    }
                    stamp[d as usize] = epoch;
                    let dn = &self.nodes[d as usize];
                    if dn.ds_id == ds {
                        if dn.kind == NodeKind::Allgather {
                            found = d;
                            break 'bfs;
                        }
                        if dn.kind == NodeKind::Wait && self.gather_of[d as usize] != NONE {
                            found = self.gather_of[d as usize];
                            break 'bfs;
                        }
                    }
                    queue.push_back(d);
                }
            }
            if found == NONE {
                return Err(Error::UngatheredParam {
                    kind: kind.as_str(),
                    ds_id: ds.unwrap_or(0),
                });
            }
            self.gather_of[v as usize] = found;
            if kind == NodeKind::Release {
                if self.release_of[found as usize] != NONE {
                    return Err(Error::Invalid(format!(
                        "all-gather '{}' (#{found}) has two releases ('{}' and '{}'); gather the parameter again \
                         before releasing it a second time",
                        self.names[found as usize], self.names[self.release_of[found as usize] as usize], self.names[v as usize]
                    )));
                }
                self.release_of[found as usize] = v;
                if spec.nodes[v as usize].free_bytes.is_none() {
                    self.nodes[v as usize].free = self.nodes[found as usize].alloc;
                }
            }
        }
        Ok(())
    }

    /// Back to the JSON form (defaults made explicit).
    pub fn to_spec(&self) -> GraphSpec {
        GraphSpec {
            nodes: (0..self.len() as u32)
                .map(|v| {
                    let n = &self.nodes[v as usize];
                    NodeSpec {
                        name: self.names[v as usize].clone(),
                        kind: n.kind,
                        deps: self.deps(v).iter().map(|&d| d as usize).collect(),
                        duration_us: n.duration_us,
                        stream: Some(n.stream),
                        alloc_bytes: Some(n.alloc),
                        free_bytes: Some(n.free),
                        ds_id: n.ds_id,
                        bytes: n.bytes,
                        dtype: n.dtype.map(|k| self.dtypes[k as usize].clone()),
                    }
                })
                .collect(),
            budget_bytes: self.budget_bytes,
            base_bytes: self.base_bytes,
            world: self.world,
        }
    }
}
