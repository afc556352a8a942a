//! `--offload params` (ZeRO-Infinity's parameter offload): the weights and gradients in host
//! memory, each unit streamed through the device's windows one layer ahead. The arithmetic is
//! the plain run's (the windows are loaded with the host's gradient sums before each unit's
//! backward), so the trajectory must be the plain run's bit for bit; the device's memory must
//! fall by what the plan takes off it, and the host's must be the plan's. With `--zero 3` each
//! data-parallel rank keeps only its shard on the host (ZeRO-Infinity).

mod common;
use common::{
    assert_same_run, assert_transfers_as_planned, assert_within_plans, llama_config, rel,
    tiny_args, tmp,
};
use ferrotron_train::alloc::Tracking;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::device::Device;
use ferrotron_train::optim::host_tier::{host_live, host_peak, reset_host_peak};
use ferrotron_train::optim::offload::{last_plan, OffloadPlan};
use ferrotron_train::run::{run, RunSummary};

#[global_allocator]
static A: Tracking = Tracking;

/// The tests' tiny llama with 6 layers: with 2 the windows (embedding, head, two layers)
/// would be the whole model, and nothing could leave the device.
fn args(tag: &str, precision: &str, offload: Option<&str>) -> TrainArgs {
    let out = tmp(&format!("offload-params-{tag}-{precision}"));
    let mut a = tiny_args(&out, 4);
    let model = llama_config(&out, 64, 160, 6);
    a.model = Some(model.to_string_lossy().into());
    a.grad_acc = Some(2);
    a.eval_interval = Some(2);
    a.sample_tokens = Some(6);
    a.device = Device::Emulated;
    a.precision = Some(precision.into());
    a.layout.offload = offload.map(String::from);
    a
}

/// The validation losses' bits.
fn val(s: &ferrotron_train::run::RunSummary) -> Vec<u64> {
    let v = s.steps.iter().filter_map(|m| m.val_loss);
    v.map(|x| x.to_bits()).collect()
}

fn error(a: TrainArgs) -> String {
    format!("{:#}", run(a).unwrap_err())
}

/// What an offloaded run measured against its plain twin: both runs, the tier's plan, and the
/// host tier's peak during the offloaded run.
struct Pair {
    plain: RunSummary,
    off: RunSummary,
    plan: OffloadPlan,
    host: u64,
}

/// Runs `plain`, then `off` (the same run with `--offload params`), and checks what every
/// case shares: the host tier is freed with the run, the trajectory (and the evaluations,
/// which stream the weights too) are the plain run's bit for bit, and every rank is within
/// its plan.
fn against_plain(what: &str, plain: TrainArgs, off: TrainArgs) -> Pair {
    let plain = run(plain).unwrap();
    reset_host_peak();
    let before = host_live();
    let off = run(off).unwrap();
    assert_eq!(
        host_live(),
        before,
        "{what}: the host tier is freed with the run"
    );
    let host = host_peak() - before;
    let plan = last_plan().unwrap();
    assert_same_run(what, &plain, &off);
    assert_eq!(val(&plain).len(), 2, "{what}");
    assert_eq!(val(&plain), val(&off), "{what}: validation losses");
    assert_within_plans(&off.steps, what);
    Pair {
        plain,
        off,
        plan,
        host,
    }
}

/// The host tier's measured peak against `ranks` in-process ranks' planned tiers.
fn host_within_plan(what: &str, p: &Pair, ranks: u64) {
    let planned = (ranks * p.plan.host_bytes) as f64;
    assert!(
        rel(p.host as f64, planned) < 0.01,
        "{what}: host {}, planned {planned}, {:?}",
        p.host,
        p.plan
    );
}

/// The tiny llama's parameters: the 8192 × 64 tied embedding, 6 layers of 43,136 and the
/// final norm's 64.
const PARAMS: u64 = 8192 * 64 + 6 * 43_136 + 64;

