//! Fuzzed readers of the planner: HF `config.json` (`presets::resolve`, `ModelSpec`), cluster
//! files (`ClusterFile` from TOML, as `ferrotron plan --cluster` reads them) and the JSON API
//! behind `ferrotron serve` (`api::plan_json`, `api::search_json`). Random bytes and mutations
//! of real files: every call returns `Ok` or a one-line error, within the case budget, and
//! whatever parses must plan (or be refused) without a panic.
//!
//! CI runs a fixed number of cases per property (about a minute for all three fuzz binaries);
//! `FERROTRON_FUZZ_SCALE=10` runs ten times as many, `PROPTEST_CASES=N` exactly N.

#[path = "../../../tests/fuzz/mutate.rs"]
mod mutate;

use ferrotron_plan::api::{plan_json, search_json};
use ferrotron_plan::cluster::ClusterFile;
use ferrotron_plan::hardware::Overhead;
use ferrotron_plan::presets::{preset_json, resolve};
use ferrotron_plan::{
    plan, Convention, Layout, ModelSource, ModelSpec, PlanInput, Recipe, Runtime,
};
use mutate::{
    bounded, config, each_extreme_number, json_mutations, mutate, mutate_json, mutations,
};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The real config.json files of the repository: the test fixtures and a few presets (one of
/// each model type, one with rope_parameters).
fn config_samples() -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = ["tiny-gqa", "tiny-qwen2", "tiny-tied"]
        .iter()
        .map(|d| std::fs::read(root().join("tests/fixtures").join(d).join("config.json")).unwrap())
        .collect();
    for p in ["gpt2", "mixtral-8x7b", "llama-3-8b", "qwen2.5-0.5b"] {
        v.push(preset_json(p).unwrap().as_bytes().to_vec());
    }
    v
}

/// A fresh file under the test's temp dir holding `bytes`.
fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-plan");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!(
        "{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// One line, no control characters (a message is printed to a terminal as is).
fn assert_one_line(msg: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        !msg.chars().any(char::is_control),
        "error message is not one clean line: {:?}",
        msg
    );
    Ok(())
}

/// Reads `bytes` as a config.json file the way `--model PATH` does; a rejection names the file
/// on one line; an accepted model plans (or is refused) without a panic.
fn check_config_file(bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = temp_file("config.json", bytes);
    let name = path.display().to_string();
    let got = bounded("resolve(config.json)", || resolve(&name))?;
    std::fs::remove_file(&path).ok();
    match got {
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(msg.starts_with(&format!("{name}: ")), "{}", msg);
            assert_one_line(&msg)?;
        }
        Ok(m) => plan_small(m)?,
    }
    Ok(())
}

/// Plans a parsed model with a small recipe: the model's sizes must not overflow anything.
fn plan_small(m: ModelSpec) -> Result<(), TestCaseError> {
    let recipe = Recipe {
        seq: 64.min(m.max_positions),
        ..Recipe::default()
    };
    let input = PlanInput {
        model: ModelSource::Spec(m),
        recipe,
        layout: Layout::default(),
        convention: Convention::Ferrotron,
        runtime: Runtime::Ferrotron,
        overhead: Overhead::NONE,
        bucket_bytes: 1 << 20,
    };
    if let Err(e) = bounded("plan(parsed config)", || plan(&input))? {
        assert_one_line(&e.to_string())?;
    }
    Ok(())
}

/// An API handler (`plan_json`, `search_json`).
type Endpoint = fn(Value) -> ferrotron_plan::Result<Value>;

/// Calls the API the way `ferrotron serve` does (body bytes → JSON → handler).
fn check_api(endpoint: Endpoint, body: &[u8]) -> Result<(), TestCaseError> {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Ok(());
    };
    if let Err(e) = bounded("api call", || endpoint(v))? {
        assert_one_line(&e.to_string())?;
    }
    Ok(())
}

/// Names the config reader looks for: fields and model types.
const CONFIG_WORDS: &[&str] = &[
    "model_type",
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "gpt2",
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
    "rope_parameters",
    "rms_norm_eps",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "n_embd",
    "n_head",
    "n_layer",
    "n_inner",
    "n_positions",
    "layer_norm_epsilon",
];

