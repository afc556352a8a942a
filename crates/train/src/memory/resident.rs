//! The rank's resident region: the second, long-lived part of its arena, where the buffers of
//! the lifetime class "the run" sit at the offsets the plan gave them
//! (`ferrotron_plan::resident`). Today these are the communication buffers (`comm.*`: the
//! data-parallel buckets, ZeRO-3's gather buffer, the model groups' buffers, a device ring's
//! receive staging, the pipeline's send and receive buffers), and, in a region of their own
//! made by the first optimizer step, Adam's two moments of a host step; and the states of a
//! host run (`ferrotron_plan::state_regions`): the weights with their fp32 master copy, in a
//! region made with the model, and the gradients, in one made with the first step.
//!
//! The region is one zeroed host block of the layout's size, allocated when the first buffer
//! is carved from it (with the first step's gradients, where the plan allocates them) and never
//! freed before its last buffer: the tracking allocator sees one allocation of exactly the
//! planned size. Each buffer is handed out once, as [`Region`]s over its planned bytes that
//! keep the block alive. On a device (`--device emulated`, cuda) these buffers are the host
//! staging of the communicator, as before: the region is host memory either way.

use ferrotron_dist::{Memory, Region};
use ferrotron_engine::model::BUF_ALIGN;
use ferrotron_engine::Elem;
use ferrotron_plan::arena::{ArenaError, ArenaLayout};
use ferrotron_plan::resident::{comm_layout, moments_layout};
use ferrotron_plan::state_regions::{grads_layout, weights_layout};
use ferrotron_plan::{DType, MemoryPlan};
use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

/// Where one buffer lives in the region.
#[derive(Clone, Copy, Debug)]
struct Place {
    offset: usize,
    elems: usize,
    dtype: DType,
    taken: bool,
}

#[derive(Debug)]
pub struct Resident {
    layout: Layout,
    places: HashMap<String, Place>,
    /// The block, once the first buffer is carved: its start, and its owner.
    block: Option<(NonNull<u8>, Arc<Block>)>,
}

/// The region's memory; freed when the resident and every region carved from it are gone.
#[derive(Debug)]
pub struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the block is only freed (in `drop`); its bytes are reached through the regions
// carved from it, each of which owns its span uniquely.
unsafe impl Send for Block {}
unsafe impl Sync for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `Resident::block` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the resident's pointer is into the block it co-owns; it is used by the rank's
// thread only, to carve regions that are then `Send` themselves.
unsafe impl Send for Resident {}

impl Resident {
    /// The resident region of `plan`'s communication buffers, or why they cannot share one.
    pub fn of_plan(plan: &MemoryPlan) -> anyhow::Result<(Self, ArenaLayout)> {
        Self::of_layout(plan, comm_layout(plan))
    }

    /// The resident region of `plan`'s Adam moments (`optim.exp_avg`, `optim.exp_avg_sq`).
    pub fn moments(plan: &MemoryPlan) -> anyhow::Result<(Self, ArenaLayout)> {
        Self::of_layout(plan, moments_layout(plan))
    }

    /// The resident region of `plan`'s weights (ZeRO-3's windows after the shard) and fp32
    /// master weights, made with the model.
    pub fn weights(plan: &MemoryPlan) -> anyhow::Result<(Self, ArenaLayout)> {
        Self::of_layout(plan, Ok(weights_layout(plan)))
    }

    /// The resident region of `plan`'s gradients (the windows after the shard), made with the
    /// first step.
    pub fn grads(plan: &MemoryPlan) -> anyhow::Result<(Self, ArenaLayout)> {
        Self::of_layout(plan, Ok(grads_layout(plan)))
    }

    /// Every resident region of `plan` (the communication buffers', the moments', the
    /// weights', the gradients'), with their layouts.
    pub fn all(plan: &MemoryPlan) -> anyhow::Result<([Self; 4], [ArenaLayout; 4])> {
        let (c, cl) = Self::of_plan(plan)?;
        let (m, ml) = Self::moments(plan)?;
        let (w, wl) = Self::weights(plan)?;
        let (g, gl) = Self::grads(plan)?;
        Ok(([c, m, w, g], [cl, ml, wl, gl]))
    }

