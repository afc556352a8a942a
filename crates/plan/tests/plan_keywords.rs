//! The keyword form of `ferrotron plan` (what Python's `ferrotron.plan(**kwargs)` calls):
//! keywords read as the flags are, a bad one named with its value, a config.json as an object.

use ferrotron_plan::plan_flags::{plan_keywords, search_keywords};
use ferrotron_plan::{plan, PlanFlags};
use serde_json::{json, Value};

fn fixture(name: &str) -> String {
    format!(
        "{}/../../tests/fixtures/{name}/config.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn keywords_give_the_document_of_the_same_flags() {
    let flags = PlanFlags {
        model: Some("llama-3-8b".into()),
        seq: Some(4096),
        dp: Some(8),
        zero: Some(1),
        gpu: Some("h100".into()),
        ..PlanFlags::default()
    };
    let r = flags.resolve(None).unwrap();
    let want =
        ferrotron_plan::report::json::to_json(&flags.report(&r, &plan(&r.input).unwrap()).unwrap());
    let got = plan_keywords(
        json!({"model": "llama-3-8b", "seq": 4096, "dp": 8, "zero": 1, "gpu": "h100"}),
    )
    .unwrap();
    assert_eq!(got, want);
    // ZeRO-1 over 8 ranks shards the optimizer: a different plan than one rank's.
    let alone = plan_keywords(json!({"model": "llama-3-8b", "seq": 4096})).unwrap();
    assert!(
        got["ranks"][0]["peak"].as_u64().unwrap() < alone["ranks"][0]["peak"].as_u64().unwrap()
    );
}

#[test]
fn a_config_json_as_an_object_plans_as_its_file() {
    let path = fixture("tiny-gqa");
    let text = std::fs::read_to_string(&path).unwrap();
    let object: Value = serde_json::from_str(&text).unwrap();
    let by_file = plan_keywords(json!({"model": path, "seq": 64})).unwrap();
    let by_object = plan_keywords(json!({"model": object, "seq": 64})).unwrap();
    assert_eq!(by_file["ranks"], by_object["ranks"]);
}

#[test]
fn nulls_are_unset_and_counts_may_be_numbers() {
    let a = plan_keywords(json!({"params": 7.5e9, "zero": 3, "dp": 4, "tp": null})).unwrap();
    let b = plan_keywords(json!({"params": "7.5e9", "zero": 3, "dp": 4})).unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_bad_keyword_is_named_with_its_value() {
    let e = plan_keywords(json!({"model": "llama-3-8b", "grad_accum": 8})).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("grad_accum = 8: unknown keyword `grad_accum`, expected one of"),
        "{msg}"
    );
    let e = plan_keywords(json!({"model": "llama-3-8b", "seq": "long"})).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"seq = "long": invalid type: string "long", expected u64"#
    );
    let e = plan_keywords(json!({"model": "llama-3-8b", "zero": 5})).unwrap_err();
    assert_eq!(e.to_string(), "zero = 5: ZeRO stages are 0, 1, 2 or 3");
    let e = plan_keywords(json!(["llama-3-8b"])).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("keywords = [\"llama-3-8b\"]: expected keyword arguments"));
}

#[test]
fn a_settings_file_fills_what_the_keywords_leave() {
    let toml = format!(
        "{}/../../configs/plan-llama3-8b.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let from_file = plan_keywords(json!({"config": toml})).unwrap();
    let spelled = plan_keywords(json!({"model": "llama-3-8b", "seq": 4096, "mbs": 1,
        "precision": "bf16", "recompute": "selective", "dp": 8, "zero": 1, "gpu": "h100"}))
    .unwrap();
    assert_eq!(from_file, spelled);
    let e = plan_keywords(json!({"config": "/nonexistent/p.toml"})).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("cannot read --config /nonexistent/p.toml: "),
        "{e}"
    );
}

#[test]
fn search_by_keywords() {
    let r = search_keywords(json!({"model": "llama-3-8b", "gpus": 16, "top": 2})).unwrap();
    assert_eq!(r["top"].as_array().unwrap().len(), 2);
    assert_eq!(r["gpus"], 16);
    let e = search_keywords(json!({"model": "llama-3-8b"})).unwrap_err();
    assert_eq!(
        e.to_string(),
        "gpus = (none): required: the number of GPUs to lay out"
    );
    let e =
        search_keywords(json!({"model": "llama-3-8b", "gpus": 8, "config": "x.toml"})).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("config = x.toml: the search takes no settings file"));
}