/// Names the API reads: settings, their choices, presets, GPUs, networks, cluster fields.
const API_WORDS: &[&str] = &[
    "model",
    "config",
    "params",
    "seq",
    "mbs",
    "grad_acc",
    "gbs",
    "precision",
    "optimizer",
    "recompute",
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "zero",
    "sp",
    "pp_schedule",
    "pp_virtual",
    "offload",
    "gpu",
    "gpus_per_node",
    "cluster",
    "flops_convention",
    "convention",
    "overhead_gib",
    "fragmentation",
    "ce_chunk",
    "bucket_mb",
    "gpus",
    "gbs_tokens",
    "margin",
    "top",
    "max_mbs",
    "fp32",
    "bf16",
    "bf16-fp32grads",
    "fp16",
    "fp8",
    "adamw",
    "sgd",
    "none",
    "selective",
    "full",
    "afab",
    "1f1b",
    "interleaved",
    "optimizer",
    "params",
    "megatron",
    "zero-paper",
    "playbook",
    "torchtitan",
    "nanotron",
    "6n",
    "llama-3-8b",
    "mixtral-8x22b",
    "llama-3.1-405b",
    "megatron-1t",
    "gpt2",
    "h100",
    "mi300x",
    "rtx4090",
    "ib-ndr",
    "eth-100",
    "custom_gpu",
    "name",
    "memory_gib",
    "bf16_tflops",
    "fp8_tflops",
    "fp32_tflops",
    "hbm_tb_s",
    "sms",
    "link_gb_s",
    "matmul_efficiency",
    "intra_node_gb_s",
    "intra_node_latency_us",
    "network",
    "inter_node_gb_s",
    "inter_node_latency_us",
    "link_efficiency",
];

/// Valid API requests, as the page sends them.
fn request_samples() -> Vec<(Endpoint, Vec<u8>)> {
    let tiny = std::fs::read_to_string(root().join("tests/fixtures/tiny-gqa/config.json")).unwrap();
    let bodies: Vec<(Endpoint, Value)> = vec![
        (
            plan_json,
            json!({"model": "llama-3-8b", "seq": 4096, "mbs": 2, "dp": 8, "tp": 2, "pp": 2,
                   "zero": 1, "sp": true, "recompute": "selective", "precision": "bf16",
                   "pp_schedule": "interleaved", "pp_virtual": 2, "grad_acc": 4, "gpu": "h100",
                   "gpus_per_node": 8, "overhead_gib": 1.0, "fragmentation": 0.05,
                   "ce_chunk": 1024, "bucket_mb": 25, "offload": "none"}),
        ),
        (
            plan_json,
            json!({"config": tiny, "seq": 64, "mbs": 1, "gbs": 8, "dp": 8}),
        ),
        (
            plan_json,
            json!({"model": "mixtral-8x7b", "ep": 8, "dp": 8, "tp": 2, "cluster":
                   {"name": "c", "gpu": "h100", "gpus_per_node": 8, "network": "ib-ndr",
                    "inter_node_gb_s": 50.0, "link_efficiency": 0.8}}),
        ),
        (plan_json, json!({"params": "7.5e9", "dp": 4, "zero": 3})),
        (
            search_json,
            json!({"model": "gpt2", "gpus": 8, "seq": 1024, "gbs_tokens": 1 << 18, "top": 3,
                   "max_mbs": 8, "margin": 0.1, "precision": "bf16"}),
        ),
    ];
    bodies
        .into_iter()
        .map(|(f, v)| (f, serde_json::to_vec(&v).unwrap()))
        .collect()
}

