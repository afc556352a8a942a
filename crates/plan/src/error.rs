//! Planner errors. Every message names the field, the value and the fix, on one line.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// A model config field is absent, mistyped or out of range.
    #[error("{source_name}: field `{field}` {problem}")]
    Config {
        source_name: String,
        field: String,
        problem: String,
    },
    /// The config names an architecture the planner does not model.
    #[error("{source_name}: model_type `{value}` is not supported (supported: llama, mistral, qwen2, mixtral, gpt2)")]
    UnsupportedModel { source_name: String, value: String },
    /// A training or layout setting is invalid for this model.
    #[error("{field} = {value}: {problem}")]
    Setting {
        field: String,
        value: String,
        problem: String,
    },
    #[error("unknown preset `{0}`; run `ferrotron plan --list-presets` for the built-in names, or pass a path to a config.json")]
    UnknownPreset(String),
}

impl PlanError {
    pub fn setting(field: &str, value: impl ToString, problem: impl Into<String>) -> Self {
        PlanError::Setting {
            field: field.to_string(),
            value: value.to_string(),
            problem: problem.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, PlanError>;
