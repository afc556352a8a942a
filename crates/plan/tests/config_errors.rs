//! Bad model configs and settings give one clear error naming the field; never a panic.

mod common;
use common::input;
use ferrotron_plan::*;
use proptest::prelude::*;
use serde_json::{json, Value};

fn llama() -> Value {
    json!({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
           "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
           "vocab_size": 1000, "max_position_embeddings": 512})
}

fn err(v: Value) -> String {
    ModelSpec::from_json_value(&v, "config.json")
        .unwrap_err()
        .to_string()
}

#[test]
fn unknown_model_type() {
    let mut v = llama();
    v["model_type"] = json!("bert");
    assert_eq!(
        err(v),
        "config.json: model_type `bert` is not supported (supported: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, gemma, gemma2, phi3, deepseek_v2, deepseek_v3, gpt2, gpt_neox or gptj)"
    );
}

#[test]
fn missing_field() {
    let mut v = llama();
    v.as_object_mut().unwrap().remove("hidden_size");
    assert_eq!(
        err(v),
        "config.json: field `hidden_size` is missing (expected a positive integer)"
    );
}

#[test]
fn mistyped_fields() {
    let mut v = llama();
    v["num_hidden_layers"] = json!("32");
    assert_eq!(
        err(v),
        "config.json: field `num_hidden_layers` is \"32\" (a string) (expected a positive integer)"
    );
    let mut v = llama();
    v["vocab_size"] = json!(-5);
    assert_eq!(
        err(v),
        "config.json: field `vocab_size` is -5 (expected a positive integer)"
    );
    let mut v = llama();
    v["tie_word_embeddings"] = json!(1);
    assert_eq!(
        err(v),
        "config.json: field `tie_word_embeddings` is 1 (expected true or false)"
    );
}

#[test]
fn heads_must_divide_hidden() {
    let mut v = llama();
    v["num_attention_heads"] = json!(7);
    v["num_key_value_heads"] = json!(7);
    assert!(
        err(v).contains("field `num_attention_heads` is 7, which does not divide hidden_size 256")
    );
}

#[test]
fn kv_heads_must_divide_heads() {
    let mut v = llama();
    v["num_key_value_heads"] = json!(3);
    assert!(err(v)
        .contains("field `num_key_value_heads` is 3, which does not divide the 8 attention heads"));
}

#[test]
fn not_json() {
    let e = ModelSpec::from_json_str("{ not json", "cfg.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cfg.json: field `(file)` is not valid JSON"),
        "{e}"
    );
}

fn layout_err(layout: Layout) -> String {
    plan(&input(
        "llama-3-8b",
        Recipe::default(),
        layout,
        Convention::Ferrotron,
    ))
    .unwrap_err()
    .to_string()
}

#[test]
fn layout_errors_name_the_field() {
    assert_eq!(
        layout_err(Layout {
            tp: 3,
            ..Layout::default()
        }),
        "tp = 3: must divide the 32 attention heads"
    );
    // tp 16 > 8 key/value heads now plans (each rank holds one replicated head: tests/
    // layouts.rs); a tp that neither divides nor is a multiple of them is refused.
    let qwen = plan(&input(
        "qwen2.5-7b",
        Recipe::default(),
        Layout {
            tp: 14,
            ..Layout::default()
        },
        Convention::Ferrotron,
    ))
    .unwrap_err()
    .to_string();
    assert_eq!(
        qwen,
        "tp = 14: must divide the 4 key/value heads or be a multiple of them (then each rank holds one replicated head)"
    );
    assert_eq!(
        layout_err(Layout {
            pp: 5,
            ..Layout::default()
        }),
        "pp = 5: pp × pp_virtual = 5 must divide the 32 layers (or give each stage's layers with --pp-layers)"
    );
    assert_eq!(
        layout_err(Layout {
            zero: 4,
            ..Layout::default()
        }),
        "zero = 4: ZeRO stages are 0, 1, 2 or 3"
    );
    assert_eq!(
        layout_err(Layout {
            ep: 2,
            ..Layout::default()
        }),
        "ep = 2: expert parallelism needs a mixture-of-experts model (e.g. mixtral)"
    );
    assert_eq!(
        layout_err(Layout {
            dp: 0,
            ..Layout::default()
        }),
        "dp = 0: must be a positive integer"
    );
}

#[test]
fn seq_beyond_the_model_is_rejected() {
    let r = Recipe {
        seq: 16384,
        ..Recipe::default()
    };
    let e = plan(&input(
        "llama-3-8b",
        r,
        Layout::default(),
        Convention::Ferrotron,
    ))
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "seq = 16384: exceeds the model's max_position_embeddings 8192 (a context-extended run: pass --max-seq)"
    );
}

fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z0-9]{0,8}".prop_map(Value::from),
        Just(json!([1, 2])),
        Just(json!({"a": 1})),
        (1u64..100_000).prop_map(Value::from),
    ]
}

const FIELDS: &[&str] = &[
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rope_theta",
    "rms_norm_eps",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "n_embd",
    "n_head",
    "n_layer",
    "n_inner",
    "n_positions",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Replacing any field of a valid config with any JSON value never panics; a rejection
    /// names a field of the config (or the model_type).
    #[test]
    fn config_reader_never_panics(field in 0..FIELDS.len(), value in any_json(), base in 0..3usize,
                                  tp in 1u64..9, pp in 1u64..9) {
        let mut v = match base {
            0 => llama(),
            1 => json!({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100}),
            _ => json!({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                        "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 2}),
        };
        v[FIELDS[field]] = value;
        match ModelSpec::from_json_value(&v, "c.json") {
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.starts_with("c.json: "), "{}", msg);
                prop_assert!(FIELDS.iter().any(|f| msg.contains(f)), "{}", msg);
            }
            Ok(m) => {
                // Whatever parses must plan or be rejected with an error, never panic.
                let recipe = Recipe { seq: 64.min(m.max_positions), ..Recipe::default() };
                let layout = Layout { tp, pp, ..Layout::default() };
                let x = PlanInput { model: ModelSource::Spec(m), recipe, layout,
                    convention: Convention::Ferrotron, runtime: Runtime::Ferrotron,
                    overhead: ferrotron_plan::hardware::Overhead::NONE, bucket_bytes: 1 << 20 };
                let _ = plan(&x);
            }
        }
    }
}

#[test]
fn rope_theta_is_read_from_rope_parameters_too() {
    let mut v = llama();
    v["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "default"});
    assert_eq!(
        ModelSpec::from_json_value(&v, "c").unwrap().rope_theta,
        500000.0
    );
    v["rope_theta"] = json!(1e6);
    assert_eq!(ModelSpec::from_json_value(&v, "c").unwrap().rope_theta, 1e6);
    let mut v = llama();
    v["rope_parameters"] = json!(3);
    assert_eq!(
        err(v),
        "config.json: field `rope_parameters` is 3 (expected an object)"
    );
}
