//! What the step-time estimate returns.

use super::cost::Efficiency;
use crate::cluster::Dim;
use crate::comm::DimComm;
use crate::flops::FlopsConvention;
use serde::Serialize;

/// The step-time breakdown; the five terms sum to `step_s`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimeBreakdown {
    /// Forward and backward compute of every micro-batch on the slowest stage.
    pub compute_s: f64,
    /// Recomputation in the backward.
    pub recompute_s: f64,
    /// Communication on the critical path (per dimension in `comm`).
    pub exposed_comm_s: f64,
    /// Pipeline bubble: idle time of the slowest stage.
    pub bubble_s: f64,
    /// Optimizer step (and host transfers with offloading).
    pub optimizer_s: f64,
}

/// Compute (with recomputation) by kind of kernel, per step, on the slowest stage.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ComputeDetail {
    pub matmul_s: f64,
    pub attention_s: f64,
    pub memory_bound_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimeReport {
    pub gpus: u64,
    pub cluster: String,
    pub gpu: String,
    pub efficiency: Efficiency,
    pub step_s: f64,
    pub tokens_per_step: u64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub hfu: f64,
    pub flops_convention: FlopsConvention,
    pub model_flops_per_step: f64,
    pub hardware_flops_per_step: f64,
    /// Model FLOPs per token under every convention (for comparison).
    pub flops_per_token: Vec<(FlopsConvention, f64)>,
    pub breakdown: TimeBreakdown,
    pub compute_detail: ComputeDetail,
    /// Per dimension (tp, cp, ep, dp, pp), per rank per step.
    pub comm: Vec<(Dim, DimComm)>,
    /// (p − 1)/(v·m): the bubble over the ideal pipeline time.
    pub bubble_fraction: f64,
    /// The stage that paces the pipeline.
    pub slowest_stage: String,
    pub notes: Vec<String>,
}

impl TimeReport {
    pub fn comm_of(&self, d: Dim) -> &DimComm {
        &self
            .comm
            .iter()
            .find(|(x, _)| *x == d)
            .expect("every dimension is reported")
            .1
    }
}
