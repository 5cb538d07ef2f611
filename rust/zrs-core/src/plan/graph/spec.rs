//! The graph as its JSON names it: node kinds, streams, [`NodeSpec`] and [`GraphSpec`], with their
//! serde form and the defaults left unset. Separate from the validated [`Graph`](super::Graph)
//! that a spec becomes.

use serde::{Deserialize, Serialize};

use super::DsId;
use crate::error::{Error, Result};

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
    /// Offload: on a reduce-scatter, the bytes this rank copies to the host once it is done (its
    /// shard of the reduced gradient, for the host optimizer); on an all-gather
    /// (`offload="params"`), the bytes of its shard copied in from the host on the gather's
    /// stream just before it. 0 for none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_bytes: u64,
    /// Hybrid sharding: on a reduce-scatter, the bytes of this rank's reduced shard that are
    /// then all-reduced across the replicas (the replicate group). 0 for none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replicate_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
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
            host_bytes: 0,
            replicate_bytes: 0,
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
