//! Data parallelism on the threads backend (ranks as threads of one process): `dp` ranks, each
//! with its slice of every global batch, without ZeRO and with ZeRO-1, 2 and 3, follow the one-rank
//! trajectory of the same global batch, and every rank's measured peak is within 1% of its own
//! plan.

mod common;
use common::{f32_tensors, tiny_args, tmp};
use ferrotron_plan::cluster::Dim;
use ferrotron_plan::comm::{bytes_per_rank, Collective};
use ferrotron_train::alloc::Tracking;
use ferrotron_train::metrics::StepMetrics;
use ferrotron_train::run::run;

// Each rank's memory is measured by the tracking allocator (per rank: ranks are threads).
#[global_allocator]
static A: Tracking = Tracking;

/// The run's metrics and its parameter count (from the plan rank 0 writes).
fn train(dp: u64, zero: u64, mbs: u64, acc: u64, steps: u64) -> (Vec<StepMetrics>, u64) {
    train_in(
        &tmp(&format!("dp{dp}-z{zero}-{mbs}x{acc}")),
        dp,
        zero,
        mbs,
        acc,
        steps,
    )
}

/// Ranks are counted by rank number in one process: two runs at once would charge each other's
/// rank 0, so the tests of this file take turns.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn train_in(
    out: &std::path::Path,
    dp: u64,
    zero: u64,
    mbs: u64,
    acc: u64,
    steps: u64,
) -> (Vec<StepMetrics>, u64) {
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut a = tiny_args(out, steps);
    a.mbs = Some(mbs);
    a.grad_acc = Some(acc);
    a.layout.dp = Some(dp);
    a.layout.zero = Some(zero);
    a.checkpoint_dir = Some(out.join("checkpoint"));
    // Small buckets: several all-reduces per step, some tensors split across two.
    a.bucket_mb = Some(1);
    let steps = run(a).unwrap().steps;
    let plan = std::fs::read_to_string(out.join("plan.json")).unwrap();
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    (steps, plan["params"].as_u64().unwrap())
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / a).abs()
}

/// The loss and gradient norm of step `y` are those of `x` within 1e-5 relative.
fn same_step(what: &str, x: &StepMetrics, y: &StepMetrics) {
    for (name, a, b) in [
        ("loss", x.loss, y.loss),
        ("grad norm", x.grad_norm, y.grad_norm),
    ] {
        assert!(rel(a, b) < 1e-5, "{what}: {name} {a} vs {b}");
    }
}

#[test]
fn data_parallel_ranks_follow_the_one_rank_trajectory() {
    // A global batch of 8 sequences: one rank as 4×2, two ranks as 4×1 and 2×2, four ranks as
    // 2×1 and 1×2. The loader deals rank r the r-th block of each micro-batch's windows, so
    // every layout sees the same 8 sequences per step.
    let (one, _) = train(1, 0, 4, 2, 6);
    let layouts = [(2, 4, 1), (2, 2, 2), (4, 2, 1), (4, 1, 2)];
    let mut peaks = std::collections::HashMap::new();
    let stages = |l| [(l, 0), (l, 1), (l, 2), (l, 3)];
    for ((dp, mbs, acc), zero) in layouts.into_iter().flat_map(stages) {
        let (s, params) = train(dp, zero, mbs, acc, 6);
        let last = &s[5].rank_mem[0];
        peaks.insert(
            (dp, mbs, zero),
            (last.mem_peak_planned, last.mem_peak_measured),
        );
        assert_eq!(s.len(), 6);
        for (x, y) in one.iter().zip(&s) {
            let what = format!("dp {dp} zero {zero} {mbs}x{acc} step {}", x.step);
            same_step(&what, x, y);
            assert_eq!(y.rank_mem.len(), dp as usize, "{what}: one entry per rank");
            for r in &y.rank_mem {
                let dev = rel(r.mem_peak_planned as f64, r.mem_peak_measured as f64);
                assert!(dev < 0.01, "{what} rank {}: {r:?}", r.rank);
            }
            // Every gradient is all-reduced once per step, as f32 (ring bytes per rank); under
            // ZeRO-1 reduce-scattered and the parameters all-gathered, padded to dp blocks;
            // under ZeRO-2 reduce-scattered after every micro-batch. ZeRO-3 pads each unit
            // (the tied embedding of 8192 × 64, each of the 2 layers, the final norm of 64)
            // and gathers each once per step: both layers fit the two layer windows, so the
            // backward and the next micro-batches find them there.
            let padded = 4.0 * params.next_multiple_of(dp) as f64;
            let scatter = bytes_per_rank(Collective::ReduceScatter, padded, dp);
            let gather = bytes_per_rank(Collective::AllGather, padded, dp);
            let (embed, norm) = (8192 * 64, 64);
            let layer = (params - embed - norm) / 2;
            let units = [embed, layer, layer, norm].map(|u| u.next_multiple_of(dp));
            let unit_bytes = 4.0 * units.iter().sum::<u64>() as f64;
            let bytes = match zero {
                0 => bytes_per_rank(Collective::AllReduce, 4.0 * params as f64, dp),
                1 => scatter + gather,
                2 => acc as f64 * scatter + gather,
                _ => {
                    acc as f64 * bytes_per_rank(Collective::ReduceScatter, unit_bytes, dp)
                        + bytes_per_rank(Collective::AllGather, unit_bytes, dp)
                }
            };
            assert_eq!(y.comm_sent(Dim::Dp), Some(bytes.round() as u64), "{what}");
        }
    }
    // Each ZeRO stage changes every rank's peak by what the plan says: ZeRO-1 drops most of
    // the optimizer states; ZeRO-2 drops most of the gradients but keeps windows of the
    // embedding, head and one layer, which on this tiny model (a tied embedding of most of its
    // parameters) cost more than the shard saves; ZeRO-3 shards the weights but keeps windows
    // of the embedding, the head and two layers, all of this 2-layer model. (The default
    // model's ranks do fall at each stage: crates/train/tests/run_mpi_train.sh.)
    for (dp, mbs) in [(2, 4), (4, 2)] {
        for zero in [1, 2, 3] {
            let (p0, m0) = peaks[&(dp, mbs, zero - 1)];
            let (p1, m1) = peaks[&(dp, mbs, zero)];
            let (planned, measured) = (p0 as f64 - p1 as f64, m0 as f64 - m1 as f64);
            let what = format!("dp {dp} ZeRO-{zero}");
            assert!(
                zero >= 2 || planned > 0.0,
                "{what} plans {p1} B, the stage before {p0} B"
            );
            assert!(
                (planned - measured).abs() < 0.005 * p0 as f64,
                "{what} saves {measured} B measured, {planned} B planned (peak {p0} B)"
            );
        }
    }
}

