//! The parameter registry: what zrs knows about every sharded parameter of one model, keyed by
//! its *slot* (the parameter's place in this registry, 0, 1, 2, ...; not the process-wide ds_id
//! that the compiled graph's ops carry).
//!
//! Python owns the tensors; the registry owns sizes and the gather life cycle
//! (partitioned -> in flight -> available -> partitioned). Gathers are refcounted because two
//! nodes of a graph can gather the same parameter with overlapping lifetimes, and the buffer may
//! only be freed when the last of them releases it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A parameter's place in one [`Registry`].
pub type Slot = usize;

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
    pub slot: Slot,
    pub shape: Vec<usize>,
    pub numel: usize,
    /// Rows (of dim 0) each rank holds: `ceil(shape[0] / world)`, the chunks of `torch.chunk`
    /// and of a DTensor's `Shard(0)`. A 0-d parameter counts as one row.
    pub shard_rows: usize,
    /// `shard_rows` rows of every rank together, so every rank holds an equal (padded) shard;
    /// the padding is at the end, past the last rank's real rows.
    pub padded_numel: usize,
    pub shard_numel: usize,
    pub dtype: String,
    pub requires_grad: bool,
    pub status: Status,
    /// Gathers started and not yet released.
    pub holders: usize,
}

#[derive(Debug, Clone)]
pub struct Registry {
    world_size: usize,
    params: BTreeMap<Slot, ParamInfo>,
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

