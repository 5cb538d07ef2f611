//! Which gathered parameters a training forward hands to its backward instead of releasing.
//!
//! The backward starts with the parameters the forward used last (the head, the last layer):
//! released at the forward's end, they would be gathered again at once, on the critical path,
//! before the backward has any compute to hide the gather behind. Keeping them is what FSDP2
//! does for its root and last block. The memory it costs is bounded by an allowance
//! ([`keep_allowance`]): what the backward may prefetch ahead anyway at its start
//! ([`PREFETCH_ALLOWANCE_GATHERS`] of the forward's largest gather), so the device holds no more
//! at the forward's end than at the backward's start; an explicit memory budget caps it at what
//! the forward's plan leaves of the budget. Only graph facts decide, so every rank keeps the same
//! parameters.

use std::collections::HashSet;

use super::graph::DsId;
use super::PREFETCH_ALLOWANCE_GATHERS;

/// Bytes a forward may keep gathered for its backward: [`PREFETCH_ALLOWANCE_GATHERS`] of its
/// largest gather, at most `budget_left` (an explicit memory budget less the forward's planned
/// peak; negative, when the plan overshot, counts as 0). `None`: no explicit budget.
pub fn keep_allowance(largest_gather_bytes: u64, budget_left: Option<i64>) -> u64 {
    let allowance = largest_gather_bytes.saturating_mul(PREFETCH_ALLOWANCE_GATHERS);
    match budget_left {
        None => allowance,
        Some(left) => allowance.min(u64::try_from(left).unwrap_or(0)),
    }
}

/// The parameters a forward keeps for its backward, given its releases in execution order as
/// (ds_id, gathered bytes), its largest gather's bytes and the budget it has left
/// ([`keep_allowance`]): [`kept_within_allowance`] of that allowance.
pub fn kept_for_backward(
    releases: &[(DsId, u64)],
    largest_gather_bytes: u64,
    budget_left: Option<i64>,
) -> Vec<DsId> {
    kept_within_allowance(releases, keep_allowance(largest_gather_bytes, budget_left))
}

/// The parameters to keep, given the forward's releases in execution order as (ds_id, gathered
/// bytes): the longest run of releases at the end of the forward whose parameters' bytes add up
/// to at most `allowance`. A parameter released more than once counts at its last release only
/// (earlier ones are gathered again later in the same forward). Returned in release order.
pub fn kept_within_allowance(releases: &[(DsId, u64)], allowance: u64) -> Vec<DsId> {
    let mut seen: HashSet<DsId> = HashSet::new();
    let mut kept = Vec::new();
    let mut total = 0u64;
    for &(id, bytes) in releases.iter().rev() {
        if !seen.insert(id) {
            continue; // an earlier release of a parameter already kept at a later one
        }
        match total.checked_add(bytes) {
            Some(t) if t <= allowance => total = t,
            _ => break, // a suffix only: the kept parameters are the forward's last ones
        }
        kept.push(id);
    }
    kept.reverse();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keeps_the_last_released_parameters_within_the_allowance() {
        // embedding, layer 0, layer 1, head: the head and layer 1 fit in 300 bytes.
        let releases = [(0, 100), (1, 80), (2, 80), (3, 200)];
        assert_eq!(kept_within_allowance(&releases, 300), vec![2, 3]);
        assert_eq!(kept_within_allowance(&releases, 199), Vec::<DsId>::new());
        assert_eq!(kept_within_allowance(&releases, 0), Vec::<DsId>::new());
        assert_eq!(kept_within_allowance(&releases, u64::MAX), vec![0, 1, 2, 3]);
    }

    #[test]
    fn the_allowance_is_two_gathers_capped_by_the_budget_left() {
        assert_eq!(PREFETCH_ALLOWANCE_GATHERS, 2);
        assert_eq!(keep_allowance(300, None), 600);
        assert_eq!(keep_allowance(0, None), 0);
        assert_eq!(keep_allowance(300, Some(100)), 100);
        assert_eq!(keep_allowance(300, Some(1000)), 600);
        assert_eq!(keep_allowance(300, Some(0)), 0);
        assert_eq!(
            keep_allowance(300, Some(-5)),
            0,
            "an overshooting plan keeps nothing"
        );
        assert_eq!(keep_allowance(u64::MAX, None), u64::MAX);
    }

    #[test]
    fn the_kept_set_is_within_the_allowance_of_the_largest_gather() {
        let releases = [(0, 100), (1, 80), (2, 80), (3, 200)];
        // Two of the largest gather (200): 400 bytes, the head and layers 1 and 0 (360).
        assert_eq!(kept_for_backward(&releases, 200, None), vec![1, 2, 3]);
        // An explicit budget with 300 bytes left: the head and layer 1.
        assert_eq!(kept_for_backward(&releases, 200, Some(300)), vec![2, 3]);
        // A plan over its budget keeps nothing.
        assert_eq!(
            kept_for_backward(&releases, 200, Some(-1)),
            Vec::<DsId>::new()
        );
        assert_eq!(kept_for_backward(&[], 0, None), Vec::<DsId>::new());
    }

    #[test]
    fn a_parameter_released_twice_counts_once_at_its_last_release() {
        // A tied weight gathered for the embedding and again for the head.
        let releases = [(0, 100), (1, 80), (0, 100)];
        assert_eq!(kept_within_allowance(&releases, 180), vec![1, 0]);
        assert_eq!(kept_within_allowance(&releases, 100), vec![0]);
    }

    proptest! {
        /// The result is the longest suffix of distinct last releases that fits the allowance.
        #[test]
        fn the_kept_set_is_the_longest_fitting_suffix(
            releases in prop::collection::vec((0u64..12, 0u64..1000), 0..40),
            allowance in 0u64..4000,
        ) {
            let kept = kept_within_allowance(&releases, allowance);
            let bytes_of = |id: DsId| releases.iter().rev().find(|r| r.0 == id).unwrap().1;
            let total: u64 = kept.iter().map(|&id| bytes_of(id)).sum();
            prop_assert!(total <= allowance);
            // Distinct, in the order of their last releases, and a suffix of that order.
            let mut last_order: Vec<DsId> = Vec::new();
            for &(id, _) in releases.iter().rev() {
                if !last_order.contains(&id) {
                    last_order.push(id);
                }
            }
            last_order.reverse();
            let n = kept.len();
            prop_assert_eq!(&kept[..], &last_order[last_order.len() - n..]);
            // Maximal: the next parameter back does not fit.
            if n < last_order.len() {
                let next = last_order[last_order.len() - n - 1];
                prop_assert!(total + bytes_of(next) > allowance);
            }
        }
    }
}
