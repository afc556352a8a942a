//! The training recipe: sequence and batch shape, precision, optimizer, recomputation.

use crate::error::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Storage element types the plan uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
    F16,
    /// fp8 e4m3 or e5m2 (one byte either way).
    F8,
    U32,
    U8,
}

impl DType {
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::F8 | DType::U8 => 1,
        }
    }
}

/// Mixed-precision recipes (Micikevicius et al. 2018 for fp16 + loss scaling; the playbook's
/// "mixed precision training" section for bf16 with fp32 master weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Everything fp32.
    Fp32,
    /// bf16 params, activations and grads; fp32 master weights and optimizer states.
    Bf16,
    /// As `Bf16`, plus an fp32 gradient accumulator (the playbook's 20 B/param case).
    Bf16Fp32grads,
    /// As `Bf16` but fp16, plus a dynamic loss scaler.
    Fp16,
    /// fp8 GEMM inputs (e4m3 forward, e5m2 gradients) with bf16 storage elsewhere.
    Fp8,
}

impl Precision {
    /// Storage type of parameters, gradients and activations.
    pub fn storage(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Fp16 => DType::F16,
            Precision::Bf16 | Precision::Bf16Fp32grads | Precision::Fp8 => DType::Bf16,
        }
    }

    /// Whether an fp32 master copy of the weights exists (all mixed recipes).
    pub fn has_master(self) -> bool {
        self != Precision::Fp32
    }

    /// Whether an extra fp32 gradient accumulator exists.
    pub fn fp32_grad_acc(self) -> bool {
        self == Precision::Bf16Fp32grads
    }

    /// Gradient storage of the ferrotron engine: fp32 under the fp32-accumulation recipe
    /// (accumulated in place, no 16-bit copy), else the storage type.
    pub fn engine_grads(self) -> DType {
        if self.fp32_grad_acc() {
            DType::F32
        } else {
            self.storage()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// Adam/AdamW: two fp32 moments per parameter (Kingma & Ba 2015; Loshchilov & Hutter 2019).
    Adamw,
    /// Plain SGD without momentum: no state.
    Sgd,
}

impl Optimizer {
    /// fp32 state values per parameter.
    pub fn states_per_param(self) -> u64 {
        match self {
            Optimizer::Adamw => 2,
            Optimizer::Sgd => 0,
        }
    }
}

/// Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022 §5 for "selective").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    Selective,
    Full,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recipe {
    pub seq: u64,
    pub mbs: u64,
    /// Micro-batches per optimizer step on each data-parallel rank.
    pub grad_acc: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub recompute: Recompute,
    /// Rows of logits materialised at once by the chunked cross-entropy (ferrotron engine).
    pub ce_chunk_tokens: u64,
    /// A mixture of experts' capacity factor (`None`: exact routing, no copy dropped): each
    /// expert takes at most ⌈cf · tokens · top_k / E⌉ of a micro-batch's routed copies.
    pub capacity_factor: Option<f64>,
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            seq: 4096,
            mbs: 1,
            grad_acc: 1,
            precision: Precision::Bf16,
            optimizer: Optimizer::Adamw,
            recompute: Recompute::None,
            ce_chunk_tokens: 1024,
            capacity_factor: None,
        }
    }
}

impl Recipe {
    /// Tokens in one micro-batch on one rank before context-parallel splitting.
    pub fn tokens(&self) -> u64 {
        self.seq * self.mbs
    }

    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("seq", self.seq),
            ("mbs", self.mbs),
            ("grad_acc", self.grad_acc),
            ("ce_chunk_tokens", self.ce_chunk_tokens),
        ] {
            if v == 0 {
                return Err(PlanError::setting(field, v, "must be a positive integer"));
            }
        }
        if let Some(cf) = self
            .capacity_factor
            .filter(|cf| !(cf.is_finite() && *cf > 0.0))
        {
            return Err(PlanError::setting(
                "capacity_factor",
                cf,
                "must be a positive number (1.0: each expert takes its even share of the copies)",
            ));
        }
        Ok(())
    }
}

/// Parses the kebab-case names used on the command line and in TOML.
fn parse_enum<T: for<'de> Deserialize<'de>>(field: &str, s: &str, choices: &str) -> Result<T> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| PlanError::setting(field, s, format!("expected one of {choices}")))
}

macro_rules! cli_enum {
    ($t:ty, $field:literal, $choices:literal) => {
        impl FromStr for $t {
            type Err = PlanError;
            fn from_str(s: &str) -> Result<Self> {
                parse_enum($field, s, $choices)
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match serde_json::to_value(self) {
                    Ok(serde_json::Value::String(s)) => f.write_str(&s),
                    _ => Err(fmt::Error),
                }
            }
        }
    };
}

cli_enum!(
    Precision,
    "precision",
    "fp32, bf16, bf16-fp32grads, fp16, fp8"
);
cli_enum!(Optimizer, "optimizer", "adamw, sgd");
cli_enum!(Recompute, "recompute", "none, selective, full");
