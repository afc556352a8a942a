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
    /// Per dimension (tp, cp, ep, dp, pp), per rank per step (of the stage that paces the
    /// pipeline).
    pub comm: Vec<(Dim, DimComm)>,
    /// Bytes a rank of each pipeline stage sends per step over tp, cp, ep and dp, stage order
    /// (stages differ: the first holds the embedding, the last the head, uneven splits their
    /// layers).
    pub stage_bytes: Vec<[f64; 4]>,
    /// (p − 1)/(v·m): the bubble over the ideal pipeline time.
    pub bubble_fraction: f64,
    /// The stage that paces the pipeline.
    pub slowest_stage: String,
    /// The disk tier of the pacing stage's offloaded optimizer states (`--disk-gib`), whose
    /// `optimizer_s` is the host side of the optimizer term.
    pub disk: Option<crate::disk_tier::DiskPlan>,
    pub notes: Vec<String>,
}

impl TimeReport {
    /// Bytes a rank of pipeline stage `stage` sends per step over `d` (tp, cp, ep or dp; the
    /// pacing stage's for pp).
    pub fn bytes_on_stage(&self, d: Dim, stage: usize) -> f64 {
        let at = match d {
            Dim::Tp => 0,
            Dim::Cp => 1,
            Dim::Ep => 2,
            Dim::Dp => 3,
            Dim::Pp => return self.comm_of(d).bytes,
        };
        self.stage_bytes[stage][at]
    }

    pub fn comm_of(&self, d: Dim) -> &DimComm {
        &self
            .comm
            .iter()
            .find(|(x, _)| *x == d)
            .expect("every dimension is reported")
            .1
    }
}
