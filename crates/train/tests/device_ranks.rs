//! Several ranks on the emulated device (`--device emulated --dp N`, threads backend): every
//! rank's weights, gradients, Adam's moments and activations in memory the host may not read
//! (`kernels::device_check`), its data-parallel buckets staging the device's gradients through
//! the host (`device_ranks`). The CPU kernels compute and the buckets widen and round as the
//! host path does, so data parallelism without ZeRO and with ZeRO-1, 2 and 3 gives the CPU run's
//! trajectory bit for bit, each rank within its own plan; so do tensor, pipeline, context
//! and expert parallelism (a mixture of experts, on one rank and several). Evaluation, sampling and the checkpoint (each reading the
//! state back from the device) match the CPU run's too.

mod common;
use common::{assert_within_plans, tiny_args, tmp};
use ferrotron_train::alloc::Tracking;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::device::Device;
use ferrotron_train::metrics::StepMetrics;
use ferrotron_train::run::{run, RunSummary};
use std::path::PathBuf;

// Each rank's memory is measured by the tracking allocator (per rank: ranks are threads).
#[global_allocator]
static A: Tracking = Tracking;

/// Ranks are counted by rank number in one process: two runs at once would charge each
/// other's rank 0, so the runs of this file take turns.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A change to the tiny run's layout (and precision).
type Set = fn(&mut TrainArgs);

/// The run's summary and its output directory (with the checkpoint the run ends with).
fn train(device: Device, what: &str, set: &dyn Fn(&mut TrainArgs)) -> (RunSummary, PathBuf) {
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tag: String = what.chars().filter(|c| c.is_alphanumeric()).collect();
    let out = tmp(&format!("ranks-{device:?}-{tag}"));
    let mut a = tiny_args(&out, 3);
    (a.mbs, a.grad_acc) = (Some(2), Some(2));
    // Small buckets: several reductions per step, some tensors split across two.
    a.bucket_mb = Some(1);
    // An evaluation, a sample and a checkpoint: each reads the state back from the device.
    (a.eval_interval, a.eval_batches, a.sample_tokens) = (Some(2), Some(1), Some(6));
    a.checkpoint_dir = Some(out.join("ck"));
    a.device = device;
    set(&mut a);
    let s = run(a).unwrap_or_else(|e| panic!("{what} on {device:?}: {e:#}"));
    (s, out)
}

/// `what` (a layout over `ranks` ranks, made by `set`) on the emulated device: the CPU run's
/// losses, norms, val losses, sample and checkpoint bit for bit, every rank within its plan.
fn device_equals_cpu(what: &str, ranks: usize, set: &dyn Fn(&mut TrainArgs)) {
    let (cpu, cpu_dir) = train(Device::Cpu, what, set);
    let (dev_run, dev_dir) = train(Device::Emulated, what, set);
    let dev = &dev_run.steps;
    assert_eq!(cpu.steps.len(), dev.len(), "{what}");
    for (c, d) in cpu.steps.iter().zip(dev) {
        let at = format!("{what} step {}", c.step);
        assert_eq!(c.loss.to_bits(), d.loss.to_bits(), "{at}: loss");
        assert_eq!(c.grad_norm.to_bits(), d.grad_norm.to_bits(), "{at}: norm");
        let val = |m: &StepMetrics| m.val_loss.map(f64::to_bits);
        assert_eq!(val(c), val(d), "{at}: val loss");
        // One rank reports its own peaks (the per-rank table is of several).
        let reports = if ranks > 1 { ranks } else { 0 };
        assert_eq!(d.rank_mem.len(), reports, "{at}: every rank reports");
        if ranks == 1 {
            let (m, p) = (d.mem_peak_measured as f64, d.mem_peak_planned as f64);
            assert!(
                (m - p).abs() < 0.01 * p,
                "{at}: measured {m} B, planned {p} B"
            );
        }
    }
    assert!(dev[1].val_loss.is_some(), "{what}: evaluated");
    assert_eq!(cpu.sample, dev_run.sample, "{what}: sample");
    assert!(
        dev_run.sample.as_ref().is_some_and(|s| !s.is_empty()),
        "{what}"
    );
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let read = |d: &PathBuf| std::fs::read(d.join("ck").join(f)).unwrap();
        assert!(read(&cpu_dir) == read(&dev_dir), "{what}: {f} differs");
    }
    // The weights moved: a step that left them alone would repeat the first loss.
    assert_ne!(dev[0].loss, dev[2].loss, "{what}");
    assert_within_plans(dev, &format!("{what} on the device"));
}

