//! The flags of `ferrotron plan` and `ferrotron plan search` as the user gives them: one
//! definition for the command line (with the `cli` feature they are clap flags), a `--config`
//! TOML file (keys are the flag names with `_` for `-`) and Python's keywords
//! (`ferrotron.plan(seq=4096, dp=8)`), each turned into a planner input by one function.

use crate::api::{search_to_json, Resolved, SearchSettings, Settings};
use crate::error::{one_line, PlanError, Result};
use crate::planner::{plan, ModelSource, PlanResult};
use crate::presets::resolve as load_model;
use crate::report::{build_with_time, html::to_html, json::to_json, Report};
use crate::search::{search, SearchSpec};
use crate::toml_file::read_toml;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// `ferrotron plan`'s settings. Every one is optional so that a TOML file can supply it; flags
/// given on the command line win.
#[derive(Deserialize, Default, Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields)]
pub struct PlanFlags {
    /// Built-in preset name (see --list-presets), a Hugging Face config.json or a directory
    /// holding one (required, or --params).
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub model: Option<String>,
    /// Bare parameter count (e.g. 7.5e9): model states only, sharded uniformly over tp·pp
    /// (instead of --model).
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    #[serde(default, deserialize_with = "crate::api::string_or_number")]
    pub params: Option<String>,
    /// With --params: parameters of the largest layer (e.g. 1e9), what ZeRO-3 gathers at once
    /// [default: none].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    #[serde(default, deserialize_with = "crate::api::string_or_number")]
    pub largest_layer: Option<String>,
    /// Sequence length [default: min(4096, model max positions)].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub seq: Option<u64>,
    /// Context length the run extends the model to: overrides its max_position_embeddings
    /// [default: the model's].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub max_seq: Option<u64>,
    /// Micro-batch size per rank [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub mbs: Option<u64>,
    /// Micro-batches per optimizer step [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub grad_acc: Option<u64>,
    /// Global batch in sequences: sets grad-acc = gbs / (mbs·dp·ep) [default: mbs·dp·ep·grad-acc].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gbs: Option<u64>,
    /// fp32 | bf16 | bf16-fp32grads | fp16 | fp8 [default: bf16].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub precision: Option<String>,
    /// adamw | sgd [default: adamw].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub optimizer: Option<String>,
    /// Activation recomputation: none | selective | full [default: none].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub recompute: Option<String>,
    /// Data-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub dp: Option<u64>,
    /// Tensor-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub tp: Option<u64>,
    /// Pipeline stages [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp: Option<u64>,
    /// Context-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub cp: Option<u64>,
    /// Expert-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub ep: Option<u64>,
    /// ZeRO stage 0..3 [default: 0].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub zero: Option<u64>,
    /// Sequence parallelism (with tp > 1); `--sp` alone means true [default: false].
    #[cfg_attr(
        feature = "cli",
        arg(long, num_args = 0..=1, default_missing_value = "true")
    )]
    pub sp: Option<bool>,
    /// afab | 1f1b | interleaved [default: 1f1b].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_schedule: Option<String>,
    /// Model chunks per stage for the interleaved schedule [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_virtual: Option<u64>,
    /// Layers per pipeline stage, e.g. 7,8*14,7 (126 layers on 16 stages), or per model chunk
    /// (pp × pp-virtual counts, model order), or auto (balanced stage times) [default: even].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_layers: Option<String>,
    /// Layers of the first pipeline stage, the others sharing the rest evenly (Megatron-LM's
    /// --decoder-first-pipeline-num-layers) [default: an even share].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_first_layers: Option<u64>,
    /// Layers of the last pipeline stage (Megatron-LM's --decoder-last-pipeline-num-layers)
    /// [default: an even share].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_last_layers: Option<u64>,
    /// Expert-parallel all-to-alls overlapped with another micro-batch's compute, as
    /// DeepSeek-V3's DualPipe runs them; `--ep-overlap` alone means true [default: false,
    /// exposed, as Megatron-LM's default].
    #[cfg_attr(
        feature = "cli",
        arg(long, num_args = 0..=1, default_missing_value = "true")
    )]
    pub ep_overlap: Option<bool>,
    /// Tensor-parallel all-gathers and reduce-scatters overlapped with the GEMMs (Megatron-LM's
    /// --tp-comm-overlap; needs --sp); `--tp-overlap` alone means true [default: false,
    /// exposed, as Megatron-LM's default].
    #[cfg_attr(
        feature = "cli",
        arg(long, num_args = 0..=1, default_missing_value = "true")
    )]
    pub tp_overlap: Option<bool>,
    /// ZeRO-1/2's parameter all-gather overlapped with the next step's first forward
    /// (Megatron-LM's --overlap-param-gather; needs --zero 1 or 2); `--param-gather-overlap`
    /// alone means true [default: false, exposed after the optimizer step].
    #[cfg_attr(
        feature = "cli",
        arg(long, num_args = 0..=1, default_missing_value = "true")
    )]
    pub param_gather_overlap: Option<bool>,
    /// Pipeline sends overlapped with the next model chunk's compute (Megatron-LM's
    /// --overlap-p2p-communication; needs --pp-schedule interleaved); `--pp-overlap` alone
    /// means true [default: false, on the critical path].
    #[cfg_attr(
        feature = "cli",
        arg(long, num_args = 0..=1, default_missing_value = "true")
    )]
    pub pp_overlap: Option<bool>,
    /// none | optimizer | params [default: none].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub offload: Option<String>,
    /// With --offload optimizer: the states kept on a drive of this many free GiB instead of
    /// host memory (ZeRO-Infinity's NVMe tier; the trainer's --offload-dir): host memory holds
    /// the buckets in flight, the step reads and writes every state once [default: none].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub disk_gib: Option<f64>,
    /// The drive's sequential read bandwidth in GB/s [default: 7.45, a PCIe 4.0 NVMe drive].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub disk_read_gbs: Option<f64>,
    /// The drive's sequential write bandwidth in GB/s [default: 6.9].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub disk_write_gbs: Option<f64>,
    /// Elements of each optimizer state per disk-tier bucket, as the trainer's
    /// --offload-bucket [default: 16777216].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub offload_bucket: Option<u64>,
    /// GPU kind for the verdict and the time model (h100, h100-96, h200, a100-40, a100-80, b200,
    /// mi300x, h100-pcie, l40s, rtx4090) [default: h100].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gpu: Option<String>,
    /// GPUs per node: groups that fit in a node use its links, larger ones the network
    /// [default: 8].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gpus_per_node: Option<u64>,
    /// Cluster file (TOML): GPU kind or a custom GPU, GPUs per node, link bandwidths and
    /// latencies (see configs/cluster-example.toml). --gpu and --gpus-per-node win over it
    /// [default: none].
    #[cfg_attr(feature = "cli", arg(long))]
    pub cluster: Option<PathBuf>,
    /// Fused attention kernel the framework runs, for the time model: flash2 (PyTorch SDPA,
    /// flash-attn 2) | triton (flash_attn_triton) [default: flash2, or the cluster file's].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub attention: Option<String>,
    /// FLOPs convention for MFU: ferrotron | torchtitan | nanotron | megatron | 6n
    /// [default: ferrotron].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub flops_convention: Option<String>,
    /// Memory and kernel accounting: ferrotron | megatron | zero-paper | playbook | torchtitan |
    /// megatron-lm | deepspeed [default: ferrotron].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub convention: Option<String>,
    /// Runtime context per rank in GiB [default: 1.0].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub overhead_gib: Option<f64>,
    /// Fragmentation margin as a fraction of allocated memory [default: 0.05].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub fragmentation: Option<f64>,
    /// Rows of logits the chunked cross-entropy materialises at once [default: 1024].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub ce_chunk: Option<u64>,
    /// Gradient bucket size in MiB: ZeRO-2 bucket buffers, and one latency per bucket in the
    /// data-parallel reduction time [default: 25].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub bucket_mb: Option<u64>,
    /// A mixture of experts' capacity factor: each expert takes at most ⌈cf · tokens · top_k /
    /// E⌉ of a micro-batch's routed copies, the rest are dropped [default: exact routing].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub capacity_factor: Option<f64>,
    /// Also write a self-contained HTML report to this file [default: none].
    #[cfg_attr(feature = "cli", arg(long))]
    pub html: Option<PathBuf>,
}

