//! Reads fields of one config.json object, producing errors that name the source and the field.

use super::size_limit;
use crate::error::{PlanError, Result};
use serde_json::Value;

pub(super) struct Fields<'a> {
    pub source: &'a str,
    pub obj: &'a serde_json::Map<String, Value>,
}

pub(super) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b} (a boolean)"),
        Value::Number(n) => format!("{n}"),
        Value::String(s) => format!("\"{s}\" (a string)"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

impl<'a> Fields<'a> {
    pub fn err(&self, field: &str, problem: impl Into<String>) -> PlanError {
        PlanError::Config {
            source_name: self.source.to_string(),
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    pub fn present(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    /// A positive integer no larger than the field's [`size_limit`].
    pub fn positive(&self, field: &str) -> Result<u64> {
        match self.present(field) {
            None => Err(self.err(field, "is missing (expected a positive integer)")),
            Some(v) => self.positive_value(field, v),
        }
    }

    pub fn positive_value(&self, field: &str, v: &Value) -> Result<u64> {
        let max = size_limit(field);
        match v.as_u64() {
            Some(0) => Err(self.err(field, "is 0 (expected a positive integer)")),
            Some(n) if n > max => Err(self.err(
                field,
                format!("is {n}, above the planner's limit {max} (is it a typo?)"),
            )),
            Some(n) => Ok(n),
            None => Err(self.err(
                field,
                format!("is {} (expected a positive integer)", describe(v)),
            )),
        }
    }

    pub fn positive_or(&self, field: &str, default: u64) -> Result<u64> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => self.positive_value(field, v),
        }
    }

    /// A non-negative integer (0 allowed: `first_k_dense_replace`, `n_shared_experts`).
    pub fn count_or(&self, field: &str, default: u64) -> Result<u64> {
        match self.present(field) {
            None => Ok(default),
            Some(v) if v.as_u64() == Some(0) => Ok(0),
            Some(v) => self.positive_value(field, v),
        }
    }

    /// A list of layer indices below `layers` (Qwen2-MoE `mlp_only_layers`).
    pub fn layer_list(&self, field: &str, layers: u64) -> Result<Vec<u64>> {
        match self.present(field) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v.as_u64() {
                    Some(i) if i < layers => Ok(i),
                    _ => Err(self.err(
                        field,
                        format!(
                            "holds {} (expected layer indices 0..{})",
                            describe(v),
                            layers - 1
                        ),
                    )),
                })
                .collect(),
            Some(v) => Err(self.err(
                field,
                format!("is {} (expected an array of layer indices)", describe(v)),
            )),
        }
    }

    pub fn boolean_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.present(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(
                field,
                format!("is {} (expected true or false)", describe(v)),
            )),
        }
    }

    pub fn float_or(&self, field: &str, default: f64) -> Result<f64> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.err(
                    field,
                    format!("is {} (expected a positive number)", describe(v)),
                )),
            },
        }
    }

    /// A coefficient that may be zero (a loss weight: 0 turns its term off).
    pub fn coefficient_or(&self, field: &str, default: f64) -> Result<f64> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
                _ => Err(self.err(
                    field,
                    format!("is {} (expected a number >= 0)", describe(v)),
                )),
            },
        }
    }

    pub fn string_or(&self, field: &str, default: &str) -> Result<String> {
        match self.present(field) {
            None => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(self.err(field, format!("is {} (expected a string)", describe(v)))),
        }
    }

    /// RoPE base: top-level `rope_theta` (transformers 4.x), or `rope_parameters.rope_theta`
    /// (transformers 5.x writes it there); 10000 when neither is present (LlamaConfig default).
    pub fn rope_theta(&self) -> Result<f64> {
        if self.present("rope_theta").is_some() {
            return self.float_or("rope_theta", 10_000.0);
        }
        match self.present("rope_parameters") {
            Some(Value::Object(obj)) => {
                let inner = Fields {
                    source: self.source,
                    obj,
                };
                inner.float_or("rope_theta", 10_000.0)
            }
            Some(v) => Err(self.err(
                "rope_parameters",
                format!("is {} (expected an object)", describe(v)),
            )),
            None => Ok(10_000.0),
        }
    }
}
