//! The fit verdict's options (issue #16, item 6): on the GPUs the user has first, then those that
//! add GPUs; every option is checked by planning it again through the JSON API, so a listed
//! peak, "fits", GPU count or global batch that the planner would not reproduce fails here.

use ferrotron_plan::api::plan_json;
use ferrotron_plan::hardware::gpu;
use ferrotron_plan::planner::plan;
use ferrotron_plan::report::build;
use ferrotron_plan::{Convention, Layout, ModelSource, PlanInput, Precision, Recipe, Runtime};
use serde_json::{json, Value};

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an integer: {v}"))
}

/// GPUs and global batch of a plan, from the settings it echoes.
fn gpus_and_batch(v: &Value) -> (u64, u64) {
    let (l, r) = (&v["settings"]["layout"], &v["settings"]["recipe"]);
    let gpus = ["dp", "tp", "pp", "cp", "ep"]
        .iter()
        .map(|k| u(&l[k]))
        .product();
    (
        gpus,
        u(&r["mbs"]) * u(&r["grad_acc"]) * u(&l["dp"]) * u(&l["ep"]),
    )
}

/// Command-line flags as settings (`--grad-acc 2` → `"grad_acc": 2`, a bare `--sp` → true), and
/// the words that are neither a flag nor its value.
fn parse_flags(flags: &str) -> (Value, Vec<String>) {
    let mut set = json!({});
    let mut stray = Vec::new();
    let mut words = flags.split_whitespace().peekable();
    while let Some(w) = words.next() {
        let Some(key) = w.strip_prefix("--") else {
            stray.push(w.to_string());
            continue;
        };
        let value = match words.next_if(|v| !v.starts_with("--")) {
            None => json!(true),
            Some(v) => v.parse::<u64>().map_or_else(|_| json!(v), |n| json!(n)),
        };
        set[key.replace('-', "_")] = value;
    }
    (set, stray)
}

/// `request` with an option's settings applied.
fn with(request: &Value, set: &Value) -> Value {
    let mut r = request.clone();
    for (k, v) in set.as_object().expect("set is an object") {
        r[k] = v.clone();
    }
    r
}

/// Plans `request` (which must not fit), then every option again: its peak, fit, GPU count and
/// global batch must be what the planner gives for its settings, and the groups must be in
/// order (same GPU count first). Returns the plan.
fn checked(request: Value) -> Value {
    let v = plan_json(request.clone()).unwrap();
    let verdict = &v["verdict"];
    assert_eq!(v["fits"], false, "{request}");
    let capacity = u(&verdict["capacity"]);
    let (gpus, batch) = gpus_and_batch(&v);
    assert_eq!(u(&verdict["gpus"]), gpus);
    assert_eq!(u(&verdict["global_batch"]), batch);
    let options = verdict["options"].as_array().expect("options");
    assert!(!options.is_empty(), "no options for {request}");
    let mut seen_more = false;
    for o in options {
        // The flags are exactly the settings: what the user types is what was planned.
        assert_eq!(
            parse_flags(o["flags"].as_str().unwrap()),
            (o["set"].clone(), vec![])
        );
        let again = plan_json(with(&request, &o["set"]))
            .unwrap_or_else(|e| panic!("option {} is rejected by the planner: {e}", o["flags"]));
        let peak = u(&again["per_rank"]["peak"]);
        assert_eq!(u(&o["peak"]), peak, "peak of {}", o["flags"]);
        assert_eq!(o["fits"], json!(peak <= capacity), "fits of {}", o["flags"]);
        assert!(
            peak < u(&verdict["peak"]),
            "{} does not lower the peak",
            o["flags"]
        );
        let (o_gpus, o_batch) = gpus_and_batch(&again);
        assert_eq!(u(&o["gpus"]), o_gpus, "GPUs of {}", o["flags"]);
        assert_eq!(o["adds_gpus"], json!(o_gpus > gpus), "{}", o["flags"]);
        assert_eq!(u(&o["global_batch"]), o_batch, "batch of {}", o["flags"]);
        if o_batch != batch {
            let why = o["why"].as_str().unwrap();
            assert!(why.contains("global batch"), "silent batch change: {o}");
        }
        // Same GPU count first, then the options that add GPUs.
        if o["adds_gpus"] == true {
            seen_more = true;
        } else {
            assert!(
                !seen_more,
                "{} listed after an option adding GPUs",
                o["flags"]
            );
        }
        // A cluster is known, so every option is timed.
        assert!(o["step_s"].as_f64().is_some_and(|s| s > 0.0), "{o}");
    }
    // The recommendation is the first option that fits.
    let first_fit = options.iter().find(|o| o["fits"] == true);
    assert_eq!(
        verdict["suggestion"],
        first_fit.cloned().unwrap_or(Value::Null)
    );
    v
}

fn gpt2_xl_on_one_rtx4090() -> Value {
    json!({"model": "gpt2-xl", "gpu": "rtx4090", "precision": "fp16", "seq": 128, "mbs": 1})
}

