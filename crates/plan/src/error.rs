//! Planner errors. Every message names the field, the value and the fix, on one line.

use std::borrow::Cow;
use thiserror::Error;

/// `s` with every control character escaped (`\n`, `\u{7f}`): the parts of a message that come
/// from outside (a field name or value from a file or a request) cannot break it over lines
/// or send escape sequences to the terminal that prints it.
pub fn one_line(s: &str) -> Cow<'_, str> {
    if s.chars().any(char::is_control) {
        Cow::Owned(
            s.chars()
                .map(|c| {
                    if c.is_control() {
                        c.escape_debug().to_string()
                    } else {
                        c.to_string()
                    }
                })
                .collect(),
        )
    } else {
        Cow::Borrowed(s)
    }
}

#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// A model config field is absent, mistyped or out of range.
    #[error("{}: field `{}` {}", one_line(.source_name), one_line(.field), one_line(.problem))]
    Config {
        source_name: String,
        field: String,
        problem: String,
    },
    /// The config names an architecture the planner does not model.
    #[error("{}: model_type `{}` is not supported (supported: {})", one_line(.source_name), one_line(.value), crate::model::SUPPORTED)]
    UnsupportedModel { source_name: String, value: String },
    /// A training or layout setting is invalid for this model.
    #[error("{} = {}: {}", one_line(.field), one_line(.value), one_line(.problem))]
    Setting {
        field: String,
        value: String,
        problem: String,
    },
    /// A settings file that cannot be read or parsed: the message names the file (and the
    /// line and column of a parse error).
    #[error("{0}")]
    File(String),
    #[error("unknown preset `{}`; run `ferrotron plan --list-presets` for the built-in names, or pass a path to a config.json", one_line(.0))]
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
