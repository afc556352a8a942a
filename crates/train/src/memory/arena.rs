//! The rank's activation arena: one region, sized by the memory plan, in which every buffer the
//! engine asks for sits at the offset the plan assigned it (`ferrotron_plan::arena`).
//!
//! The region is the lifetime class "one micro-batch": it is allocated when the first of its
//! buffers is asked for (the embedding's output) and freed when the last goes back (the
//! backward's scratch), so the process holds it exactly while the plan has activations live,
//! and the tracking allocator sees one allocation of exactly the planned size. (The tracking
//! allocator keeps the freed region for the next micro-batch: `big_blocks`.) Inside it, each request is
//! checked against the plan: the name must be a plan buffer, the size the planned size, and the
//! bytes must overlap no buffer still live. A mismatch is an engine bug and panics with both
//! names.

use anyhow::bail;
use ferrotron_engine::kernels::{DeviceAlloc, Memory};
use ferrotron_engine::model::{BufName, BUF_ALIGN};
use ferrotron_plan::arena::{arena_layout, ArenaLayout};
use ferrotron_plan::memory::{Category, Op, Phase};
use ferrotron_plan::tensors::{Edge, LayerTensor};
use ferrotron_plan::MemoryPlan;
use std::alloc::Layout;
use std::cell::Cell;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

/// Where one buffer lives in the region.
#[derive(Clone, Copy, Debug)]
struct Slot {
    offset: u64,
    bytes: u64,
}

/// A live buffer: its bytes in the region, and its name for messages.
#[derive(Clone, Copy, Debug)]
struct Live {
    start: u64,
    end: u64,
    name: BufName,
    slot: u64,
}

#[derive(Debug)]
pub struct Arena {
    layout: Layout,
    /// The region while any buffer is live.
    region: Option<NonNull<u8>>,
    /// By name and in-flight slot (`name@slot` in the plan: a pipeline stage holds several
    /// micro-batches' activations at once, `ferrotron_plan::schedule::slots`).
    slots: HashMap<(BufName, u64), Slot>,
    /// The in-flight slot of the work running now (set by the pipeline before each piece of
    /// work; 0 without pipelining). A name without a buffer of this slot is the slot-0 one.
    slot: u64,
    /// Reserved for as many buffers as the plan has, so the hot path never grows it.
    live: Vec<Live>,
    /// Bytes of live buffers (as planned, without alignment padding).
    in_use: u64,
    /// The device the region lives on (`None`: the host's heap).
    device: Option<Arc<dyn DeviceAlloc>>,
}

// SAFETY: the arena owns its region; buffers handed out are used by the thread that runs the
// engine with this arena.
unsafe impl Send for Arena {}

/// The buffers of a plan that live in the arena: activations and workspace that appear after
/// the plan's `model init` mark (the engine's per-micro-batch buffers). The ones allocated
/// before it (token batches, RoPE tables) are persistent and stay plain allocations.
pub fn members(plan: &MemoryPlan) -> Vec<bool> {
    let mut member = vec![false; plan.buffers.len()];
    let mut after_init = false;
    for op in &plan.program {
        match *op {
            Op::Mark {
                phase: Phase::Init, ..
            } => after_init = true,
            Op::Alloc(i) if after_init => {
                member[i] = matches!(
                    plan.buffers[i].category,
                    Category::LayerActivations | Category::OtherActivations | Category::Workspace
                );
            }
            _ => {}
        }
    }
    member
}

impl Arena {
    /// The arena of `plan`'s per-micro-batch buffers for a model of `layers` layers, or why
    /// they cannot share one (or are not the engine's).
    pub fn of_plan(plan: &MemoryPlan, layers: usize) -> anyhow::Result<(Self, ArenaLayout)> {
        let member = members(plan);
        let placed =
            arena_layout(plan, |i| member[i]).map_err(|e| anyhow::anyhow!("memory plan: {e}"))?;
        let by_name: HashMap<String, BufName> =
            engine_names(layers).map(|n| (n.to_string(), n)).collect();
        let mut slots = HashMap::new();
        for (id, b) in plan.buffers.iter().enumerate() {
            let Some(offset) = placed.offset(id) else {
                continue;
            };
            let (base, slot) = match b.name.split_once(ferrotron_plan::planner::SLOT_MARK) {
                Some((base, s)) => (base, s.parse::<u64>().unwrap_or(0)),
                None => (b.name.as_str(), 0),
            };
            let Some(&name) = by_name.get(base) else {
                bail!(
                    "internal: the memory plan has `{}`, which the engine never allocates",
                    b.name
                );
            };
            let placed = Slot {
                offset,
                bytes: b.bytes(),
            };
            slots.insert((name, slot), placed);
        }
        let layout = Layout::from_size_align(placed.bytes.max(1) as usize, BUF_ALIGN)?;
        let arena = Arena {
            layout,
            region: None,
            live: Vec::with_capacity(slots.len()),
            slots,
            slot: 0,
            in_use: 0,
            device: None,
        };
        Ok((arena, placed))
    }