#[test]
fn one_gpu_is_first_offered_fixes_that_keep_one_gpu() {
    let request = gpt2_xl_on_one_rtx4090();
    let v = plan_json(request.clone()).unwrap();
    assert_eq!(v["fits"], false);
    let s = &v["verdict"]["suggestion"];
    // The recommended flags, planned again: still one GPU, the same batch, and it fits.
    let flags = s["flags"].as_str().expect("a recommended change");
    let again = plan_json(with(&request, &parse_flags(flags).0)).unwrap();
    assert_eq!(
        gpus_and_batch(&again),
        (1, 1),
        "recommended `{flags}` for a single GPU"
    );
    assert_eq!(again["fits"], true, "`{flags}` does not fit");
    assert_eq!(u(&s["peak"]), u(&again["per_rank"]["peak"]));
    assert!(u(&s["peak"]) <= u(&v["verdict"]["capacity"]));

    let v = checked(request);
    let verdict = &v["verdict"];
    assert_eq!(verdict["suggestion"]["adds_gpus"], false);
    // The options that add GPUs are still listed, after the others.
    let options = verdict["options"].as_array().unwrap();
    assert!(options.iter().any(|o| o["adds_gpus"] == true));
    // Recomputation is offered even though it is not enough here: the user sees why not.
    let recompute = options
        .iter()
        .find(|o| o["set"]["recompute"] == "full")
        .expect("full recompute listed");
    assert_eq!(recompute["adds_gpus"], false);
}

#[test]
fn cheapest_same_gpu_fix_is_recommended_when_several_fit() {
    let v = checked(gpt2_xl_on_one_rtx4090());
    let options = v["verdict"]["options"].as_array().unwrap();
    let fitting: Vec<f64> = options
        .iter()
        .filter(|o| o["fits"] == true && o["adds_gpus"] == false)
        .map(|o| o["slowdown"].as_f64().unwrap())
        .collect();
    assert!(fitting.len() >= 2, "{options:?}");
    assert!(
        fitting.windows(2).all(|w| w[0] <= w[1]),
        "not cheapest first: {fitting:?}"
    );
    assert_eq!(
        v["verdict"]["suggestion"]["slowdown"].as_f64(),
        Some(fitting[0])
    );
}

#[test]
fn a_combination_is_offered_when_no_single_change_fits() {
    // 70B on 8 H100s: neither ZeRO-3 nor offloading alone brings it under 80 GB.
    let v = checked(json!({"model": "llama-3-70b", "seq": 4096, "dp": 8, "gpu": "h100"}));
    let s = &v["verdict"]["suggestion"];
    assert_eq!(s["adds_gpus"], false, "{s}");
    assert!(s["set"].as_object().unwrap().len() >= 2, "{s}");
    let singles_fit = v["verdict"]["options"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["adds_gpus"] == false && o["fits"] == true)
        .count();
    assert_eq!(singles_fit, 1, "only the combination fits");
}

#[test]
fn tensor_and_pipeline_parallelism_keep_the_gpu_count_and_the_batch_on_even_dp() {
    let v = checked(json!({"model": "llama-3-70b", "seq": 4096, "dp": 8, "gpu": "h100"}));
    let options = v["verdict"]["options"].as_array().unwrap();
    for dim in ["tp", "pp"] {
        let o = options
            .iter()
            .find(|o| o["set"][dim] == 2 && o["set"].as_object().unwrap().len() <= 4)
            .unwrap_or_else(|| panic!("no {dim} option"));
        assert_eq!(o["adds_gpus"], false, "{o}");
        assert_eq!(u(&o["global_batch"]), 8, "{o}");
    }
}

#[test]
fn smaller_micro_batches_keep_the_global_batch() {
    let v = checked(
        json!({"model": "llama-3-8b", "seq": 4096, "mbs": 4, "grad_acc": 2,
                           "dp": 8, "zero": 1, "gpu": "h100"}),
    );
    let options = v["verdict"]["options"].as_array().unwrap();
    let halved = options
        .iter()
        .find(|o| o["set"]["mbs"] == 2)
        .expect("mbs 2 offered");
    assert_eq!(halved["set"]["grad_acc"], 4);
    assert!(options
        .iter()
        .any(|o| o["set"]["mbs"] == 1 && o["set"]["grad_acc"] == 8));
}

#[test]
fn without_a_cluster_the_cost_is_stated_in_words() {
    let input = PlanInput {
        model: ModelSource::Spec(ferrotron_plan::presets::preset("gpt2-xl").unwrap()),
        recipe: Recipe {
            seq: 128,
            mbs: 1,
            precision: Precision::Fp16,
            ..Recipe::default()
        },
        layout: Layout::default(),
        convention: Convention::Ferrotron,
        runtime: Runtime::Ferrotron,
        overhead: ferrotron_plan::hardware::Overhead::GPU_DEFAULT,
        bucket_bytes: 25 << 20,
    };
    let result = plan(&input).unwrap();
    let g = gpu("rtx4090").unwrap();
    let rep = build(&input, &result, Some(&g), false).unwrap();
    let v = rep.verdict.expect("a verdict");
    assert!(!v.fits);
    let s = v.suggestion.expect("a suggestion");
    assert!(!s.adds_gpus && s.peak <= g.capacity, "{s:?}");
    for o in &v.options {
        assert!(o.step_s.is_none() && o.slowdown.is_none(), "{o:?}");
        assert!(!o.cost.is_empty(), "{o:?}");
    }
}

#[test]
fn a_configuration_that_fits_has_no_options() {
    let v = plan_json(json!({"model": "gpt2", "gpu": "rtx4090", "seq": 128})).unwrap();
    assert_eq!(v["fits"], true);
    assert_eq!(v["verdict"]["suggestion"], Value::Null);
    assert_eq!(v["verdict"]["options"], json!([]));
}
