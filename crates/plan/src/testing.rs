//! A small planner input the tests of the plan's layouts and of the trainer's regions and
//! arena share: ferrotron-12m at seq 32, micro-batch 2, two micro-batches, bf16 AdamW, no
//! recompute, the ferrotron runtime without overhead, 64 KiB buckets. A test changes the one
//! field it is about (`PlanInput { runtime, ..small_input(layout) }`).

use crate::hardware::Overhead;
use crate::{
    Convention, Layout, ModelSource, Optimizer, PlanInput, Precision, Recipe, Recompute, Runtime,
};

/// The model of [`small_input`].
pub const SMALL_MODEL: &str = "ferrotron-12m";

/// The shared small input for `layout`.
pub fn small_input(layout: Layout) -> PlanInput {
    let spec = crate::presets::resolve(SMALL_MODEL).expect("a bundled preset");
    PlanInput {
        model: ModelSource::Spec(spec),
        recipe: Recipe {
            seq: 32,
            mbs: 2,
            grad_acc: 2,
            precision: Precision::Bf16,
            optimizer: Optimizer::Adamw,
            recompute: Recompute::None,
            ce_chunk_tokens: 16,
            capacity_factor: None,
        },
        layout,
        convention: Convention::Ferrotron,
        runtime: Runtime::Ferrotron,
        overhead: Overhead::NONE,
        bucket_bytes: 1 << 16,
    }
}
