//! Gradient buckets of the eager backward, planned from the order a recorded backward completed
//! its gradients: the same next fit as the compiled path's
//! [`grad_buckets`](crate::plan::grad_buckets::grad_buckets). Each gradient learns its bucket's
//! size, so that Python allocates a bucket at exactly the size its members fill and
//! reduce-scatters it the moment they have.

use crate::plan::grad_buckets::bucket_runs;

/// Each gradient's bucket size (per-rank elements), given the gradients' per-rank shard elements
/// in the order the backward completes them: the compiled path's runs.
pub(super) fn plan(shard_numels: &[u64], capacity: u64) -> Vec<u64> {
    bucket_runs(shard_numels, capacity)
        .into_iter()
        .flat_map(|(members, numel)| std::iter::repeat_n(numel, members))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::grad_buckets::grad_buckets;
    use proptest::prelude::*;

    #[test]
    fn each_gradient_learns_its_runs_size() {
        assert_eq!(plan(&[4, 4, 4, 9, 1], 10), vec![8, 8, 4, 10, 10]);
        assert_eq!(plan(&[30, 2], 10), vec![30, 2]);
        assert!(plan(&[], 10).is_empty());
    }

    proptest! {
        /// The sizes are the compiled path's, and consecutive members of one size fill it
        /// exactly, so Python's "full" is the bucket's end.
        #[test]
        fn buckets_match_the_compiled_path(
            numels in prop::collection::vec(0u64..300, 0..60),
            capacity in 1u64..600,
        ) {
            let b = plan(&numels, capacity);
            prop_assert_eq!(&b, &grad_buckets(&numels, capacity));
            let mut start = 0;
            for (members, numel) in bucket_runs(&numels, capacity) {
                prop_assert!(b[start..start + members].iter().all(|&n| n == numel));
                prop_assert_eq!(numels[start..start + members].iter().sum::<u64>(), numel);
                start += members;
            }
            prop_assert_eq!(start, numels.len());
        }
    }
}
