//! Gradient buckets of a backward graph: which consecutive gradients share one reduce-scatter.
//!
//! The runtime packs each gradient's shards rank-major into its bucket, `(world, capacity)`, so
//! that one reduce-scatter leaves every rank its shards side by side. A bucket must be full when
//! it is reduced: rows of a partly filled one are strided and the collective needs them packed,
//! which costs a copy of the whole bucket (22.7 ms per step at 7b on 4×H200, more than the packing
//! itself). Planned from the graph, each bucket is allocated at exactly the size its members fill.

/// The per-rank elements of the bucket each gradient goes to, given the gradients' per-rank
/// shard elements in the order the backward produces them: consecutive gradients fill a bucket
/// while their sum stays within `capacity` (next fit: the order is the graph's, and a bucket
/// reduces as soon as it is full). A gradient larger than `capacity` gets a bucket of its own.
pub fn grad_buckets(numels: &[u64], capacity: u64) -> Vec<u64> {
    bucket_runs(numels, capacity)
        .into_iter()
        .flat_map(|(members, total)| std::iter::repeat_n(total, members))
        .collect()
}

/// The buckets of [`grad_buckets`] as runs: (gradients in the bucket, its per-rank elements), in
/// order; the eager path also needs to know which gradient closes each bucket.
pub fn bucket_runs(numels: &[u64], capacity: u64) -> Vec<(usize, u64)> {
    let mut runs = Vec::new();
    let mut start = 0;
    let mut total = 0u64;
    for (i, &n) in numels.iter().enumerate() {
        if i > start && total.saturating_add(n) > capacity {
            runs.push((i - start, total));
            start = i;
            total = 0;
        }
        total = total.saturating_add(n);
    }
    if start < numels.len() {
        runs.push((numels.len() - start, total));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn consecutive_gradients_share_a_bucket_up_to_its_capacity() {
        assert_eq!(grad_buckets(&[4, 4, 4, 9, 1], 10), vec![8, 8, 4, 10, 10]);
        assert_eq!(grad_buckets(&[30, 2], 10), vec![30, 2]); // too large: alone
        assert_eq!(grad_buckets(&[2, 30, 2], 10), vec![2, 30, 2]);
        assert_eq!(grad_buckets(&[], 10), Vec::<u64>::new());
        assert_eq!(grad_buckets(&[0, 5, 0], 5), vec![5, 5, 5]);
    }

    proptest! {
        /// Buckets are runs of consecutive gradients whose recorded size is their sum, within
        /// the capacity unless a single gradient exceeds it, and next fit: the gradient after a
        /// bucket would not have fit into it.
        #[test]
        fn buckets_are_maximal_runs_that_fit(
            numels in prop::collection::vec(0u64..300, 0..60),
            capacity in 1u64..600,
        ) {
            let sizes = grad_buckets(&numels, capacity);
            prop_assert_eq!(sizes.len(), numels.len());
            let mut i = 0;
            while i < numels.len() {
                let (mut j, mut sum) = (i, 0u64);
                while j < numels.len() && sum < sizes[i] || j == i {
                    sum += numels[j];
                    j += 1;
                }
                // Zero-sized gradients at the run's end join it too.
                while j < numels.len() && numels[j] == 0 && sizes[j] == sizes[i] {
                    j += 1;
                }
                prop_assert_eq!(sum, sizes[i]);
                prop_assert!(sizes[i..j].iter().all(|&s| s == sizes[i]));
                prop_assert!(sum <= capacity || j - i == 1);
                if j < numels.len() {
                    prop_assert!(sum + numels[j] > capacity);
                }
                i = j;
            }
        }
    }
}
