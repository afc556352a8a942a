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
    /// Layers of each pipeline stage, first to last (`--pp-layers 7,8*14,7`: pp counts), or
    /// of each model chunk in model order (pp × pp_virtual counts; chunk g sits on stage
    /// g mod pp); empty: L / (p·v) each. With pp counts and virtual stages, a stage's layers
    /// split evenly over its chunks (Megatron-LM's rule). Llama 3 405B ran 126 layers on 16
    /// stages with one layer fewer on the first and the last, which also hold the embedding
    /// and the LM head, while interleaving (Llama Team 2024, arXiv 2407.21783 §3.3.2). A stage
    /// or chunk may hold 0 layers (an embedding- or head-only one).
    #[serde(default)]
    pub pp_layers: Vec<u64>,
    /// Megatron-LM's first/last-stage form (`--decoder-first-pipeline-num-layers`,
    /// `--decoder-last-pipeline-num-layers`): the first (last) stage holds this many layers,
    /// the other stages the rest evenly; with virtual stages each stage's layers split evenly
    /// over its chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_first_layers: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_last_layers: Option<u64>,
    pub offload: Offload,
    /// Expert-parallel all-to-alls overlapped with another micro-batch's compute (DeepSeek-V3's
    /// DualPipe, arXiv 2412.19437 §3.2.1) instead of exposed; a planner setting (`--ep-overlap`),
    /// not one of the trainer's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ep_overlap: bool,
    /// Tensor-parallel all-gathers and reduce-scatters overlapped with the GEMMs they feed
    /// (Megatron-LM's `--tp-comm-overlap`, Transformer Engine's userbuffers; NeMo's default in
    /// its performance recipes) instead of exposed; a planner setting (`--tp-overlap`), not one
    /// of the trainer's. Megatron-LM allows it only with sequence parallelism.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tp_overlap: bool,
    /// ZeRO-1/2's all-gather of the updated parameters overlapped with the next step's first
    /// forward (Megatron-LM's `--overlap-param-gather`, with its distributed optimizer: each
    /// bucket is gathered as the forward reaches it) instead of exposed after the optimizer
    /// step; a planner setting (`--param-gather-overlap`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub param_gather_overlap: bool,
    /// Pipeline sends and receives overlapped with the next model chunk's forward or backward
    /// (Megatron-LM's `--overlap-p2p-communication`, on by default but only in the interleaved
    /// schedule: "Overlap P2P communication is disabled if not using the interleaved schedule",
    /// `arguments.py`) instead of on the critical path; a planner setting (`--pp-overlap`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pp_overlap: bool,
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
            pp_first_layers: None,
            pp_last_layers: None,
            offload: Offload::None,
            ep_overlap: false,
            tp_overlap: false,
            param_gather_overlap: false,
            pp_overlap: false,
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

    /// Whether the layers are split unevenly (a `pp_layers` list or the first/last form).
    pub fn uneven(&self) -> bool {
        !self.pp_layers.is_empty()
            || self.pp_first_layers.is_some()
            || self.pp_last_layers.is_some()
    }

    /// Layers pipeline stage `stage` holds under the first/last form (Megatron-LM's
    /// `get_num_layers_to_build`: the stages not named share the rest evenly).
    fn first_last_stage_layers(&self, layers: u64, stage: u64) -> u64 {
        let (first, last) = (self.pp_first_layers, self.pp_last_layers);
        if stage == 0 && first.is_some() {
            return first.unwrap_or(0);
        }
        if stage == self.pp - 1 && last.is_some() {
            return last.unwrap_or(0);
        }
        let named = first.is_some() as u64 + last.is_some() as u64;
        let rest = layers.saturating_sub(first.unwrap_or(0).saturating_add(last.unwrap_or(0)));
        rest / self.pp.saturating_sub(named).max(1)
    }

    /// Layers of model chunk `g` (of pp × pp_virtual; chunk g sits on stage g mod pp).
    pub fn chunk_layer_count(&self, layers: u64, g: u64) -> u64 {
        let (p, v) = (self.pp, self.pp_virtual);
        let n = self.pp_layers.len() as u64;
        if n == p * v {
            self.pp_layers[g as usize]
        } else if n == p {
            self.pp_layers[(g % p) as usize] / v
        } else if self.pp_first_layers.is_some() || self.pp_last_layers.is_some() {
            self.first_last_stage_layers(layers, g % p) / v
        } else {
            layers / (p * v)
        }
    }

    /// The layers of model chunk `g` (of pp × pp_virtual; chunk g sits on stage g mod pp) for a
    /// model of `layers` layers: L/(p·v) consecutive layers each, or the uneven split's.
    pub fn chunk_layers(&self, layers: u64, g: u64) -> std::ops::Range<u64> {
        if !self.uneven() {
            let per = layers / (self.pp * self.pp_virtual);
            return g * per..(g + 1) * per;
        }
        let start: u64 = (0..g).map(|h| self.chunk_layer_count(layers, h)).sum();
        start..start + self.chunk_layer_count(layers, g)
    }

    /// Which pipeline stage holds part `p` of a model of `layers` layers. Model chunk g (of
    /// p·v) holds layers [g·L/(pv), (g+1)·L/(pv)) (or the uneven split's) and sits on stage
    /// g mod p; the embedding is on the first stage, the final norm and LM head on the last.
    pub fn stage_of(&self, p: crate::inventory::Placement, layers: u64) -> u64 {
        use crate::inventory::Placement;
        let chunks = self.pp * self.pp_virtual;
        match p {
            Placement::Embedding => 0,
            Placement::Head => self.pp - 1,
            Placement::Layer(i) if !self.uneven() => (i / (layers / chunks)) % self.pp,
            Placement::Layer(i) => {
                let mut end = 0;
                (0..chunks)
                    .find(|&g| {
                        end += self.chunk_layer_count(layers, g);
                        i < end
                    })
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
        if self.ep_overlap && self.ep == 1 {
            return Err(PlanError::setting(
                "ep_overlap",
                true,
                "overlaps expert-parallel all-to-alls: add --ep 2 or more",
            ));
        }
        if self.tp_overlap && (self.tp == 1 || !self.sp) {
            // Megatron-LM's arguments.py: "Tensor parallel communication/GEMM overlap can
            // happen only when sequence parallelism is enabled".
            return Err(PlanError::setting(
                "tp_overlap",
                true,
                "overlaps the all-gathers and reduce-scatters of sequence parallelism: add --tp 2 or more and --sp",
            ));
        }
        if self.param_gather_overlap && !(self.zero == 1 || self.zero == 2) {
            return Err(PlanError::setting(
                "param_gather_overlap",
                true,
                "overlaps the parameter all-gather of ZeRO-1/2 (Megatron-LM's distributed optimizer): add --zero 1",
            ));
        }
        if self.pp_overlap && (self.pp == 1 || self.pp_schedule != PpSchedule::Interleaved) {
            return Err(PlanError::setting(
                "pp_overlap",
                true,
                "Megatron-LM overlaps pipeline sends only in the interleaved schedule: add --pp 2 or more and --pp-schedule interleaved",
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
        if self.uneven() {
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
        let (p, v) = (self.pp, self.pp_virtual);
        if self.pp_layers.is_empty() {
            return self.validate_first_last(layers);
        }
        let list = || {
            self.pp_layers
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        if let Some((flag, n)) = [
            ("pp_first_layers", self.pp_first_layers),
            ("pp_last_layers", self.pp_last_layers),
        ]
        .into_iter()
        .find_map(|(f, n)| n.map(|n| (f, n)))
        {
            return Err(PlanError::setting(
                flag,
                n,
                "goes without --pp-layers (give either every stage's layers or the first and last stage's)",
            ));
        }
        let n = self.pp_layers.len() as u64;
        if n != p && n != p * v {
            let per_chunk = if v > 1 {
                format!(
                    ", or pp × pp_virtual = {} counts, one per model chunk",
                    p * v
                )
            } else {
                String::new()
            };
            return Err(PlanError::setting(
                "pp_layers",
                list(),
                format!(
                    "gives {n} stages but pp is {p} (one layer count per stage, e.g. 7,8*14,7{per_chunk})"
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
        if n == p && v > 1 {
            if let Some(s) = (0..p).find(|&s| !self.pp_layers[s as usize].is_multiple_of(v)) {
                return Err(PlanError::setting(
                    "pp_layers",
                    list(),
                    format!(
                        "stage {s}'s {} layers do not split evenly over pp_virtual = {v} model chunks (give one count per model chunk: {} counts in model order)",
                        self.pp_layers[s as usize],
                        p * v
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Megatron-LM's first/last form: the named stages' counts, the rest evenly over the
    /// others, and every stage's count a multiple of pp_virtual (its chunks split it evenly).
    fn validate_first_last(&self, layers: u64) -> Result<()> {
        let (p, v) = (self.pp, self.pp_virtual);
        let (first, last) = (self.pp_first_layers, self.pp_last_layers);
        let (flag, given) = match (first, last) {
            (Some(f), _) => ("pp_first_layers", f),
            (None, Some(l)) => ("pp_last_layers", l),
            (None, None) => return Ok(()),
        };
        if p < 2 {
            return Err(PlanError::setting(
                flag,
                given,
                "names a pipeline stage's layers: add --pp 2 or more",
            ));
        }
        let named = first.is_some() as u64 + last.is_some() as u64;
        let edges = first.unwrap_or(0).saturating_add(last.unwrap_or(0));
        let others = p - named;
        let fix = "(Megatron-LM's rule: the other stages share the rest evenly; else give every stage's layers with --pp-layers)";
        if edges > layers || (others == 0 && edges != layers) {
            return Err(PlanError::setting(
                flag,
                given,
                format!(
                    "the first and last stage's {edges} layers leave {} for the other {others} stages of a {layers}-layer model {fix}",
                    layers as i128 - edges as i128
                ),
            ));
        }
        if others > 0 && !(layers - edges).is_multiple_of(others) {
            return Err(PlanError::setting(
                flag,
                given,
                format!(
                    "the other {others} stages cannot share the remaining {} layers evenly {fix}",
                    layers - edges
                ),
            ));
        }
        if let Some(s) =
            (0..p).find(|&s| !self.first_last_stage_layers(layers, s).is_multiple_of(v))
        {
            return Err(PlanError::setting(
                flag,
                given,
                format!(
                    "stage {s}'s {} layers do not split evenly over pp_virtual = {v} model chunks (give one count per model chunk with --pp-layers: {} counts in model order)",
                    self.first_last_stage_layers(layers, s),
                    p * v
                ),
            ));
        }
        Ok(())
    }
}

/// Writes layer counts as `--pp-layers` reads them, runs as `n*k` (`7,8*14,7`).
pub fn format_pp_layers(counts: &[u64]) -> String {
    let mut parts: Vec<String> = vec![];
    let mut i = 0;
    while i < counts.len() {
        let k = counts[i..].iter().take_while(|&&n| n == counts[i]).count();
        parts.push(match k {
            1 => counts[i].to_string(),
            _ => format!("{}*{k}", counts[i]),
        });
        i += k;
    }
    parts.join(",")
}

/// Parses `--pp-layers`: comma-separated layer counts, `n*k` for k stages of n layers
/// (`7,8*14,7` is 16 stages).
pub fn parse_pp_layers(s: &str) -> Result<Vec<u64>> {
    if s.trim() == "auto" {
        return Err(PlanError::setting(
            "pp_layers",
            s,
            "`ferrotron plan --pp-layers auto` proposes a split; give the layer counts its layout line prints",
        ));
    }
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