macro_rules! merge {
    ($cli:ident, $file:ident; $($f:ident),*) => { $( if $cli.$f.is_none() { $cli.$f = $file.$f.take(); } )* };
}

impl PlanFlags {
    /// These flags with the unset ones filled from the TOML file `config` (`--config`).
    pub fn merged(mut self, config: Option<&Path>) -> Result<Self> {
        let Some(path) = config else {
            return Ok(self);
        };
        let mut file: PlanFlags = read_toml("config", path)?;
        merge!(self, file; model, params, largest_layer, seq, max_seq, mbs, grad_acc, gbs, precision, optimizer, recompute,
            dp, tp, pp, cp, ep, zero, sp, pp_schedule, pp_virtual, pp_layers, pp_first_layers, pp_last_layers, ep_overlap, tp_overlap, param_gather_overlap, pp_overlap, offload, disk_gib, disk_read_gbs, disk_write_gbs, offload_bucket, gpu, gpus_per_node,
            cluster, attention, flops_convention, convention, overhead_gib, fragmentation, ce_chunk,
            bucket_mb, capacity_factor, html);
        Ok(self)
    }

    /// The planner input, its cluster and FLOPs convention. `pasted` is a config.json given as
    /// a JSON object instead of `model` (Python's `model={...}`).
    pub fn resolve(&self, pasted: Option<Value>) -> Result<Resolved> {
        if self.model.is_some() && self.params.is_some() {
            return Err(PlanError::setting(
                "model",
                self.model.as_deref().unwrap_or_default(),
                "give either --model or --params, not both",
            ));
        }
        let model = match &self.model {
            Some(m) => Some(ModelSource::Spec(load_model(m)?)),
            None => None,
        };
        let settings = Settings {
            model: None,
            config: pasted,
            params: self.params.clone(),
            largest_layer: self.largest_layer.clone(),
            seq: self.seq,
            max_seq: self.max_seq,
            mbs: self.mbs,
            grad_acc: self.grad_acc,
            gbs: self.gbs,
            precision: self.precision.clone(),
            optimizer: self.optimizer.clone(),
            recompute: self.recompute.clone(),
            dp: self.dp,
            tp: self.tp,
            pp: self.pp,
            cp: self.cp,
            ep: self.ep,
            zero: self.zero,
            sp: self.sp,
            pp_schedule: self.pp_schedule.clone(),
            pp_virtual: self.pp_virtual,
            pp_layers: self.pp_layers.clone(),
            pp_first_layers: self.pp_first_layers,
            pp_last_layers: self.pp_last_layers,
            ep_overlap: self.ep_overlap,
            tp_overlap: self.tp_overlap,
            param_gather_overlap: self.param_gather_overlap,
            pp_overlap: self.pp_overlap,
            offload: self.offload.clone(),
            disk_gib: self.disk_gib,
            disk_read_gbs: self.disk_read_gbs,
            disk_write_gbs: self.disk_write_gbs,
            offload_bucket: self.offload_bucket,
            gpu: self.gpu.clone(),
            gpus_per_node: self.gpus_per_node,
            cluster: self
                .cluster
                .as_deref()
                .map(|p| read_toml("cluster", p))
                .transpose()?,
            attention: self.attention.clone(),
            flops_convention: self.flops_convention.clone(),
            convention: self.convention.clone(),
            overhead_gib: self.overhead_gib,
            fragmentation: self.fragmentation,
            ce_chunk: self.ce_chunk,
            bucket_mb: self.bucket_mb,
            capacity_factor: self.capacity_factor,
        };
        settings.resolve(model)
    }

