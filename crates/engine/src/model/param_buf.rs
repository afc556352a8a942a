//! Where a forward or backward reads parameters.
//!
//! The model addresses a parameter by its range in the flat parameter order
//! ([`super::ParamTable`]). One rank without ZeRO-3 holds every parameter in one buffer of that
//! order ([`WholeParams`]). ZeRO-3 does not: a rank holds its shard, and gathers a unit's
//! parameters (the embedding, a layer, the head: [`Unit`]) into a window just before the unit
//! runs (Rajbhandari et al. 2020, §5.3). The model asks a [`ParamSource`] for each unit as it
//! reaches it, in the order of `ferrotron_plan::zero3::train_sequence` (training) or
//! `eval_sequence` (a forward without gradients), and reads the unit's parameters through the
//! [`ParamBuf`] it gets.

use crate::kernels::View;
pub use ferrotron_plan::zero3::Unit;
use std::ops::Range;

/// Parameters addressed by their range in the flat parameter order, as views in the memory
/// the kernels run on.
pub trait ParamBuf<S> {
    /// The parameters `r` (every range the unit being computed reads).
    fn slice(&self, r: Range<usize>) -> View<'_, S>;
}

/// Hands out the parameters of each unit as the model reaches it.
pub trait ParamSource<S> {
    /// The parameters unit `u` reads, ready.
    fn unit(&mut self, u: Unit) -> &dyn ParamBuf<S>;
}

/// Every parameter, in one buffer of the flat order.
pub struct WholeParams<'a, S>(pub View<'a, S>);

impl<'a, S> WholeParams<'a, S> {
    /// Every parameter, in host memory.
    pub fn host(params: &'a [S]) -> Self {
        WholeParams(params.into())
    }
}

impl<S> ParamBuf<S> for WholeParams<'_, S> {
    fn slice(&self, r: Range<usize>) -> View<'_, S> {
        self.0.slice(r)
    }
}

impl<S> ParamSource<S> for WholeParams<'_, S> {
    fn unit(&mut self, _: Unit) -> &dyn ParamBuf<S> {
        self
    }
}
