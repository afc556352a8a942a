//! A mixture of experts (Mixtral) in the trainer: it learns on the bundled corpus, every
//! recompute policy follows the same trajectory, data- and expert-parallel ranks follow the
//! one-rank trajectory of the same micro-batches, checkpoints resume across those layouts, and
//! every rank's measured peak is within 1% of its plan. (The model itself is golden-tested
//! against transformers: crates/engine/tests/golden.rs.)

mod common;
use common::{rel, shards, tiny_moe_model, tmp};
use ferrotron_train::alloc::Tracking;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::metrics::StepMetrics;
use ferrotron_train::run::run;

#[global_allocator]
static A: Tracking = Tracking;

/// Ranks are counted by rank number in one process: the runs of this file take turns.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn args(tag: &str, steps: u64) -> TrainArgs {
    let out = tmp(tag);
    TrainArgs {
        model: Some(tiny_moe_model(&out).to_string_lossy().into()),
        data: Some(shards().to_path_buf()),
        seq: Some(32),
        mbs: Some(4),
        steps: Some(steps),
        warmup: Some(2),
        eval_interval: Some(0),
        out_dir: Some(out),
        peak_gflops: Some(100.0),
        quiet: true,
        ..TrainArgs::default()
    }
}

fn train(a: TrainArgs) -> Vec<StepMetrics> {
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    run(a).unwrap().steps
}

fn within_plan(what: &str, s: &[StepMetrics]) {
    for m in s {
        for r in &m.rank_mem {
            let dev = rel(r.mem_peak_planned as f64, r.mem_peak_measured as f64);
            assert!(dev < 0.01, "{what} step {} rank {}: {r:?}", m.step, r.rank);
        }
    }
}

#[test]
fn a_mixture_of_experts_learns() {
    let mut a = args("moe-learns", 60);
    a.lr = Some(3e-3);
    let s = train(a);
    within_plan("60 steps", &s);
    let (first, last) = (s[0].loss, s[59].loss);
    assert!(first - last > 0.5, "loss {first} -> {last}");
}

#[test]
fn recompute_policies_follow_one_trajectory() {
    let run_with = |rc: &str| {
        let mut a = args(&format!("moe-rc-{rc}"), 4);
        a.recompute = Some(rc.into());
        a.grad_acc = Some(2);
        train(a)
    };
    let none = run_with("none");
    within_plan("none", &none);
    for rc in ["selective", "full"] {
        let s = run_with(rc);
        within_plan(rc, &s);
        for (x, y) in none.iter().zip(&s) {
            // The same kernels on the same inputs: the same bits.
            assert_eq!(x.loss, y.loss, "{rc} step {}", x.step);
            assert_eq!(x.grad_norm, y.grad_norm, "{rc} step {}", x.step);
        }
    }
}

#[test]
fn data_parallel_ranks_follow_the_one_rank_trajectory() {
    // The load-balancing loss is per micro-batch, so the one-rank reference runs the ranks'
    // micro-batches in turn: rank r's micro-batch is the one rank's r-th.
    let with = |dp: u64, acc: u64, zero: u64| {
        let mut a = args(&format!("moe-dp{dp}-z{zero}"), 5);
        a.grad_acc = Some(acc);
        a.layout.dp = Some(dp);
        a.layout.zero = Some(zero);
        a.mbs = Some(8 / dp.max(2));
        train(a)
    };
    let one = with(1, 2, 0);
    for (dp, acc, zero) in [(2, 1, 0), (2, 1, 1)] {
        let s = with(dp, acc, zero);
        within_plan(&format!("dp {dp} zero {zero}"), &s);
        for (x, y) in one.iter().zip(&s) {
            for (name, a, b) in [
                ("loss", x.loss, y.loss),
                ("grad norm", x.grad_norm, y.grad_norm),
            ] {
                assert!(
                    rel(a, b) < 1e-5,
                    "dp {dp} zero {zero} step {}: {name} {a} vs {b}",
                    x.step
                );
            }
        }
    }
}

/// The trajectory of `(dp, ep)` replicas of 4 sequences each, against one rank running the
/// replicas' micro-batches in turn (the load-balancing loss is per micro-batch).
fn same_trajectory(what: &str, one: &[StepMetrics], s: &[StepMetrics]) {
    assert_eq!(one.len(), s.len(), "{what}");
    for (x, y) in one.iter().zip(s) {
        for (name, a, b) in [
            ("loss", x.loss, y.loss),
            ("grad norm", x.grad_norm, y.grad_norm),
        ] {
            assert!(
                rel(a, b) < 1e-5,
                "{what} step {}: {name} {a} vs {b}",
                x.step
            );
        }
    }
}

