//! The `--json` output. Keys named in the issue are stable; more may be added.

use super::{RankSummary, Report};
use crate::time::TimeReport;
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
        "disk_offload": r.disk_offload,
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
    if let Some(t) = &rep.time {
        v["time"] = time(t);
        v["comm"] = comm(t);
    }
    v
}

/// `"time"`: step time, throughput, utilisation and the breakdown (whose five terms sum to
/// `step_s`).
pub fn time(t: &TimeReport) -> Value {
    let b = &t.breakdown;
    let per_token: serde_json::Map<String, Value> = t
        .flops_per_token
        .iter()
        .map(|(c, f)| (c.name().to_string(), json!(f)))
        .collect();
    json!({
        "step_s": t.step_s,
        "tokens_per_s": t.tokens_per_s,
        "tokens_per_step": t.tokens_per_step,
        "mfu": t.mfu,
        "hfu": t.hfu,
        "gpus": t.gpus,
        "gpu": t.gpu,
        "cluster": t.cluster,
        "flops_convention": t.flops_convention.name(),
        "model_flops_per_step": t.model_flops_per_step,
        "hardware_flops_per_step": t.hardware_flops_per_step,
        "flops_per_token": per_token,
        "breakdown": {
            "compute_s": b.compute_s,
            "recompute_s": b.recompute_s,
            "exposed_comm_s": b.exposed_comm_s,
            "bubble_s": b.bubble_s,
            "optimizer_s": b.optimizer_s,
        },
        "compute_detail": {
            "matmul_s": t.compute_detail.matmul_s,
            "attention_s": t.compute_detail.attention_s,
            "memory_bound_s": t.compute_detail.memory_bound_s,
        },
        "bubble_fraction": t.bubble_fraction,
        "slowest_stage": t.slowest_stage,
        "disk": t.disk,
        "efficiency": {
            "peak_flops": t.efficiency.peak_flops,
            "matmul": t.efficiency.matmul,
            "memory": t.efficiency.memory,
        },
        "notes": t.notes,
    })
}

/// `"comm"`: per dimension, bytes each rank sends per step (integer), the seconds those
/// collectives take and the seconds on the critical path.
pub fn comm(t: &TimeReport) -> Value {
    let map: serde_json::Map<String, Value> = t
        .comm
        .iter()
        .map(|(d, c)| {
            (
                d.name().to_string(),
                json!({
                    "bytes": c.bytes.round() as u64,
                    "s": c.s,
                    "exposed_s": c.exposed_s,
                    "group": c.group,
                    "crosses_nodes": c.crosses_nodes,
                    "what": c.what,
                }),
            )
        })
        .collect();
    Value::Object(map)
}