#[test]
fn a_sharded_checkpoint_holds_every_parameters_states_and_weights() {
    // The same run with the states replicated and sharded over 4 ranks (ZeRO-1; ZeRO-3 also
    // shards the weights): the checkpoint of a sharded one gathers every rank's blocks, so the
    // files hold the same tensors.
    let plain = tmp("ckpt-dp4-z0");
    train_in(&plain, 4, 0, 2, 1, 3);
    for zero in [1, 3] {
        let sharded = tmp(&format!("ckpt-dp4-z{zero}"));
        train_in(&sharded, 4, zero, 2, 1, 3);
        for file in ["optimizer.safetensors", "model.safetensors"] {
            let ck = |d: &std::path::Path| f32_tensors(&d.join("checkpoint").join(file));
            let (a, b) = (ck(&plain), ck(&sharded));
            let names: Vec<&str> = a.iter().map(|t| t.0.as_str()).collect();
            let nb: Vec<&str> = b.iter().map(|t| t.0.as_str()).collect();
            assert_eq!(names, nb, "ZeRO-{zero} {file}");
            if file.starts_with("optimizer") {
                assert_eq!(names, ["exp_avg", "exp_avg_sq"]);
            }
            for ((name, x), (_, y)) in a.iter().zip(&b) {
                assert_eq!(x.len(), y.len(), "{name}");
                let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let worst = x
                    .iter()
                    .zip(y)
                    .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(
                    scale > 0.0 && worst <= 1e-5 * scale,
                    "ZeRO-{zero} {name}: differs by {worst} (max {scale})"
                );
            }
        }
    }
}

#[test]
fn the_planned_bytes_are_the_bytes_sent_in_every_precision() {
    // Gradients are reduced and parameters gathered through f32 buffers whatever the storage
    // type, and the plan counts them so: a bf16 run sends what an fp32 one does.
    for (precision, zero) in [("bf16", 1), ("bf16", 3), ("fp16", 2)] {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let out = tmp(&format!("bytes-{precision}-{zero}"));
        let mut a = tiny_args(&out, 2);
        (a.mbs, a.layout.dp, a.layout.zero) = (Some(4), Some(2), Some(zero));
        a.precision = Some(precision.into());
        for m in run(a).unwrap().steps {
            let what = format!("{precision} ZeRO-{zero} step {}", m.step);
            assert!(m.comm_sent(Dim::Dp).is_some_and(|b| b > 0), "{what}");
            assert_eq!(m.comm_sent(Dim::Dp), m.comm_planned(Dim::Dp), "{what}");
        }
    }
}

