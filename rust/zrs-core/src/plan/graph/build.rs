//! A [`GraphSpec`] validated into an indexed [`Graph`] (defaults applied, deps and users in CSR
//! form, a topological order, each wait's and release's all-gather) and back to a spec. Separate
//! from the graph's accessors, which every scheduler reads.

use super::{Graph, GraphSpec, Node, NodeKind, NodeSpec, NONE};
use crate::error::{Error, Result};

impl Graph {
    pub fn from_json(s: &str) -> Result<Self> {
        Self::new(GraphSpec::from_json(s)?)
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
            if ns.host_bytes > 0
                && !matches!(ns.kind, NodeKind::ReduceScatter | NodeKind::Allgather)
            {
                return Err(Error::Invalid(format!(
                    "node '{}' (#{i}) has host_bytes, but only a reduce_scatter (copied to the \
                     host) or an allgather (staged in from it) moves bytes over the host link",
                    ns.name
                )));
            }
            if ns.replicate_bytes > 0 && ns.kind != NodeKind::ReduceScatter {
                return Err(Error::Invalid(format!(
                    "node '{}' (#{i}) has replicate_bytes, but only a reduce_scatter's output is \
                     all-reduced across the replicas",
                    ns.name
                )));
            }
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
                host_bytes: ns.host_bytes,
                replicate_bytes: ns.replicate_bytes,
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
                        host_bytes: n.host_bytes,
                        replicate_bytes: n.replicate_bytes,
                    }
                })
                .collect(),
            budget_bytes: self.budget_bytes,
            base_bytes: self.base_bytes,
            world: self.world,
        }
    }
}