    fn of_layout(
        plan: &MemoryPlan,
        placed: Result<ArenaLayout, ArenaError>,
    ) -> anyhow::Result<(Self, ArenaLayout)> {
        let placed = placed.map_err(|e| anyhow::anyhow!("memory plan: {e}"))?;
        let mut places = HashMap::new();
        for (id, b) in plan.buffers.iter().enumerate() {
            let Some(offset) = placed.offset(id) else {
                continue;
            };
            // Every element type divides the line the layouts align spans to, so each buffer
            // is aligned for its type (a window follows its shard of the same type).
            anyhow::ensure!(
                offset % b.dtype.bytes() == 0,
                "internal: the memory plan's resident buffer `{}` at byte {offset} is not aligned for {:?}",
                b.name,
                b.dtype
            );
            let place = Place {
                offset: offset as usize,
                elems: b.numel as usize,
                dtype: b.dtype,
                taken: false,
            };
            places.insert(b.name.clone(), place);
        }
        let layout = Layout::from_size_align(placed.bytes.max(1) as usize, BUF_ALIGN)?;
        let block = None;
        Ok((
            Resident {
                layout,
                places,
                block,
            },
            placed,
        ))
    }

    /// Bytes of the region while it is held, else 0.
    pub fn held(&self) -> u64 {
        self.block.as_ref().map_or(0, |_| self.layout.size() as u64)
    }

    /// Whether the plan has buffer `name` here and it was carved already.
    pub fn taken(&self, name: &str) -> bool {
        self.places.get(name).is_some_and(|p| p.taken)
    }

    /// The block, allocated (zeroed) on first use.
    fn block(&mut self) -> (NonNull<u8>, Arc<Block>) {
        let layout = self.layout;
        let (ptr, owner) = self.block.get_or_insert_with(|| {
            // SAFETY: the layout has a non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            (ptr, Arc::new(Block { ptr, layout }))
        });
        (*ptr, owner.clone())
    }

    /// Planned buffer `name` as `parts` regions of equal length, adjacent, at its offset (the
    /// two data-parallel buckets of `comm.dp.grad_buckets`; one region for any other buffer);
    /// `None` when the plan has no such buffer. A buffer is carved once: a second carve of it
    /// is an internal error (two owners of the same bytes).
    pub fn carve(&mut self, name: &str, parts: usize) -> Option<Vec<Region<f32>>> {
        let place = *self.places.get(name)?;
        assert!(
            parts > 0 && place.elems % parts == 0,
            "internal: the planned buffer `{name}` of {} f32 does not split into {parts}",
            place.elems
        );
        let whole = self.take::<f32>(&[name])?;
        let len = place.elems / parts;
        Some(
            (0..parts)
                .map(|j| self.span(whole.0 + j * len * 4, len, &whole.1))
                .collect(),
        )
    }

    /// The planned buffers `names` that the plan has, which it laid out back to back (a state
    /// and its windows), as one region of `T` (their type); `None` when it has none of them.
    pub fn carve_span<T: Elem>(&mut self, names: &[&str]) -> Option<Region<T>> {
        let (offset, owner) = self.take::<T>(names)?;
        let elems = names
            .iter()
            .filter_map(|n| self.places.get(*n))
            .map(|p| p.elems)
            .sum();
        Some(self.span(offset, elems, &owner))
    }

    /// Marks `names` (those the plan has) taken and returns the byte offset of the first and
    /// the block, checking that they are `T`, adjacent in this order, and not taken before.
    fn take<T: Elem>(&mut self, names: &[&str]) -> Option<(usize, Arc<Block>)> {
        let mut at: Option<(usize, usize)> = None;
        for name in names {
            let Some(place) = self.places.get_mut(*name) else {
                continue;
            };
            assert!(
                !place.taken,
                "internal: the planned buffer `{name}` is carved twice"
            );
            assert!(
                place.dtype == T::DTYPE,
                "internal: the planned buffer `{name}` is {:?}, taken as {:?}",
                place.dtype,
                T::DTYPE
            );
            let end = place.offset + place.elems * size_of::<T>();
            at = match at {
                None => Some((place.offset, end)),
                Some((first, prev_end)) => {
                    assert_eq!(
                        place.offset, prev_end,
                        "internal: the planned buffer `{name}` does not follow the one before it"
                    );
                    Some((first, end))
                }
            };
            place.taken = true;
        }
        let (offset, _) = at?;
        Some((offset, self.block().1))
    }

