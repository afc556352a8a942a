//! Context parallelism on the threads backend: `--cp 2` and `--cp 4` (ring attention over the
//! load-balanced split of every sequence), with every recompute policy, composed with data
//! parallelism and ZeRO (dp 2 × cp 2) and with tensor + sequence parallelism (tp 2 × cp 2),
//! follow the one-rank trajectory of the same global batch within 1e-5, evaluate the same
//! validation loss, and every rank's measured peak is within 1% of its own plan. Checkpoints
//! resume across cp changes. Layouts it cannot run are refused before any work, with the fix.

mod common;
use common::{assert_follows, assert_within_plans, rel, tiny_args, tiny_moe_model, tmp};
use ferrotron_plan::cluster::Dim;
use ferrotron_train::alloc::Tracking;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::metrics::StepMetrics;
use ferrotron_train::run::run;

// Each rank's memory is measured by the tracking allocator (per rank: ranks are threads).
#[global_allocator]
static A: Tracking = Tracking;

/// Ranks are counted by rank number in one process: the runs of this file take turns.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A 5-step run of the tiny model at seq 32, 8 sequences a step (`mbs` per data-parallel
/// replica, grad_acc 2), with `edit` applied.
fn train(tag: &str, mbs: u64, edit: &dyn Fn(&mut TrainArgs)) -> Vec<StepMetrics> {
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut a = tiny_args(&tmp(tag), 5);
    (a.mbs, a.grad_acc) = (Some(mbs), Some(2));
    a.bucket_mb = Some(1);
    edit(&mut a);
    run(a).unwrap().steps
}

#[test]
fn context_parallel_ranks_follow_the_one_rank_trajectory() {
    let one = train("cp-one", 4, &|_| {});
    // (cp, dp, tp with sp, pp (1F1B), ZeRO, recompute)
    for (cp, dp, tp, pp, zero, rc) in [
        (2, 1, 1, 1, 0, "none"),
        (2, 1, 1, 1, 0, "selective"),
        (2, 1, 1, 1, 0, "full"),
        (4, 1, 1, 1, 0, "none"),
        (2, 2, 1, 1, 1, "none"),
        (2, 2, 1, 1, 3, "selective"),
        (2, 1, 2, 1, 0, "none"),
        (2, 1, 1, 2, 0, "none"),
        (2, 2, 2, 2, 1, "full"),
    ] {
        let what = format!("cp {cp} dp {dp} tp {tp} pp {pp} ZeRO-{zero} {rc}");
        let s = train(&what.replace(' ', "-"), 4 / dp, &|a| {
            (a.layout.cp, a.layout.dp, a.layout.tp) = (Some(cp), Some(dp), Some(tp));
            (a.layout.zero, a.layout.sp, a.layout.pp) = (Some(zero), Some(tp > 1), Some(pp));
            a.recompute = Some(rc.into());
        });
        assert_eq!(s.len(), 5, "{what}");
        assert_follows(&one, &s, 1e-5, true, &what);
        assert_eq!(s[0].rank_mem.len(), (cp * dp * tp * pp) as usize, "{what}");
        for y in &s {
            // The ring sends what the planner prices: per layer and micro-batch, cp − 1 K/V
            // blocks forward (again in a full recomputation's replay), cp − 1 blocks with their
            // gradients backward and one last pass of the gradients home.
            assert!(y.comm_sent(Dim::Cp).is_some_and(|b| b > 0), "{what}");
            assert_eq!(
                y.comm_sent(Dim::Cp),
                y.comm_planned(Dim::Cp),
                "{what} step {}",
                y.step
            );
            for r in &y.rank_mem {
                // Under full recomputation this tiny model's peak is a few MB, where the ~50 KB
                // a process allocates outside any plan (one rank too) is over 1%: there the
                // bound is in bytes (the default model: docs/BENCHMARKS.md, within 0.1%).
                let (m, p) = (r.mem_peak_measured as f64, r.mem_peak_planned as f64);
                let ok = rel(m, p) < 0.01 || (rc == "full" && (m - p).abs() < 64.0 * 1024.0);
                assert!(ok, "{what} step {} rank {}: {r:?}", y.step, r.rank);
            }
        }
    }
}

#[test]
fn activation_memory_falls_with_cp() {
    // Each rank holds 1/cp of every sequence's activations (and a few ring buffers), its
    // weights and optimizer states whole (no ZeRO).
    let plan = |cp: u64| {
        let s = train(&format!("cp-mem-{cp}"), 4, &|a| a.layout.cp = Some(cp));
        assert_within_plans(&s, &format!("cp {cp}"));
        s[4].rank_mem
            .first()
            .map_or(s[4].mem_peak_planned, |r| r.mem_peak_planned)
    };
    let (one, two, four) = (plan(1), plan(2), plan(4));
    assert!(
        one > two && two > four,
        "planned peaks {one}, {two}, {four}"
    );
}