#[test]
fn expert_parallel_ranks_follow_the_one_rank_trajectory() {
    let with_zero = |tag: &str, dp: u64, ep: u64, acc: u64, rc: &str, zero: u64| {
        let mut a = args(&format!("moe-ep-{tag}"), 4);
        (a.layout.dp, a.layout.ep, a.grad_acc) = (Some(dp), Some(ep), Some(acc));
        a.recompute = Some(rc.into());
        a.layout.zero = Some(zero);
        a
    };
    let with = |tag: &str, dp: u64, ep: u64, acc: u64, rc: &str| with_zero(tag, dp, ep, acc, rc, 0);
    let one = train(with("one", 1, 1, 4, "none"));
    for (dp, ep, acc, rc) in [(1, 2, 2, "none"), (2, 2, 1, "selective"), (1, 4, 1, "full")] {
        let what = format!("dp {dp} ep {ep} × {acc} {rc}");
        let s = train(with(&format!("{dp}-{ep}"), dp, ep, acc, rc));
        same_trajectory(&what, &one, &s);
        within_plan(&what, &s);
        assert_eq!(
            s[0].rank_mem.len(),
            (dp * ep) as usize,
            "{what}: one entry per rank"
        );
    }
    // dp 4 × ep 4: 16 ranks, each expert on 4 of them, against one rank running the 16
    // replicas' micro-batches in turn.
    let one = train(with("one16", 1, 1, 16, "none"));
    let s = train(with("4-4", 4, 4, 1, "none"));
    same_trajectory("dp 4 ep 4", &one, &s);
    within_plan("dp 4 ep 4", &s);
    assert_eq!(s[0].rank_mem.len(), 16, "dp 4 ep 4: one entry per rank");
    // ZeRO-1 for the dense part (over the dp × ep replicas) and the experts (over each
    // expert's dp replicas, or whole without them), against the 4-micro-batch one rank.
    let one = train(with("one", 1, 1, 4, "none"));
    for (dp, ep, acc) in [(2, 2, 1), (1, 2, 2), (1, 4, 1)] {
        let what = format!("ZeRO-1 dp {dp} ep {ep} × {acc}");
        let s = train(with_zero(&format!("z1-{dp}-{ep}"), dp, ep, acc, "none", 1));
        same_trajectory(&what, &one, &s);
        within_plan(&what, &s);
        if dp > 1 {
            // Sharded states: each rank plans (and holds) less than without ZeRO.
            let z0 = train(with(&format!("z0-{dp}-{ep}"), dp, ep, acc, "none"));
            let (a, b) = (
                z0[3].rank_mem[0].mem_peak_planned,
                s[3].rank_mem[0].mem_peak_planned,
            );
            assert!(b < a, "{what}: ZeRO-1 plans {b} B, ZeRO-0 {a} B");
        }
    }
}

#[test]
fn an_expert_parallel_checkpoint_resumes_on_one_rank_and_back() {
    // Two steps on dp 2 × ep 2, then the last two on one rank (4 micro-batches), and on ep 4:
    // the trajectory of four steps on one rank.
    let one = train({
        let mut a = args("moe-ck-one", 4);
        a.grad_acc = Some(4);
        a
    });
    let ck = tmp("moe-ck").join("ck");
    // Written under ZeRO-1: each rank its blocks of the dense and of its experts' states.
    let mut a = args("moe-ck-first", 4);
    (a.layout.dp, a.layout.ep, a.stop_after) = (Some(2), Some(2), Some(2));
    a.layout.zero = Some(1);
    a.checkpoint_dir = Some(ck.clone());
    train(a);
    for (tag, dp, ep, acc) in [("one", 1, 1, 4), ("ep4", 1, 4, 1)] {
        let copy = tmp(&format!("moe-ck-{tag}")).join("ck");
        std::fs::create_dir_all(&copy).unwrap();
        for f in std::fs::read_dir(&ck).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
        }
        let mut a = args(&format!("moe-ck-{tag}-run"), 4);
        (a.layout.dp, a.layout.ep, a.grad_acc) = (Some(dp), Some(ep), Some(acc));
        // Its own checkpoints elsewhere: the resumed run's must not overwrite the first.
        a.checkpoint_dir = Some(copy.with_file_name("next"));
        a.resume = Some(copy);
        let s = train(a);
        same_trajectory(&format!("resumed on dp {dp} ep {ep}"), &one[2..], &s);
    }
}

