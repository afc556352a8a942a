//! Where a backward writes parameter gradients.
//!
//! The model addresses a gradient by its parameter's range in the flat parameter order
//! ([`super::ParamTable`]). One rank without ZeRO holds every gradient in one buffer of that
//! order ([`Whole`], or a `Vec`). ZeRO-2 does not: a rank holds its shard of the reduced
//! gradients and, while a unit's backward runs, only that unit's full gradients, in a window it
//! reuses for the next unit (Rajbhandari et al. 2020, §5.2: gradients are reduced and released
//! as soon as they are complete; the trainer's `zero2::UnitGrads`).

use std::ops::{Index, IndexMut, Range};

/// Parameter gradients addressed by their range in the flat parameter order.
pub trait GradBuf<G> {
    /// The gradients of parameters `r`.
    fn slice(&self, r: Range<usize>) -> &[G];
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G];
    /// Two disjoint ranges at once (a weight's gradient and its bias's).
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]);
}

impl<G> Index<Range<usize>> for dyn GradBuf<G> + '_ {
    type Output = [G];
    fn index(&self, r: Range<usize>) -> &[G] {
        self.slice(r)
    }
}

impl<G> IndexMut<Range<usize>> for dyn GradBuf<G> + '_ {
    fn index_mut(&mut self, r: Range<usize>) -> &mut [G] {
        self.slice_mut(r)
    }
}

/// Mutable views of two disjoint ranges of one buffer.
pub fn two_mut<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&mut [T], &mut [T]) {
    assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&mut hi[..a.end - a.start], &mut lo[b])
    }
}

/// Every gradient, in one buffer of the flat order.
pub struct Whole<'a, G>(pub &'a mut [G]);

impl<G> GradBuf<G> for Whole<'_, G> {
    fn slice(&self, r: Range<usize>) -> &[G] {
        &self.0[r]
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G] {
        &mut self.0[r]
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]) {
        two_mut(self.0, a, b)
    }
}

impl<G> GradBuf<G> for Vec<G> {
    fn slice(&self, r: Range<usize>) -> &[G] {
        &self[r]
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G] {
        &mut self[r]
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]) {
        two_mut(self, a, b)
    }
}
