//! The JSON API behind `ferrotron serve`: answers, and one clear error naming the field for bad
//! input (the server turns those into 400s).

use ferrotron_plan::api::{plan_json, presets_json, search_json};
use serde_json::{json, Value};

fn err(v: Value) -> String {
    plan_json(v).unwrap_err().to_string()
}

#[test]
fn plan_answers_with_memory_time_and_comm() {
    let v = plan_json(
        json!({"model": "llama-3-8b", "seq": 4096, "mbs": 2, "dp": 8, "zero": 1,
                             "recompute": "selective", "gpu": "h100", "gpus_per_node": 8}),
    )
    .unwrap();
    let peak = v["per_rank"]["peak"].as_u64().unwrap();
    assert!(peak > 0);
    assert_eq!(v["settings"]["recipe"]["mbs"], 2);
    let t = &v["time"];
    for k in ["step_s", "tokens_per_s", "mfu", "hfu"] {
        assert!(t[k].as_f64().unwrap() > 0.0, "time.{k}");
    }
    let b = &t["breakdown"];
    let sum: f64 = [
        "compute_s",
        "recompute_s",
        "exposed_comm_s",
        "bubble_s",
        "optimizer_s",
    ]
    .iter()
    .map(|k| b[k].as_f64().unwrap())
    .sum();
    assert!((sum - t["step_s"].as_f64().unwrap()).abs() < 1e-9);
    for d in ["tp", "cp", "ep", "dp", "pp"] {
        let c = &v["comm"][d];
        assert!(
            c["bytes"].is_u64() && c["s"].is_f64() && c["exposed_s"].is_f64(),
            "comm.{d}"
        );
    }
    assert!(v["comm"]["dp"]["bytes"].as_u64().unwrap() > 0);
    // A larger micro-batch holds more activations.
    let v4 = plan_json(
        json!({"model": "llama-3-8b", "seq": 4096, "mbs": 4, "dp": 8, "zero": 1,
                              "recompute": "selective"}),
    )
    .unwrap();
    assert!(v4["per_rank"]["peak"].as_u64().unwrap() > peak);
}

