//! Offsets of the rank's states in their resident regions: the weights and their fp32 master
//! copy (the lifetime class "from initialisation"), and the gradients (the class "from the
//! first step"). With the communication buffers and Adam's moments (`resident.rs`) these are
//! every long-lived buffer of a trainer's rank, so it allocates what the plan lists, at the
//! plan's offsets, and nothing of its own.
//!
//! A state and its windows are one buffer of the trainer: ZeRO-3 keeps its shard of the
//! weights and, after it, the windows it gathers units into (`params`, `zero3.param_windows`);
//! ZeRO-2/3 and streamed parameters keep their gradient shard and, after it, the windows the
//! backward fills (`grads`, `comm.zero2.grad_windows`; streamed, the windows alone). So the
//! layout is not greedy: each span's members sit back to back in that order (the trainer
//! indexes the windows from the end of the shard), and each span starts at the next
//! [`ALIGN`]-byte line. The region is the spans' bytes, each rounded up to a line.

use crate::arena::{with_block, ArenaLayout, ALIGN};
use crate::memory::{Category, MemoryPlan};

/// The weights' region: the weights (with ZeRO-3's windows after the shard), then the fp32
/// master weights of mixed precision.
pub const WEIGHTS: [&[&str]; 2] = [&["params", "zero3.param_windows"], &["master"]];

/// The gradients' region: the gradients (with ZeRO-2/3's or the streamed windows after them).
pub const GRADS: [&[&str]; 1] = [&["grads", "comm.zero2.grad_windows"]];

/// `spans` of `plan`'s buffers laid out back to back, each span at a line; a name the plan
/// lacks (a run without ZeRO has no windows, `--offload` has its states on the host) is
/// skipped.
pub fn spans_layout(plan: &MemoryPlan, spans: &[&[&str]]) -> ArenaLayout {
    let mut offsets = vec![None; plan.buffers.len()];
    let (mut end, mut live) = (0u64, 0u64);
    for span in spans {
        let mut at = end;
        for name in *span {
            let Some(id) = plan.buffers.iter().position(|b| b.name == *name) else {
                continue;
            };
            offsets[id] = Some(at);
            at += plan.buffers[id].bytes();
            live += plan.buffers[id].bytes();
        }
        end = at.next_multiple_of(ALIGN);
    }
    ArenaLayout {
        offsets,
        bytes: end,
        peak_live: live,
    }
}

/// The layout of `plan`'s weights and master weights.
pub fn weights_layout(plan: &MemoryPlan) -> ArenaLayout {
    spans_layout(plan, &WEIGHTS)
}

/// The layout of `plan`'s gradients and their windows.
pub fn grads_layout(plan: &MemoryPlan) -> ArenaLayout {
    spans_layout(plan, &GRADS)
}

/// Elements of the trainer's one gradient buffer: the plan's gradients this rank keeps in its
/// memory (none when they are the host's, streamed) and the windows after them.
pub fn grads_len(plan: &MemoryPlan) -> u64 {
    GRADS[0]
        .iter()
        .filter_map(|n| plan.find(n))
        .map(|b| b.numel)
        .sum()
}

/// The plan with the weights' region (`weights`) in place of its members.
pub fn with_weights(plan: &MemoryPlan, layout: &ArenaLayout) -> MemoryPlan {
    with_block(plan, layout, "weights", Category::Params)
}

/// The plan with the gradients' region (`gradients`) in place of its members.
pub fn with_grads(plan: &MemoryPlan, layout: &ArenaLayout) -> MemoryPlan {
    with_block(plan, layout, "gradients", Category::Grads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{plan, Layout, Precision};

    fn rank0(layout: Layout, precision: Precision) -> MemoryPlan {
        let mut input = crate::testing::small_input(layout);
        input.recipe.precision = precision;
        plan(&input).unwrap().ranks.remove(0).plan
    }

    #[test]
    fn a_state_and_its_windows_are_one_span_and_each_span_starts_at_a_line() {
        let zero3 = Layout {
            dp: 2,
            zero: 3,
            ..Layout::default()
        };
        let p = rank0(zero3, Precision::Bf16);
        let id = |n: &str| p.buffers.iter().position(|b| b.name == n).unwrap();
        let w = weights_layout(&p);
        let (params, windows, master) = (id("params"), id("zero3.param_windows"), id("master"));
        assert_eq!(w.offset(params), Some(0));
        assert_eq!(w.offset(windows), Some(p.buffers[params].bytes()));
        let shard_end = p.buffers[params].bytes() + p.buffers[windows].bytes();
        assert_eq!(w.offset(master), Some(shard_end.next_multiple_of(ALIGN)));
        assert_eq!(w.bytes % ALIGN, 0);
        assert!(w.bytes - w.peak_live < 2 * ALIGN, "{w:?}");
        let g = grads_layout(&p);
        let (grads, gw) = (id("grads"), id("comm.zero2.grad_windows"));
        assert_eq!(g.offset(gw), Some(p.buffers[grads].bytes()));
        assert_eq!(grads_len(&p), p.buffers[grads].numel + p.buffers[gw].numel);
        // Nothing else is a member, and the plan with the regions peaks as high, padding aside.
        let members = |l: &ArenaLayout| l.offsets.iter().flatten().count();
        assert_eq!((members(&w), members(&g)), (3, 2));
        let held = with_grads(&with_weights(&p, &w), &g);
        let pad = (w.bytes - w.peak_live) + (g.bytes - g.peak_live);
        assert_eq!(held.sweep().peak, p.sweep().peak + pad);
    }

    #[test]
    fn one_rank_in_fp32_has_no_windows_and_no_master() {
        let p = rank0(Layout::default(), Precision::Fp32);
        let w = weights_layout(&p);
        assert_eq!(w.offsets.iter().flatten().count(), 1);
        assert_eq!(
            w.bytes,
            p.find("params").unwrap().bytes().next_multiple_of(ALIGN)
        );
        assert_eq!(grads_len(&p), p.find("grads").unwrap().numel);
    }
}
