//! Everything `ferrotron plan` prints, assembled once: a table, JSON (stable keys) or HTML.

pub mod html;
pub mod json;
pub mod svg;
pub mod table;

use crate::cluster::Cluster;
use crate::disk_tier::{fp32_states, DiskTier};
use crate::error::Result;
use crate::flops::FlopsConvention;
use crate::hardware::Gpu;
use crate::layout::Offload;
use crate::memory::Breakdown;
use crate::planner::{plan, ModelSource, PlanInput, PlanResult, RankPlan};
use crate::recipe::Recompute;
use crate::timeline::{coarse, step2_explanation, TimelinePoint};
use crate::verdict::{verdict, Timing, Verdict};
use serde::Serialize;

/// Per-rank memory by component, in bytes. `buffers` = workspace + comm buffers.
#[derive(Debug, Clone, Serialize)]
pub struct RankSummary {
    pub name: String,
    pub params: u64,
    pub grads: u64,
    pub master: u64,
    pub optimizer: u64,
    pub model_states: u64,
    pub activations: u64,
    pub activations_layers: u64,
    pub buffers: u64,
    pub workspace: u64,
    pub comm_buffers: u64,
    pub overhead: u64,
    pub peak: u64,
    /// The program point where the peak is reached.
    pub peak_at: String,
    /// Bytes moved to host memory by offloading (with a disk tier, the buckets in flight).
    pub host_offload: u64,
    /// Bytes kept on the drive with a disk tier (`--disk-gib`); each is read and written once
    /// per step.
    pub disk_offload: u64,
}

impl RankSummary {
    fn new(r: &RankPlan) -> Self {
        let b: &Breakdown = &r.at_peak;
        RankSummary {
            name: r.name.clone(),
            params: b.params,
            grads: b.grads,
            master: b.master,
            optimizer: b.optimizer,
            model_states: b.model_states(),
            activations: b.activations(),
            activations_layers: b.layer_activations,
            buffers: b.workspace + b.comm_buffers,
            workspace: b.workspace,
            comm_buffers: b.comm_buffers,
            overhead: r.overhead,
            peak: r.peak,
            peak_at: r.sweep.peak_label.clone(),
            host_offload: r.plan.host_bytes,
            disk_offload: 0,
        }
    }

    /// The rank's offloaded optimizer states on the drive of `t` (`disk_tier`): host memory
    /// keeps the buckets in flight. Refuses a drive too small, naming the setting.
    fn on_disk(&mut self, t: &DiskTier, r: &RankPlan, x: &PlanInput) -> Result<()> {
        let states = fp32_states(&x.recipe);
        if x.layout.offload != Offload::Optimizer || states == 0 {
            return Ok(());
        }
        let d = t.plan(r.states.opt, states, 0.0)?;
        self.host_offload = self.host_offload.saturating_sub(d.host_saved);
        self.disk_offload = d.disk_bytes;
        Ok(())
    }
}

/// Activation memory (GiB-ready bytes) of the most loaded rank at one sequence length.
#[derive(Debug, Clone, Serialize)]
pub struct SeqPoint {
    pub seq: u64,
    pub none: u64,
    pub selective: u64,
    pub full: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub params_total: u64,
    pub params_active: u64,
    pub convention: String,
    pub settings: Vec<(String, String)>,
    pub ranks: Vec<RankSummary>,
    pub most_loaded: usize,
    pub timeline: Vec<TimelinePoint>,
    pub step2_explanation: String,
    pub verdict: Option<Verdict>,
    pub overhead_note: String,
    pub activations_vs_seq: Vec<SeqPoint>,
    /// Step time, throughput and communication (only with an architecture and a cluster).
    pub time: Option<crate::time::TimeReport>,
}

impl Report {
    pub fn worst(&self) -> &RankSummary {
        &self.ranks[self.most_loaded]
    }
}

/// The schedule's virtual stages and an uneven split's layers per model chunk, model order.
fn split(x: &PlanInput) -> String {
    let l = &x.layout;
    let layers = match &x.model {
        ModelSource::Spec(m) if l.uneven() => m.layers,
        _ if l.pp_virtual > 1 => return format!(" (v = {})", l.pp_virtual),
        _ => return String::new(),
    };
    let each: Vec<u64> = (0..l.pp * l.pp_virtual)
        .map(|g| l.chunk_layer_count(layers, g))
        .collect();
    let each = crate::layout::format_pp_layers(&each);
    match l.pp_virtual {
        1 => format!(" (layers per stage {each})"),
        v => format!(" (v = {v}; layers per model chunk {each})"),
    }
}

