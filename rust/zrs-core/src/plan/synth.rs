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

use super::graph::{GraphSpec, NodeKind, NodeSpec};
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

#[derive(Clone, Copy)]
enum Cost {
    Flops(f64),
    Bytes(f64),
}

/// One forward op of the template.
struct OpDef {
    name: &'static str,
    /// Inputs: `None` is the op's external input (previous layer's output), `Some(i)` an op of
    /// the same template.
    inputs: Vec<Option<usize>>,
    params: Vec<(&'static str, u64)>,
    cost: Cost,
    out_elems: u64,
    /// Backward time as a multiple of forward.
    bw_factor: f64,
}

struct Builder<'p> {
    p: &'p Preset,
    spec: GraphSpec,
    next_ds: u64,
    /// Forward ops in emission order: (fw node, out bytes, consumers' bw nodes, grad bytes).
    fw: Vec<FwOp>,
}

struct FwOp {
    node: usize,
    out_bytes: u64,
    params: Vec<(String, u64, u64)>, // (name, ds_id, bytes)
    inputs: Vec<Option<usize>>,      // indices into Builder::fw
    duration: f64,
    bw_factor: f64,
    /// Backward nodes that produced a gradient for this op's output.
    grad_from: Vec<usize>,
}

impl<'p> Builder<'p> {
    fn push(&mut self, n: NodeSpec) -> usize {
        self.spec.push(n) as usize
    }

    fn gather(&mut self, name: &str, ds: u64, bytes: u64) -> usize {
        let ag = self.push(NodeSpec {
            ds_id: Some(ds),
            bytes,
            ..NodeSpec::new(format!("ag.{name}"), NodeKind::Allgather)
        });
        self.push(NodeSpec {
            ds_id: Some(ds),
            deps: vec![ag],
            ..NodeSpec::new(format!("wait.{name}"), NodeKind::Wait)
        })
    }

    fn release(&mut self, name: &str, ds: u64, wait: usize, user: usize) {
        self.push(NodeSpec {
            ds_id: Some(ds),
            deps: vec![wait, user],
            ..NodeSpec::new(format!("rel.{name}"), NodeKind::Release)
        });
    }

    /// Emit a forward op; returns its index in `fw`.
    fn forward(&mut self, prefix: &str, def: &OpDef, inputs: Vec<Option<usize>>) -> usize {
        let p = self.p;
        let mut waits = Vec::new();
        let mut params = Vec::new();
        for &(pname, numel) in &def.params {
            let ds = self.next_ds;
            self.next_ds += 1;
            let name = format!("{prefix}.{pname}");
            let bytes = numel * p.param_bytes;
            waits.push((
                name.clone(),
                ds,
                self.gather(&format!("{name}.fw"), ds, bytes),
            ));
            params.push((name, ds, bytes));
        }
        let mut deps: Vec<usize> = inputs.iter().flatten().map(|&i| self.fw[i].node).collect();
        deps.extend(waits.iter().map(|w| w.2));
        let duration = match def.cost {
            Cost::Flops(f) => p.matmul_us(f),
            Cost::Bytes(b) => p.memory_us(b),
        };
        let out_bytes = def.out_elems * p.act_bytes;
        let node = self.push(NodeSpec {
            deps,
            duration_us: Some(duration),
            alloc_bytes: Some(out_bytes),
            ..NodeSpec::new(format!("{prefix}.{}", def.name), NodeKind::Compute)
        });
        for (name, ds, w) in waits {
            self.release(&format!("{name}.fw"), ds, w, node);
        }
        self.fw.push(FwOp {
            node,
            out_bytes,
            params,
            inputs,
            duration,
            bw_factor: def.bw_factor,
            grad_from: Vec::new(),
        });
        self.fw.len() - 1
    }

