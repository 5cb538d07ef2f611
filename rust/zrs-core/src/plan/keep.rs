//! Which gathered parameters a training forward hands to its backward instead of releasing.
//!
//! The backward starts with the parameters the forward used last (the head, the last layer):
//! released at the forward's end, they would be gathered again at once, on the critical path,
//! before the backward has any compute to hide the gather behind. Keeping them is what FSDP2
//! does for its root and last block. The memory it costs is bounded by an allowance: the caller
//! passes the bytes its backward may prefetch ahead anyway (`PREFETCH_ALLOWANCE_GATHERS` of the
//! largest gather), so the device holds no more at the forward's end than at the backward's start.

use std::collections::HashSet;

use crate::registry::ParamId;

/// The parameters to keep, given the forward's releases in execution order as (ds_id, gathered
/// bytes): the longest run of releases at the end of the forward whose parameters' bytes add up
/// to at most `allowance`. A parameter released more than once counts at its last release only
/// (earlier ones are gathered again later in the same forward). Returned in release order.
pub fn kept_for_backward(releases: &[(ParamId, u64)], allowance: u64) -> Vec<ParamId> {
    let mut seen: HashSet<ParamId> = HashSet::new();
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
        assert_eq!(kept_for_backward(&releases, 300), vec![2, 3]);
        assert_eq!(kept_for_backward(&releases, 199), Vec::<ParamId>::new());
        assert_eq!(kept_for_backward(&releases, 0), Vec::<ParamId>::new());
        assert_eq!(kept_for_backward(&releases, u64::MAX), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_parameter_released_twice_counts_once_at_its_last_release() {
        // A tied weight gathered for the embedding and again for the head.
        let releases = [(0, 100), (1, 80), (0, 100)];
        assert_eq!(kept_for_backward(&releases, 180), vec![1, 0]);
        assert_eq!(kept_for_backward(&releases, 100), vec![0]);
    }

    proptest! {
        /// The result is the longest suffix of distinct last releases that fits the allowance.
        #[test]
        fn the_kept_set_is_the_longest_fitting_suffix(
            releases in prop::collection::vec((0usize..12, 0u64..1000), 0..40),
            allowance in 0u64..4000,
        ) {
            let kept = kept_for_backward(&releases, allowance);
            let bytes_of = |id: ParamId| releases.iter().rev().find(|r| r.0 == id).unwrap().1;
            let total: u64 = kept.iter().map(|&id| bytes_of(id)).sum();
            prop_assert!(total <= allowance);
            // Distinct, in the order of their last releases, and a suffix of that order.
            let mut last_order: Vec<ParamId> = Vec::new();
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