    /// The report of `result` (the plan of `r`), as `ferrotron plan` prints it. With `--html`
    /// the report also holds the sequence-length sweep the page draws, and is written there.
    pub fn report(&self, r: &Resolved, result: &PlanResult) -> Result<Report> {
        let mut report =
            build_with_time(&r.input, result, &r.cluster, r.flops, self.html.is_some())?;
        // How the settings were completed (`--pp-layers auto`'s proposal).
        if let Some(t) = report.time.as_mut() {
            t.notes.extend(r.notes.iter().cloned());
        }
        if let Some(path) = &self.html {
            write_atomic(path, &to_html(&report))?;
        }
        Ok(report)
    }
}

/// Writes `text` to `path` atomically: a temp file beside it, then a rename.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let fail = |e: std::io::Error| {
        PlanError::setting(
            "html",
            one_line(&path.display().to_string()),
            format!("cannot write: {}", one_line(&e.to_string())),
        )
    };
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(fail)?;
    std::fs::rename(&tmp, path).map_err(fail)
}

/// `ferrotron plan search`'s settings.
#[derive(Deserialize, Default, Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields)]
pub struct SearchFlags {
    /// Built-in preset name, a Hugging Face config.json or a directory holding one (required).
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub model: Option<String>,
    /// Number of GPUs to lay out (required).
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gpus: Option<u64>,
    /// GPUs per node [default: 8].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gpus_per_node: Option<u64>,
    /// GPU kind (see `ferrotron plan --list-gpus`) [default: h100].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gpu: Option<String>,
    /// Cluster file (TOML); --gpu and --gpus-per-node win over it [default: none].
    #[cfg_attr(feature = "cli", arg(long))]
    pub cluster: Option<PathBuf>,
    /// Fused attention kernel for the time model: flash2 | triton [default: flash2].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub attention: Option<String>,
    /// Sequence length [default: min(4096, model max positions)].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub seq: Option<u64>,
    /// Context length the run extends the model to: overrides its max_position_embeddings
    /// [default: the model's].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub max_seq: Option<u64>,
    /// Global batch in tokens per optimizer step [default: seq × gpus].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub gbs_tokens: Option<u64>,
    /// fp32 | bf16 | bf16-fp32grads | fp16 | fp8 [default: bf16].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub precision: Option<String>,
    /// adamw | sgd [default: adamw].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub optimizer: Option<String>,
    /// Memory convention: ferrotron | megatron | zero-paper | playbook | torchtitan |
    /// megatron-lm | deepspeed [default: ferrotron].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub convention: Option<String>,
    /// FLOPs convention for MFU: ferrotron | torchtitan | nanotron | megatron | 6n
    /// [default: ferrotron].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub flops_convention: Option<String>,
    /// Fraction of GPU memory a layout may use [default: 0.8].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub margin: Option<f64>,
    /// How many layouts to show [default: 5].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub top: Option<u64>,
    /// Largest micro-batch to try [default: 64].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub max_mbs: Option<u64>,
    /// Runtime context per rank in GiB [default: 1.0].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub overhead_gib: Option<f64>,
    /// Fragmentation margin as a fraction of allocated memory [default: 0.05].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub fragmentation: Option<f64>,
}

