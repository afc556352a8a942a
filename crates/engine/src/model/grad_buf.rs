//! Where a backward writes parameter gradients.
//!
//! The model addresses a gradient by its parameter's range in the flat parameter order
//! ([`super::ParamTable`]). One rank without ZeRO holds every gradient in one buffer of that
//! order ([`Whole`], or a `Vec`). ZeRO-2 does not: a rank holds its shard of the reduced
//! gradients and, while a unit's backward runs, only that unit's full gradients, in a window it
//! reuses for the next unit (Rajbhandari et al. 2020, §5.2: gradients are reduced and released
//! as soon as they are complete; the trainer's `zero2::UnitGrads`).

use crate::kernels::{AsView, AsViewMut, View, ViewMut};
use std::ops::Range;

/// Parameter gradients addressed by their range in the flat parameter order, as views in the
/// memory the kernels run on.
pub trait GradBuf<G> {
    /// The gradients of parameters `r`.
    fn slice(&self, r: Range<usize>) -> View<'_, G>;
    fn slice_mut(&mut self, r: Range<usize>) -> ViewMut<'_, G>;
    /// Two disjoint ranges at once (a weight's gradient and its bias's).
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (ViewMut<'_, G>, ViewMut<'_, G>);
}

/// Writable views of two disjoint ranges of one buffer.
pub fn two_mut<T>(
    buf: ViewMut<'_, T>,
    a: Range<usize>,
    b: Range<usize>,
) -> (ViewMut<'_, T>, ViewMut<'_, T>) {
    assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (lo.slice_mut(a), hi.slice_mut(..b.end - b.start))
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (hi.slice_mut(..a.end - a.start), lo.slice_mut(b))
    }
}

/// Every gradient, in one buffer of the flat order.
pub struct Whole<'a, G>(pub ViewMut<'a, G>);

impl<'a, G> Whole<'a, G> {
    /// Every gradient, in host memory.
    pub fn host(grads: &'a mut [G]) -> Self {
        Whole(grads.into())
    }
}

impl<G> GradBuf<G> for Whole<'_, G> {
    fn slice(&self, r: Range<usize>) -> View<'_, G> {
        self.0.as_view().slice(r)
    }
    fn slice_mut(&mut self, r: Range<usize>) -> ViewMut<'_, G> {
        self.0.rb().slice_mut(r)
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (ViewMut<'_, G>, ViewMut<'_, G>) {
        two_mut(self.0.rb(), a, b)
    }
}

impl<G> GradBuf<G> for Vec<G> {
    fn slice(&self, r: Range<usize>) -> View<'_, G> {
        self.view().slice(r)
    }
    fn slice_mut(&mut self, r: Range<usize>) -> ViewMut<'_, G> {
        self.view_mut().slice_mut(r)
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (ViewMut<'_, G>, ViewMut<'_, G>) {
        two_mut(self.view_mut(), a, b)
    }
}
