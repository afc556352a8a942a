//! `--pp-layers auto` (`balance.rs`): the proposed split is priced by the same step-time model
//! and is never slower than the even split; bad requests name the field and the fix.

use ferrotron_plan::api::plan_json;
use serde_json::{json, Value};

fn plan(mut body: Value, pp_layers: Option<&str>) -> Value {
    if let Some(s) = pp_layers {
        body["pp_layers"] = json!(s);
    }
    plan_json(body).unwrap()
}

fn split(v: &Value) -> Vec<u64> {
    serde_json::from_value(v["settings"]["layout"]["pp_layers"].clone()).unwrap()
}

#[test]
fn the_proposed_split_lightens_the_edge_stages_and_is_faster_than_the_even_one() {
    // Llama-3-8B on 4 stages: the first stage adds the embedding, the last the LM head over
    // 128,256 tokens and its fp32 cross-entropy, a few layers' worth.
    let body = json!({"model": "llama-3-8b", "seq": 4096, "pp": 4, "grad_acc": 8, "gpu": "h100"});
    let auto = plan(body.clone(), Some("auto"));
    let even = plan(body, None);
    let n = split(&auto);
    assert_eq!(n.iter().sum::<u64>(), 32);
    assert!(n[3] < 8 && n[1] >= 8, "{n:?}");
    let step = |v: &Value| v["time"]["step_s"].as_f64().unwrap();
    assert!(
        step(&auto) < step(&even),
        "{} vs {}",
        step(&auto),
        step(&even)
    );
    let notes = auto["time"]["notes"].to_string();
    assert!(
        notes.contains("--pp-layers auto: stage times balanced"),
        "{notes}"
    );
    // The split given back by hand plans the same.
    let list: Vec<String> = n.iter().map(u64::to_string).collect();
    let again = plan(
        json!({"model": "llama-3-8b", "seq": 4096, "pp": 4, "grad_acc": 8, "gpu": "h100"}),
        Some(&list.join(",")),
    );
    assert_eq!(step(&again), step(&auto));
}

#[test]
fn a_split_for_a_layer_count_no_stage_count_divides_with_virtual_stages() {
    // Llama 3.1 405B's 126 layers on 16 stages × 2 chunks: one count per chunk, 126 in all.
    let v = plan(
        json!({"model": "llama-3.1-405b", "seq": 8192, "tp": 8, "pp": 16, "grad_acc": 16,
               "pp_schedule": "interleaved", "pp_virtual": 2, "recompute": "full", "gpu": "h100"}),
        Some("auto"),
    );
    let n = split(&v);
    assert_eq!(n.len(), 32);
    assert_eq!(n.iter().sum::<u64>(), 126);
    // Stage 0 is chunks 0 and 16, stage 15 chunks 15 and 31: the edges hold the fewest.
    let stage = |s: usize| n[s] + n[s + 16];
    assert!(stage(0) <= stage(7) && stage(15) <= stage(7), "{n:?}");
}

/// What `plan --pp-layers auto` proposes, `train --pp-layers` accepts given back by hand:
/// the default model (6 layers, its head worth more than a layer at seq 256) on 4 stages used
/// to get a last stage of no layer, a split refused by hand.
#[test]
fn every_stage_of_the_proposal_holds_a_layer() {
    let body = json!({"model": "ferrotron-12m", "seq": 256, "pp": 4});
    let n = split(&plan(body.clone(), Some("auto")));
    assert_eq!(n.iter().sum::<u64>(), 6, "{n:?}");
    assert!(n.iter().all(|&k| k >= 1), "{n:?}");
    let list: Vec<String> = n.iter().map(u64::to_string).collect();
    plan(body, Some(&list.join(",")));
}

#[test]
fn auto_errors_name_the_field_and_the_fix() {
    let err = |body: Value| plan_json(body).unwrap_err().to_string();
    assert_eq!(
        err(json!({"params": "7e9", "pp": 2, "pp_layers": "auto"})),
        "pp_layers = auto: proposing a split needs the model's layers (--model or --config, not --params)"
    );
    assert_eq!(
        err(json!({"model": "llama-3-8b", "pp": 4, "pp_layers": "auto", "pp_first_layers": 6})),
        "pp_layers = auto: goes without --pp-first-layers/--pp-last-layers (auto chooses every stage's layers)"
    );
    assert_eq!(
        err(json!({"model": "llama-3-8b", "pp": 4, "tp": 3, "pp_layers": "auto"})),
        "tp = 3: must divide the 32 attention heads"
    );
}
