//! One decoder layer's ops (`layer_template`: their inputs, parameters, FLOPs or bytes) and the
//! builder that emits them, forward and backward, into a graph.

use super::Preset;
use crate::plan::graph::{GraphSpec, NodeKind, NodeSpec};

#[derive(Clone, Copy)]
pub(super) enum Cost {
    Flops(f64),
    Bytes(f64),
}

/// One forward op of the template.
pub(super) struct OpDef {
    pub(super) name: &'static str,
    /// Inputs: `None` is the op's external input (previous layer's output), `Some(i)` an op of
    /// the same template.
    pub(super) inputs: Vec<Option<usize>>,
    pub(super) params: Vec<(&'static str, u64)>,
    pub(super) cost: Cost,
    pub(super) out_elems: u64,
    /// Backward time as a multiple of forward.
    pub(super) bw_factor: f64,
}

pub(super) struct Builder<'p> {
    pub(super) p: &'p Preset,
    pub(super) spec: GraphSpec,
    pub(super) next_ds: u64,
    /// Forward ops in emission order: (fw node, out bytes, consumers' bw nodes, grad bytes).
    pub(super) fw: Vec<FwOp>,
}

pub(super) struct FwOp {
    pub(super) node: usize,
    pub(super) out_bytes: u64,
    pub(super) params: Vec<(String, u64, u64)>, // (name, ds_id, bytes)
    pub(super) inputs: Vec<Option<usize>>,      // indices into Builder::fw
    pub(super) duration: f64,
    pub(super) bw_factor: f64,
    /// Backward nodes that produced a gradient for this op's output.
    pub(super) grad_from: Vec<usize>,
}

impl<'p> Builder<'p> {
    pub(super) fn push(&mut self, n: NodeSpec) -> usize {
        self.spec.push(n) as usize
    }

    pub(super) fn gather(&mut self, name: &str, ds: u64, bytes: u64) -> usize {
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

    pub(super) fn release(&mut self, name: &str, ds: u64, wait: usize, user: usize) {
        self.push(NodeSpec {
            ds_id: Some(ds),
            deps: vec![wait, user],
            ..NodeSpec::new(format!("rel.{name}"), NodeKind::Release)
        });
    }

    /// Emit a forward op; returns its index in `fw`.
    pub(super) fn forward(
        &mut self,
        prefix: &str,
        def: &OpDef,
        inputs: Vec<Option<usize>>,
    ) -> usize {
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
    pub(super) fn backward(&mut self, i: usize) -> usize {
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

pub(super) fn layer_template(p: &Preset) -> Vec<OpDef> {
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
