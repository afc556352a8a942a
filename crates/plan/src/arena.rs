//! Offsets in one arena for the activation buffers of a rank's memory plan.
//!
//! The engine's per-micro-batch buffers (layer activations, the `recompute.*` workspace, the
//! head's buffers and the backward scratch) live in one slab per rank, as llm.c keeps its
//! activations in one allocation. Where each buffer sits is decided here, from the plan's own
//! program, so that the trainer allocates exactly what the plan says: one region of
//! [`ArenaLayout::bytes`], each buffer at its offset whenever it is live.
//!
//! Placement is offline "greedy by size" (Pisarchyk & Lee 2020, "Efficient Memory Management
//! for Deep Neural Net Inference", §3.2, the strategy of TensorFlow Lite's arena planner):
//! buffers sorted by size, largest first, each put at the lowest offset where it overlaps no
//! already placed buffer whose lifetime meets its own. A buffer that is allocated several times
//! (every micro-batch, both simulated steps) has the union of those intervals as its lifetime,
//! so one offset serves every instance. The result is checked against the plan's peak of
//! the same buffers: [`ArenaLayout::fragmentation`] is what the placement could not pack.

use crate::memory::{BufId, MemoryPlan, Op};

/// Offsets are multiples of this (a cache line; every element type divides it).
pub const ALIGN: u64 = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaLayout {
    /// Offset in bytes of each member buffer, indexed by `BufId` (`None`: not in the arena).
    pub offsets: Vec<Option<u64>>,
    /// Size of the region: the highest end of any placed buffer.
    pub bytes: u64,
    /// The most bytes of member buffers live at once in the plan (a lower bound for `bytes`).
    pub peak_live: u64,
}

impl ArenaLayout {
    /// Bytes of the region that the placement could not use at its fullest instant.
    pub fn fragmentation(&self) -> u64 {
        self.bytes - self.peak_live
    }

    pub fn offset(&self, id: BufId) -> Option<u64> {
        self.offsets.get(id).copied().flatten()
    }
}

/// Why a plan's buffers cannot share one arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArenaError {
    /// Two instances of one buffer are live at once (several micro-batches in flight): each
    /// needs its own name before it can have its own offset.
    Overlapping(String),
}

impl std::fmt::Display for ArenaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArenaError::Overlapping(n) => write!(
                f,
                "buffer `{n}` is live twice at once (several micro-batches in flight): \
                 an arena needs one name per in-flight instance"
            ),
        }
    }
}