    /// Places the region in `device`'s memory from now on (before any buffer is placed).
    pub fn on_device(&mut self, device: Arc<dyn DeviceAlloc>) {
        assert!(
            self.region.is_none(),
            "internal: the arena moves while in use"
        );
        self.device = Some(device);
    }

    /// Where the buffers placed here live.
    pub fn memory(&self) -> Memory {
        self.device.as_ref().map_or(Memory::Host, |d| d.memory())
    }

    fn alloc_region(&self) -> NonNull<u8> {
        let _planned = PlannedRegion::enter();
        match &self.device {
            Some(d) => d.alloc(self.layout.size()).unwrap_or_else(|e| {
                panic!(
                    "the activation arena ({} bytes, as planned): {e}",
                    self.layout.size()
                )
            }),
            None => {
                // SAFETY: the layout has a non-zero size.
                let p = unsafe { std::alloc::alloc(self.layout) };
                NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(self.layout))
            }
        }
    }

    fn free_region(&mut self) {
        if let Some(p) = self.region.take() {
            match &self.device {
                // SAFETY: allocated by `alloc_region` with this size.
                Some(d) => unsafe { d.free(p, self.layout.size()) },
                // SAFETY: allocated in `alloc_region` with this layout.
                None => unsafe { std::alloc::dealloc(p.as_ptr(), self.layout) },
            }
        }
    }

    /// Frees the region if no buffer is live. A device keeps its region across micro-batches
    /// (`DeviceAlloc::keeps_regions`); the trainer gives it back where the plan has no
    /// activations (the optimizer step, after an evaluation), so the memory is the plan's there
    /// too: at step 1 Adam's new moments would otherwise sit on top of it.
    pub fn trim(&mut self) {
        if self.live.is_empty() {
            self.free_region();
        }
    }

    /// The region, placed now if it is not held: its address. A captured micro-batch
    /// (`--cuda-graph`) holds it before the capture and before each replay, so the region's
    /// placement (an allocation, which a capture cannot hold) is outside the graph and the
    /// graph's addresses can be checked against it.
    pub fn hold(&mut self) -> usize {
        if self.region.is_none() {
            self.region = Some(self.alloc_region());
        }
        self.region.expect("placed above").as_ptr() as usize
    }

    /// Bytes of the region while it is held, else 0.
    pub fn held(&self) -> u64 {
        if self.region.is_some() {
            self.layout.size() as u64
        } else {
            0
        }
    }

    /// Bytes of the buffers live now, as the plan counts them.
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Sets the in-flight slot of the work that runs next.
    pub fn set_slot(&mut self, slot: u64) {
        self.slot = slot;
    }

    /// The slot of buffer `name` in the work running now: its own for this in-flight slot,
    /// else the one buffer of that name (scratch shared by every micro-batch).
    fn find(&self, name: BufName) -> Option<((BufName, u64), Slot)> {
        let own = (name, self.slot);
        let shared = (name, 0);
        (self.slots.get(&own).map(|s| (own, *s)))
            .or_else(|| self.slots.get(&shared).map(|s| (shared, *s)))
    }

    /// The memory of buffer `name` of `bytes` bytes, at its planned offset.
    pub fn place(&mut self, name: BufName, bytes: u64) -> NonNull<u8> {
        let Some((key, slot)) = self.find(name) else {
            panic!("internal: the engine allocates `{name}`, which the memory plan does not have");
        };
        assert_eq!(
            slot.bytes, bytes,
            "internal: the engine allocates `{name}` with {bytes} bytes, the plan with {}",
            slot.bytes
        );
        let (start, end) = (slot.offset, slot.offset + bytes);
        if let Some(o) = self
            .live
            .iter()
            .find(|l| (l.name, l.slot) == key || (start < l.end && l.start < end))
        {
            panic!(
                "internal: `{name}` at bytes {start}..{end} of the arena meets live `{}` at {}..{}",
                o.name, o.start, o.end
            );
        }
        if self.region.is_none() {
            self.region = Some(self.alloc_region());
        }
        let region = self.region.expect("allocated above");
        self.live.push(Live {
            start,
            end,
            name,
            slot: key.1,
        });
        self.in_use += bytes;
        // SAFETY: offset + bytes is within the region (the plan placed it there).
        unsafe { region.add(start as usize) }
    }

    /// Buffer `name` is back; the region goes with the last live buffer.
    pub fn release(&mut self, name: BufName, bytes: u64) {
        let key = self.find(name).map_or((name, 0), |(k, _)| k);
        if let Some(i) = self.live.iter().position(|l| (l.name, l.slot) == key) {
            self.live.swap_remove(i);
            self.in_use -= bytes;
        }
        // A GPU keeps its region: its allocator would synchronise the device every micro-batch.
        let keep = self.device.as_ref().is_some_and(|d| d.keeps_regions());
        if self.live.is_empty() && !keep {
            self.free_region();
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.free_region();
    }
}

