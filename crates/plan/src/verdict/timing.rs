//! The speed cost of an option, from the same step-time model as the report's "Step time"
//! section (`time/`). Available only with an architecture and a cluster; without them the
//! verdict states each option's cost in words.

use crate::cluster::Cluster;
use crate::flops::FlopsConvention;
use crate::planner::PlanInput;
use crate::time::{estimate, TimeReport};

/// Where the options can be timed: the cluster (GPU kind, links) and the FLOPs convention.
#[derive(Debug, Clone, Copy)]
pub struct Timing<'a> {
    pub cluster: &'a Cluster,
    pub flops: FlopsConvention,
}

/// An option's predicted step time, against the current configuration's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Speed {
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Time per token relative to the current configuration, minus one: +0.25 is 25% slower.
    /// Per token rather than per step, so that an option that changes the global batch is
    /// compared fairly.
    pub slowdown: f64,
}

/// Times options against a baseline (the configuration as given, as if it fitted).
pub(super) struct Clock<'a> {
    timing: Timing<'a>,
    base: TimeReport,
}

impl<'a> Clock<'a> {
    /// `None` when the step-time model cannot run (no architecture, or an invalid input).
    pub(super) fn new(x: &PlanInput, timing: Timing<'a>) -> Option<Self> {
        let base = estimate(x, timing.cluster, timing.flops).ok().flatten()?;
        Some(Clock { timing, base })
    }

    pub(super) fn speed(&self, y: &PlanInput) -> Option<Speed> {
        let t = estimate(y, self.timing.cluster, self.timing.flops)
            .ok()
            .flatten()?;
        if !(t.tokens_per_s > 0.0 && self.base.tokens_per_s > 0.0) {
            return None;
        }
        Some(Speed {
            step_s: t.step_s,
            tokens_per_s: t.tokens_per_s,
            slowdown: self.base.tokens_per_s / t.tokens_per_s - 1.0,
        })
    }
}