fn aligned(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// Half-open program intervals `[alloc, free)` in which a buffer is live.
type Lifetime = Vec<(usize, usize)>;

fn meets(a: &Lifetime, b: &Lifetime) -> bool {
    a.iter()
        .any(|&(s0, e0)| b.iter().any(|&(s1, e1)| s0 < e1 && s1 < e0))
}

/// Lifetimes of the member buffers, and the most member bytes live at once.
fn lifetimes(plan: &MemoryPlan, member: &[bool]) -> Result<(Vec<Lifetime>, u64), ArenaError> {
    let n = plan.buffers.len();
    let mut open: Vec<Option<usize>> = vec![None; n];
    let mut life: Vec<Lifetime> = vec![Vec::new(); n];
    let (mut live, mut peak) = (0u64, 0u64);
    for (t, op) in plan.program.iter().enumerate() {
        match *op {
            Op::Alloc(i) if member[i] => {
                if open[i].is_some() {
                    return Err(ArenaError::Overlapping(plan.buffers[i].name.clone()));
                }
                open[i] = Some(t);
                live += plan.buffers[i].bytes();
                peak = peak.max(live);
            }
            Op::Free(i) if member[i] => {
                if let Some(s) = open[i].take() {
                    life[i].push((s, t));
                    live -= plan.buffers[i].bytes();
                }
            }
            _ => {}
        }
    }
    // A buffer still live at the end of the program lives to the end.
    let end = plan.program.len();
    for (i, s) in open.into_iter().enumerate() {
        if let Some(s) = s {
            life[i].push((s, end));
        }
    }
    Ok((life, peak))
}

/// Places the buffers `member` selects (by id) in one region.
pub fn arena_layout(
    plan: &MemoryPlan,
    member: impl Fn(BufId) -> bool,
) -> Result<ArenaLayout, ArenaError> {
    let n = plan.buffers.len();
    let member: Vec<bool> = (0..n)
        .map(|i| member(i) && plan.buffers[i].bytes() > 0)
        .collect();
    let (life, peak_live) = lifetimes(plan, &member)?;
    let mut order: Vec<BufId> = (0..n)
        .filter(|&i| member[i] && !life[i].is_empty())
        .collect();
    // Largest first; ties in order of first use, so the layout is deterministic.
    order.sort_by_key(|&i| (std::cmp::Reverse(plan.buffers[i].bytes()), life[i][0].0));
    let mut offsets: Vec<Option<u64>> = vec![None; n];
    let mut placed: Vec<BufId> = Vec::with_capacity(order.len());
    let mut bytes = 0u64;
    let mut taken: Vec<(u64, u64)> = Vec::new();
    for i in order {
        let size = aligned(plan.buffers[i].bytes());
        taken.clear();
        taken.extend(
            placed
                .iter()
                .filter(|&&j| meets(&life[i], &life[j]))
                .map(|&j| {
                    let o = offsets[j].expect("placed");
                    (o, o + aligned(plan.buffers[j].bytes()))
                }),
        );
        taken.sort_unstable();
        // The lowest gap that holds `size`.
        let mut at = 0u64;
        for &(s, e) in &taken {
            if s >= at + size {
                break;
            }
            at = at.max(e);
        }
        offsets[i] = Some(at);
        bytes = bytes.max(at + size);
        placed.push(i);
    }
    Ok(ArenaLayout {
        offsets,
        bytes,
        peak_live,
    })
}

/// The plan as the process holds it with an arena: the member buffers replaced by the region,
/// allocated when the first of them appears and freed when the last goes (one micro-batch).
/// Its sweep's marks are what the allocator sees: between marks the region is held whole, even
/// where the buffers live in it are fewer than at its fullest.
pub fn with_region(plan: &MemoryPlan, layout: &ArenaLayout) -> MemoryPlan {
    with_block(
        plan,
        layout,
        "arena",
        crate::memory::Category::OtherActivations,
    )
}

/// The plan with `layout`'s members replaced by one block `name` of `layout.bytes`, allocated
/// when the first of them appears and freed when the last goes (never, for buffers the plan
/// never frees: `resident.rs`).
pub fn with_block(
    plan: &MemoryPlan,
    layout: &ArenaLayout,
    name: &str,
    category: crate::memory::Category,
) -> MemoryPlan {
    let mut out = MemoryPlan {
        buffers: plan.buffers.clone(),
        program: Vec::with_capacity(plan.program.len()),
        host_bytes: plan.host_bytes,
    };
    let region = out.add(name, crate::recipe::DType::U8, layout.bytes, category);
    let mut live = 0usize;
    for op in &plan.program {
        match *op {
            Op::Alloc(i) if layout.offset(i).is_some() => {
                if live == 0 {
                    out.program.push(Op::Alloc(region));
                }
                live += 1;
            }
            Op::Free(i) if layout.offset(i).is_some() => {
                live -= 1;
                if live == 0 {
                    out.program.push(Op::Free(region));
                }
            }
            _ => out.program.push(op.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Category;
    use crate::recipe::DType;

    fn buf(plan: &mut MemoryPlan, name: &str, bytes: u64) -> BufId {
        plan.add(name, DType::U8, bytes, Category::Workspace)
    }

    #[test]
    fn a_stack_packs_to_its_peak_and_disjoint_lifetimes_share_bytes() {
        let mut p = MemoryPlan::default();
        let a = buf(&mut p, "a", 640);
        let b = buf(&mut p, "b", 128);
        let c = buf(&mut p, "c", 512);
        p.alloc(&[a, b]);
        p.free(&[b]);
        p.alloc(&[c]);
        p.free(&[a, c]);
        let l = arena_layout(&p, |_| true).unwrap();
        assert_eq!(with_region(&p, &l).sweep().peak, l.bytes);
        assert_eq!(l.peak_live, 640 + 512);
        assert_eq!(l.bytes, l.peak_live);
        // b and c never live together: c may reuse b's bytes, never a's.
        let (oa, oc) = (l.offset(a).unwrap(), l.offset(c).unwrap());
        assert!(oc >= oa + 640 || oc + 512 <= oa);
    }

    #[test]
    fn two_live_instances_of_one_name_are_refused() {
        let mut p = MemoryPlan::default();
        let a = buf(&mut p, "act.layers.0.q", 64);
        p.alloc(&[a, a]);
        let e = arena_layout(&p, |_| true).unwrap_err();
        assert!(
            e.to_string().contains("`act.layers.0.q` is live twice"),
            "{e}"
        );
    }
}
