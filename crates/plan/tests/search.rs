//! The layout search returns feasible layouts only, ranked by predicted tokens/s, and stopping
//! early (memory planned fastest first) gives the same answer as planning every candidate.

use ferrotron_plan::cluster::{gpu, Cluster};
use ferrotron_plan::presets::preset;
use ferrotron_plan::search::{search, SearchSpec};
use ferrotron_plan::*;

fn spec(model: &str, gpus: u64, gpu_kind: &str, seq: u64, gbs_tokens: u64) -> SearchSpec {
    SearchSpec::new(
        preset(model).unwrap(),
        gpus,
        Cluster::of(gpu(gpu_kind).unwrap(), 8).unwrap(),
        seq,
        gbs_tokens,
    )
}

#[test]
fn returns_feasible_layouts_ranked_by_tokens_per_second() {
    let s = spec("llama-3-8b", 16, "a100-40", 4096, 1 << 21);
    let r = search(&s).unwrap();
    assert_eq!(r.top.len(), 5);
    assert!(r.evaluated > 100);
    assert_eq!(r.budget, (r.capacity as f64 * 0.8) as u64);
    for c in &r.top {
        // Re-plan every stage from scratch: the layout really fits in the budget.
        let x = PlanInput {
            model: ModelSource::Spec(s.model.clone()),
            recipe: c.recipe.clone(),
            layout: c.layout.clone(),
            convention: s.convention,
            runtime: Runtime::of(s.convention),
            overhead: s.overhead,
            bucket_bytes: s.bucket_bytes,
        };
        let p = plan(&x).unwrap();
        assert_eq!(p.worst().peak, c.peak, "{}", c.flags);
        assert!(c.peak <= r.budget, "{}", c.flags);
        assert_eq!(c.layout.world(), 16);
        assert_eq!(c.layout.global_batch(&c.recipe) * c.recipe.seq, 1 << 21);
    }
    for w in r.top.windows(2) {
        // Non-increasing throughput (ties within 0.01% are ordered by simplicity).
        assert!(w[0].time.tokens_per_s >= w[1].time.tokens_per_s * (1.0 - 1e-4));
    }
    assert!(r.reason.contains(&r.top[0].flags), "{}", r.reason);
    // A 40 GB A100 cannot hold Llama-3-8B's 16 B/param states without sharding: the faster
    // layouts that did not fit are reported, and the winner shards.
    assert!(r.faster_rejected > 0);
    let f = r.fastest_rejected.as_ref().unwrap();
    assert!(f.peak > r.budget && f.time.tokens_per_s >= r.top[0].time.tokens_per_s);
    assert!(r.top[0].layout.zero >= 1 || r.top[0].layout.tp * r.top[0].layout.pp > 1);
}

#[test]
fn early_stopping_gives_the_same_top_as_planning_everything() {
    let mut s = spec("llama-3.2-1b", 8, "rtx4090", 2048, 1 << 19);
    let fast = search(&s).unwrap();
    s.top_k = 1_000_000;
    let all = search(&s).unwrap();
    assert!(all.memory_planned > fast.memory_planned);
    assert!(all.top.len() > fast.top.len());
    for (a, b) in fast.top.iter().zip(&all.top) {
        assert_eq!(a.flags, b.flags);
        assert_eq!(a.peak, b.peak);
    }
    // Everything the exhaustive run found fits; nothing faster than #1 did.
    assert!(all.top.iter().all(|c| c.peak <= all.budget));
    assert_eq!(all.faster_rejected, fast.faster_rejected);
}

#[test]
fn mixture_of_experts_uses_expert_parallelism_when_it_pays() {
    let r = search(&spec("mixtral-8x7b", 64, "h100", 4096, 1 << 22)).unwrap();
    assert!(r.top.iter().all(|c| 8 % c.layout.ep == 0));
    assert!(r.top.iter().any(|c| c.layout.ep > 1), "{}", r.reason);
}

#[test]
fn impossible_or_malformed_searches_name_the_field() {
    let e = search(&spec("llama-3-8b", 8, "h100", 4096, 4095))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("gbs_tokens = 4095: must be a positive multiple of seq = 4096"),
        "{e}"
    );
    let e = search(&spec("llama-3.1-405b", 2, "rtx4090", 4096, 8192))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("gpus = 2: no layout of llama-3.1-405b"),
        "{e}"
    );
    let e = search(&spec("llama-3-8b", 8, "h100", 100_000, 100_000))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("seq = 100000"), "{e}");
    let mut s = spec("llama-3-8b", 8, "h100", 4096, 1 << 20);
    s.margin = 1.5;
    assert!(search(&s)
        .unwrap_err()
        .to_string()
        .starts_with("margin = 1.5"));
}

#[test]
fn the_search_turns_on_the_overlaps_the_convention_offers() {
    // Megatron-LM offers all three; each layout gets those it allows, and the winner's flags
    // reproduce its plan (the overlaps included).
    let mut s = spec("llama-3-8b", 32, "a100-40", 4096, 1 << 21);
    s.convention = Convention::MegatronLm;
    s.top_k = 20;
    let r = search(&s).unwrap();
    for c in &r.top {
        let l = &c.layout;
        assert_eq!(l.tp_overlap, l.tp > 1, "{}", c.flags);
        assert_eq!(
            l.param_gather_overlap,
            l.zero == 1 || l.zero == 2,
            "{}",
            c.flags
        );
        assert_eq!(
            l.pp_overlap,
            l.pp_schedule == PpSchedule::Interleaved,
            "{}",
            c.flags
        );
        assert_eq!(c.flags.contains("--tp-overlap"), l.tp_overlap);
        // Each overlap only shortens the step: the same layout without them is no faster.
        let mut x = PlanInput {
            model: ModelSource::Spec(s.model.clone()),
            recipe: c.recipe.clone(),
            layout: c.layout.clone(),
            convention: s.convention,
            runtime: Runtime::of(s.convention),
            overhead: s.overhead,
            bucket_bytes: s.bucket_bytes,
        };
        let with = time::estimate(&x, &s.cluster, s.flops).unwrap().unwrap();
        x.layout.tp_overlap = false;
        x.layout.param_gather_overlap = false;
        x.layout.pp_overlap = false;
        let without = time::estimate(&x, &s.cluster, s.flops).unwrap().unwrap();
        assert!(with.step_s <= without.step_s, "{}", c.flags);
    }
    assert!(r.top.iter().any(|c| c.layout.tp_overlap), "{}", r.reason);
    assert!(
        r.top.iter().any(|c| c.layout.param_gather_overlap),
        "{}",
        r.reason
    );
    // torchtitan offers async TP only; ferrotron's engine none.
    s.convention = Convention::Torchtitan;
    let r = search(&s).unwrap();
    assert!(r
        .top
        .iter()
        .all(|c| !c.layout.param_gather_overlap && !c.layout.pp_overlap));
    s.convention = Convention::Ferrotron;
    let r = search(&s).unwrap();
    assert!(
        r.top.iter().all(|c| !c.flags.contains("overlap")),
        "{}",
        r.reason
    );
}
