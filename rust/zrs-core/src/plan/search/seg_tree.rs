//! A range-add / range-max segment tree over the base sequence's slots: the memory per slot that
//! the list scheduler checks and raises as it issues gathers early. Separate because it is a
//! plain data structure that knows nothing of graphs.

/// Range add / range max over slots.
#[derive(Clone, Debug)]
pub struct SegTree {
    n: usize,
    mx: Vec<i64>,
    lz: Vec<i64>,
}

impl SegTree {
    pub fn new(vals: &[i64]) -> Self {
        let n = vals.len().max(1);
        let mut t = SegTree {
            n,
            mx: vec![i64::MIN / 4; 4 * n],
            lz: vec![0; 4 * n],
        };
        t.build(1, 0, n, vals);
        t
    }

    fn build(&mut self, x: usize, l: usize, r: usize, vals: &[i64]) {
        if r - l == 1 {
            self.mx[x] = vals.get(l).copied().unwrap_or(i64::MIN / 4);
            return;
        }
        let m = (l + r) / 2;
        self.build(2 * x, l, m, vals);
        self.build(2 * x + 1, m, r, vals);
        self.mx[x] = self.mx[2 * x].max(self.mx[2 * x + 1]);
    }

    /// Add `v` to slots `[l, r)`.
    pub fn add(&mut self, l: usize, r: usize, v: i64) {
        if l < r {
            self.add_rec(1, 0, self.n, l, r, v);
        }
    }

    fn add_rec(&mut self, x: usize, xl: usize, xr: usize, l: usize, r: usize, v: i64) {
        if r <= xl || xr <= l {
            return;
        }
        if l <= xl && xr <= r {
            self.mx[x] += v;
            self.lz[x] += v;
            return;
        }
        let m = (xl + xr) / 2;
        self.add_rec(2 * x, xl, m, l, r, v);
        self.add_rec(2 * x + 1, m, xr, l, r, v);
        self.mx[x] = self.mx[2 * x].max(self.mx[2 * x + 1]) + self.lz[x];
    }

    /// Max over slots `[l, r)` (`i64::MIN/4` when empty).
    pub fn max(&self, l: usize, r: usize) -> i64 {
        if l >= r {
            return i64::MIN / 4;
        }
        self.max_rec(1, 0, self.n, l, r)
    }

    fn max_rec(&self, x: usize, xl: usize, xr: usize, l: usize, r: usize) -> i64 {
        if r <= xl || xr <= l {
            return i64::MIN / 4;
        }
        if l <= xl && xr <= r {
            return self.mx[x];
        }
        let m = (xl + xr) / 2;
        self.max_rec(2 * x, xl, m, l, r)
            .max(self.max_rec(2 * x + 1, m, xr, l, r))
            + self.lz[x]
    }
}