#[test]
fn a_run_resumes_on_another_layout_and_goes_on_along_the_same_trajectory() {
    // Eight sequences a step throughout. Stopped after step 3 on dp 2 with ZeRO-1 (each rank
    // writing its shard of the checkpoint), resumed on dp 4 with ZeRO-2, on dp 2 with ZeRO-3
    // and on one rank, each rank reading its own blocks back: steps 4–6 follow the
    // uninterrupted dp 2 run.
    let straight = tmp("resume-straight");
    let (whole, _) = train_in(&straight, 2, 1, 2, 2, 6);
    let first = tmp("resume-first");
    let ck = first.join("checkpoint");
    {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut a = tiny_args(&first, 6);
        (a.mbs, a.grad_acc, a.stop_after) = (Some(2), Some(2), Some(3));
        (a.layout.dp, a.layout.zero) = (Some(2), Some(1));
        a.checkpoint_dir = Some(ck.clone());
        assert_eq!(run(a).unwrap().steps.len(), 3);
    }
    // `--zero 3` alone keeps the checkpoint's dp 2.
    for (flag, zero, mbs) in [(Some(4), 2, 1), (None, 3, 2), (Some(1), 0, 4)] {
        let dp = flag.unwrap_or(2);
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let out = tmp(&format!("resume-dp{dp}"));
        let mut a = tiny_args(&out, 6);
        (a.resume, a.data, a.model, a.warmup) = (Some(ck.clone()), None, None, None);
        (a.mbs, a.grad_acc) = (Some(mbs), Some(2));
        a.checkpoint_dir = Some(out.join("checkpoint"));
        (a.layout.dp, a.layout.zero) = (flag, Some(zero));
        let rest = run(a).unwrap().steps;
        assert_eq!(rest.len(), 3, "dp {dp}: steps 4 to 6");
        for (x, y) in whole[3..].iter().zip(&rest) {
            assert_eq!(x.step, y.step);
            let what = format!("resumed on dp {dp} ZeRO-{zero}, step {}", y.step);
            same_step(&what, x, y);
            let ranks = if dp > 1 { dp as usize } else { 0 };
            assert_eq!(y.rank_mem.len(), ranks, "{what}: one entry per rank");
        }
    }
    // The sequences per step stay the checkpoint's.
    let mut a = tiny_args(&tmp("resume-bad"), 6);
    (a.resume, a.data, a.model, a.warmup) = (Some(ck), None, None, None);
    (a.layout.dp, a.mbs, a.grad_acc) = (Some(4), Some(2), Some(2));
    let e = run(a).unwrap_err().to_string();
    assert_eq!(
        e,
        "mbs = 2: with grad_acc = 2 and dp = 4 a step trains 16 sequences, the checkpoint's 8 (mbs 2 × grad_acc 2 × dp 2); a resumed run keeps the sequences per step"
    );
}

#[test]
fn the_trace_shows_each_collective_on_its_own_track() {
    // dp 2 with ZeRO-1 and 1 MiB buckets: every bucket's reduce-scatter and all-gather is an
    // event on the communication track of each rank's row of the trace, and the time blocked
    // on them is part of the step.
    let out = tmp("trace-comm");
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut a = tiny_args(&out, 2);
    (a.layout.dp, a.layout.zero, a.bucket_mb) = (Some(2), Some(1), Some(1));
    a.trace = Some(out.join("trace.json"));
    let steps = run(a).unwrap().steps;
    for m in &steps {
        let e = m
            .comm_exposed_ms
            .expect("a data-parallel step reports its exposed time");
        assert!(
            (0.0..=m.step_ms).contains(&e),
            "step {}: {e} ms of {}",
            m.step,
            m.step_ms
        );
    }
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let comm: Vec<&str> = events
        .iter()
        .filter(|e| e["cat"] == "comm" && e["pid"] == 0)
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    let track = events
        .iter()
        .find(|e| e["args"]["name"] == "collectives in flight")
        .expect("the communication track is named");
    assert!(events
        .iter()
        .filter(|e| e["cat"] == "comm")
        .all(|e| e["tid"] == track["tid"]));
    let scatters = comm.iter().filter(|n| **n == "reduce-scatter").count();
    let gathers = comm.iter().filter(|n| **n == "all-gather").count();
    assert!(scatters > 1, "{comm:?}");
    assert_eq!(
        scatters, gathers,
        "one all-gather per bucket reduced: {comm:?}"
    );
    // One file, a process row per rank (named), each with its kernels and its collectives.
    for rank in 0..2 {
        let named = format!("rank {rank}");
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == named.as_str()),
            "{named} has its row"
        );
        for cat in ["kernel", "comm"] {
            assert!(
                events.iter().any(|e| e["pid"] == rank && e["cat"] == cat),
                "{named} has {cat} events"
            );
        }
    }
    assert!(
        !out.join("trace.json.rank1").exists(),
        "the part is merged and removed"
    );
}