/// One test: the tracking allocator's and the host tier's counters are the process's.
#[test]
fn streamed_parameters_follow_the_plain_run_within_their_plan() {
    for precision in ["fp32", "bf16"] {
        let what = format!("{precision}: --offload params on the device");
        let plain = args("plain", precision, None);
        let p = against_plain(&what, plain, args("params", precision, Some("params")));
        let (plain, off, plan) = (&p.plain, &p.off, p.plan);
        // The device's peak falls by what the plan takes off it: the weights, gradients and
        // optimizer states, less the windows.
        let planned = plain.planned_peak as f64 - off.planned_peak as f64;
        let fell = plain.measured_peak as f64 - off.measured_peak as f64;
        assert!(
            planned > plan.host_bytes as f64 / 2.0,
            "{what}: {planned} {plan:?}"
        );
        assert!(
            rel(fell, planned) < 0.01,
            "{what}: fell {fell}, planned {planned}"
        );
        // The host holds every weight, gradient and optimizer state, 16 bytes a parameter
        // either way (fp32: 4 + 4 + 8 of moments; bf16: 2 + 2 + 4 of master weights + 8); and
        // no staging.
        assert_eq!(plan.host_bytes, 16 * PARAMS, "{what}");
        assert_eq!(
            (plan.staging_bytes, plan.host_bytes),
            (0, plan.states_bytes)
        );
        host_within_plan(&what, &p, 1);
        // Each of the 2 micro-batches brings every gradient down; the weights go up by the
        // schedule, and the gradient sums once more, before the second micro-batch.
        let t = assert_transfers_as_planned(&off.steps, &what);
        let g = if precision == "fp32" { 4 } else { 2 };
        assert_eq!(t.planned_down, 2 * g * PARAMS, "{what}");
        assert!(t.planned_up > g * PARAMS, "{what}: {t:?}");
    }
    data_parallel_ranks_stream_the_whole_model_each();
    zero3_ranks_stream_their_shards();
    let mut tp = args("tp", "fp32", Some("params"));
    tp.layout.tp = Some(2);
    assert_eq!(
        error(tp),
        "offload = params: not with --tp 2 yet (each data-parallel rank streams the whole model): drop --tp, or --offload"
    );
    let mut zero = args("zero", "fp32", Some("params"));
    (zero.layout.dp, zero.layout.zero) = (Some(2), Some(1));
    assert_eq!(
        error(zero),
        "offload = params: not with --zero 1 (each of the 2 data-parallel ranks would keep the whole weights in host memory): use --zero 3 (each rank keeps its shard), drop --zero, or --offload"
    );
    let mut cpu = args("cpu", "fp32", Some("params"));
    cpu.device = Device::Cpu;
    assert_eq!(
        error(cpu),
        "offload = params: a CPU run keeps its weights in host memory already, so there is nothing to stream: add --device emulated (or cuda), or drop --offload"
    );
}

/// bf16 with `--dp 2` and `zero` (ZeRO stage), with or without `--offload params`.
fn dp2(tag: &str, zero: u64, offload: Option<&str>) -> TrainArgs {
    let mut a = args(tag, "bf16", offload);
    (a.layout.dp, a.layout.zero) = (Some(2), Some(zero));
    a
}

/// `--dp 2`: each rank streams the whole model from its own host copy, and the last backward
/// all-reduces each unit's host gradients in the plan's f32 buckets as it completes: the
/// trajectory is the plain dp 2 run's, each rank within its plan, and the host holds each
/// rank's planned tier.
fn data_parallel_ranks_stream_the_whole_model_each() {
    let what = "bf16, dp 2: --offload params on the device";
    let p = against_plain(
        what,
        dp2("dp-plain", 0, None),
        dp2("dp-params", 0, Some("params")),
    );
    assert!(p.off.steps.iter().all(|m| m.rank_mem.len() == 2), "{what}");
    // Every rank holds the whole model's 16 B/param (as one rank above), at once.
    assert_eq!(p.plan.host_bytes, 16 * PARAMS, "{what}");
    host_within_plan(what, &p, 2);
    // Each rank streams as one rank does (its reduction is on host memory).
    assert_transfers_as_planned(&p.off.steps, what);
}

/// `--dp 2 --zero 3` (ZeRO-Infinity): each rank's host holds its half of every unit, the
/// windows are all-gathered from the two host shards and the gradients reduce-scattered back
/// into them: the trajectory is the plain `--dp 2 --zero 3` run's, the device holds only the
/// windows and buckets, and each rank's host half the whole model's states.
fn zero3_ranks_stream_their_shards() {
    let what = "bf16, dp 2, zero 3: --offload params on the device";
    let p = against_plain(
        what,
        dp2("z3-plain", 3, None),
        dp2("z3-params", 3, Some("params")),
    );
    assert!(p.off.steps.iter().all(|m| m.rank_mem.len() == 2), "{what}");
    // Every unit's length is even here, so each rank's shard is exactly half of it.
    assert_eq!(p.plan.host_bytes, 16 * PARAMS / 2, "{what}");
    host_within_plan(what, &p, 2);
    // The device no longer holds the shard's 16 B/param: its peak falls by that.
    let planned = p.plain.planned_peak as f64 - p.off.planned_peak as f64;
    let fell = p.plain.measured_peak as f64 - p.off.measured_peak as f64;
    assert!(
        rel(planned, p.plan.host_bytes as f64) < 0.01,
        "{what}: planned fall {planned}, {:?}",
        p.plan
    );
    assert!(
        rel(fell, planned) < 0.01,
        "{what}: fell {fell}, planned {planned}"
    );
}
