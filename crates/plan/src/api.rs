//! Settings as flat key/values (the CLI flags, TOML files and the JSON API share them) and the
//! JSON API `ferrotron serve` exposes: `plan`, `search`, `presets`. Every function returns a
//! `PlanError` naming the field for bad input; none panics.

use crate::attention_kernel::AttentionKernel;
use crate::cluster::{gpu, gpus, networks, Cluster, ClusterFile};
use crate::convention::Convention;
use crate::error::{PlanError, Result};
use crate::flops::FlopsConvention;
use crate::hardware::Overhead;
use crate::inventory::{count, inventory};
use crate::layout::{Layout, PpSchedule};
use crate::layout_flags::LayoutFlags;
use crate::model::ModelSpec;
use crate::planner::{plan, ModelSource, PlanInput};
use crate::presets::{preset, preset_names};
use crate::recipe::{Optimizer, Precision, Recipe, Recompute};
use crate::report::{build_with_time, json::to_json};
use crate::search::{search, SearchResult, SearchSpec, DEFAULT_MARGIN};
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};

/// Accepts `7.5e9`, `"7.5e9"` or `7500000000` for a parameter count.
pub(crate) fn string_or_number<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<String>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(other) => Some(other.to_string()),
    })
}

/// Every setting of a plan. Keys are the flag names with `_` for `-`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// A built-in preset name.
    pub model: Option<String>,
    /// An HF config.json, as a JSON object or as its text (the API's "pasted config").
    pub config: Option<Value>,
    #[serde(default, deserialize_with = "string_or_number")]
    pub params: Option<String>,
    /// With `params`: parameters of the largest layer, what ZeRO-3 gathers at once.
    #[serde(default, deserialize_with = "string_or_number")]
    pub largest_layer: Option<String>,
    pub seq: Option<u64>,
    /// Overrides the model's `max_position_embeddings` (a context-extended run).
    pub max_seq: Option<u64>,
    pub mbs: Option<u64>,
    pub grad_acc: Option<u64>,
    pub gbs: Option<u64>,
    pub precision: Option<String>,
    pub optimizer: Option<String>,
    pub recompute: Option<String>,
    pub dp: Option<u64>,
    pub tp: Option<u64>,
    pub pp: Option<u64>,
    pub cp: Option<u64>,
    pub ep: Option<u64>,
    pub zero: Option<u64>,
    pub sp: Option<bool>,
    pub pp_schedule: Option<String>,
    pub pp_virtual: Option<u64>,
    pub pp_layers: Option<String>,
    pub pp_first_layers: Option<u64>,
    pub pp_last_layers: Option<u64>,
    pub offload: Option<String>,
    /// Expert-parallel all-to-alls overlapped with compute (DeepSeek-V3's DualPipe).
    pub ep_overlap: Option<bool>,
    /// Tensor-parallel collectives overlapped with the GEMMs (Megatron-LM's --tp-comm-overlap).
    pub tp_overlap: Option<bool>,
    /// ZeRO-1/2's parameter all-gather overlapped with the next forward (--overlap-param-gather).
    pub param_gather_overlap: Option<bool>,
    /// Pipeline sends overlapped with compute (--overlap-p2p-communication, interleaved only).
    pub pp_overlap: Option<bool>,
    pub gpu: Option<String>,
    pub gpus_per_node: Option<u64>,
    pub cluster: Option<ClusterFile>,
    /// The fused attention kernel (flash2, triton); wins over the cluster file's.
    pub attention: Option<String>,
    pub flops_convention: Option<String>,
    pub convention: Option<String>,
    pub overhead_gib: Option<f64>,
    pub fragmentation: Option<f64>,
    pub ce_chunk: Option<u64>,
    pub bucket_mb: Option<u64>,
    /// A mixture of experts' capacity factor (exact routing without).
    pub capacity_factor: Option<f64>,
    /// The disk tier of `offload = optimizer` (ZeRO-Infinity's NVMe offload): the drive's free
    /// GiB, its sequential bandwidths (GB/s) and the bucket in elements of each state.
    pub disk_gib: Option<f64>,
    pub disk_read_gbs: Option<f64>,
    pub disk_write_gbs: Option<f64>,
    pub offload_bucket: Option<u64>,
}

/// A plan input with the cluster it runs on and the FLOPs convention for MFU.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub input: PlanInput,
    pub cluster: Cluster,
    pub flops: FlopsConvention,
    /// How the settings were completed (`--pp-layers auto`'s proposal), for the report.
    pub notes: Vec<String>,
}