#[test]
fn pasted_configs_work_as_object_or_text() {
    let cfg = json!({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
                     "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000});
    let a = plan_json(json!({"config": cfg, "seq": 1024})).unwrap();
    let b = plan_json(json!({"config": cfg.to_string(), "seq": 1024})).unwrap();
    assert_eq!(a["per_rank"], b["per_rank"]);
    assert_eq!(
        a["params"]["total"],
        4 * (4 * 512 * 512 + 3 * 512 * 1536 + 2 * 512) + 2 * 32000 * 512 + 512
    );
}

#[test]
fn bad_input_names_the_field() {
    let cases = [
        (json!([1, 2]), "request = (body): expected a JSON object"),
        (
            json!({"model": "llama-3-8b", "mbz": 2}),
            "unknown field `mbz`",
        ),
        (
            json!({"model": "llama-3-8b", "mbs": "two"}),
            "invalid type: string \"two\", expected u64",
        ),
        (
            json!({"model": "llama-3-8b", "mbs": -1}),
            "invalid value: integer `-1`, expected u64",
        ),
        (
            json!({"model": "llama-3-8b", "tp": 3}),
            "tp = 3: must divide the 32 attention heads",
        ),
        (
            json!({"model": "llama-3-8b", "zero": 4}),
            "zero = 4: ZeRO stages are 0, 1, 2 or 3",
        ),
        (
            json!({"model": "llama-3-8b", "mbs": 0}),
            "mbs = 0: must be a positive integer",
        ),
        (
            json!({"model": "llama-3-8b", "gpu": "tpu"}),
            "gpu = tpu: unknown GPU",
        ),
        (
            json!({"model": "llama-3-8b", "gpus_per_node": 0}),
            "gpus_per_node = 0",
        ),
        (
            json!({"model": "llama-3-8b", "flops_convention": "x"}),
            "flops_convention = x",
        ),
        (
            json!({"model": "llama-9b"}),
            "model = llama-9b: not a built-in preset",
        ),
        (
            json!({"model": "../../etc/passwd"}),
            "not a built-in preset",
        ),
        (
            json!({"config": {"model_type": "t5"}}),
            "model_type `t5` is not supported",
        ),
        (
            json!({"config": "{not json"}),
            "config: field `(file)` is not valid JSON",
        ),
        (
            json!({"config": {"model_type": "llama", "hidden_size": 512}}),
            "field `num_attention_heads` is missing",
        ),
        (json!({}), "no model"),
        (json!({"model": "llama-3-8b", "params": 7e9}), "not several"),
        (
            json!({"model": "llama-3-8b", "cluster": {"gpu": "h100", "intra_node_gb_s": -1.0}}),
            "intra_node_gb_s = -1",
        ),
        (
            json!({"model": "llama-3-8b", "cluster": {"gpus": 8}}),
            "unknown field `gpus`",
        ),
    ];
    for (body, want) in cases {
        let e = err(body.clone());
        assert!(e.contains(want), "{body}: got {e:?}, want {want:?}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
}

#[test]
fn search_and_presets() {
    let v = search_json(
        json!({"model": "llama-3.2-1b", "gpus": 8, "gpu": "h100", "seq": 2048,
                               "gbs_tokens": 1 << 20, "top": 3}),
    )
    .unwrap();
    let top = v["top"].as_array().unwrap();
    assert_eq!(top.len(), 3);
    assert!(top.iter().all(|c| c["fits"] == true));
    assert!(v["reason"].as_str().unwrap().contains("wins"));
    for (body, want) in [
        (json!({"model": "llama-3.2-1b"}), "gpus = (none): required"),
        (
            json!({"model": "llama-3.2-1b", "gpus": 8, "gbs_tokens": 100}),
            "gbs_tokens = 100",
        ),
        (json!({"model": "llama-3.2-1b", "gpus": 0}), "gpus = 0"),
        (
            json!({"model": "llama-3.2-1b", "gpus": 8, "dp": 2}),
            "unknown field `dp`",
        ),
        (json!("x"), "expected a JSON object"),
    ] {
        let e = search_json(body.clone()).unwrap_err().to_string();
        assert!(e.contains(want), "{body}: got {e:?}");
    }
    let p = presets_json();
    assert!(p["models"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "llama-3-8b"));
    assert!(p["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g["name"] == "mi300x"));
    assert_eq!(p["flops_convention"].as_array().unwrap().len(), 5);
}

#[test]
fn huge_values_are_refused_not_overflowed() {
    for (body, want) in [
        (
            json!({"model": "llama-3-8b", "mbs": 1u64 << 40}),
            "mbs = 1099511627776: is above",
        ),
        (
            json!({"model": "llama-3-8b", "grad_acc": 10000, "pp": 2, "pp_schedule": "afab"}),
            "grad_acc = 10000: the AFAB schedule",
        ),
        (
            json!({"model": "llama-3-8b", "dp": u64::MAX}),
            "dp = 18446744073709551615",
        ),
        (
            json!({"config": {"model_type": "llama", "hidden_size": 1u64 << 31, "intermediate_size": 8,
                           "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1u64 << 31}}),
            "field `hidden_size` is 2147483648, above the planner's limit",
        ),
    ] {
        let e = err(body.clone());
        assert!(e.contains(want), "{body}: got {e:?}");
    }
    let e = search_json(json!({"model": "gpt2", "gpus": 8, "gbs_tokens": u64::MAX})).unwrap_err();
    assert!(e.to_string().contains("gbs_tokens"), "{e}");
}

#[test]
fn products_of_large_dimensions_do_not_overflow() {
    for body in [
        json!({"model": "llama-3-8b", "dp": 1u64 << 20, "tp": 32, "pp": 32, "cp": 64, "ep": 1}),
        json!({"model": "llama-3-8b", "dp": u64::MAX, "mbs": 2, "gbs": 7}),
        json!({"model": "llama-3-8b", "mbs": 1u64 << 16, "seq": 1u64 << 22}),
    ] {
        let e = err(body.clone());
        assert!(e.contains("limit") || e.contains("gbs = 7"), "{body}: {e}");
    }
}
