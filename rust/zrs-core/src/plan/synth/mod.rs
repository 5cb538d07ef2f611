//! Synthetic transformer-shaped graphs with realistic sizes, for benches, tests and the CLI.
//!
//! One decoder layer (LLaMA-style: RMSNorm, q/k/v/o projections, causal attention, SwiGLU MLP)
//! has 13 ops and 9 parameters. The forward gathers each parameter before its op and releases it
//! after; the backward gathers it again (gathers are recomputed, never saved), runs the op's
//! backward (dx and dw), releases it and reduce-scatters the gradient. Compute durations come
//! from FLOPs at an achieved bf16 rate (matmuls, attention) or from bytes moved at an achieved
//! HBM bandwidth (norms, elementwise), with a small launch floor. Every forward output is saved
//! for the backward and freed by its op's backward; gradients live from the op that produces them
//! to the op that consumes them; a parameter gradient lives until its reduce-scatter.
//!
//! Sizes scale by layer count: about 89 nodes per layer plus 29 for embedding, head and loss.

mod layer;

use layer::{layer_template, Builder, Cost, OpDef};

use super::graph::GraphSpec;
use crate::error::{Error, Result};

/// Model and hardware shape of a synthetic graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub layers: usize,
    pub dim: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub seq: u64,
    pub micro_batch: u64,
    /// Bytes per parameter element as gathered (bf16).
    pub param_bytes: u64,
    /// Bytes per activation element (bf16).
    pub act_bytes: u64,
    /// Achieved dense bf16 throughput, TFLOP/s.
    pub tflops: f64,
    /// Achieved HBM bandwidth for memory-bound ops, GB/s.
    pub hbm_gbps: f64,
    /// Smallest kernel time, microseconds.
    pub launch_us: f64,
}

impl Preset {
    /// `"1b"`: 16 layers, dim 2048, FFN 5504, vocab 32000, seq 2048, micro-batch 4, bf16, on an
    /// H200-class GPU (700 TFLOP/s achieved). `"7b"`: 32 layers, dim 4096, FFN 11008, seq 4096,
    /// micro-batch 1. `"70b"`: Llama-2-70B's 80 layers of 8192 and FFN 28672 (its attention
    /// as full multi-head: 78 B parameters), seq 4096, micro-batch 1. `"tiny"`: a toy for tests.
    pub fn by_name(name: &str) -> Result<Self> {
        let base = Preset {
            name: "1b",
            layers: 16,
            dim: 2048,
            ffn: 5504,
            vocab: 32000,
            seq: 2048,
            micro_batch: 4,
            param_bytes: 2,
            act_bytes: 2,
            tflops: 700.0,
            hbm_gbps: 3000.0,
            launch_us: 3.0,
        };
        match name {
            "1b" => Ok(base),
            "7b" => Ok(Preset {
                name: "7b",
                layers: 32,
                dim: 4096,
                ffn: 11008,
                seq: 4096,
                micro_batch: 1,
                ..base
            }),
            "70b" => Ok(Preset {
                name: "70b",
                layers: 80,
                dim: 8192,
                ffn: 28672,
                seq: 4096,
                micro_batch: 1,
                ..base
            }),
            "tiny" => Ok(Preset {
                name: "tiny",
                layers: 2,
                dim: 64,
                ffn: 176,
                vocab: 256,
                seq: 64,
                micro_batch: 2,
                ..base
            }),
            other => Err(Error::Invalid(format!(
                "unknown synthetic preset '{other}'; use '1b', '7b', '70b' or 'tiny'"
            ))),
        }
    }

    fn matmul_us(&self, flops: f64) -> f64 {
        (flops / (self.tflops * 1e6)).max(self.launch_us)
    }

    fn memory_us(&self, bytes: f64) -> f64 {
        (bytes / (self.hbm_gbps * 1e3)).max(self.launch_us)
    }
}

/// Nodes per decoder layer and outside the layers.
pub const NODES_PER_LAYER: usize = 89;
pub const NODES_OUTSIDE_LAYERS: usize = 29;

/// Layer count that gives about `n_nodes` nodes (0: the preset's own).
pub fn layers_for(preset: &Preset, n_nodes: usize) -> usize {
    if n_nodes == 0 {
        preset.layers
    } else {
        (n_nodes.saturating_sub(NODES_OUTSIDE_LAYERS) as f64 / NODES_PER_LAYER as f64)
            .round()
            .max(1.0) as usize
    }
}