/// The model with its `max_position_embeddings` replaced by `--max-seq`: the context a run
/// extends the model to (Llama 3.1 went from 8k to 128k by RoPE scaling; context parallelism
/// then splits such sequences). Only the sequence length it allows changes: no parameter
/// depends on it.
fn with_max_seq(mut m: ModelSpec, max_seq: Option<u64>) -> Result<ModelSpec> {
    match max_seq {
        None => Ok(m),
        Some(0) => Err(PlanError::setting(
            "max_seq",
            0,
            "must be a positive integer",
        )),
        Some(n) if n > 1 << 24 => Err(PlanError::setting(
            "max_seq",
            n,
            "is above the planner's limit of 16,777,216 positions",
        )),
        Some(n) => {
            m.max_positions = n;
            Ok(m)
        }
    }
}

/// A named setting parsed from its text, or `default` when not given.
pub(crate) fn parse<T: std::str::FromStr<Err = PlanError>>(
    v: &Option<String>,
    default: T,
) -> Result<T> {
    match v {
        None => Ok(default),
        Some(s) => s.parse(),
    }
}

/// Largest `params` the planner takes: 2^50 ≈ 1.1e15, a thousand times the largest models,
/// so that 16 bytes of model states per parameter (and their sums) fit in u64.
pub const MAX_PARAMS: u64 = 1 << 50;

/// Parses a parameter count such as `7.5e9` or `7000000000` exactly.
pub fn parse_params(s: &str) -> Result<u64> {
    parse_count("params", s)
}

/// Parses a parameter count for setting `field` (`params`, `largest_layer`).
fn parse_count(field: &str, s: &str) -> Result<u64> {
    let bad = || {
        PlanError::setting(
            field,
            s,
            "expected a positive parameter count such as 7.5e9 or 125000000",
        )
    };
    let n = match s.parse::<u64>() {
        Ok(0) => return Err(bad()),
        Ok(n) => n,
        Err(_) => {
            let x: f64 = s.parse().map_err(|_| bad())?;
            if !((1.0..9.0e18).contains(&x) && x.fract() == 0.0) {
                return Err(bad());
            }
            x as u64
        }
    };
    if n > MAX_PARAMS {
        return Err(PlanError::setting(
            field,
            s,
            format!("is above the planner's limit {MAX_PARAMS} (about 1.1e15 parameters)"),
        ));
    }
    Ok(n)
}

/// A model from an inline config.json (object or text). The reader bounds every size (see
/// `model::size_limit`), so byte counts cannot overflow.
pub fn model_from_config(v: &Value) -> Result<ModelSpec> {
    match v {
        Value::String(text) => ModelSpec::from_json_str(text, "config"),
        other => ModelSpec::from_json_value(other, "config"),
    }
}

/// Upper bounds on the settings, so that no byte count overflows and no simulated program
/// grows without bound (the AFAB schedule is simulated micro-batch by micro-batch).
fn check_limits(r: &Recipe, l: &Layout) -> Result<()> {
    for (field, v, max) in [
        ("seq", r.seq, 1u64 << 22),
        ("mbs", r.mbs, 1 << 16),
        ("grad_acc", r.grad_acc, 1 << 20),
        ("ce_chunk", r.ce_chunk_tokens, 1 << 24),
        ("dp", l.dp, 1 << 20),
        ("tp", l.tp, 1 << 12),
        ("pp", l.pp, 1 << 12),
        ("cp", l.cp, 1 << 12),
        ("ep", l.ep, 1 << 12),
        ("pp_virtual", l.pp_virtual, 1 << 10),
    ] {
        if v > max {
            return Err(PlanError::setting(
                field,
                v,
                format!("is above the planner's limit {max}"),
            ));
        }
    }
    let world = [l.dp, l.tp, l.pp, l.cp, l.ep]
        .iter()
        .try_fold(1u64, |a, &b| a.checked_mul(b))
        .unwrap_or(u64::MAX);
    if world > 1 << 24 {
        return Err(PlanError::setting(
            "dp",
            l.dp,
            format!("dp·tp·pp·cp·ep = {world} ranks is above the planner's limit 2^24"),
        ));
    }
    if r.seq * r.mbs > 1 << 26 {
        return Err(PlanError::setting(
            "mbs",
            r.mbs,
            format!(
                "mbs × seq = {} tokens per micro-batch is above the planner's limit 2^26",
                r.seq * r.mbs
            ),
        ));
    }
    if l.pp_schedule == PpSchedule::Afab && r.grad_acc > 4096 {
        return Err(PlanError::setting(
            "grad_acc",
            r.grad_acc,
            "the AFAB schedule is simulated micro-batch by micro-batch; use at most 4096 (or 1f1b)",
        ));
    }
    Ok(())
}