fn settings(x: &PlanInput) -> Vec<(String, String)> {
    let (r, l) = (&x.recipe, &x.layout);
    let gbs = l.global_batch(r);
    vec![
        (
            "batch".into(),
            format!(
                "seq {} × mbs {} × grad-acc {} × dp·ep {} = gbs {} sequences ({} tokens)",
                r.seq,
                r.mbs,
                r.grad_acc,
                l.dp * l.ep,
                gbs,
                gbs * r.seq
            ),
        ),
        (
            "training".into(),
            format!("precision {}, optimizer {}, recompute {}", r.precision, r.optimizer, match r.recompute {
                Recompute::None => "none",
                Recompute::Selective => "selective",
                Recompute::Full => "full",
            }),
        ),
        (
            "layout".into(),
            format!(
                "dp {} × tp {} × pp {} × cp {} × ep {} = {} ranks; ZeRO-{}; sp {}; schedule {}{}; offload {}",
                l.dp,
                l.tp,
                l.pp,
                l.cp,
                l.ep,
                l.world(),
                l.zero,
                if l.sp { "on" } else { "off" },
                l.pp_schedule,
                split(x),
                l.offload
            ),
        ),
    ]
}

/// Activation memory vs sequence length for the three recompute policies (the playbook's
/// figure), at powers of two from 512 up to the model's maximum (at most 32k).
fn activations_vs_seq(x: &PlanInput) -> Vec<SeqPoint> {
    let ModelSource::Spec(m) = &x.model else {
        return vec![];
    };
    let mut out = Vec::new();
    let mut seq = 512;
    while seq <= m.max_positions.min(32_768) {
        let at = |rc| {
            let mut y = x.clone();
            y.recipe.seq = seq;
            y.recipe.recompute = rc;
            y.recipe.grad_acc = y.recipe.grad_acc.min(y.layout.pp * 2).max(1);
            plan(&y).map(|p| p.worst().at_peak.activations()).ok()
        };
        if let (Some(none), Some(selective), Some(full)) = (
            at(Recompute::None),
            at(Recompute::Selective),
            at(Recompute::Full),
        ) {
            out.push(SeqPoint {
                seq,
                none,
                selective,
                full,
            });
        }
        seq *= 2;
    }
    out
}

pub fn build(
    x: &PlanInput,
    result: &PlanResult,
    gpu: Option<&Gpu>,
    with_seq_sweep: bool,
) -> Result<Report> {
    assemble(x, result, gpu, None, with_seq_sweep)
}

/// The report without the step-time section; `timing` (a cluster) times the verdict's options.
fn assemble(
    x: &PlanInput,
    result: &PlanResult,
    gpu: Option<&Gpu>,
    timing: Option<Timing>,
    with_seq_sweep: bool,
) -> Result<Report> {
    let worst = result.worst();
    let timeline = coarse(&worst.sweep, &x.overhead);
    let opt_bytes = worst.at_peak.optimizer;
    let explanation = step2_explanation(&timeline, opt_bytes, worst.at_peak.grads);
    let model = match &x.model {
        ModelSource::Spec(m) => m.name.clone(),
        ModelSource::Params(n) => format!("{n} parameters (model states only)"),
        ModelSource::Counted {
            params,
            largest_layer,
        } => format!(
            "{params} parameters, largest layer {largest_layer} (model states and ZeRO-3 gathers)"
        ),
    };
    let verdict = gpu.map(|g| verdict(x, worst.peak, g, timing)).transpose()?;
    Ok(Report {
        model,
        params_total: result.params.total,
        params_active: result.params.active,
        convention: format!("{} — {}", x.convention, x.convention.describe()),
        settings: settings(x),
        ranks: result.ranks.iter().map(RankSummary::new).collect(),
        most_loaded: result.most_loaded,
        timeline,
        step2_explanation: explanation,
        verdict,
        overhead_note: format!(
            "overhead = runtime context {:.2} GiB + fragmentation margin {:.0}% of allocated (assumptions; --overhead-gib, --fragmentation); PyTorch's caching allocator, replayed over the most loaded rank's program, would reserve {:.2} GiB at its peak (allocator.rs)",
            x.overhead.context_bytes as f64 / crate::GIB,
            x.overhead.fragmentation * 100.0,
            worst.reserved() as f64 / crate::GIB
        ),
        activations_vs_seq: if with_seq_sweep { activations_vs_seq(x) } else { vec![] },
        time: None,
    })
}

/// `build`, plus the step-time model on `cluster` (its GPU also gives the verdict's capacity).
pub fn build_with_time(
    x: &PlanInput,
    result: &PlanResult,
    cluster: &Cluster,
    flops: FlopsConvention,
    with_seq_sweep: bool,
) -> Result<Report> {
    let timing = Timing { cluster, flops };
    let mut rep = assemble(x, result, Some(&cluster.gpu), Some(timing), with_seq_sweep)?;
    if let Some(t) = &cluster.disk {
        for (s, r) in rep.ranks.iter_mut().zip(&result.ranks) {
            s.on_disk(t, r, x)?;
        }
    }
    rep.time = crate::time::estimate(x, cluster, flops)?;
    Ok(rep)
}
