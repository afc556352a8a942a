//! The trainer's step allocates nothing of its own: once two steps have run (the gradients,
//! the communication buffers and the optimizer's moments made, at the plan's offsets), a step
//! — the loader's next batch, the micro-batches, the gradient sync (data parallelism's
//! buckets, ZeRO's shards and gathers), the norm, the clip and AdamW, the loss scale, the
//! pipeline's schedule, the tensor-parallel groups, the metrics with each dimension's bytes —
//! takes nothing from the heap but the kernels' scratch inside an op
//! (`ferrotron_engine::kernels::cpu::scratch`) and the communication backend's own work
//! inside a call (`ferrotron_dist::backends::internals`: a real MPI or NCCL allocates inside
//! too). Two kinds of allocation are the step's by design, and counted apart, each bounded:
//! - the activation arena's region (`memory::arena::in_arena_region`), which is the plan: one
//!   allocation of exactly the planned size while activations are live, at most once per
//!   micro-batch (given back between them so the optimizer step's memory is the plan's);
//! - the step's record, [`StepMetrics`](ferrotron_train::metrics::StepMetrics), which the step
//!   hands to its caller (the run keeps every step's in its summary and writes it as a metrics
//!   line): its GEMM name, every rank's memory (`rank_mem`, with several ranks) and each
//!   stage's bubble (`pp_bubble`, with a pipeline), one allocation each per step.
//!
//! Anything else a step allocates is memory no plan lists.
//!
//! Layouts covered: one rank in fp32, bf16 and fp16; dp 2 with ZeRO 0 to 3; tp 2; cp 2; a
//! mixture of experts with ep 2 (its token exchange); pp 2, 1F1B and interleaved; the
//! optimizer offloaded (to disk on the CPU, to the host from the emulated device); the
//! emulated device. What runs off the rank's thread is not counted (the disk offload's reader and
//! writer threads, `optim::disk_io`), the rank's side of their queues is.
//!
//! Counted by a global allocator on each rank's own thread (the one `run` trains the rank on:
//! with one thread per rank the kernels' parallel loops run there too) while each of steps 3
//! to 5 runs (`Trainer::train_step`; not the run's printing and writing between steps), armed
//! and disarmed by the run's step hook (`run::run_observed`). `HOT_PATH_TRACE=1` prints where
//! each counted allocation was made.

mod common;
use common::{llama_config, tiny_args, tiny_moe_model, tmp};
use ferrotron_dist::backends::internals::in_backend_internals;
use ferrotron_engine::kernels::cpu::scratch::in_kernel_scratch;
use ferrotron_train::alloc::Tracking;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::device::Device;
use ferrotron_train::memory::arena::in_arena_region;
use ferrotron_train::run::{run_observed, StepEdge};
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The trainer's own accounting (per-rank peaks against the plan) stays as in a run.
struct Counting;

static TRACE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Heap allocations made by this thread while `COUNTING` is set.
    static COUNT: Cell<usize> = const { Cell::new(0) };
    /// Of which, allocations of the activation arena's region.
    static ARENA: Cell<usize> = const { Cell::new(0) };
    /// Allowed and not in `COUNT`: the communication backend's own (reported, not checked).
    static BACKEND: Cell<usize> = const { Cell::new(0) };
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn count(bytes: usize) {
    if !COUNTING.with(|c| c.get()) || in_kernel_scratch() {
        return;
    }
    if in_backend_internals() {
        BACKEND.with(|n| n.set(n.get() + 1));
        return;
    }
    if in_arena_region() {
        ARENA.with(|n| n.set(n.get() + 1));
        return;
    }
    COUNT.with(|n| n.set(n.get() + 1));
    if TRACE.load(Ordering::Relaxed) {
        COUNTING.with(|c| c.set(false));
        let trace = std::backtrace::Backtrace::force_capture().to_string();
        let ours = trace.lines().filter(|l| l.contains("ferrotron"));
        let ours: Vec<_> = ours.take(8).map(str::trim).collect();
        eprintln!("{bytes} B at {}", ours.join(" < "));
        COUNTING.with(|c| c.set(true));
    }
}

// SAFETY: forwards to the tracking allocator; the thread-local cells are const-initialised,
// so touching them never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size());
        Tracking.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size());
        Tracking.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        Tracking.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        count(size);
        Tracking.realloc(p, l, size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The first step counted, and the last.
const FIRST: u64 = 3;
const LAST: u64 = 5;

/// Micro-batches per step.
const GRAD_ACC: u64 = 2;

/// A rank's heap allocations over steps 3 to 5: its arena's regions, and every other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Counted {
    arena: usize,
    other: usize,
    /// The communication backend's own, for the record.
    backend: usize,
}