#[test]
fn layouts_a_mixture_of_experts_cannot_run_are_refused() {
    for (tp, pp, zero, want) in [
        (2, 1, 0, "tp = 2: tensor parallelism of a mixture-of-experts model is not supported; run it with --dp"),
        (1, 2, 0, "pp = 2: pipeline parallelism of a mixture-of-experts model is not supported; run it with --dp"),
        (1, 1, 3, "zero = 3: ZeRO-2/3 of a mixture-of-experts model is not supported; use --zero 0 or 1"),
    ] {
        let mut a = args(&format!("moe-refused-{tp}-{pp}-{zero}"), 2);
        a.layout.tp = Some(tp);
        a.layout.pp = Some(pp);
        a.layout.dp = Some(2);
        a.layout.zero = Some(zero);
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let err = run(a).unwrap_err().to_string();
        assert_eq!(err, want);
    }
    // Expert parallelism: experts to share out, evenly, with ZeRO-1 at most.
    let refused = |a: TrainArgs| {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        run(a).unwrap_err().to_string()
    };
    let mut a = args("moe-refused-ep3", 2);
    a.layout.ep = Some(3);
    let model = a.model.clone().unwrap();
    assert_eq!(
        refused(a),
        format!("ep = 3: model {model} has 4 experts per layer; ep must divide them")
    );
    let mut a = args("moe-refused-ep-zero", 2);
    (a.layout.ep, a.layout.zero) = (Some(2), Some(2));
    assert_eq!(
        refused(a),
        "zero = 2: ZeRO-2/3 of a mixture-of-experts model is not supported; use --zero 0 or 1"
    );
    let mut a = args("moe-refused-ep-dense", 2);
    let dense = common::tiny_model(&tmp("moe-refused-dense"), 8192, 128);
    (a.model, a.layout.ep) = (Some(dense.to_string_lossy().into()), Some(2));
    assert_eq!(
        refused(a),
        format!(
            "ep = 2: expert parallelism shares out a mixture of experts; model {} has none",
            dense.display()
        )
    );
}

#[test]
fn a_capacity_factor_drops_copies_and_shrinks_the_routed_buffers() {
    let with = |tag: &str, dp: u64, ep: u64, acc: u64, cf: Option<f64>| {
        let mut a = args(&format!("moe-cf-{tag}"), 4);
        (a.layout.dp, a.layout.ep, a.grad_acc) = (Some(dp), Some(ep), Some(acc));
        a.capacity_factor = cf;
        train(a)
    };
    // Each rank drops its own micro-batch's copies past the capacity, as one rank does with
    // each micro-batch in turn.
    let one = with("one", 1, 1, 4, Some(1.0));
    let exact = with("one-exact", 1, 1, 4, None);
    assert!(
        rel(one[0].loss, exact[0].loss) > 1e-6,
        "cf 1.0 dropped nothing: {} vs {}",
        one[0].loss,
        exact[0].loss
    );
    let s = with("dp2-ep2", 2, 2, 1, Some(1.0));
    same_trajectory("cf 1.0 dp 2 ep 2", &one, &s);
    within_plan("cf 1.0 dp 2 ep 2", &s);
    // Under ep 4 a rank's routed buffers hold every expert's capacity instead of the most
    // exact routing could send it.
    let (roomy, bounded) = (
        with("ep4", 1, 4, 1, None),
        with("ep4-cf", 1, 4, 1, Some(1.0)),
    );
    within_plan("cf 1.0 ep 4", &bounded);
    let plan = |s: &[StepMetrics]| s[3].rank_mem[0].mem_peak_planned;
    assert!(
        plan(&bounded) < plan(&roomy),
        "ep 4 plans {} B with cf 1.0, {} B without",
        plan(&bounded),
        plan(&roomy)
    );
    let refused = |cf: f64, dense: bool| {
        let mut a = args(&format!("moe-cf-bad-{cf}-{dense}"), 2);
        if dense {
            let m = common::tiny_model(&tmp(&format!("moe-cf-dense-{cf}")), 8192, 128);
            a.model = Some(m.to_string_lossy().into());
        }
        a.capacity_factor = Some(cf);
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        run(a).unwrap_err().to_string()
    };
    assert_eq!(
        refused(0.0, false),
        "capacity_factor = 0: must be a positive number"
    );
    assert!(refused(1.0, true)
        .starts_with("capacity_factor = 1: a capacity bounds each expert's routed tokens; model "));
}
