// Shared by the planner's integration tests.
#![allow(dead_code)]

use ferrotron_plan::hardware::Overhead;
use ferrotron_plan::presets::preset;
use ferrotron_plan::*;

pub fn input(model: &str, recipe: Recipe, layout: Layout, convention: Convention) -> PlanInput {
    PlanInput {
        model: ModelSource::Spec(preset(model).unwrap()),
        recipe,
        layout,
        convention,
        runtime: Runtime::of(convention),
        overhead: Overhead::NONE,
        bucket_bytes: 25 << 20,
    }
}
