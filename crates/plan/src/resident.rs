//! Offsets in the rank's long-lived regions: the buffers that live for the run.
//!
//! The activation arena (`arena.rs`) is the lifetime class "one micro-batch". The trainer's
//! communication buffers (the data-parallel buckets, ZeRO-3's gather buffer, the model
//! groups' buffers, the pipeline's send and receive buffers: `comm.*` of
//! [`Category::CommBuffers`]) appear with the first step's gradients and are never freed: they
//! are the lifetime class "the run". They share one region, each at the offset laid out here,
//! so the trainer allocates one block of [`ArenaLayout::bytes`] and carves every buffer from
//! it instead of one heap allocation each.
//!
//! The placement is the arena's (`arena::arena_layout`): buffers that are all live at once
//! meet pairwise, so greedy-by-size stacks them, largest first, each at the next
//! [`crate::arena::ALIGN`]-byte boundary (a cache line: a bucket the communicator's worker
//! sums in never shares a line with the one the backward fills). The region is the members'
//! planned bytes, each rounded up to that boundary.
//!
//! Adam's moments are the lifetime class "from the first optimizer step": they share a
//! resident region of their own ([`moments_layout`]), allocated by that step.

use crate::arena::{arena_layout, with_block, ArenaError, ArenaLayout};
use crate::memory::{BufId, Category, MemoryPlan};

/// The trainer's gradient windows are listed with the communication buffers (they appear
/// with them) but are part of the gradients' buffer, a state: not a region of their own.
const GRAD_WINDOWS: &str = "comm.zero2.grad_windows";

/// Whether buffer `id` of `plan` is a communication buffer of the resident region: a
/// `comm.*` buffer of [`Category::CommBuffers`] (the engine's own `comm.cp.*` / `comm.ep.*`
/// blocks are activations, in the activation arena).
pub fn is_comm_buffer(plan: &MemoryPlan, id: BufId) -> bool {
    let b = &plan.buffers[id];
    b.category == Category::CommBuffers && b.name.starts_with("comm.") && b.name != GRAD_WINDOWS
}

/// The layout of `plan`'s communication buffers in the resident region.
pub fn comm_layout(plan: &MemoryPlan) -> Result<ArenaLayout, ArenaError> {
    arena_layout(plan, |i| is_comm_buffer(plan, i))
}

/// Whether buffer `id` of `plan` is one of Adam's moments (`optim.exp_avg`,
/// `optim.exp_avg_sq`): the lifetime class "from the first optimizer step", a resident
/// region of its own (held from the step that creates them, as `torch.optim` does).
pub fn is_moment(plan: &MemoryPlan, id: BufId) -> bool {
    let b = &plan.buffers[id];
    b.category == Category::Optimizer && b.name.starts_with("optim.")
}

/// The layout of `plan`'s optimizer moments in their resident region.
pub fn moments_layout(plan: &MemoryPlan) -> Result<ArenaLayout, ArenaError> {
    arena_layout(plan, |i| is_moment(plan, i))
}

/// The plan as the process holds it with the resident region: its members replaced by the
/// region (`resident`), allocated where the first of them is. (They are never freed, so
/// neither is it.)
pub fn with_resident(plan: &MemoryPlan, layout: &ArenaLayout) -> MemoryPlan {
    with_block(plan, layout, "resident", Category::CommBuffers)
}

/// The plan with Adam's moments replaced by their region (`moments`), allocated by the first
/// optimizer step.
pub fn with_moments(plan: &MemoryPlan, layout: &ArenaLayout) -> MemoryPlan {
    with_block(plan, layout, "moments", Category::Optimizer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::ALIGN;
    use crate::{plan, Layout, PlanInput, Runtime};

    fn rank_plans(layout: Layout, runtime: Runtime) -> Vec<MemoryPlan> {
        let input = PlanInput {
            runtime,
            ..crate::testing::small_input(layout)
        };
        plan(&input)
            .unwrap()
            .ranks
            .into_iter()
            .map(|r| r.plan)
            .collect()
    }

    #[test]
    fn every_comm_buffer_has_an_aligned_place_of_its_own_and_the_region_is_their_sum() {
        let layouts = [
            (
                Layout {
                    dp: 2,
                    tp: 2,
                    pp: 2,
                    ..Layout::default()
                },
                Runtime::Ferrotron,
            ),
            (
                Layout {
                    dp: 2,
                    zero: 3,
                    ..Layout::default()
                },
                Runtime::Ferrotron,
            ),
            (
                Layout {
                    dp: 2,
                    cp: 2,
                    ..Layout::default()
                },
                Runtime::FerrotronDevice,
            ),
        ];
        for (l, runtime) in layouts {
            let what = format!(
                "dp {} tp {} pp {} cp {} zero {}",
                l.dp, l.tp, l.pp, l.cp, l.zero
            );
            for p in rank_plans(l, runtime) {
                let r = comm_layout(&p).unwrap();
                let members: Vec<BufId> = (0..p.buffers.len())
                    .filter(|&i| is_comm_buffer(&p, i))
                    .collect();
                assert!(members.len() >= 2, "{what}: {members:?}");
                let names: Vec<&str> = members
                    .iter()
                    .map(|&i| p.buffers[i].name.as_str())
                    .collect();
                assert!(!names.contains(&GRAD_WINDOWS), "{what}");
                let padded = |i: BufId| p.buffers[i].bytes().next_multiple_of(ALIGN);
                // Each at a cache line, and no two overlap (all are live together).
                let mut spans: Vec<(u64, u64)> = members
                    .iter()
                    .map(|&i| {
                        let o = r
                            .offset(i)
                            .unwrap_or_else(|| panic!("{what}: {} unplaced", p.buffers[i].name));
                        assert_eq!(o % ALIGN, 0, "{what}: {}", p.buffers[i].name);
                        (o, o + padded(i))
                    })
                    .collect();
                spans.sort_unstable();
                assert!(
                    spans.windows(2).all(|w| w[0].1 <= w[1].0),
                    "{what}: {spans:?}"
                );
                // The region is the members' planned bytes, each padded to its line, no more.
                let planned: u64 = members.iter().map(|&i| p.buffers[i].bytes()).sum();
                assert_eq!(r.peak_live, planned, "{what}");
                assert_eq!(
                    r.bytes,
                    members.iter().map(|&i| padded(i)).sum::<u64>(),
                    "{what}"
                );
                assert!(r.bytes - planned < ALIGN * members.len() as u64, "{what}");
                // Held whole from the first of them on, the region costs the plan's peak only
                // its padding: the buffers appear together, before any activation.
                let held = with_resident(&p, &r).sweep().peak;
                assert_eq!(held, p.sweep().peak + r.bytes - planned, "{what}");
                // Adam's two moments, one region of their own, created together.
                let m = moments_layout(&p).unwrap();
                let moments: Vec<BufId> =
                    (0..p.buffers.len()).filter(|&i| is_moment(&p, i)).collect();
                assert_eq!(moments.len(), 2, "{what}");
                assert_eq!(
                    m.bytes,
                    moments.iter().map(|&i| padded(i)).sum::<u64>(),
                    "{what}"
                );
                let held = with_moments(&p, &m).sweep().peak;
                assert_eq!(held, p.sweep().peak + m.bytes - m.peak_live, "{what}");
            }
        }
    }
}