impl SearchFlags {
    /// The search these flags describe; `pasted` as in [`PlanFlags::resolve`].
    pub fn resolve(&self, pasted: Option<Value>) -> Result<SearchSpec> {
        let model = match &self.model {
            Some(m) => Some(load_model(m)?),
            None => None,
        };
        let settings = SearchSettings {
            model: None,
            config: pasted,
            gpus: self.gpus,
            gpu: self.gpu.clone(),
            gpus_per_node: self.gpus_per_node,
            cluster: self
                .cluster
                .as_deref()
                .map(|p| read_toml("cluster", p))
                .transpose()?,
            attention: self.attention.clone(),
            seq: self.seq,
            max_seq: self.max_seq,
            gbs_tokens: self.gbs_tokens,
            precision: self.precision.clone(),
            optimizer: self.optimizer.clone(),
            convention: self.convention.clone(),
            flops_convention: self.flops_convention.clone(),
            margin: self.margin,
            top: self.top,
            max_mbs: self.max_mbs,
            overhead_gib: self.overhead_gib,
            fragmentation: self.fragmentation,
        };
        settings.resolve(model)
    }
}

/// Keywords (a JSON object) into flags `T`. A bad keyword is named with its value: each key is
/// read alone when the whole object fails, since serde's message does not say which field.
fn from_keywords<T: DeserializeOwned>(kw: Map<String, Value>) -> Result<T> {
    match serde_json::from_value(Value::Object(kw.clone())) {
        Ok(t) => Ok(t),
        Err(whole) => {
            for (k, v) in kw {
                let one = Map::from_iter([(k.clone(), v.clone())]);
                if let Err(e) = serde_json::from_value::<T>(Value::Object(one)) {
                    let problem = e.to_string().replace("field", "keyword");
                    return Err(PlanError::setting(&k, v, problem));
                }
            }
            Err(PlanError::setting("keywords", "(all)", whole.to_string()))
        }
    }
}