fn positive(field: &str, v: Option<u64>, default: u64) -> Result<u64> {
    match v {
        Some(0) => Err(PlanError::setting(field, 0, "must be a positive integer")),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

impl Settings {
    /// The cluster: a cluster file (flags `gpu` and `gpus_per_node` win over it) or a GPU kind
    /// in nodes of `gpus_per_node` [default h100, 8 per node].
    pub fn cluster(&self) -> Result<Cluster> {
        let mut c = match &self.cluster {
            Some(f) => f.resolve(self.gpu.as_deref(), self.gpus_per_node)?,
            None => Cluster::of(
                gpu(self.gpu.as_deref().unwrap_or("h100"))?,
                positive("gpus_per_node", self.gpus_per_node, 8)?,
            )?,
        };
        if let Some(k) = &self.attention {
            c.attention_kernel = k.parse()?;
        }
        Ok(c)
    }

    /// Builds the planner input. `model` is a model the caller already loaded (the CLI reads
    /// config files); otherwise `model` must name a preset, or `config` hold a config.json.
    pub fn resolve(&self, model: Option<ModelSource>) -> Result<Resolved> {
        let given = [
            self.model.is_some() || model.is_some(),
            self.config.is_some(),
            self.params.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if given > 1 {
            return Err(PlanError::setting(
                "model",
                self.model.as_deref().unwrap_or("(config)"),
                "give one of --model, a pasted config or --params, not several",
            ));
        }
        let model = match (model, &self.model, &self.config, &self.params) {
            (Some(m), _, _, _) => m,
            (None, Some(name), _, _) => {
                if preset_names().any(|n| n == name) {
                    ModelSource::Spec(preset(name)?)
                } else {
                    return Err(PlanError::setting(
                        "model",
                        name,
                        "not a built-in preset (see --list-presets or /api/presets); paste a config.json instead",
                    ));
                }
            }
            (None, None, Some(cfg), _) => ModelSource::Spec(model_from_config(cfg)?),
            (None, None, None, Some(p)) => match &self.largest_layer {
                None => ModelSource::Params(parse_params(p)?),
                Some(big) => ModelSource::Counted {
                    params: parse_params(p)?,
                    largest_layer: parse_count("largest_layer", big)?,
                },
            },
            (None, None, None, None) => {
                return Err(PlanError::setting(
                    "model",
                    "(none)",
                    "no model: pass --model PRESET_OR_CONFIG_JSON or --params N",
                ))
            }
        };
        if let (Some(big), ModelSource::Spec(_)) = (&self.largest_layer, &model) {
            return Err(PlanError::setting(
                "largest_layer",
                big,
                "goes with --params (a model config gives its own layers)",
            ));
        }
        let model = match model {
            ModelSource::Spec(m) => ModelSource::Spec(with_max_seq(m, self.max_seq)?),
            other => other,
        };
        let max_pos = match &model {
            ModelSource::Spec(m) => m.max_positions,
            ModelSource::Params(_) | ModelSource::Counted { .. } => u64::MAX,
        };
        let layout = LayoutFlags {
            dp: self.dp,
            tp: self.tp,
            pp: self.pp,
            cp: self.cp,
            ep: self.ep,
            zero: self.zero,
            sp: self.sp,
            pp_schedule: self.pp_schedule.clone(),
            pp_virtual: self.pp_virtual,
            pp_layers: self.pp_layers.clone().filter(|s| s.trim() != "auto"),
            pp_first_layers: self.pp_first_layers,
            pp_last_layers: self.pp_last_layers,
            offload: self.offload.clone(),
        }
        .resolve()?;
        let layout = Layout {
            ep_overlap: self.ep_overlap.unwrap_or(false),
            tp_overlap: self.tp_overlap.unwrap_or(false),
            param_gather_overlap: self.param_gather_overlap.unwrap_or(false),
            pp_overlap: self.pp_overlap.unwrap_or(false),
            ..layout
        };
        let mbs = self.mbs.unwrap_or(1);
        let grad_acc = match (self.gbs, self.grad_acc) {
            (None, ga) => ga.unwrap_or(1),
            (Some(gbs), ga) => {
                let per_step = mbs
                    .checked_mul(layout.dp)
                    .and_then(|x| x.checked_mul(layout.ep))
                    .unwrap_or(u64::MAX);
                if per_step == 0 || gbs == 0 || gbs % per_step != 0 {
                    return Err(PlanError::setting(
                        "gbs",
                        gbs,
                        format!("must be a positive multiple of mbs·dp·ep = {per_step}"),
                    ));
                }
                let derived = gbs / per_step;
                if let Some(g) = ga {
                    if g != derived {
                        return Err(PlanError::setting(
                            "grad_acc",
                            g,
                            format!("contradicts gbs = {gbs} (which implies grad_acc = {derived}); give one of them"),
                        ));
                    }
                }
                derived
            }
        };
        let recipe = Recipe {
            seq: self.seq.unwrap_or(4096.min(max_pos)),
            mbs,
            grad_acc,
            precision: parse(&self.precision, Precision::Bf16)?,
            optimizer: parse(&self.optimizer, Optimizer::Adamw)?,
            recompute: parse(&self.recompute, Recompute::None)?,
            ce_chunk_tokens: self.ce_chunk.unwrap_or(1024),
            capacity_factor: self.capacity_factor,
        };
        if let Some(cf) = recipe.capacity_factor {
            recipe.validate()?;
            // A capacity bounds each expert's routed copies: a model must have experts.
            if let ModelSource::Spec(m) = &model {
                if m.moe.is_none() {
                    return Err(PlanError::setting(
                        "capacity_factor",
                        cf,
                        format!(
                            "a capacity bounds each expert's routed tokens; model {} has no experts",
                            m.name
                        ),
                    ));
                }
            }
        }
        check_limits(&recipe, &layout)?;
        let g = self.overhead_gib.unwrap_or(1.0);
        if !(0.0..=1024.0).contains(&g) {
            return Err(PlanError::setting(
                "overhead_gib",
                g,
                "expected GiB between 0 and 1024",
            ));
        }
        let overhead = Overhead {
            context_bytes: (g * (1u64 << 30) as f64) as u64,
            fragmentation: self.fragmentation.unwrap_or(0.05),
        };
        overhead.validate()?;
        let convention: Convention = parse(&self.convention, Convention::Ferrotron)?;
        let flops: FlopsConvention = parse(&self.flops_convention, FlopsConvention::Ferrotron)?;
        let bucket_bytes = self
            .bucket_mb
            .unwrap_or(25)
            .checked_mul(1 << 20)
            .ok_or_else(|| {
                PlanError::setting("bucket_mb", self.bucket_mb.unwrap_or(0), "too large")
            })?;
        let mut cluster = self.cluster()?;
        cluster.disk = crate::disk_tier::tier(
            self.disk_gib,
            self.disk_read_gbs,
            self.disk_write_gbs,
            self.offload_bucket,
            layout.offload,
        )?;
        let mut input = PlanInput {
            model,
            recipe,
            layout,
            convention,
            runtime: crate::runtime::Runtime::of(convention),
            overhead,
            bucket_bytes,
        };
        let mut notes = vec![];
        if self.pp_layers.as_deref().map(str::trim) == Some("auto") {
            let (split, why) = crate::balance::propose(&input, &cluster)?;
            input.layout.pp_layers = split;
            notes = why;
        }
        Ok(Resolved {
            input,
            cluster,
            flops,
            notes,
        })
    }
}

/// Reads a JSON request body into settings, naming the offending field on error.
pub fn settings_from_json(v: Value) -> Result<Settings> {
    if !v.is_object() {
        return Err(PlanError::setting(
            "request",
            "(body)",
            "expected a JSON object of settings, e.g. {\"model\": \"llama-3-8b\", \"mbs\": 2}",
        ));
    }
    serde_json::from_value(v).map_err(|e| PlanError::setting("request", "(body)", e.to_string()))
}

/// `/api/plan`: the same JSON as `ferrotron plan --json` (with "time" and "comm"), plus
/// "settings" echoing the effective recipe and layout.
pub fn plan_json(body: Value) -> Result<Value> {
    let r = settings_from_json(body)?.resolve(None)?;
    // Deep pipelines: plan the first and last stage only (they bound every stage), so that a
    // request cannot make the server simulate thousands of stages.
    let result = if r.input.layout.pp > 16 {
        crate::planner::plan_extremes(&r.input)?
    } else {
        plan(&r.input)?
    };
    let mut rep = build_with_time(&r.input, &result, &r.cluster, r.flops, false)?;
    if let Some(t) = rep.time.as_mut() {
        t.notes.extend(r.notes.iter().cloned());
    }
    let mut v = to_json(&rep);
    v["settings"] = json!({
        "recipe": r.input.recipe,
        "layout": r.input.layout,
        "gpu": r.cluster.gpu.name,
        "gpus_per_node": r.cluster.gpus_per_node,
        "capacity": r.cluster.gpu.capacity,
    });
    Ok(v)
}

/// Search settings: the plan settings that apply (model, precision, convention, ...) plus the
/// GPU count, the global batch in tokens, the memory margin and how many to return.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchSettings {
    pub model: Option<String>,
    pub config: Option<Value>,
    /// Overrides the model's `max_position_embeddings` (see [`Settings::max_seq`]).
    pub max_seq: Option<u64>,
    pub gpus: Option<u64>,
    pub gpu: Option<String>,
    pub gpus_per_node: Option<u64>,
    pub cluster: Option<ClusterFile>,
    /// The fused attention kernel (see [`Settings::attention`]).
    pub attention: Option<String>,
    pub seq: Option<u64>,
    pub gbs_tokens: Option<u64>,
    pub precision: Option<String>,
    pub optimizer: Option<String>,
    pub convention: Option<String>,
    pub flops_convention: Option<String>,
    pub margin: Option<f64>,
    pub top: Option<u64>,
    pub max_mbs: Option<u64>,
    pub overhead_gib: Option<f64>,
    pub fragmentation: Option<f64>,
}

impl SearchSettings {
    /// `model` is a model the caller already loaded (the CLI reads config files).
    pub fn resolve(&self, model: Option<ModelSpec>) -> Result<SearchSpec> {
        let spec = match (model, &self.model, &self.config) {
            (Some(m), _, _) => m,
            (None, Some(name), None) => {
                if preset_names().any(|n| n == name) {
                    preset(name)?
                } else {
                    return Err(PlanError::setting(
                        "model",
                        name,
                        "not a built-in preset (see --list-presets or /api/presets)",
                    ));
                }
            }
            (None, None, Some(cfg)) => model_from_config(cfg)?,
            (None, Some(_), Some(_)) => {
                return Err(PlanError::setting(
                    "model",
                    "(and config)",
                    "give a preset or a pasted config, not both",
                ))
            }
            (None, None, None) => {
                return Err(PlanError::setting(
                    "model",
                    "(none)",
                    "no model: pass --model PRESET_OR_CONFIG_JSON",
                ))
            }
        };
        let gpus = match self.gpus {
            None => {
                return Err(PlanError::setting(
                    "gpus",
                    "(none)",
                    "required: the number of GPUs to lay out",
                ))
            }
            Some(0) => return Err(PlanError::setting("gpus", 0, "must be a positive integer")),
            Some(n) if n > 1 << 20 => {
                return Err(PlanError::setting("gpus", n, "at most 1,048,576 GPUs"))
            }
            Some(n) => n,
        };
        let spec = with_max_seq(spec, self.max_seq)?;
        let seq = positive("seq", self.seq, 4096.min(spec.max_positions))?;
        let gbs_tokens = match self.gbs_tokens {
            Some(t) if t > 1 << 40 => {
                return Err(PlanError::setting(
                    "gbs_tokens",
                    t,
                    "is above the planner's limit 2^40",
                ))
            }
            Some(t) => t,
            None => seq * gpus,
        };
        let cluster = Settings {
            gpu: self.gpu.clone(),
            gpus_per_node: self.gpus_per_node,
            cluster: self.cluster.clone(),
            attention: self.attention.clone(),
            ..Settings::default()
        }
        .cluster()?;
        let mut s = SearchSpec::new(spec, gpus, cluster, seq, gbs_tokens);
        s.precision = parse(&self.precision, Precision::Bf16)?;
        s.optimizer = parse(&self.optimizer, Optimizer::Adamw)?;
        s.convention = parse(&self.convention, Convention::Ferrotron)?;
        s.flops = parse(&self.flops_convention, FlopsConvention::Ferrotron)?;
        s.margin = self.margin.unwrap_or(DEFAULT_MARGIN);
        s.top_k = positive("top", self.top, 5)?.min(100) as usize;
        s.max_mbs = positive("max_mbs", self.max_mbs, 64)?.min(1 << 16);
        let g = self.overhead_gib.unwrap_or(1.0);
        if !(0.0..=1024.0).contains(&g) {
            return Err(PlanError::setting(
                "overhead_gib",
                g,
                "expected GiB between 0 and 1024",
            ));
        }
        s.overhead = Overhead {
            context_bytes: (g * (1u64 << 30) as f64) as u64,
            fragmentation: self.fragmentation.unwrap_or(0.05),
        };
        Ok(s)
    }
}

/// The search result as JSON (what `plan search --json` prints and `/api/search` returns).
pub fn search_to_json(r: &SearchResult, s: &SearchSpec) -> Value {
    let cand = |i: usize, c: &crate::search::Candidate| {
        json!({
            "rank": i + 1,
            "flags": c.flags,
            "dp": c.layout.dp, "tp": c.layout.tp, "pp": c.layout.pp, "cp": c.layout.cp,
            "ep": c.layout.ep, "zero": c.layout.zero, "sp": c.layout.sp,
            "pp_schedule": c.layout.pp_schedule, "pp_virtual": c.layout.pp_virtual,
            "recompute": c.recipe.recompute, "mbs": c.recipe.mbs, "grad_acc": c.recipe.grad_acc,
            "peak": c.peak,
            "peak_rank": c.peak_rank,
            "fits": c.peak <= r.budget,
            "time": crate::report::json::time(&c.time),
            "comm": crate::report::json::comm(&c.time),
        })
    };
    json!({
        "model": s.model.name,
        "gpus": s.gpus,
        "gpu": s.cluster.gpu.name,
        "gpus_per_node": s.cluster.gpus_per_node,
        "seq": s.seq,
        "gbs_tokens": s.gbs_tokens,
        "margin": s.margin,
        "capacity": r.capacity,
        "budget": r.budget,
        "evaluated": r.evaluated,
        "memory_planned": r.memory_planned,
        "faster_rejected": r.faster_rejected,
        "fastest_rejected": r.fastest_rejected.as_ref().map(|c| cand(0, c)),
        "nearest_rejected": r.nearest_rejected.as_ref().map(|c| cand(0, c)),
        "top": r.top.iter().enumerate().map(|(i, c)| cand(i, c)).collect::<Vec<_>>(),
        "reason": r.reason,
    })
}

/// `/api/search`.
pub fn search_json(body: Value) -> Result<Value> {
    if !body.is_object() {
        return Err(PlanError::setting(
            "request",
            "(body)",
            "expected a JSON object, e.g. {\"model\": \"llama-3-8b\", \"gpus\": 64}",
        ));
    }
    let s: SearchSettings = serde_json::from_value(body)
        .map_err(|e| PlanError::setting("request", "(body)", e.to_string()))?;
    let spec = s.resolve(None)?;
    let r = search(&spec)?;
    Ok(search_to_json(&r, &spec))
}

/// `/api/presets`: models (with parameter counts and shapes), GPUs, networks, the choices of
/// every enumerated setting.
pub fn presets_json() -> Value {
    let models: Vec<Value> = preset_names()
        .filter_map(|n| preset(n).ok().map(|m| (n, m)))
        .map(|(n, m)| {
            let c = count(&m, &inventory(&m));
            json!({
                "name": n, "model_type": m.model_type, "params": c.total,
                "layers": m.layers, "heads": m.heads, "kv_heads": m.kv_heads,
                "hidden": m.hidden, "max_positions": m.max_positions,
                "experts": m.moe.map(|x| x.num_experts),
            })
        })
        .collect();
    let gpus: Vec<Value> = gpus()
        .into_iter()
        .map(|g| {
            json!({"name": g.name, "capacity": g.capacity, "note": g.note,
                   "bf16_tflops": g.bf16_flops / 1e12, "hbm_gb_s": g.hbm_bw / 1e9})
        })
        .collect();
    let nets: Vec<Value> = networks()
        .into_iter()
        .map(|n| json!({"name": n.name, "gb_s": n.bw / 1e9, "note": n.note}))
        .collect();
    json!({
        "models": models,
        "gpus": gpus,
        "networks": nets,
        "precision": ["fp32", "bf16", "bf16-fp32grads", "fp16", "fp8"],
        "recompute": ["none", "selective", "full"],
        "pp_schedule": ["afab", "1f1b", "interleaved"],
        "offload": ["none", "optimizer", "params"],
        "optimizer": ["adamw", "sgd"],
        "convention": Convention::ALL.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        "attention": AttentionKernel::ALL.iter().map(|k| k.name()).collect::<Vec<_>>(),
        "flops_convention": FlopsConvention::ALL.iter().map(|c| c.name()).collect::<Vec<_>>(),
    })
}
