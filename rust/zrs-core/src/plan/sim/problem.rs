//! A graph and its cost model: the duration of every node and of the work after each
//! reduce-scatter, resolved once for the simulator and the search.

use crate::plan::cost::CostModel;
use crate::plan::graph::{Graph, NodeKind, Stream};

/// A graph with its cost model: the resolved duration of every node.
#[derive(Clone, Debug)]
pub struct Problem<'a> {
    pub g: &'a Graph,
    pub cost: CostModel,
    /// Duration of each node alone (collectives from the cost model unless given).
    pub dur: Vec<f64>,
    /// Duration of each reduce-scatter's copy to the host (0: none).
    pub host_dur: Vec<f64>,
    /// Duration of each reduce-scatter's all-reduce across the replicas (0: none).
    pub replicate_dur: Vec<f64>,
}

impl<'a> Problem<'a> {
    pub fn new(g: &'a Graph, cost: &CostModel) -> Self {
        let dur = g
            .nodes
            .iter()
            .map(|n| match (n.duration_us, n.kind) {
                (Some(d), _) => d,
                (None, NodeKind::Allgather) => {
                    cost.allgather_us(n.bytes) + cost.host_copy_us(n.host_bytes)
                }
                (None, NodeKind::ReduceScatter) => cost.reduce_scatter_us(n.bytes),
                (None, _) => 0.0,
            })
            .collect();
        let host_dur = g
            .nodes
            .iter()
            .map(|n| match n.kind {
                NodeKind::ReduceScatter => cost.host_copy_us(n.host_bytes),
                _ => 0.0,
            })
            .collect();
        let replicate_dur = g
            .nodes
            .iter()
            .map(|n| match n.kind {
                NodeKind::ReduceScatter => cost.all_reduce_us(n.replicate_bytes),
                _ => 0.0,
            })
            .collect();
        Problem {
            g,
            cost: cost.clone(),
            dur,
            host_dur,
            replicate_dur,
        }
    }

    pub fn len(&self) -> usize {
        self.g.len()
    }

    pub fn is_empty(&self) -> bool {
        self.g.is_empty()
    }

    /// Duration of a fused all-gather of these members (and of their stage-in, if staged).
    pub fn group_dur(&self, members: &[u32]) -> f64 {
        if members.len() == 1 {
            return self.dur[members[0] as usize];
        }
        let nodes = || members.iter().map(|&m| &self.g.nodes[m as usize]);
        let bytes: u64 = nodes().map(|n| n.bytes).sum();
        let staged: u64 = nodes().map(|n| n.host_bytes).sum();
        self.cost.allgather_us(bytes) + self.cost.host_copy_us(staged)
    }

    /// Total compute-stream busy time (independent of the order).
    pub fn compute_busy_us(&self) -> f64 {
        (0..self.len())
            .filter(|&v| self.g.nodes[v].stream == Stream::Compute)
            .map(|v| self.dur[v])
            .sum()
    }
}
