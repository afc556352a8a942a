//! The parallel layout: a grid of dp × pp × cp × ep × tp ranks, ZeRO stage, schedule, offload.

use crate::error::{PlanError, Result};
use crate::model::ModelSpec;
use crate::recipe::Recipe;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Pipeline schedules: all-forward-all-backward (GPipe, Huang et al. 2019), 1F1B (PipeDream-Flush,
/// Narayanan et al. 2021) and interleaved 1F1B with `v` model chunks per stage (ibid.).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PpSchedule {
    Afab,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Interleaved,
}

/// What lives in host memory instead of the accelerator (ZeRO-Offload, Ren et al. 2021;
/// ZeRO-Infinity, Rajbhandari et al. 2021).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    None,
    /// fp32 master weights and optimizer states on the host; the update runs there.
    Optimizer,
    /// Additionally parameters and gradients, streamed per layer like ZeRO-3.
    Params,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    pub cp: u64,
    pub ep: u64,
    pub zero: u8,
    /// Sequence parallelism (Korthikanti et al. 2022 §4.2.2): shard the norm/dropout regions
    /// of the activations along the sequence over the tp group.
    pub sp: bool,
    pub pp_schedule: PpSchedule,
    /// Model chunks per pipeline stage (only with the interleaved schedule).
    pub pp_virtual: u64,
    /// Layers of each pipeline stage, first to last (`--pp-layers 7,8*14,7`); empty: L / p
    /// each. Llama 3 405B ran 126 layers on 16 stages with one layer fewer on the first and
    /// the last, which also hold the embedding and the LM head (Llama Team 2024, arXiv
    /// 2407.21783 §3.3.2). A stage may hold 0 layers (an embedding- or head-only stage).
    #[serde(default)]
    pub pp_layers: Vec<u64>,
    pub offload: Offload,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            zero: 0,
            sp: false,
            pp_schedule: PpSchedule::OneFOneB,
            pp_virtual: 1,
            pp_layers: vec![],
            offload: Offload::None,
        }
    }
}

impl Layout {
    /// Total ranks: dp × pp × cp × ep × tp.
    pub fn world(&self) -> u64 {
        self.dp * self.pp * self.cp * self.ep * self.tp
    }

    /// Ranks that hold replicas of a dense (non-expert) parameter and process different data:
    /// dp × cp × ep. ZeRO shards dense states over this group (as Megatron's distributed
    /// optimizer shards over the data-parallel × context-parallel group).
    pub fn dense_replicas(&self) -> u64 {
        self.dp * self.cp * self.ep
    }

    /// Ranks that hold replicas of one expert: dp × cp (the ep ranks hold different experts).
    pub fn expert_replicas(&self) -> u64 {
        self.dp * self.cp
    }

    /// The layers of model chunk `g` (of pp × pp_virtual; chunk g sits on stage g mod pp) for a
    /// model of `layers` layers: L/(p·v) consecutive layers each, or the `pp_layers` split.
    pub fn chunk_layers(&self, layers: u64, g: u64) -> std::ops::Range<u64> {
        if self.pp_layers.is_empty() {
            let per = layers / (self.pp * self.pp_virtual);
            return g * per..(g + 1) * per;
        }
        let start: u64 = self.pp_layers[..g as usize].iter().sum();
        start..start + self.pp_layers[g as usize]
    }

    /// Which pipeline stage holds part `p` of a model of `layers` layers. Model chunk g (of
    /// p·v) holds layers [g·L/(pv), (g+1)·L/(pv)) (or the `pp_layers` split) and sits on stage
    /// g mod p; the embedding is on the first stage, the final norm and LM head on the last.
    pub fn stage_of(&self, p: crate::inventory::Placement, layers: u64) -> u64 {
        use crate::inventory::Placement;
        let chunks = self.pp * self.pp_virtual;
        match p {
            Placement::Embedding => 0,
            Placement::Head => self.pp - 1,
            Placement::Layer(i) if self.pp_layers.is_empty() => (i / (layers / chunks)) % self.pp,
            Placement::Layer(i) => {
                (0..chunks)
                    .find(|&g| self.chunk_layers(layers, g).contains(&i))
                    .unwrap_or(0)
                    % self.pp
            }
        }
    }

    /// Layers pipeline stage `stage` holds, over all its model chunks.
    pub fn stage_layer_count(&self, layers: u64, stage: u64) -> u64 {
        (0..self.pp_virtual)
            .map(|c| self.chunk_layers(layers, c * self.pp + stage))
            .map(|r| r.end - r.start)
            .sum()
    }

    /// Sequences consumed per optimizer step across the whole job.
    pub fn global_batch(&self, r: &Recipe) -> u64 {
        r.mbs * r.grad_acc * self.dp * self.ep
    }