    /// `elems` elements of `T` at byte `offset` of the block.
    fn span<T: Elem>(&mut self, offset: usize, elems: usize, owner: &Arc<Block>) -> Region<T> {
        let base = self.block().0;
        let owner: Arc<dyn Send + Sync> = owner.clone();
        // SAFETY: the plan placed the buffers at `offset` (aligned for `T`, checked in
        // `of_layout`) with `elems` elements of `T` inside the region, overlapping no other
        // buffer of it; the block was zeroed, and zero bits are an initialised f32, bf16 or
        // f16 (`Elem`'s types); `take` hands each buffer out once, and the parts of one carve
        // do not overlap, so each region is the only owner of its span. `owner` keeps the
        // block alive while a region lives.
        unsafe {
            let at = base.as_ptr().add(offset).cast::<T>();
            Region::from_raw_parts(NonNull::new_unchecked(at), elems, Memory::Host, owner)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_plan::{plan, Layout as PlanLayout};

    fn dp_tp_plan() -> MemoryPlan {
        rank0(PlanLayout {
            dp: 2,
            tp: 2,
            ..PlanLayout::default()
        })
    }

    fn rank0(layout: PlanLayout) -> MemoryPlan {
        let input = ferrotron_plan::testing::small_input(layout);
        plan(&input).unwrap().ranks.remove(0).plan
    }

    #[test]
    fn buffers_are_carved_at_their_planned_offsets_once() {
        let p = dp_tp_plan();
        let (mut r, l) = Resident::of_plan(&p).unwrap();
        assert_eq!((r.held(), r.taken("comm.tp.staging")), (0, false));
        let buckets = r.carve("comm.dp.grad_buckets", 2).unwrap();
        assert_eq!(r.held(), l.bytes);
        let staging = r.carve("comm.tp.staging", 1).unwrap().remove(0);
        assert!(r.taken("comm.tp.staging"));
        let id = |n: &str| p.buffers.iter().position(|b| b.name == n).unwrap();
        let at = |x: &Region<f32>| x.as_ptr() as u64;
        let (b, s) = (id("comm.dp.grad_buckets"), id("comm.tp.staging"));
        let want = l.offset(s).unwrap() as i64 - l.offset(b).unwrap() as i64;
        assert_eq!(at(&staging) as i64 - at(&buckets[0]) as i64, want);
        // The buckets are the buffer's two halves, adjacent, zeroed.
        let half = p.buffers[b].numel as usize / 2;
        assert_eq!(
            (buckets[0].len(), buckets[1].len(), staging.len()),
            (half, half, p.buffers[s].numel as usize)
        );
        assert_eq!(at(&buckets[1]) - at(&buckets[0]), 4 * half as u64);
        assert!(buckets[1].iter().all(|&x| x == 0.0));
        assert!(r.carve("comm.pp.recv", 1).is_none());
        // The block outlives the resident while a region holds it.
        drop(r);
        assert!(staging.iter().all(|&x| x == 0.0));
    }

    #[test]
    #[should_panic(expected = "the planned buffer `comm.tp.staging` is carved twice")]
    fn a_buffer_carved_twice_is_refused() {
        let (mut r, _) = Resident::of_plan(&dp_tp_plan()).unwrap();
        let _first = r.carve("comm.tp.staging", 1);
        r.carve("comm.tp.staging", 1);
    }

    #[test]
    fn a_state_and_its_windows_are_carved_as_one_region_of_their_type() {
        use ferrotron_plan::state_regions::WEIGHTS;
        use half::bf16;
        let p = rank0(PlanLayout {
            dp: 2,
            zero: 3,
            ..PlanLayout::default()
        });
        let (mut r, l) = Resident::weights(&p).unwrap();
        let weights: Region<bf16> = r.carve_span(WEIGHTS[0]).unwrap();
        let master: Region<f32> = r.carve_span(WEIGHTS[1]).unwrap();
        let numel = |n: &str| p.find(n).unwrap().numel as usize;
        assert_eq!(
            (weights.len(), master.len()),
            (
                numel("params") + numel("zero3.param_windows"),
                numel("master")
            )
        );
        let id = p.buffers.iter().position(|b| b.name == "master").unwrap();
        let apart = master.as_ptr() as u64 - weights.as_ptr() as u64;
        assert_eq!(Some(apart), l.offset(id));
        assert_eq!(r.held(), l.bytes);
        assert!(weights.iter().all(|&x| x == bf16::ZERO));
        assert!(r.carve_span::<f32>(&["grads"]).is_none());
    }

    #[test]
    #[should_panic(expected = "the planned buffer `master` is F32, taken as Bf16")]
    fn a_buffer_taken_as_another_type_is_refused() {
        let p = rank0(PlanLayout::default());
        let (mut r, _) = Resident::weights(&p).unwrap();
        r.carve_span::<half::bf16>(&["master"]);
    }
}