/// Cluster files: the example, and one with a custom GPU (the commented block, enabled).
fn cluster_samples() -> Vec<String> {
    let example = std::fs::read_to_string(root().join("configs/cluster-example.toml")).unwrap();
    // Uncomment the `[custom_gpu]` block and drop `gpu = ...` (the file says: use one or the other).
    let mut in_block = false;
    let custom = example
        .lines()
        .filter(|l| !l.starts_with("gpu ="))
        .map(|l| {
            in_block |= l == "# [custom_gpu]";
            if in_block {
                l.trim_start_matches("# ")
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    vec![example, custom]
}

/// Reads a cluster file the way `--cluster` does (TOML → `ClusterFile` → `resolve`), then plans
/// on it through the API (a cluster with absurd links must still give numbers or an error).
fn check_cluster(text: &str) -> Result<(), TestCaseError> {
    let Ok(file) = bounded("toml cluster", || toml::from_str::<ClusterFile>(text))? else {
        return Ok(());
    };
    match bounded("ClusterFile::resolve", || file.resolve(None, None))? {
        Err(e) => assert_one_line(&e.to_string())?,
        Ok(_) => {
            let body = json!({"model": "gpt2", "seq": 512, "dp": 16, "cluster": file});
            check_api(plan_json, &serde_json::to_vec(&body).unwrap())?;
        }
    }
    Ok(())
}

#[test]
fn samples_are_valid() {
    // The properties below mutate these; if they did not parse, mutants would test nothing.
    for s in config_samples() {
        let m = ModelSpec::from_json_str(std::str::from_utf8(&s).unwrap(), "sample").unwrap();
        plan_small(m).unwrap();
    }
    for (f, body) in request_samples() {
        let v = serde_json::from_slice(&body).unwrap();
        f(v).unwrap();
    }
    for c in cluster_samples() {
        let file: ClusterFile = toml::from_str(&c).unwrap();
        file.resolve(None, None).unwrap();
    }
    assert!(cluster_samples()[1].contains("[custom_gpu]\nname = \"my-accelerator\""));
}

#[test]
fn config_fields_with_extreme_numbers() {
    for sample in config_samples() {
        each_extreme_number(&serde_json::from_slice(&sample).unwrap(), check_config_file);
    }
}

#[test]
fn api_fields_with_extreme_numbers() {
    for (f, body) in request_samples() {
        each_extreme_number(&serde_json::from_slice(&body).unwrap(), |b| check_api(f, b));
    }
}

proptest! {
    #![proptest_config(config(40_000))]

    #[test]
    fn config_json_random_bytes(bytes in mutate::bytes(512)) {
        check_config_file(&bytes)?;
    }

    #[test]
    fn config_json_random_text(text in mutate::text(256)) {
        check_config_file(text.as_bytes())?;
    }

    #[test]
    fn config_json_mutated(i in 0..7usize, muts in mutations(4)) {
        let samples = config_samples();
        check_config_file(&mutate(&samples[i % samples.len()], &muts))?;
    }

    #[test]
    fn api_random_bytes(bytes in mutate::bytes(256), search in any::<bool>()) {
        check_api(if search { search_json } else { plan_json }, &bytes)?;
    }

    #[test]
    fn cluster_toml_random_text(text in mutate::text(256)) {
        check_cluster(&text)?;
    }

    #[test]
    fn cluster_toml_mutated(i in 0..2usize, muts in mutations(4)) {
        let bytes = mutate(cluster_samples()[i].as_bytes(), &muts);
        check_cluster(&String::from_utf8_lossy(&bytes))?;
    }
}

proptest! {
    // Each case plans a model or searches layouts: fewer of them.
    #![proptest_config(config(15_000))]

    /// Structured edits (a field set to a hostile value, removed, or added): unlike byte
    /// edits, these keep the JSON valid and so reach the settings checks and the planner.
    #[test]
    fn api_requests_structured(i in 0..5usize, muts in json_mutations(API_WORDS, 4)) {
        let samples = request_samples();
        let (f, body) = &samples[i];
        let doc = mutate_json(&serde_json::from_slice(body).unwrap(), &muts);
        check_api(*f, &serde_json::to_vec(&doc).unwrap())?;
    }

    #[test]
    fn config_json_structured(i in 0..7usize, muts in json_mutations(CONFIG_WORDS, 4)) {
        let samples = config_samples();
        let doc = mutate_json(&serde_json::from_slice(&samples[i]).unwrap(), &muts);
        check_config_file(doc.to_string().as_bytes())?;
    }


    #[test]
    fn api_requests_mutated(i in 0..5usize, muts in mutations(4)) {
        let samples = request_samples();
        let (f, body) = &samples[i];
        check_api(*f, &mutate(body, &muts))?;
    }
}

// ---------------------------------------------------------------------------------------------
// Regressions: what the properties above found, each pinned with its message.

/// `config_fields_with_extreme_numbers`: `--model config.json` took any size up to 2^32 (only
/// the web API had limits), and the planner walks every layer: 65535 layers took 1.5 s to plan,
/// 2^32 would not finish. The reader now bounds every size.
#[test]
fn regression_huge_layer_count_is_refused_by_the_reader() {
    let mut v: Value = serde_json::from_slice(&config_samples()[0]).unwrap();
    v["num_hidden_layers"] = json!(65535);
    let e = ModelSpec::from_json_value(&v, "config.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "config.json: field `num_hidden_layers` is 65535, above the planner's limit 4096 (is it a typo?)"
    );
    v["num_hidden_layers"] = json!(2);
    v["num_attention_heads"] = json!(1);
    v["num_key_value_heads"] = json!(1);
    v.as_object_mut().unwrap().remove("head_dim");
    v["hidden_size"] = json!(8192);
    let e = ModelSpec::from_json_value(&v, "config.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "config.json: field `num_attention_heads` is 1, which makes head_dim = hidden_size / num_attention_heads = 8192, above the planner's limit 4096 (set head_dim or fix the head count)"
    );
}

/// `api_requests_mutated`: `params` up to 9e18 overflowed the byte sums of the plan (a panic
/// in debug builds, a wrapped total in release).
#[test]
fn regression_huge_params_are_refused() {
    let e = plan_json(json!({"params": "18446744073709551615"})).unwrap_err();
    assert_eq!(
        e.to_string(),
        "params = 18446744073709551615: is above the planner's limit 1125899906842624 (about 1.1e15 parameters)"
    );
}

/// `api_requests_mutated`: a field name or value from the request or the file went into the
/// message verbatim, control characters included (a DEL, a newline, a terminal escape).
#[test]
fn regression_control_characters_in_errors_are_escaped() {
    let e = plan_json(json!({"model": "llama-3-8b", "precisi\u{7f}n\n": "bf16"})).unwrap_err();
    assert!(
        e.to_string().starts_with(
            "request = (body): unknown field `precisi\\u{7f}n\\n`, expected one of `model`"
        ),
        "{e}"
    );
    let e = ModelSpec::from_json_value(&json!({"model_type": "llama\n\u{1b}[31m"}), "c.json")
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "c.json: model_type `llama\\n\\u{1b}[31m` is not supported (supported: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, gemma, gemma2, phi3, deepseek_v2, deepseek_v3, gpt2, gpt_neox or gptj)"
    );
}