    /// Emit the backward of forward op `i` (after all its consumers' backwards).
    fn backward(&mut self, i: usize) -> usize {
        let p = self.p;
        let (params, inputs) = (self.fw[i].params.clone(), self.fw[i].inputs.clone());
        let mut waits = Vec::new();
        for (name, ds, bytes) in &params {
            waits.push((
                name.clone(),
                *ds,
                self.gather(&format!("{name}.bw"), *ds, *bytes),
            ));
        }
        let mut deps: Vec<usize> = self.fw[i].grad_from.clone();
        deps.push(self.fw[i].node);
        deps.extend(waits.iter().map(|w| w.2));
        let grad_in: u64 = inputs.iter().flatten().map(|&j| self.fw[j].out_bytes).sum();
        let grad_params: u64 = params.iter().map(|x| x.2).sum();
        // Free the saved output and every gradient that flowed into it.
        let freed = self.fw[i].out_bytes * (1 + self.fw[i].grad_from.len() as u64);
        let name = self.spec.nodes[self.fw[i].node].name.clone();
        let node = self.push(NodeSpec {
            deps,
            duration_us: Some((self.fw[i].duration * self.fw[i].bw_factor).max(p.launch_us)),
            alloc_bytes: Some(grad_in + grad_params),
            free_bytes: Some(freed),
            ..NodeSpec::new(format!("{name}.bw"), NodeKind::Compute)
        });
        for (pname, ds, w) in waits {
            self.release(&format!("{pname}.bw"), ds, w, node);
        }
        for (pname, ds, bytes) in &params {
            self.push(NodeSpec {
                deps: vec![node],
                ds_id: Some(*ds),
                bytes: *bytes,
                free_bytes: Some(*bytes),
                ..NodeSpec::new(format!("rs.{pname}"), NodeKind::ReduceScatter)
            });
        }
        for j in inputs.into_iter().flatten() {
            self.fw[j].grad_from.push(node);
        }
        node
    }
}

fn layer_template(p: &Preset) -> Vec<OpDef> {
    let (d, f) = (p.dim, p.ffn);
    let t = p.micro_batch * p.seq;
    let td = (t * d) as f64;
    let tf = (t * f) as f64;
    let ab = p.act_bytes as f64;
    let mm = |i: u64, o: u64| Cost::Flops(2.0 * t as f64 * i as f64 * o as f64);
    // Causal attention: 4*B*S^2*d FLOPs halved.
    let attn = Cost::Flops(2.0 * (p.micro_batch * p.seq * p.seq * d) as f64);
    vec![
        OpDef {
            name: "norm1",
            inputs: vec![None],
            params: vec![("attn_norm", d)],
            cost: Cost::Bytes(2.0 * td * ab),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "q",
            inputs: vec![Some(0)],
            params: vec![("wq", d * d)],
            cost: mm(d, d),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "k",
            inputs: vec![Some(0)],
            params: vec![("wk", d * d)],
            cost: mm(d, d),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "v",
            inputs: vec![Some(0)],
            params: vec![("wv", d * d)],
            cost: mm(d, d),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "attn",
            inputs: vec![Some(1), Some(2), Some(3)],
            params: vec![],
            cost: attn,
            out_elems: t * d,
            bw_factor: 2.5,
        },
        OpDef {
            name: "o",
            inputs: vec![Some(4)],
            params: vec![("wo", d * d)],
            cost: mm(d, d),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "add1",
            inputs: vec![None, Some(5)],
            params: vec![],
            cost: Cost::Bytes(3.0 * td * ab),
            out_elems: t * d,
            bw_factor: 1.0,
        },
        OpDef {
            name: "norm2",
            inputs: vec![Some(6)],
            params: vec![("mlp_norm", d)],
            cost: Cost::Bytes(2.0 * td * ab),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "gate",
            inputs: vec![Some(7)],
            params: vec![("w1", d * f)],
            cost: mm(d, f),
            out_elems: t * f,
            bw_factor: 2.0,
        },
        OpDef {
            name: "up",
            inputs: vec![Some(7)],
            params: vec![("w3", d * f)],
            cost: mm(d, f),
            out_elems: t * f,
            bw_factor: 2.0,
        },
        OpDef {
            name: "act",
            inputs: vec![Some(8), Some(9)],
            params: vec![],
            cost: Cost::Bytes(3.0 * tf * ab),
            out_elems: t * f,
            bw_factor: 2.0,
        },
        OpDef {
            name: "down",
            inputs: vec![Some(10)],
            params: vec![("w2", f * d)],
            cost: mm(f, d),
            out_elems: t * d,
            bw_factor: 2.0,
        },
        OpDef {
            name: "add2",
            inputs: vec![Some(6), Some(11)],
            params: vec![],
            cost: Cost::Bytes(3.0 * td * ab),
            out_elems: t * d,
            bw_factor: 1.0,
        },
    ]
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
    use crate::plan::graph::Graph;

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
