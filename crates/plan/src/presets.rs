//! Built-in model presets: real HF `config.json` files shipped in `presets/`, embedded in the
//! binary so `--model llama-3-8b` works from any directory without network access.

use crate::error::{PlanError, Result};
use crate::model::ModelSpec;

macro_rules! presets {
    ($($name:literal),* $(,)?) => {
        /// (name, config.json text) for every built-in preset.
        pub const PRESETS: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("../presets/", $name, ".json"))),)*
        ];
    };
}

presets!(
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.1-405b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "mistral-7b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "smollm-135m",
    "smollm-360m",
    "smollm-1.7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-3b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
    "gemma-2b",
    "gemma-2-9b",
    "phi-3-mini-4k",
    "deepseek-v2-lite",
    "deepseek-v3",
    "megatron-22b",
    "megatron-175b",
    "megatron-530b",
    "megatron-1t",
    "pythia-160m",
    "pythia-1.4b",
    "gpt-j-6b",
    "ferrotron-12m",
    "ferrotron-moe-16m",
);

pub fn preset_names() -> impl Iterator<Item = &'static str> {
    PRESETS.iter().map(|(n, _)| *n)
}

pub fn preset_json(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, j)| *j)
}

/// Loads a preset by name.
pub fn preset(name: &str) -> Result<ModelSpec> {
    let text = preset_json(name).ok_or_else(|| PlanError::UnknownPreset(name.to_string()))?;
    let mut spec = ModelSpec::from_json_str(text, name)?;
    spec.name = name.to_string();
    Ok(spec)
}

/// Resolves `--model`: a preset name, a config.json file, or a directory holding one.
pub fn resolve(name_or_path: &str) -> Result<ModelSpec> {
    if preset_json(name_or_path).is_some() {
        return preset(name_or_path);
    }
    let path = std::path::Path::new(name_or_path);
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if !file.is_file() {
        return Err(PlanError::setting(
            "model",
            name_or_path,
            "neither a built-in preset nor a config.json file (run `ferrotron plan --list-presets`)",
        ));
    }
    let source = file.display().to_string();
    let text = std::fs::read_to_string(&file).map_err(|e| PlanError::Config {
        source_name: source.clone(),
        field: "(file)".into(),
        problem: format!("cannot be read: {e}"),
    })?;
    ModelSpec::from_json_str(&text, &source)
}