    /// Checks the layout against the model and recipe; each error names the field and the fix.
    pub fn validate(&self, m: Option<&ModelSpec>, r: &Recipe) -> Result<()> {
        for (field, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("pp_virtual", self.pp_virtual),
        ] {
            if v == 0 {
                return Err(PlanError::setting(field, v, "must be a positive integer"));
            }
        }
        if self.zero > 3 {
            return Err(PlanError::setting(
                "zero",
                self.zero,
                "ZeRO stages are 0, 1, 2 or 3",
            ));
        }
        if self.pp_virtual > 1 && self.pp_schedule != PpSchedule::Interleaved {
            return Err(PlanError::setting(
                "pp_virtual",
                self.pp_virtual,
                "virtual stages need --pp-schedule interleaved",
            ));
        }
        if !r.seq.is_multiple_of(self.cp) {
            return Err(PlanError::setting(
                "cp",
                self.cp,
                format!("must divide seq {}", r.seq),
            ));
        }
        let Some(m) = m else { return Ok(()) };
        if m.heads % self.tp != 0 {
            return Err(PlanError::setting(
                "tp",
                self.tp,
                format!("must divide the {} attention heads", m.heads),
            ));
        }
        // tp ≤ kv heads: each rank holds kv/tp of them; tp > kv heads: each rank holds one,
        // every head replicated tp/kv times (`ModelSpec::kv_heads_tp`).
        if !m.kv_heads.is_multiple_of(self.tp) && !self.tp.is_multiple_of(m.kv_heads) {
            return Err(PlanError::setting(
                "tp",
                self.tp,
                format!(
                    "must divide the {} key/value heads or be a multiple of them (then each rank holds one replicated head)",
                    m.kv_heads
                ),
            ));
        }
        if !self.pp_layers.is_empty() {
            self.validate_pp_layers(m.layers)?;
        } else if m.layers % (self.pp * self.pp_virtual) != 0 {
            return Err(PlanError::setting(
                "pp",
                self.pp,
                format!(
                    "pp × pp_virtual = {} must divide the {} layers (or give each stage's layers with --pp-layers)",
                    self.pp * self.pp_virtual,
                    m.layers
                ),
            ));
        }
        match m.moe {
            None if self.ep > 1 => {
                return Err(PlanError::setting(
                    "ep",
                    self.ep,
                    "expert parallelism needs a mixture-of-experts model (e.g. mixtral)",
                ))
            }
            Some(moe) if moe.num_experts % self.ep != 0 => {
                return Err(PlanError::setting(
                    "ep",
                    self.ep,
                    format!("must divide the {} experts", moe.num_experts),
                ))
            }
            _ => {}
        }
        if r.seq > m.max_positions {
            return Err(PlanError::setting(
                "seq",
                r.seq,
                format!(
                    "exceeds the model's max_position_embeddings {} (a context-extended run: pass --max-seq)",
                    m.max_positions
                ),
            ));
        }
        Ok(())
    }
}

impl Layout {
    fn validate_pp_layers(&self, layers: u64) -> Result<()> {
        let list = || {
            self.pp_layers
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        if self.pp_virtual > 1 {
            return Err(PlanError::setting(
                "pp_layers",
                list(),
                "an uneven split needs pp_virtual 1 (drop --pp-virtual or --pp-layers)",
            ));
        }
        if self.pp_layers.len() as u64 != self.pp {
            return Err(PlanError::setting(
                "pp_layers",
                list(),
                format!(
                    "gives {} stages but pp is {} (one layer count per stage, e.g. 7,8*14,7)",
                    self.pp_layers.len(),
                    self.pp
                ),
            ));
        }
        let sum: u64 = self.pp_layers.iter().sum();
        if sum != layers {
            return Err(PlanError::setting(
                "pp_layers",
                list(),
                format!("adds up to {sum} layers but the model has {layers}"),
            ));
        }
        Ok(())
    }
}

/// Parses `--pp-layers`: comma-separated layer counts, `n*k` for k stages of n layers
/// (`7,8*14,7` is 16 stages).
pub fn parse_pp_layers(s: &str) -> Result<Vec<u64>> {
    let bad = || {
        PlanError::setting(
            "pp_layers",
            s,
            "expected layer counts per stage separated by commas, n*k for k stages of n (e.g. 7,8*14,7)",
        )
    };
    let mut out = vec![];
    for part in s.split(',') {
        let (n, k) = match part.trim().split_once('*') {
            Some((n, k)) => (n.trim(), k.trim().parse::<u64>().map_err(|_| bad())?),
            None => (part.trim(), 1),
        };
        let n: u64 = n.parse().map_err(|_| bad())?;
        if k == 0 || k > 1 << 12 || out.len() as u64 + k > 1 << 12 {
            return Err(bad());
        }
        out.extend(std::iter::repeat_n(n, k as usize));
    }
    Ok(out)
}

impl FromStr for PpSchedule {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "afab" => Ok(PpSchedule::Afab),
            "1f1b" => Ok(PpSchedule::OneFOneB),
            "interleaved" => Ok(PpSchedule::Interleaved),
            _ => Err(PlanError::setting(
                "pp_schedule",
                s,
                "expected one of afab, 1f1b, interleaved",
            )),
        }
    }
}

impl fmt::Display for PpSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PpSchedule::Afab => "afab",
            PpSchedule::OneFOneB => "1f1b",
            PpSchedule::Interleaved => "interleaved",
        })
    }
}

impl FromStr for Offload {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "params" => Ok(Offload::Params),
            _ => Err(PlanError::setting(
                "offload",
                s,
                "expected one of none, optimizer, params",
            )),
        }
    }
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
        })
    }
}
