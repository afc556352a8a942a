//! The `--json` output. Keys named in the issue are stable; more may be added.

use super::{RankSummary, Report};
use serde_json::{json, Value};

fn rank(r: &RankSummary) -> Value {
    json!({
        "name": r.name,
        "params": r.params,
        "grads": r.grads,
        "master": r.master,
        "optimizer": r.optimizer,
        "model_states": r.model_states,
        "activations": r.activations,
        "activations_layers": r.activations_layers,
        "buffers": r.buffers,
        "workspace": r.workspace,
        "comm_buffers": r.comm_buffers,
        "overhead": r.overhead,
        "peak": r.peak,
        "peak_at": r.peak_at,
        "host_offload": r.host_offload,
    })
}

pub fn to_json(rep: &Report) -> Value {
    let w = rep.worst();
    let mut v = json!({
        "model": rep.model,
        "convention": rep.convention,
        "params": {"total": rep.params_total, "active": rep.params_active},
        "per_rank": rank(w),
        "ranks": rep.ranks.iter().map(rank).collect::<Vec<_>>(),
        "timeline": rep.timeline.iter().map(|p| json!({"phase": p.phase, "bytes": p.bytes})).collect::<Vec<_>>(),
        "step2_explanation": rep.step2_explanation,
        "overhead_note": rep.overhead_note,
        "fits": rep.verdict.as_ref().map(|v| v.fits),
    });
    if let Some(verdict) = &rep.verdict {
        v["verdict"] = serde_json::to_value(verdict).unwrap_or(Value::Null);
    }
    v
}