#[test]
fn data_parallel_device_ranks_give_the_cpu_ranks_bits_within_their_plans() {
    for (dp, zero, precision) in [
        (2, 0, "fp32"),
        (4, 0, "bf16-fp32grads"),
        (2, 1, "bf16"),
        (4, 2, "fp16"),
        (2, 3, "fp32"),
        (4, 3, "bf16"),
    ] {
        let what = format!("dp {dp} ZeRO-{zero} {precision}");
        device_equals_cpu(&what, dp as usize, &|a: &mut TrainArgs| {
            (a.layout.dp, a.layout.zero) = (Some(dp), Some(zero));
            a.precision = Some(precision.into());
        });
    }
}

/// The tiny model with `n` layers (a pipeline of 2 stages × 2 chunks needs 4).
fn layers(a: &TrainArgs, n: u64) {
    let p = a.model.as_ref().expect("tiny_args writes a model");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    cfg["num_hidden_layers"] = n.into();
    std::fs::write(p, cfg.to_string()).unwrap();
}

/// The model-parallel layouts the device ranks run: each `(name, ranks, set)`.
const MODEL_PARALLEL: [(&str, usize, Set); 7] = [
    ("tp 2 fp32", 2, |a| a.layout.tp = Some(2)),
    // Sequence parallelism's gathers and reduce-scatters, and its norm sums, on 16-bit
    // activations and gradients, beside data parallelism.
    ("tp 2 sp dp 2 ZeRO-1 bf16", 4, |a| {
        (a.layout.tp, a.layout.sp) = (Some(2), Some(true));
        (a.layout.dp, a.layout.zero) = (Some(2), Some(1));
        a.precision = Some("bf16".into());
    }),
    // Every schedule: the stages' activations and gradients sent from and received into the
    // device, and the tied embedding's two copies summed.
    ("pp 2 afab fp32", 2, |a| {
        a.layout.pp = Some(2);
        a.layout.pp_schedule = Some("afab".into());
    }),
    ("pp 2 1f1b dp 2 bf16", 4, |a| {
        (a.layout.pp, a.layout.dp) = (Some(2), Some(2));
        a.layout.pp_schedule = Some("1f1b".into());
        a.precision = Some("bf16".into());
    }),
    ("pp 2 interleaved v 2 fp32", 2, |a| {
        layers(a, 4);
        (a.layout.pp, a.layout.pp_virtual) = (Some(2), Some(2));
        a.layout.pp_schedule = Some("interleaved".into());
    }),
    // The ring's key/value blocks (and their gradients) widened into device blocks, sent
    // from and received into them.
    ("cp 2 fp32", 2, |a| a.layout.cp = Some(2)),
    ("cp 2 dp 2 bf16", 4, |a| {
        (a.layout.cp, a.layout.dp) = (Some(2), Some(2));
        a.precision = Some("bf16".into());
    }),
];

#[test]
fn model_parallel_device_ranks_give_the_cpu_ranks_bits_within_their_plans() {
    for (what, ranks, set) in MODEL_PARALLEL {
        device_equals_cpu(what, ranks, &set);
    }
}

/// The tiny mixture of experts (4 experts, top 2) in place of the tiny dense model.
fn experts(a: &mut TrainArgs) {
    let model = common::tiny_moe_model(&tmp("ranks-moe-model"));
    a.model = Some(model.to_string_lossy().into());
}

/// A mixture of experts on the device: its router's statistics in a device buffer, its
/// routing read back to the host for the per-expert grouping; under expert parallelism each
/// exchange's device blocks staged through the group's message buffer.
const MIXTURE_OF_EXPERTS: [(&str, usize, Set); 2] = [
    ("moe fp32", 1, experts),
    // The rows and routing weights widened into and rounded out of the f32 exchange.
    ("moe ep 2 bf16", 2, |a| {
        experts(a);
        a.layout.ep = Some(2);
        a.precision = Some("bf16".into());
    }),
];

#[test]
fn mixture_of_experts_device_ranks_give_the_cpu_ranks_bits_within_their_plans() {
    for (what, ranks, set) in MIXTURE_OF_EXPERTS {
        device_equals_cpu(what, ranks, &set);
    }
}
