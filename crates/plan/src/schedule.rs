//! The program of one pipeline stage over the first two optimizer steps: which micro-batch
//! chunk runs forward or backward when (AFAB, 1F1B, interleaved 1F1B), and the allocations
//! and frees each implies.

use crate::layout::{Layout, PpSchedule};

/// One unit of work of a stage: forward or backward of micro-batch `mb` on model chunk `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    F { mb: u64, chunk: u64 },
    B { mb: u64, chunk: u64 },
}

/// Warm-up forwards on `stage` before the first backward.
/// 1F1B: p − s − 1 (Narayanan et al. 2021, PipeDream-Flush). Interleaved with v chunks:
/// (p − s − 1)·2 + (v − 1)·p (Megatron-LM `schedules.py`); this reproduces Korthikanti et al.
/// 2022's first-stage factor: p·(L/p)·(1 + (p − 1)/(p·v)) layers in flight.
pub fn warmup(l: &Layout, stage: u64, micro_batches: u64) -> u64 {
    let (p, v) = (l.pp, l.pp_virtual);
    let total = micro_batches * v;
    match l.pp_schedule {
        PpSchedule::Afab => total,
        PpSchedule::OneFOneB => (p - stage - 1).min(total),
        PpSchedule::Interleaved => ((p - stage - 1) * 2 + (v - 1) * p).min(total),
    }
}

/// Micro-batches simulated per step. The steady 1F1B phase repeats itself, so simulating the
/// warm-up plus two more micro-batches reaches the same peak as simulating all of them.
pub fn simulated_micro_batches(l: &Layout, stage: u64, micro_batches: u64) -> u64 {
    match l.pp_schedule {
        PpSchedule::Afab => micro_batches,
        _ => micro_batches.min(warmup(l, stage, micro_batches).div_ceil(l.pp_virtual) + 2),
    }
}

/// The order of forward and backward work on `stage` for `m` micro-batches.
pub fn order(l: &Layout, stage: u64, m: u64) -> Vec<Work> {
    let (p, v) = (l.pp, l.pp_virtual);
    let total = m * v;
    let w = warmup(l, stage, m);
    // Megatron's get_model_chunk_id: the k-th forward (or backward) of a stage goes to chunk
    // (k / p) % v (reversed for backward), micro-batch groups of p.
    let fwd = |k: u64| {
        let group = k / (p * v);
        let chunk = (k / p) % v;
        Work::F {
            mb: group * p + k % p,
            chunk,
        }
    };
    let bwd = |k: u64| {
        let group = k / (p * v);
        let chunk = v - 1 - (k / p) % v;
        Work::B {
            mb: group * p + k % p,
            chunk,
        }
    };
    if v == 1 {
        // Plain schedules: micro-batch k, chunk 0.
        let f = |k| Work::F { mb: k, chunk: 0 };
        let b = |k| Work::B { mb: k, chunk: 0 };
        let mut out: Vec<Work> = (0..w).map(f).collect();
        for k in 0..total - w {
            out.push(f(w + k));
            out.push(b(k));
        }
        out.extend((total - w..total).map(b));
        return out;
    }
    let mut out: Vec<Work> = (0..w).map(fwd).collect();
    for k in 0..total - w {
        out.push(fwd(w + k));
        out.push(bwd(k));
    }
    out.extend((total - w..total).map(bwd));
    out
}
