//! Megatron-LM's communication overlaps as planner settings: `tp_overlap`
//! (`--tp-comm-overlap`), `param_gather_overlap` (`--overlap-param-gather`) and `pp_overlap`
//! (`--overlap-p2p-communication`). Each hides its collective under compute at the cost
//! `overlap::exposed` gives, moves the same bytes, and is refused where Megatron-LM refuses
//! or ignores it.

use ferrotron_plan::api::plan_json;
use serde_json::{json, Value};

/// Llama 3 70B laid out as the Megatron-LM README's H100 runs are (t 8, dp 48, one layer per
/// virtual stage), on 8 stages.
fn megatron_run() -> Value {
    json!({"model": "llama-3-70b", "seq": 4096, "tp": 8, "sp": true, "pp": 8,
           "pp_schedule": "interleaved", "pp_virtual": 10, "dp": 48, "zero": 1,
           "grad_acc": 24, "convention": "megatron-lm", "gpu": "h100",
           "tp_overlap": true, "param_gather_overlap": true, "pp_overlap": true})
}

fn comm(f: &dyn Fn(&mut Value)) -> (f64, Value) {
    let mut b = megatron_run();
    f(&mut b);
    let v = plan_json(b).unwrap();
    (v["time"]["step_s"].as_f64().unwrap(), v["comm"].clone())
}

#[test]
fn each_overlap_shortens_the_step_and_moves_the_same_bytes() {
    let (base, c) = comm(&|_| {});
    for (key, dim) in [
        ("tp_overlap", "tp"),
        ("param_gather_overlap", "dp"),
        ("pp_overlap", "pp"),
    ] {
        let (exposed, e) = comm(&|b| b[key] = json!(false));
        assert!(exposed > base, "{key}: {exposed} vs {base}");
        assert_eq!(e[dim]["bytes"], c[dim]["bytes"], "{key}");
        assert!(
            e[dim]["exposed_s"].as_f64().unwrap() > c[dim]["exposed_s"].as_f64().unwrap(),
            "{key}"
        );
        // Hidden under compute, an overlapped collective still slows it by the SMs it takes
        // (OVERLAP_SLOWDOWN): never free.
        assert!(c[dim]["exposed_s"].as_f64().unwrap() > 0.0, "{key}");
    }
}

#[test]
fn overlaps_are_refused_where_megatron_lm_has_none() {
    let err = |b: Value| plan_json(b).unwrap_err().to_string();
    assert_eq!(
        err(json!({"model": "llama-3-8b", "tp": 2, "tp_overlap": true})),
        "tp_overlap = true: overlaps the all-gathers and reduce-scatters of sequence parallelism: add --tp 2 or more and --sp"
    );
    assert_eq!(
        err(json!({"model": "llama-3-8b", "dp": 8, "param_gather_overlap": true})),
        "param_gather_overlap = true: overlaps the parameter all-gather of ZeRO-1/2 (Megatron-LM's distributed optimizer): add --zero 1"
    );
    assert_eq!(
        err(json!({"model": "llama-3-8b", "pp": 2, "pp_overlap": true})),
        "pp_overlap = true: Megatron-LM overlaps pipeline sends only in the interleaved schedule: add --pp 2 or more and --pp-schedule interleaved"
    );
}
