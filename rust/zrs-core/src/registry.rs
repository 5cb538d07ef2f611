//! The parameter registry: what zrs knows about every sharded parameter, keyed by ds_id.
//!
//! Python owns the tensors; the registry owns sizes and the gather life cycle
//! (partitioned -> in flight -> available -> partitioned). Gathers are refcounted because two
//! nodes of a graph can gather the same parameter with overlapping lifetimes, and the buffer may
//! only be freed when the last of them releases it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub type ParamId = usize;

/// Where the full (gathered) copy of a parameter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Only the local shard exists.
    Partitioned,
    /// An all-gather has been issued and not yet waited on.
    InFlight,
    /// The gathered copy is materialized.
    Available,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Partitioned => "partitioned",
            Status::InFlight => "in_flight",
            Status::Available => "available",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamInfo {
    pub ds_id: ParamId,
    pub shape: Vec<usize>,
    pub numel: usize,
    /// Rows (of dim 0) each rank holds: ceil(shape[0] / world), the chunks of `torch.chunk`
    /// and of a DTensor's `Shard(0)`. A 0-d parameter counts as one row.
    pub shard_rows: usize,
    /// `shard_rows` rows of every rank together, so every rank holds an equal (padded) shard;
    /// the padding is at the end, past the last rank's real rows.
    pub padded_numel: usize,
    pub shard_numel: usize,
    pub dtype: String,
    /// Persistent parameters keep their gathered copy between uses.
    pub persistent: bool,
    pub requires_grad: bool,
    pub status: Status,
    /// Whether the gathered copy (in flight or available) reflects the current shards.
    pub gathered_valid: bool,
    /// Gathers started and not yet released.
    pub holders: usize,
    /// graph_id -> number of uses of this parameter in that graph.
    pub uses: BTreeMap<usize, usize>,
}

#[derive(Debug, Clone)]
pub struct Registry {
    world_size: usize,
    params: BTreeMap<ParamId, ParamInfo>,
}

