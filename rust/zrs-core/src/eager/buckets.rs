//! Gradient buckets of the eager backward, planned from the order a recorded backward completed
//! its gradients: the same next fit as the compiled path's
//! [`grad_buckets`](crate::plan::grad_buckets::grad_buckets), which also tells each gradient
//! whether it closes its bucket, so that Python reduce-scatters a bucket the moment its last
//! gradient arrives and allocates it at exactly the size its members fill.

use crate::plan::grad_buckets::bucket_runs;

/// The bucket a gradient goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bucket {
    /// Per-rank elements of the whole bucket.
    pub(super) numel: u64,
    /// This gradient is the bucket's last member.
    pub(super) last: bool,
}

/// Each gradient's bucket, given the gradients' per-rank shard elements in the order the
/// backward completes them: the compiled path's runs, each member told whether it closes its run.
pub(super) fn plan(shard_numels: &[u64], capacity: u64) -> Vec<Bucket> {
    bucket_runs(shard_numels, capacity)
        .into_iter()
        .flat_map(|(members, numel)| {
            (0..members).map(move |k| Bucket {
                numel,
                last: k + 1 == members,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::grad_buckets::grad_buckets;
    use proptest::prelude::*;

    #[test]
    fn each_bucket_ends_with_a_flush() {
        let b = plan(&[4, 4, 4, 9, 1], 10);
        let sizes: Vec<u64> = b.iter().map(|b| b.numel).collect();
        let last: Vec<bool> = b.iter().map(|b| b.last).collect();
        assert_eq!(sizes, vec![8, 8, 4, 10, 10]);
        assert_eq!(last, vec![false, true, true, false, true]);
        assert_eq!(
            plan(&[30, 2], 10)[0],
            Bucket {
                numel: 30,
                last: true
            }
        );
        assert!(plan(&[], 10).is_empty());
    }

    proptest! {
        /// The sizes are the compiled path's, and a bucket's members are a run that ends at its
        /// one `last` member and adds up to its size.
        #[test]
        fn buckets_match_the_compiled_path(
            numels in prop::collection::vec(0u64..300, 0..60),
            capacity in 1u64..600,
        ) {
            let b = plan(&numels, capacity);
            let sizes: Vec<u64> = b.iter().map(|b| b.numel).collect();
            prop_assert_eq!(sizes, grad_buckets(&numels, capacity));
            let mut sum = 0u64;
            for (i, bucket) in b.iter().enumerate() {
                sum += numels[i];
                if bucket.last {
                    prop_assert_eq!(sum, bucket.numel);
                    sum = 0;
                }
            }
            prop_assert_eq!(sum, 0);
            prop_assert!(b.last().is_none_or(|b| b.last));
        }
    }
}