#[test]
fn context_parallel_ranks_evaluate_the_one_rank_validation_loss() {
    let eval = |cp: u64, pp: u64| {
        train(&format!("cp-eval-{cp}-{pp}"), 4, &|a| {
            (a.layout.cp, a.layout.pp) = (Some(cp), Some(pp));
            (a.eval_interval, a.eval_batches) = (Some(2), Some(2));
        })
    };
    let one = eval(1, 1);
    let vals = |s: &[StepMetrics]| s.iter().filter_map(|m| m.val_loss).collect::<Vec<_>>();
    let a = vals(&one);
    assert_eq!(a.len(), 3, "steps 2, 4 and the last");
    // Also through the pipeline's evaluation (each stage's ring).
    for pp in [1, 2] {
        let two = eval(2, pp);
        // The evaluation's ring passes are not the step's communication.
        assert!(two
            .iter()
            .all(|y| y.comm_sent(Dim::Cp) == y.comm_planned(Dim::Cp)));
        for (x, y) in a.iter().zip(&vals(&two)) {
            assert!(
                rel(*x, *y) < 1e-5,
                "cp 2 pp {pp}: validation loss {x} vs {y}"
            );
        }
    }
}

#[test]
fn context_parallelism_runs_in_16_bit_precisions() {
    // The ring merges blocks in f32 and rounds the output once; one rank rounds it once too,
    // but sums its tiles in another order: cp 2 follows one rank to 16-bit accuracy.
    for precision in ["bf16", "fp16"] {
        let run_as = |cp: u64| {
            train(&format!("cp{cp}-{precision}"), 4, &|a| {
                a.layout.cp = Some(cp);
                a.precision = Some(precision.into());
            })
        };
        let (one, two) = (run_as(1), run_as(2));
        let what = format!("{precision} cp 2");
        assert_follows(&one, &two, 2e-3, false, &what);
        assert_within_plans(&two, &what);
        // Blocks travel in f32 whatever the storage type, as planned.
        assert!(
            two.iter()
                .all(|y| y.comm_sent(Dim::Cp) == y.comm_planned(Dim::Cp)),
            "{what}"
        );
    }
}

#[test]
fn a_context_parallel_checkpoint_resumes_on_other_layouts() {
    // Stopped after step 3 of 5 under cp 2: resumed on one rank, on cp 4 and on dp 2 (with
    // ZeRO-1), each following the straight one-rank run.
    let straight = train("cpck-straight", 4, &|_| {});
    let ck = {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let out = tmp("cpck-cp2");
        let mut a = tiny_args(&out, 5);
        (a.mbs, a.grad_acc, a.stop_after) = (Some(4), Some(2), Some(3));
        a.layout.cp = Some(2);
        a.checkpoint_dir = Some(out.join("ck"));
        run(a).unwrap();
        out.join("ck")
    };
    for (cp, dp, zero, mbs) in [(1, 1, 0, 4), (4, 1, 0, 4), (1, 2, 1, 2)] {
        let what = format!("resumed on cp {cp} dp {dp} ZeRO-{zero}");
        let rest = train(&what.replace(' ', "-"), mbs, &|a| {
            (a.resume, a.data, a.model, a.warmup) = (Some(ck.clone()), None, None, None);
            (a.layout.cp, a.layout.dp, a.layout.zero) = (Some(cp), Some(dp), Some(zero));
            // Its own checkpoints, not into the one it resumes.
            a.checkpoint_dir = a.out_dir.as_ref().map(|o| o.join("ck"));
        });
        assert_eq!(rest.len(), 2, "{what}");
        assert_follows(&straight[3..], &rest, 1e-5, true, &what);
    }
}

#[test]
fn a_mixture_of_experts_under_context_parallelism_follows_one_rank() {
    // The ring's ranks sum each micro-batch's router statistics, so the load-balancing term is
    // the micro-batch's, as on one rank. Data-parallel replicas each have their own
    // micro-batches (and terms): dp 2 × cp 2 follows one rank running them in turn.
    let moe_dir = tmp("cp-moe-model");
    let moe = tiny_moe_model(&moe_dir);
    let with = |tag: &str, cp: u64, dp: u64, mbs: u64, acc: u64| {
        train(tag, mbs, &|a| {
            a.model = Some(moe.to_string_lossy().into());
            (a.layout.cp, a.layout.dp, a.layout.zero) = (Some(cp), Some(dp), Some(dp - 1));
            a.grad_acc = Some(acc);
        })
    };
    let one = with("cp-moe-one", 1, 1, 4, 2);
    let in_turn = with("cp-moe-one-in-turn", 1, 1, 2, 4);
    for (cp, dp, reference) in [(2, 1, &one), (4, 1, &one), (2, 2, &in_turn)] {
        let what = format!("MoE cp {cp} dp {dp}");
        let s = with(&what.replace(' ', "-"), cp, dp, 4 / dp, 2);
        assert_follows(reference, &s, 1e-5, true, &what);
        assert_within_plans(&s, &what);
    }
}

#[test]
fn layouts_context_parallelism_cannot_run_are_refused_with_the_fix() {
    let out = tmp("cp-bad");
    let bad = |edit: &dyn Fn(&mut TrainArgs)| {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut a = tiny_args(&out, 2);
        a.layout.cp = Some(2);
        edit(&mut a);
        format!("{:#}", run(a).unwrap_err())
    };
    assert_eq!(
        bad(&|a| a.seq = Some(30)),
        "seq = 30: context parallelism over cp = 2 cuts each sequence into 2·cp = 4 equal chunks; use a multiple of 4"
    );
    let moe_dir = out.join("moe");
    std::fs::create_dir_all(&moe_dir).unwrap();
    let moe = tiny_moe_model(&moe_dir);
    assert_eq!(
        bad(&|a| (a.model, a.layout.ep) = (Some(moe.to_string_lossy().into()), Some(2))),
        "cp = 2: context parallelism does not run with expert parallelism yet: use --cp or --ep, not both"
    );
}