/// Keywords split into the flags, a pasted config (`model` given as a config.json object) and
/// the settings file (`config`, a TOML path as `--config`).
struct Keywords {
    flags: Map<String, Value>,
    pasted: Option<Value>,
    config: Option<PathBuf>,
}

fn keywords(kw: Value) -> Result<Keywords> {
    let Value::Object(mut kw) = kw else {
        return Err(PlanError::setting(
            "keywords",
            one_line(&kw.to_string()),
            "expected keyword arguments, e.g. plan(model='llama-3-8b', seq=4096)",
        ));
    };
    let pasted = match kw.get("model") {
        Some(Value::Object(_)) => kw.remove("model"),
        _ => None,
    };
    let config = match kw.remove("config") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(PathBuf::from(p)),
        Some(other) => {
            return Err(PlanError::setting(
                "config",
                other,
                "expected the path of a TOML file of settings",
            ))
        }
    };
    // Python's None is an unset keyword, as an absent flag.
    kw.retain(|_, v| !v.is_null());
    Ok(Keywords {
        flags: kw,
        pasted,
        config,
    })
}

/// `ferrotron plan --json` from keywords (the flag names with `_` for `-`; `model` a preset,
/// a config.json path or a config.json object; `config` a TOML file of settings): the same
/// document the command prints. What Python's `ferrotron.plan(**kwargs)` returns.
pub fn plan_keywords(kw: Value) -> Result<Value> {
    let kw = keywords(kw)?;
    let flags: PlanFlags = from_keywords(kw.flags)?;
    let flags = flags.merged(kw.config.as_deref())?;
    let r = flags.resolve(kw.pasted)?;
    let report = flags.report(&r, &plan(&r.input)?)?;
    Ok(to_json(&report))
}

/// `ferrotron plan search --json` from keywords, as [`plan_keywords`]. A `config` keyword is
/// refused: the search command has no settings file.
pub fn search_keywords(kw: Value) -> Result<Value> {
    let kw = keywords(kw)?;
    if let Some(p) = kw.config {
        return Err(PlanError::setting(
            "config",
            one_line(&p.display().to_string()),
            "the search takes no settings file; pass its settings as keywords",
        ));
    }
    let flags: SearchFlags = from_keywords(kw.flags)?;
    let spec = flags.resolve(kw.pasted)?;
    let r = search(&spec)?;
    Ok(search_to_json(&r, &spec))
}