/// Every buffer name the engine can ask for, for a model of `layers` layers.
fn engine_names(layers: usize) -> impl Iterator<Item = BufName> {
    let per_layer = (0..layers as u32)
        .flat_map(|i| LayerTensor::ALL.iter().map(move |&t| BufName::Layer(i, t)));
    per_layer
        .chain(LayerTensor::ALL.iter().map(|&t| BufName::Recompute(t)))
        .chain(Edge::ALL.iter().map(|&e| BufName::Edge(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_plan::testing::{small_input, SMALL_MODEL};
    use ferrotron_plan::{plan, Layout, Recompute};

    fn arena(rc: Recompute) -> (Arena, ArenaLayout, MemoryPlan) {
        let mut input = small_input(Layout::default());
        input.recipe.recompute = rc;
        input.bucket_bytes = 0;
        let spec = ferrotron_plan::presets::resolve(SMALL_MODEL).unwrap();
        let p = plan(&input).unwrap().ranks.remove(0).plan;
        let (a, l) = Arena::of_plan(&p, spec.layers as usize).unwrap();
        (a, l, p)
    }

    fn bytes(p: &MemoryPlan, name: BufName) -> u64 {
        p.find(&name.to_string()).unwrap().bytes()
    }

    #[test]
    fn buffers_sit_at_their_planned_offsets_and_the_region_lives_with_them() {
        for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let (mut a, l, p) = arena(rc);
            // The default model packs without a byte lost.
            assert_eq!(l.fragmentation(), 0, "{rc}");
            let x = BufName::Layer(0, LayerTensor::Input);
            let logits = BufName::Edge(Edge::LogitsChunk);
            let px = a.place(x, bytes(&p, x));
            assert_eq!(a.held(), l.bytes);
            let pl = a.place(logits, bytes(&p, logits));
            let id = |n: BufName| p.buffers.iter().position(|b| b.name == n.to_string());
            let gap = pl.as_ptr() as u64 - px.as_ptr() as u64;
            let want = l.offset(id(logits).unwrap()).unwrap() - l.offset(id(x).unwrap()).unwrap();
            assert_eq!(gap, want);
            assert_eq!(a.in_use(), bytes(&p, x) + bytes(&p, logits));
            a.release(logits, bytes(&p, logits));
            a.release(x, bytes(&p, x));
            assert_eq!((a.held(), a.in_use()), (0, 0));
        }
    }

    #[test]
    #[should_panic(
        expected = "the engine allocates `act.last_hidden`, which the memory plan does not have"
    )]
    fn a_buffer_outside_the_plan_is_refused() {
        let (mut a, ..) = arena(Recompute::None);
        a.place(BufName::Edge(Edge::LastHidden), 64);
    }

    #[test]
    #[should_panic(expected = "the engine allocates `act.layers.0.q` with 8 bytes, the plan with")]
    fn a_size_other_than_the_plan_is_refused() {
        let (mut a, ..) = arena(Recompute::None);
        a.place(BufName::Layer(0, LayerTensor::Q), 8);
    }

    #[test]
    #[should_panic(expected = "`act.layers.1.q` at bytes")]
    fn a_buffer_allocated_twice_is_refused() {
        let (mut a, _, p) = arena(Recompute::None);
        let q = BufName::Layer(1, LayerTensor::Q);
        a.place(q, bytes(&p, q));
        a.place(q, bytes(&p, q));
    }
}

thread_local! {
    /// Whether this thread is allocating an arena's region.
    static PLACING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is allocating an activation arena's region: the plan's own allocation,
/// once per micro-batch at exactly the planned size (see the module comment), which the step's
/// hot-path test (`tests/step_hot_path.rs`) tells apart from memory no plan lists. (Reading it
/// never allocates, so a global allocator may ask.)
pub fn in_arena_region() -> bool {
    PLACING.with(Cell::get)
}

/// Marks this thread's allocation as an arena's region while it lives.
struct PlannedRegion(());

impl PlannedRegion {
    fn enter() -> Self {
        PLACING.with(|c| c.set(true));
        PlannedRegion(())
    }
}

impl Drop for PlannedRegion {
    fn drop(&mut self) {
        PLACING.with(|c| c.set(false));
    }
}