/// A forward + backward training graph of a `preset` transformer with about `n_nodes` nodes
/// (0: the preset's own layer count), for data-parallel `world` ranks.
pub fn synthetic_graph(preset: &Preset, n_nodes: usize, world: u32) -> GraphSpec {
    let p = preset;
    let layers = layers_for(p, n_nodes);
    let t = p.micro_batch * p.seq;
    let (d, v) = (p.dim, p.vocab);
    let mut b = Builder {
        p,
        spec: GraphSpec {
            world: Some(world),
            ..GraphSpec::default()
        },
        next_ds: 0,
        fw: Vec::new(),
    };
    let embed = OpDef {
        name: "embed",
        inputs: vec![],
        params: vec![("embed", v * d)],
        cost: Cost::Bytes(2.0 * (t * d * p.act_bytes) as f64),
        out_elems: t * d,
        bw_factor: 2.0,
    };
    let mut x = b.forward("model", &embed, vec![]);
    let tmpl = layer_template(p);
    let mut layer_ops: Vec<Vec<usize>> = Vec::with_capacity(layers);
    for l in 0..layers {
        let prefix = format!("layers.{l}");
        let mut ids: Vec<usize> = Vec::with_capacity(tmpl.len());
        for def in &tmpl {
            let inputs = def
                .inputs
                .iter()
                .map(|inp| Some(inp.map_or(x, |k| ids[k])))
                .collect();
            let id = b.forward(&prefix, def, inputs);
            ids.push(id);
        }
        x = *ids.last().unwrap();
        layer_ops.push(ids);
    }
    let td = (t * d) as f64;
    let norm = OpDef {
        name: "norm",
        inputs: vec![],
        params: vec![("norm", d)],
        cost: Cost::Bytes(2.0 * td * p.act_bytes as f64),
        out_elems: t * d,
        bw_factor: 2.0,
    };
    let xn = b.forward("model", &norm, vec![Some(x)]);
    let head = OpDef {
        name: "lm_head",
        inputs: vec![],
        params: vec![("lm_head", v * d)],
        cost: Cost::Flops(2.0 * (t * d * v) as f64),
        out_elems: t * v,
        bw_factor: 2.0,
    };
    let logits = b.forward("model", &head, vec![Some(xn)]);
    let loss = OpDef {
        name: "loss",
        inputs: vec![],
        params: vec![],
        cost: Cost::Bytes(2.0 * (t * v * p.act_bytes) as f64),
        out_elems: 2, // one fp32 scalar, in act_bytes units
        bw_factor: 1.0,
    };
    let loss_id = b.forward("model", &loss, vec![Some(logits)]);
    // Backward, in reverse.
    b.backward(loss_id);
    b.backward(logits);
    b.backward(xn);
    for ids in layer_ops.iter().rev() {
        for &i in ids.iter().rev() {
            b.backward(i);
        }
    }
    b.backward(0);
    b.spec
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::graph::{Graph, NodeKind};

    #[test]
    fn sizes_and_counts() {
        let p = Preset::by_name("1b").unwrap();
        let s = synthetic_graph(&p, 0, 2);
        assert_eq!(s.nodes.len(), 16 * NODES_PER_LAYER + NODES_OUTSIDE_LAYERS);
        let g = Graph::new(s).unwrap();
        let gathered: u64 = g
            .nodes
            .iter()
            .filter(|n| n.kind == NodeKind::Allgather)
            .map(|n| n.bytes)
            .sum();
        // Every parameter is gathered twice (forward and backward): about 2 x 1.0e9 params x 2 bytes.
        let params = gathered / 2 / 2;
        assert!((0.9e9..1.2e9).contains(&(params as f64)), "{params}");
        // Memory balances: everything allocated is freed except the loss.
        let alloc: u64 = g.nodes.iter().map(|n| n.alloc).sum();
        let free: u64 = g.nodes.iter().map(|n| n.free).sum();
        assert_eq!(alloc - free, 0, "alloc {alloc} free {free}");
        for n in [1000, 10_000, 100_000] {
            let s = synthetic_graph(&p, n, 2);
            let err = (s.nodes.len() as f64 - n as f64).abs() / n as f64;
            assert!(err < 0.1, "{n}: {}", s.nodes.len());
        }
    }
}
