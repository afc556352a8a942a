//! The rank grid of a layout: dp × pp × cp × ep × tp ranks, numbered with tp innermost, then
//! cp, ep, dp and pp outermost — the placement the planner prices (tensor-parallel groups on
//! the fastest links, as Megatron-LM and picotron place them). A group is every rank that
//! shares all coordinates but one.

use ferrotron_plan::Layout;

/// A dimension of the grid: the planner's, which prices the same placement.
pub use ferrotron_plan::cluster::Dim;

/// Innermost first.
const ORDER: [Dim; 5] = Dim::ALL;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grid {
    sizes: [usize; 5],
}

impl Grid {
    pub fn new(l: &Layout) -> Self {
        let s = |x: u64| x.max(1) as usize;
        Grid {
            sizes: [s(l.tp), s(l.cp), s(l.ep), s(l.dp), s(l.pp)],
        }
    }

    fn index(d: Dim) -> usize {
        ORDER
            .iter()
            .position(|&x| x == d)
            .expect("every Dim is in ORDER")
    }

    /// Ranks in the grid.
    pub fn world(&self) -> usize {
        self.sizes.iter().product()
    }

    pub fn size(&self, d: Dim) -> usize {
        self.sizes[Self::index(d)]
    }

    /// `rank`'s coordinate along `d`.
    pub fn coord(&self, rank: usize, d: Dim) -> usize {
        let i = Self::index(d);
        let stride: usize = self.sizes[..i].iter().product();
        rank / stride % self.sizes[i]
    }

    /// The ranks that share every coordinate of `rank` but those along `dims`, in rank order
    /// (expert parallelism's dense replicas: the dp × ep ranks of a tensor-parallel position).
    pub fn group_of(&self, rank: usize, dims: &[Dim]) -> Vec<usize> {
        let fixed: Vec<Dim> = ORDER.into_iter().filter(|d| !dims.contains(d)).collect();
        (0..self.world())
            .filter(|&r| {
                fixed
                    .iter()
                    .all(|&d| self.coord(r, d) == self.coord(rank, d))
            })
            .collect()
    }

    /// The ranks of `rank`'s group along `d`, in order of their coordinate along `d`.
    pub fn group(&self, rank: usize, d: Dim) -> Vec<usize> {
        let i = Self::index(d);
        let stride: usize = self.sizes[..i].iter().product();
        let base = rank - self.coord(rank, d) * stride;
        (0..self.sizes[i]).map(|c| base + c * stride).collect()
    }
}