    /// Registers a parameter under the next slot (one past the largest registered) and returns it.
    pub fn register(
        &mut self,
        shape: Vec<usize>,
        dtype: String,
        requires_grad: bool,
    ) -> Result<Slot> {
        let slot = self.params.last_key_value().map_or(0, |(&s, _)| s + 1);
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
            slot,
            numel,
            shard_rows,
            padded_numel,
            shard_numel,
            shape,
            dtype,
            requires_grad,
            status: Status::Partitioned,
            holders: 0,
        };
        self.params.insert(slot, info);
        Ok(slot)
    }

    /// Rows of `slot` that `rank` really holds: `shard_rows`, fewer on the last ranks when the
    /// rows do not divide evenly (none past the end). A 0-d parameter is replicated: every rank
    /// holds its one element.
    pub fn local_rows(&self, slot: Slot, rank: usize) -> Result<usize> {
        if rank >= self.world_size {
            return Err(Error::Invalid(format!(
                "rank {rank} is outside a world of {}",
                self.world_size
            )));
        }
        let p = self.info(slot)?;
        let Some(&rows) = p.shape.first() else {
            return Ok(1);
        };
        Ok(rows.saturating_sub(rank * p.shard_rows).min(p.shard_rows))
    }

    pub fn info(&self, slot: Slot) -> Result<&ParamInfo> {
        self.params.get(&slot).ok_or(Error::UnknownSlot(slot))
    }

    fn info_mut(&mut self, slot: Slot) -> Result<&mut ParamInfo> {
        self.params.get_mut(&slot).ok_or(Error::UnknownSlot(slot))
    }

    /// Takes a hold on the gathered copy. Returns true when the caller must issue an all-gather;
    /// false when a copy is already in flight or available and can be reused.
    pub fn start_gather(&mut self, slot: Slot) -> Result<bool> {
        let p = self.info_mut(slot)?;
        p.holders += 1;
        let issue = p.status == Status::Partitioned;
        if issue {
            p.status = Status::InFlight;
        }
        Ok(issue)
    }

    /// Marks the all-gather as complete. Waiting twice on the same gather is harmless.
    pub fn finish_gather(&mut self, slot: Slot) -> Result<()> {
        let p = self.info_mut(slot)?;
        match p.status {
            Status::Partitioned => Err(Error::WaitWithoutGather(slot)),
            Status::InFlight | Status::Available => {
                p.status = Status::Available;
                Ok(())
            }
        }
    }

    /// Drops a hold. Returns true when the caller must free the gathered buffer now: the last
    /// holder is gone.
    pub fn release(&mut self, slot: Slot) -> Result<bool> {
        let p = self.info_mut(slot)?;
        if p.holders == 0 {
            return Err(Error::ReleaseWithoutGather(slot));
        }
        p.holders -= 1;
        let free = p.holders == 0;
        if free {
            p.status = Status::Partitioned;
        }
        Ok(free)
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
        }
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reg(world_size: usize) -> Registry {
        Registry::new(world_size).unwrap()
    }

    fn add(r: &mut Registry, shape: &[usize]) -> Slot {
        r.register(shape.to_vec(), "float32".into(), true).unwrap()
    }

    fn state(r: &Registry, slot: Slot) -> (Status, usize) {
        let p = r.info(slot).unwrap();
        (p.status, p.holders)
    }

    #[test]
    fn zero_world_size_is_an_error() {
        assert_eq!(Registry::new(0).unwrap_err(), Error::InvalidWorldSize(0));
    }

    #[test]
    fn dropping_all_gathers_forgets_holds_and_copies() {
        let mut r = reg(2);
        let (a, b, c) = (add(&mut r, &[4]), add(&mut r, &[4]), add(&mut r, &[4]));
        assert!(r.start_gather(a).unwrap());
        assert!(r.start_gather(b).unwrap());
        r.finish_gather(b).unwrap();
        assert_eq!(r.drop_all_gathers(), 2);
        for slot in [a, b, c] {
            assert_eq!(state(&r, slot), (Status::Partitioned, 0));
        }
        assert!(r.start_gather(a).unwrap()); // a fresh gather, not a reuse
        assert_eq!(r.drop_all_gathers(), 1);
        assert_eq!(r.drop_all_gathers(), 0);
    }

    #[test]
    fn register_assigns_sequential_slots_and_sizes() {
        let mut r = reg(3);
        let a = add(&mut r, &[5, 2]);
        let b = r.register(vec![], "bfloat16".into(), false).unwrap();
        let c = add(&mut r, &[4, 0]);
        assert_eq!((a, b, c), (0, 1, 2));

        let pa = r.info(a).unwrap();
        assert_eq!(pa.slot, a);
        assert_eq!(pa.shape, vec![5, 2]);
        assert_eq!((pa.numel, pa.padded_numel, pa.shard_numel), (10, 12, 4));
        assert_eq!(pa.dtype, "float32");
        assert!(pa.requires_grad);
        assert_eq!(state(&r, a), (Status::Partitioned, 0));

        let pb = r.info(b).unwrap();
        assert_eq!((pb.numel, pb.padded_numel, pb.shard_numel), (1, 3, 1));
        assert!(!pb.requires_grad);

        let pc = r.info(c).unwrap();
        assert_eq!((pc.numel, pc.padded_numel, pc.shard_numel), (0, 0, 0));
        assert_eq!(r.info(3), Err(Error::UnknownSlot(3)));
    }

    #[test]
    fn shards_are_whole_rows_as_torch_chunk_cuts_them() {
        let mut r = reg(4);
        let a = add(&mut r, &[7, 3]);
        let b = add(&mut r, &[2, 5]);
        let scalar = add(&mut r, &[]);
        let pa = r.info(a).unwrap();
        assert_eq!((pa.shard_rows, pa.shard_numel, pa.padded_numel), (2, 6, 24));
        let rows = |slot| {
            (0..4)
                .map(|k| r.local_rows(slot, k).unwrap())
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
    fn oversized_shape_is_an_error() {
        let mut r = reg(1);
        let err = r
            .register(vec![usize::MAX, 2], "float32".into(), true)
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(_)));
        assert_eq!(add(&mut r, &[1]), 0, "nothing was registered");
    }

    #[test]
    fn gather_wait_release_cycle() {
        let mut r = reg(2);
        let a = add(&mut r, &[4]);
        assert!(r.start_gather(a).unwrap());
        assert_eq!(state(&r, a), (Status::InFlight, 1));
        r.finish_gather(a).unwrap();
        assert_eq!(state(&r, a), (Status::Available, 1));
        r.finish_gather(a).unwrap();
        assert_eq!(state(&r, a), (Status::Available, 1));
        assert!(r.release(a).unwrap());
        assert_eq!(state(&r, a), (Status::Partitioned, 0));
    }

    #[test]
    fn overlapping_gathers_share_one_collective() {
        let mut r = reg(2);
        let a = add(&mut r, &[4]);
        assert!(r.start_gather(a).unwrap());
        assert!(!r.start_gather(a).unwrap(), "reuse the in-flight copy");
        r.finish_gather(a).unwrap();
        assert!(!r.start_gather(a).unwrap(), "reuse the available copy");
        assert_eq!(state(&r, a), (Status::Available, 3));
        assert!(!r.release(a).unwrap());
        assert!(!r.release(a).unwrap());
        assert!(r.release(a).unwrap());
        assert_eq!(state(&r, a), (Status::Partitioned, 0));
    }

    #[test]
    fn release_without_gather_is_an_error() {
        let mut r = reg(2);
        let a = add(&mut r, &[4]);
        assert_eq!(r.release(a), Err(Error::ReleaseWithoutGather(a)));
        r.start_gather(a).unwrap();
        r.release(a).unwrap();
        assert_eq!(r.release(a), Err(Error::ReleaseWithoutGather(a)));
    }

    #[test]
    fn wait_without_gather_is_an_error() {
        let mut r = reg(2);
        let a = add(&mut r, &[4]);
        assert_eq!(r.finish_gather(a), Err(Error::WaitWithoutGather(a)));
    }

    #[test]
    fn unknown_slots_are_errors() {
        let mut r = reg(2);
        let e = Err(Error::UnknownSlot(9));
        assert_eq!(r.info(9).map(|_| ()), e);
        assert_eq!(r.local_rows(9, 0).map(|_| ()), e);
        assert_eq!(r.start_gather(9).map(|_| ()), e);
        assert_eq!(r.finish_gather(9), e);
        assert_eq!(r.release(9).map(|_| ()), e);
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let msg = Error::UnknownSlot(4).to_string();
        assert!(msg.contains("parameter slot 4") && msg.contains("zrs.compile"));
        let msg = Error::ReleaseWithoutGather(2).to_string();
        assert!(msg.starts_with("release of parameter slot 2 that was never gathered"));
        let msg = Error::WaitWithoutGather(2).to_string();
        assert!(msg.starts_with("wait on parameter slot 2 that was never gathered"));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Start(usize),
        Finish(usize),
        Release(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3usize).prop_map(Op::Start),
            (0..3usize).prop_map(Op::Finish),
            (0..3usize).prop_map(Op::Release),
        ]
    }

    proptest! {
        #[test]
        fn holders_never_go_negative(ops in proptest::collection::vec(op(), 0..64)) {
            let mut r = reg(4);
            for _ in 0..3 {
                add(&mut r, &[7]);
            }
            let mut holders = [0usize; 3];
            for op in ops {
                match op {
                    Op::Start(i) => {
                        let issue = r.start_gather(i).unwrap();
                        prop_assert_eq!(issue, holders[i] == 0);
                        holders[i] += 1;
                    }
                    Op::Finish(i) => {
                        let partitioned = r.info(i).unwrap().status == Status::Partitioned;
                        prop_assert_eq!(r.finish_gather(i).is_err(), partitioned);
                    }
                    Op::Release(i) => match r.release(i) {
                        Ok(free) => {
                            holders[i] -= 1;
                            prop_assert_eq!(free, holders[i] == 0);
                        }
                        Err(e) => {
                            prop_assert_eq!(holders[i], 0);
                            prop_assert_eq!(e, Error::ReleaseWithoutGather(i));
                        }
                    },
                }
                for (i, &h) in holders.iter().enumerate() {
                    let p = r.info(i).unwrap();
                    prop_assert_eq!(p.holders, h);
                    // Held if and only if a gathered copy is on its way or in place.
                    prop_assert_eq!(h == 0, p.status == Status::Partitioned);
                }
            }
        }
    }
}