impl Registry {
    pub fn new(world_size: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidWorldSize(world_size));
        }
        Ok(Self {
            world_size,
            params: BTreeMap::new(),
        })
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Registers a parameter under the next free ds_id (one past the largest registered).
    pub fn register(
        &mut self,
        shape: Vec<usize>,
        dtype: String,
        persistent: bool,
        requires_grad: bool,
    ) -> Result<ParamId> {
        let ds_id = self.params.last_key_value().map_or(0, |(&id, _)| id + 1);
        self.register_with_id(ds_id, shape, dtype, persistent, requires_grad)
    }

    pub fn register_with_id(
        &mut self,
        ds_id: ParamId,
        shape: Vec<usize>,
        dtype: String,
        persistent: bool,
        requires_grad: bool,
    ) -> Result<ParamId> {
        if self.params.contains_key(&ds_id) {
            return Err(Error::AlreadyRegistered(ds_id));
        }
        let too_large = || Error::Invalid(format!("parameter shape {shape:?} is too large"));
        let numel = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(too_large)?;
        let rows = shape.first().copied().unwrap_or(1);
        let row_numel = shape.iter().skip(1).product::<usize>();
        let shard_rows = rows.div_ceil(self.world_size);
        let shard_numel = shard_rows.checked_mul(row_numel).ok_or_else(too_large)?;
        let padded_numel = shard_numel
            .checked_mul(self.world_size)
            .ok_or_else(too_large)?;
        let info = ParamInfo {
            ds_id,
            numel,
            shard_rows,
            padded_numel,
            shard_numel,
            shape,
            dtype,
            persistent,
            requires_grad,
            status: Status::Partitioned,
            gathered_valid: false,
            holders: 0,
            uses: BTreeMap::new(),
        };
        self.params.insert(ds_id, info);
        Ok(ds_id)
    }

    /// Rows of `ds_id` that `rank` really holds: `shard_rows`, fewer on the last ranks when the
    /// rows do not divide evenly (none past the end). A 0-d parameter is replicated: every rank
    /// holds its one element.
    pub fn local_rows(&self, ds_id: ParamId, rank: usize) -> Result<usize> {
        if rank >= self.world_size {
            return Err(Error::Invalid(format!(
                "rank {rank} is outside a world of {}",
                self.world_size
            )));
        }
        let p = self.info(ds_id)?;
        let Some(&rows) = p.shape.first() else {
            return Ok(1);
        };
        Ok(rows.saturating_sub(rank * p.shard_rows).min(p.shard_rows))
    }

    pub fn info(&self, ds_id: ParamId) -> Result<&ParamInfo> {
        self.params.get(&ds_id).ok_or(Error::UnknownParam(ds_id))
    }

    fn info_mut(&mut self, ds_id: ParamId) -> Result<&mut ParamInfo> {
        self.params
            .get_mut(&ds_id)
            .ok_or(Error::UnknownParam(ds_id))
    }

    pub fn contains(&self, ds_id: ParamId) -> bool {
        self.params.contains_key(&ds_id)
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Registered ds_ids in increasing order.
    pub fn ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.params.keys().copied()
    }

    pub fn total_numel(&self) -> usize {
        self.params.values().map(|p| p.numel).sum()
    }

    pub fn total_shard_numel(&self) -> usize {
        self.params.values().map(|p| p.shard_numel).sum()
    }

    /// Takes a hold on the gathered copy. Returns true when the caller must issue an all-gather;
    /// false when a valid copy is already in flight or available and can be reused.
    pub fn start_gather(&mut self, ds_id: ParamId) -> Result<bool> {
        let p = self.info_mut(ds_id)?;
        p.holders += 1;
        let issue = p.status == Status::Partitioned || !p.gathered_valid;
        if issue {
            // The copy now in flight is gathered from the current shards.
            p.status = Status::InFlight;
            p.gathered_valid = true;
        }
        Ok(issue)
    }

    /// Marks the all-gather as complete. Waiting twice on the same gather is harmless.
    pub fn finish_gather(&mut self, ds_id: ParamId) -> Result<()> {
        let p = self.info_mut(ds_id)?;
        match p.status {
            Status::Partitioned => Err(Error::WaitWithoutGather(ds_id)),
            Status::InFlight | Status::Available => {
                p.status = Status::Available;
                p.gathered_valid = true;
                Ok(())
            }
        }
    }

    /// Drops a hold. Returns true when the caller must free the gathered buffer now: the last
    /// holder is gone and the copy is either not persistent or stale.
    pub fn release(&mut self, ds_id: ParamId) -> Result<bool> {
        let p = self.info_mut(ds_id)?;
        if p.holders == 0 {
            return Err(Error::ReleaseWithoutGather(ds_id));
        }
        p.holders -= 1;
        let free = p.holders == 0 && (!p.persistent || !p.gathered_valid);
        if free {
            p.status = Status::Partitioned;
            p.gathered_valid = false;
        }
        Ok(free)
    }

    /// Marks the gathered copy stale (the shards changed, e.g. after an optimizer step).
    /// A copy nobody holds is dropped at once; a held one is dropped by its last release.
    pub fn invalidate(&mut self, ds_id: ParamId) -> Result<()> {
        Self::invalidate_one(self.info_mut(ds_id)?);
        Ok(())
    }

    pub fn invalidate_all(&mut self) {
        self.params.values_mut().for_each(Self::invalidate_one);
    }

    fn invalidate_one(p: &mut ParamInfo) {
        p.gathered_valid = false;
        if p.holders == 0 {
            p.status = Status::Partitioned;
        }
    }

    /// Forgets every hold and gathered copy (a step that failed part-way: its releases never
    /// ran). Returns how many parameters were still held or gathered.
    pub fn drop_all_gathers(&mut self) -> usize {
        let mut dropped = 0;
        for p in self.params.values_mut() {
            if p.holders > 0 || p.status != Status::Partitioned {
                dropped += 1;
            }
            p.holders = 0;
            p.status = Status::Partitioned;
            p.gathered_valid = false;
        }
        dropped
    }

    /// Records how many nodes of graph `graph_id` use the parameter; 0 forgets the entry.
    pub fn set_uses(&mut self, graph_id: usize, ds_id: ParamId, n: usize) -> Result<()> {
        let uses = &mut self.info_mut(ds_id)?.uses;
        if n == 0 {
            uses.remove(&graph_id);
        } else {
            uses.insert(graph_id, n);
        }
        Ok(())
    }

    /// Uses of the parameter in graph `graph_id`; 0 when that graph never recorded any.
    pub fn uses(&self, graph_id: usize, ds_id: ParamId) -> Result<usize> {
        Ok(self.info(ds_id)?.uses.get(&graph_id).copied().unwrap_or(0))
    }

    /// Every graph id that recorded uses, in increasing order.
    pub fn graph_ids(&self) -> Vec<usize> {
        let ids: BTreeSet<usize> = self
            .params
            .values()
            .flat_map(|p| p.uses.keys().copied())
            .collect();
        ids.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reg(world_size: usize) -> Registry {
        Registry::new(world_size).unwrap()
    }

    fn add(r: &mut Registry, shape: &[usize], persistent: bool) -> ParamId {
        r.register(shape.to_vec(), "float32".into(), persistent, true)
            .unwrap()
    }

    fn state(r: &Registry, id: ParamId) -> (Status, bool, usize) {
        let p = r.info(id).unwrap();
        (p.status, p.gathered_valid, p.holders)
    }

    #[test]
    fn zero_world_size_is_an_error() {
        assert_eq!(Registry::new(0).unwrap_err(), Error::InvalidWorldSize(0));
    }

    #[test]
    fn dropping_all_gathers_forgets_holds_and_copies() {
        let mut r = reg(2);
        let (a, b, c) = (
            add(&mut r, &[4], false),
            add(&mut r, &[4], true),
            add(&mut r, &[4], false),
        );
        assert!(r.start_gather(a).unwrap());
        assert!(r.start_gather(b).unwrap());
        r.finish_gather(b).unwrap();
        assert!(!r.release(b).unwrap()); // persistent: stays available, unheld
        assert_eq!(r.drop_all_gathers(), 2);
        for id in [a, b, c] {
            assert_eq!(state(&r, id), (Status::Partitioned, false, 0));
        }
        assert!(r.start_gather(a).unwrap()); // a fresh gather, not a reuse
        assert_eq!(r.drop_all_gathers(), 1);
        assert_eq!(r.drop_all_gathers(), 0);
    }

    #[test]
    fn register_assigns_sequential_ids_and_sizes() {
        let mut r = reg(3);
        assert!(r.is_empty());
        let a = add(&mut r, &[5, 2], false);
        let b = r.register(vec![], "bfloat16".into(), true, false).unwrap();
        let c = add(&mut r, &[4, 0], false);
        assert_eq!((a, b, c), (0, 1, 2));

        let pa = r.info(a).unwrap();
        assert_eq!(pa.shape, vec![5, 2]);
        assert_eq!((pa.numel, pa.padded_numel, pa.shard_numel), (10, 12, 4));
        assert_eq!(pa.dtype, "float32");
        assert!(!pa.persistent && pa.requires_grad);
        assert_eq!(state(&r, a), (Status::Partitioned, false, 0));

        let pb = r.info(b).unwrap();
        assert_eq!((pb.numel, pb.padded_numel, pb.shard_numel), (1, 3, 1));
        assert!(pb.persistent && !pb.requires_grad);

        let pc = r.info(c).unwrap();
        assert_eq!((pc.numel, pc.padded_numel, pc.shard_numel), (0, 0, 0));

        assert_eq!(r.len(), 3);
        assert_eq!(r.ids().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(r.total_numel(), 11);
        assert_eq!(r.total_shard_numel(), 5);
        assert!(r.contains(1) && !r.contains(3));
    }

    #[test]
    fn shards_are_whole_rows_as_torch_chunk_cuts_them() {
        let mut r = reg(4);
        let a = add(&mut r, &[7, 3], false);
        let b = add(&mut r, &[2, 5], false);
        let scalar = add(&mut r, &[], false);
        let pa = r.info(a).unwrap();
        assert_eq!((pa.shard_rows, pa.shard_numel, pa.padded_numel), (2, 6, 24));
        let rows = |id| {
            (0..4)
                .map(|k| r.local_rows(id, k).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(rows(a), vec![2, 2, 2, 1]);
        // fewer rows than ranks: the last ranks hold none, only padding
        assert_eq!(rows(b), vec![1, 1, 0, 0]);
        assert_eq!(r.info(b).unwrap().padded_numel, 20);
        assert!(r.local_rows(a, 4).is_err());
        assert_eq!(rows(scalar), vec![1, 1, 1, 1]);
    }

    #[test]
    fn register_with_id_and_next_id() {
        let mut r = reg(2);
        r.register_with_id(7, vec![3], "float32".into(), false, true)
            .unwrap();
        assert_eq!(add(&mut r, &[1], false), 8);
        assert_eq!(
            r.register_with_id(7, vec![3], "float32".into(), false, true),
            Err(Error::AlreadyRegistered(7))
        );
    }

    #[test]
    fn oversized_shape_is_an_error() {
        let mut r = reg(1);
        let err = r
            .register(vec![usize::MAX, 2], "float32".into(), false, true)
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(_)));
        assert!(r.is_empty());
    }

    #[test]
    fn gather_wait_release_cycle() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], false);
        assert!(r.start_gather(a).unwrap());
        assert_eq!(state(&r, a), (Status::InFlight, true, 1));
        r.finish_gather(a).unwrap();
        assert_eq!(state(&r, a), (Status::Available, true, 1));
        r.finish_gather(a).unwrap();
        assert_eq!(state(&r, a), (Status::Available, true, 1));
        assert!(r.release(a).unwrap());
        assert_eq!(state(&r, a), (Status::Partitioned, false, 0));
    }

    #[test]
    fn overlapping_gathers_share_one_collective() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], false);
        assert!(r.start_gather(a).unwrap());
        assert!(!r.start_gather(a).unwrap(), "reuse the in-flight copy");
        r.finish_gather(a).unwrap();
        assert!(!r.start_gather(a).unwrap(), "reuse the available copy");
        assert_eq!(state(&r, a), (Status::Available, true, 3));
        assert!(!r.release(a).unwrap());
        assert!(!r.release(a).unwrap());
        assert!(r.release(a).unwrap());
        assert_eq!(state(&r, a), (Status::Partitioned, false, 0));
    }

    #[test]
    fn persistent_params_stay_available() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], true);
        assert!(r.start_gather(a).unwrap());
        r.finish_gather(a).unwrap();
        assert!(!r.release(a).unwrap());
        assert_eq!(state(&r, a), (Status::Available, true, 0));
        assert!(!r.start_gather(a).unwrap());
        assert_eq!(state(&r, a), (Status::Available, true, 1));
    }

    #[test]
    fn invalidate_unheld_persistent_partitions_it() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], true);
        r.start_gather(a).unwrap();
        r.finish_gather(a).unwrap();
        r.release(a).unwrap();
        r.invalidate(a).unwrap();
        assert_eq!(state(&r, a), (Status::Partitioned, false, 0));
        assert!(r.start_gather(a).unwrap());
    }

    #[test]
    fn invalidate_held_copy_regathers_and_frees_on_release() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], true);
        r.start_gather(a).unwrap();
        r.finish_gather(a).unwrap();
        r.invalidate(a).unwrap();
        assert_eq!(state(&r, a), (Status::Available, false, 1));
        assert!(
            r.start_gather(a).unwrap(),
            "stale copy must be gathered again"
        );
        assert_eq!(state(&r, a), (Status::InFlight, true, 2));
        r.finish_gather(a).unwrap();
        r.invalidate(a).unwrap();
        assert!(!r.release(a).unwrap());
        assert!(r.release(a).unwrap(), "stale persistent copy is freed");
        assert_eq!(state(&r, a), (Status::Partitioned, false, 0));
    }

    #[test]
    fn invalidate_all_touches_every_param() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], true);
        let b = add(&mut r, &[4], true);
        for id in [a, b] {
            r.start_gather(id).unwrap();
            r.finish_gather(id).unwrap();
        }
        r.release(a).unwrap();
        r.invalidate_all();
        assert_eq!(state(&r, a), (Status::Partitioned, false, 0));
        assert_eq!(state(&r, b), (Status::Available, false, 1));
    }

    #[test]
    fn release_without_gather_is_an_error() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], false);
        assert_eq!(r.release(a), Err(Error::ReleaseWithoutGather(a)));
        r.start_gather(a).unwrap();
        r.release(a).unwrap();
        assert_eq!(r.release(a), Err(Error::ReleaseWithoutGather(a)));
    }

    #[test]
    fn wait_without_gather_is_an_error() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], false);
        assert_eq!(r.finish_gather(a), Err(Error::WaitWithoutGather(a)));
    }

    #[test]
    fn unknown_ids_are_errors() {
        let mut r = reg(2);
        let e = Err(Error::UnknownParam(9));
        assert_eq!(r.info(9).map(|_| ()), e);
        assert_eq!(r.start_gather(9).map(|_| ()), e);
        assert_eq!(r.finish_gather(9), e);
        assert_eq!(r.release(9).map(|_| ()), e);
        assert_eq!(r.invalidate(9), e);
        assert_eq!(r.set_uses(0, 9, 1), e);
        assert_eq!(r.uses(0, 9).map(|_| ()), e);
    }

    #[test]
    fn use_counts_per_graph() {
        let mut r = reg(2);
        let a = add(&mut r, &[4], false);
        let b = add(&mut r, &[4], false);
        assert_eq!(r.uses(0, a), Ok(0));
        r.set_uses(0, a, 2).unwrap();
        r.set_uses(3, a, 1).unwrap();
        r.set_uses(3, b, 5).unwrap();
        assert_eq!(r.uses(0, a), Ok(2));
        assert_eq!(r.uses(3, b), Ok(5));
        assert_eq!(r.uses(0, b), Ok(0));
        assert_eq!(r.graph_ids(), vec![0, 3]);
        r.set_uses(0, a, 0).unwrap();
        assert_eq!(r.uses(0, a), Ok(0));
        assert_eq!(r.graph_ids(), vec![3]);
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let msg = Error::UnknownParam(4).to_string();
        assert!(msg.contains("ds_id 4") && msg.contains("zrs.compile"));
        let msg = Error::ReleaseWithoutGather(2).to_string();
        assert!(msg.starts_with("release of parameter 2 that was never gathered"));
        let msg = Error::WaitWithoutGather(2).to_string();
        assert!(msg.starts_with("wait on parameter 2 that was never gathered"));
        let msg = Error::AlreadyRegistered(1).to_string();
        assert!(msg.starts_with("parameter ds_id 1 is already registered"));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Start(usize),
        Finish(usize),
        Release(usize),
        Invalidate(usize),
        InvalidateAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3usize).prop_map(Op::Start),
            (0..3usize).prop_map(Op::Finish),
            (0..3usize).prop_map(Op::Release),
            (0..3usize).prop_map(Op::Invalidate),
            Just(Op::InvalidateAll),
        ]
    }

    proptest! {
        #[test]
        fn holders_never_go_negative(
            persistent in proptest::collection::vec(any::<bool>(), 3),
            ops in proptest::collection::vec(op(), 0..64),
        ) {
            let mut r = reg(4);
            for &p in &persistent {
                add(&mut r, &[7], p);
            }
            let mut holders = [0usize; 3];
            for op in ops {
                match op {
                    Op::Start(i) => {
                        r.start_gather(i).unwrap();
                        holders[i] += 1;
                    }
                    Op::Finish(i) => {
                        let partitioned = r.info(i).unwrap().status == Status::Partitioned;
                        prop_assert_eq!(r.finish_gather(i).is_err(), partitioned);
                    }
                    Op::Release(i) => match r.release(i) {
                        Ok(free) => {
                            holders[i] -= 1;
                            prop_assert!(!free || holders[i] == 0);
                            prop_assert!(persistent[i] || free == (holders[i] == 0));
                        }
                        Err(e) => {
                            prop_assert_eq!(holders[i], 0);
                            prop_assert_eq!(e, Error::ReleaseWithoutGather(i));
                        }
                    },
                    Op::Invalidate(i) => r.invalidate(i).unwrap(),
                    Op::InvalidateAll => r.invalidate_all(),
                }
                for (i, &h) in holders.iter().enumerate() {
                    let p = r.info(i).unwrap();
                    prop_assert_eq!(p.holders, h);
                    // A held parameter always has a gathered copy on its way or in place.
                    prop_assert!(h == 0 || p.status != Status::Partitioned);
                    prop_assert!(p.status != Status::Partitioned || !p.gathered_valid);
                }
            }
        }
    }
}