/// Each rank's heap allocations over steps 3 to 5 of the tiny model's run with `args` changed
/// by `layout` (rank order).
fn step_allocations(name: &str, layout: impl FnOnce(&mut TrainArgs)) -> Vec<Counted> {
    TRACE.store(
        std::env::var_os("HOT_PATH_TRACE").is_some(),
        Ordering::Relaxed,
    );
    let out = tmp(&format!("step-allocs-{name}"));
    let mut a = tiny_args(&out, LAST);
    a.grad_acc = Some(GRAD_ACC);
    // One thread per rank: its kernels' parallel loops run on the rank's own thread (which is
    // the thread counted) and queue their work on its own deque.
    a.threads = Some(1);
    // Small buckets: several all-reduces per step.
    a.bucket_mb = Some(1);
    layout(&mut a);
    let counts = Arc::new(Mutex::new(Vec::new()));
    let seen = counts.clone();
    let hook = Arc::new(move |e: StepEdge| {
        if !(FIRST..=LAST).contains(&e.step) {
            return;
        }
        if e.step == FIRST && !e.done {
            COUNT.with(|n| n.set(0));
            ARENA.with(|n| n.set(0));
            BACKEND.with(|n| n.set(0));
        }
        COUNTING.with(|c| c.set(!e.done));
        if e.step == LAST && e.done {
            let counted = Counted {
                arena: ARENA.with(Cell::get),
                other: COUNT.with(Cell::get),
                backend: BACKEND.with(Cell::get),
            };
            seen.lock().unwrap().push((e.rank, counted));
        }
    });
    // One rank trains on the calling thread: on a worker of a pool of its own, so that its
    // kernels' loops queue on that worker's deque rather than injecting into the global
    // pool's queue (which allocates now and then, whatever the trainer does). `run` gives
    // every rank of several such a pool itself.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let steps = pool.install(|| run_observed(a, Some(hook))).unwrap().steps;
    assert_eq!(steps.len(), LAST as usize, "{name}");
    let mut counts = counts.lock().unwrap().clone();
    counts.sort();
    counts.into_iter().map(|(_, n)| n).collect()
}

/// Every rank of the run of `layout` (`ranks` of them, `pp` a pipeline) allocates in steps 3
/// to 5 nothing but its arena's region (at most once per micro-batch) and the steps' records.
fn assert_none(name: &str, layout: impl FnOnce(&mut TrainArgs), ranks: usize, pp: bool) {
    let counts = step_allocations(name, layout);
    eprintln!("{name}: steps {FIRST}..={LAST}, per rank: {counts:?}");
    assert_eq!(counts.len(), ranks, "{name}: every rank counted");
    let steps = (LAST - FIRST + 1) as usize;
    // The record's GEMM name; every rank's memory with several; the stages' bubbles.
    let record = steps * (1 + (ranks > 1) as usize + pp as usize);
    for (rank, c) in counts.iter().enumerate() {
        assert_eq!(
            c.other, record,
            "{name} rank {rank}: heap allocations of steps {FIRST}..={LAST} beside the arena's, {record} of them the steps' records (HOT_PATH_TRACE=1 shows where)"
        );
        let micro_batches = steps * GRAD_ACC as usize;
        assert!(
            c.arena <= micro_batches,
            "{name} rank {rank}: {} arena regions in {micro_batches} micro-batches",
            c.arena
        );
    }
}

#[test]
fn one_rank_steps_allocate_nothing_outside_the_plan() {
    assert_none("fp32", |_| {}, 1, false);
    assert_none("bf16", |a| a.precision = Some("bf16".into()), 1, false);
    // fp16: the dynamic loss scale's checks and updates.
    assert_none("fp16", |a| a.precision = Some("fp16".into()), 1, false);
}

#[test]
fn data_parallel_steps_allocate_nothing_outside_the_plan() {
    // Without ZeRO (the gradient buckets all-reduced while the backward runs), ZeRO-1 (the
    // optimizer's shard, the weights all-gathered) and ZeRO-3 (the units gathered).
    for zero in [0, 1, 2, 3] {
        let layout = |a: &mut TrainArgs| {
            a.layout.dp = Some(2);
            a.layout.zero = Some(zero);
        };
        assert_none(&format!("dp2-zero{zero}"), layout, 2, false);
    }
}

#[test]
fn tensor_parallel_steps_allocate_nothing_outside_the_plan() {
    assert_none("tp2", |a| a.layout.tp = Some(2), 2, false);
}

#[test]
fn pipeline_steps_allocate_nothing_outside_the_plan() {
    let layout = |a: &mut TrainArgs| {
        a.layout.pp = Some(2);
        a.layout.pp_schedule = Some("1f1b".into());
    };
    assert_none("pp2-1f1b", layout, 2, true);
}

#[test]
fn context_parallel_steps_allocate_nothing_outside_the_plan() {
    assert_none("cp2", |a| a.layout.cp = Some(2), 2, false);
}

#[test]
fn expert_parallel_steps_allocate_nothing_outside_the_plan() {
    let dir = tmp("step-allocs-moe-model");
    let moe = tiny_moe_model(&dir);
    let layout = |a: &mut TrainArgs| {
        a.model = Some(moe.to_string_lossy().into());
        a.layout.ep = Some(2);
    };
    assert_none("moe-ep2", layout, 2, false);
}

#[test]
fn interleaved_pipeline_steps_allocate_nothing_outside_the_plan() {
    let dir = tmp("step-allocs-4-layers");
    let model = llama_config(&dir, 64, 160, 4);
    let layout = |a: &mut TrainArgs| {
        a.model = Some(model.to_string_lossy().into());
        a.layout.pp = Some(2);
        a.layout.pp_schedule = Some("interleaved".into());
        a.layout.pp_virtual = Some(2);
    };
    assert_none("pp2-interleaved", layout, 2, true);
}

#[test]
fn offloaded_optimizer_steps_allocate_nothing_outside_the_plan() {
    let disk = tmp("step-allocs-offload-dir");
    let layout = |a: &mut TrainArgs| {
        a.layout.offload = Some("optimizer".into());
        a.offload_bucket = Some(1 << 16);
        a.offload_dir = Some(disk.clone());
    };
    assert_none("offload-optimizer-disk", layout, 1, false);
    let layout = |a: &mut TrainArgs| {
        a.layout.offload = Some("optimizer".into());
        a.offload_bucket = Some(1 << 16);
        a.device = Device::Emulated;
    };
    assert_none("offload-optimizer-host", layout, 1, false);
}

#[test]
fn emulated_device_steps_allocate_nothing_outside_the_plan() {
    assert_none("emulated", |a| a.device = Device::Emulated, 1, false);
}
