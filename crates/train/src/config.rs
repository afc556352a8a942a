//! `ferrotron train` settings: command-line flags, mirrored one to one by a TOML file
//! (`--config run.toml`, keys are the flag names with `_` for `-`, grouped in the tables of
//! [`SECTIONS`] or, as in the first files, all at the top level); flags win over the file.
//! The resolved [`TrainConfig`] has the same sections.

use crate::optim::loss_scale::LossScaleConfig;
use clap::Args;
use ferrotron_plan::error::one_line;
// Re-exported: `toml_error` was defined here before the planner's settings files needed it.
pub use ferrotron_plan::toml_file::{toml_error, toml_message};
use ferrotron_plan::{Layout, LayoutFlags, Precision, Recompute};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Flags as given (all optional so that a TOML file can fill them).
#[derive(Args, Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct TrainArgs {
    /// TOML file with any of these settings (keys are the flag names with `_` for `-`, in the
    /// tables of configs/train-default.toml); flags given here win [default: none].
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Model: a preset name or an HF config.json (Llama family) [default: ferrotron-12m].
    #[arg(long)]
    pub model: Option<String>,
    /// Directory of token shards made by `ferrotron data` [default: the bundled corpus,
    /// tokenized into OUT_DIR/data on first use].
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// HF tokenizer.json [default: the bundled BPE tokenizer].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per sequence [default: 256].
    #[arg(long, allow_negative_numbers = true)]
    pub seq: Option<u64>,
    /// Sequences per micro-batch on each data-parallel rank [default: 8].
    #[arg(long, allow_negative_numbers = true)]
    pub mbs: Option<u64>,
    /// Micro-batches per optimizer step (gradient accumulation) [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub grad_acc: Option<u64>,
    /// Optimizer steps to train, and the length of the learning-rate schedule (with --resume:
    /// the new total, over which the schedule then decays) [default: 150].
    #[arg(long, allow_negative_numbers = true)]
    pub steps: Option<u64>,
    /// End this run after step N, keeping the schedule of --steps (a long run done in parts:
    /// resume the checkpoint to go on) [default: --steps].
    #[arg(long, allow_negative_numbers = true)]
    pub stop_after: Option<u64>,
    /// Peak learning rate, reached after the warmup [default: 3e-3].
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// The cosine schedule's final learning rate as a fraction of --lr [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    pub min_lr_ratio: Option<f64>,
    /// Steps of linear learning-rate warmup [default: 15].
    #[arg(long, allow_negative_numbers = true)]
    pub warmup: Option<u64>,
    /// Length of the cosine schedule [default: --steps].
    #[arg(long, allow_negative_numbers = true)]
    pub decay_steps: Option<u64>,
    /// AdamW's decoupled weight decay [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// AdamW's β1, the decay of the first moment [default: 0.9].
    #[arg(long, allow_negative_numbers = true)]
    pub beta1: Option<f64>,
    /// AdamW's β2, the decay of the second moment [default: 0.95].
    #[arg(long, allow_negative_numbers = true)]
    pub beta2: Option<f64>,
    /// AdamW's ε, added to the second moment's square root [default: 1e-8].
    #[arg(long, allow_negative_numbers = true)]
    pub eps: Option<f64>,
    /// Global gradient-norm clip (0 disables) [default: 1.0].
    #[arg(long, allow_negative_numbers = true)]
    pub clip: Option<f64>,
    /// Seed of the weight initialisation and the order of the batches [default: 1337].
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// Worker threads [default: all cores].
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Evaluate the validation loss every N steps (0: never) [default: 25].
    #[arg(long, allow_negative_numbers = true)]
    pub eval_interval: Option<u64>,
    /// Global batches (mbs × grad_acc × dp sequences each) in the validation set: the same
    /// tokens whatever the layout, so val losses compare across layouts [default: 4].
    #[arg(long, allow_negative_numbers = true)]
    pub eval_batches: Option<u64>,
    /// Output directory (metrics, checkpoints by default) [default: runs/default].
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Directory the checkpoints are written to [default: none, no checkpoint].
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every N steps (0: only at the end when a checkpoint dir is set)
    /// [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    pub checkpoint_interval: Option<u64>,
    /// Keep the K newest checkpoints as CHECKPOINT_DIR/step-NNNNNNNN, with
    /// CHECKPOINT_DIR/latest naming the newest complete one (--resume CHECKPOINT_DIR follows
    /// it) [default: one checkpoint, CHECKPOINT_DIR itself, replaced by each save].
    #[arg(long, allow_negative_numbers = true)]
    pub keep_checkpoints: Option<u64>,
    /// Save checkpoints in the background: each save copies this rank's weights and optimizer
    /// states into a staging buffer in the memory plan, and training goes on while a thread
    /// writes them; a kill still leaves the previous checkpoint [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub async_checkpoint: Option<bool>,
    /// Seconds a rank waits in a collective or for a message before it names itself, the
    /// operation, the group and the step, and takes the job down so a scheduler can restart
    /// it from the last checkpoint (as PyTorch's NCCL timeout) [default: 600].
    #[arg(long, allow_negative_numbers = true)]
    pub comm_timeout: Option<f64>,
    /// Stop after this many consecutive steps skipped for a non-finite loss or gradient
    /// (fp32 and bf16; fp16's loss scaler handles its own overflows) [default: 5].
    #[arg(long, allow_negative_numbers = true)]
    pub max_skipped_steps: Option<u64>,
    /// GiB of device memory the run may plan for (a smaller card, as PyTorch's
    /// `set_per_process_memory_fraction`): a layout whose plan exceeds it is refused before
    /// anything is allocated, with the planner's same-GPU fixes [default: no budget].
    #[arg(long, allow_negative_numbers = true)]
    pub device_memory: Option<f64>,
    /// With --offload optimizer: keep the offloaded optimizer states (fp32 master weights,
    /// Adam's moments) in files under this directory instead of host memory, read and written
    /// bucket by bucket around the update (ZeRO-Infinity's NVMe tier); CPU runs too
    /// [default: host memory].
    #[arg(long)]
    pub offload_dir: Option<PathBuf>,
    /// Elements of each optimizer state per offload bucket (DeepSpeed's `sub_group_size`)
    /// [default: 16777216].
    #[arg(long, allow_negative_numbers = true)]
    pub offload_bucket: Option<u64>,
    /// With --device cuda: capture a micro-batch's forward and backward into a CUDA graph at
    /// this run's third step and replay it for every later micro-batch, one launch instead of
    /// hundreds (a single-rank dense model, any precision: fp16's is captured again when its
    /// loss scale changes; the update stays eager; not taken from a checkpoint on --resume)
    /// [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub cuda_graph: Option<bool>,
    /// Continue from a checkpoint directory up to --steps [default: none, a new run].
    #[arg(long)]
    #[serde(skip)]
    pub resume: Option<PathBuf>,
    /// Start from the weights of a model folder (a Hugging Face model of a supported family, or
    /// a ferrotron checkpoint) instead of a random initialisation; --model defaults to its
    /// config.json and --tokenizer to its tokenizer.json. The optimizer starts fresh at step 0
    /// [default: none, random weights].
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// A mixture of experts' capacity factor: each expert takes at most ⌈cf · tokens · top_k /
    /// E⌉ of a micro-batch's routed copies (per rank), the rest are dropped, and the routed
    /// buffers shrink to match [default: exact routing, nothing dropped].
    #[arg(long, allow_negative_numbers = true)]
    pub capacity_factor: Option<f64>,
    /// JSON lines, one per step [default: OUT_DIR/metrics.jsonl].
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Rows of logits materialised at once by the chunked cross-entropy [default: 1024].
    #[arg(long, allow_negative_numbers = true)]
    pub ce_chunk: Option<u64>,
    /// Data parallelism: MiB of gradients per all-reduce bucket (two in flight) [default: 25,
    /// PyTorch DDP's bucket_cap_mb].
    #[arg(long, allow_negative_numbers = true)]
    pub bucket_mb: Option<u64>,
    /// Activation recomputation: none, selective (rebuild both RMSNorm outputs and the SwiGLU
    /// product in the backward) or full (keep each layer's input, replay its forward)
    /// [default: none].
    #[arg(long)]
    pub recompute: Option<String>,
    /// Precision: fp32, bf16 (bf16 weights, activations and gradients, fp32 master weights
    /// and Adam states), fp16 (as bf16, with dynamic loss scaling) or fp8 (bf16 storage, layer
    /// GEMM inputs quantised to e4m3/e5m2 with per-tensor current scaling) [default: fp32].
    #[arg(long)]
    pub precision: Option<String>,
    /// With bf16: accumulate gradients in fp32 (18 instead of 16 bytes per parameter)
    /// [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fp32_grad_acc: Option<bool>,
    /// With 16-bit precisions: round the updated master weights into the 16-bit weights
    /// stochastically (seeded, reproducible) instead of to nearest [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub stochastic_rounding: Option<bool>,
    /// fp16: the loss scaler's initial scale [default: 65536].
    #[arg(long, allow_negative_numbers = true)]
    pub loss_scale_init: Option<f32>,
    /// fp16: finite steps before the loss scale doubles [default: 2000].
    #[arg(long, allow_negative_numbers = true)]
    pub loss_scale_growth_interval: Option<u64>,
    /// Peak matmul GFLOP/s of this machine for MFU [default: measured once, cached].
    #[arg(long, allow_negative_numbers = true)]
    pub peak_gflops: Option<f64>,
    /// Tokens to sample at the end of training (0: none) [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    pub sample_tokens: Option<u64>,
    /// Measured vs planned live bytes at every phase boundary of the first steps, as JSON
    /// [default: OUT_DIR/memory_timeline.json; not recorded on --resume, nor with --device cuda].
    #[arg(long)]
    pub memory_timeline: Option<PathBuf>,
    /// Steps the memory timeline covers (0: none) [default: 2].
    #[arg(long, allow_negative_numbers = true)]
    pub memory_timeline_steps: Option<u64>,
    /// Chrome trace (Perfetto, chrome://tracing) of every kernel call and phase of the first
    /// steps [default: none].
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Steps the trace covers [default: 3].
    #[arg(long, allow_negative_numbers = true)]
    pub trace_steps: Option<u64>,
    /// Also write every metric as TensorBoard event files into this directory
    /// (`tensorboard --logdir DIR`) [default: none].
    #[arg(long)]
    pub tensorboard: Option<PathBuf>,
    /// Hide the progress line.
    #[arg(long)]
    #[serde(skip)]
    pub quiet: bool,
    /// How data-parallel ranks talk: mpi (one process per rank, under mpirun or srun), threads
    /// (ranks as threads of this process) or auto (mpi when launched by mpirun, else threads)
    /// [default: auto].
    #[arg(long, value_enum)]
    #[serde(skip)]
    pub comm: Option<CommBackend>,
    /// Where the step runs: cpu, or cuda (one NVIDIA GPU; a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t)]
    #[serde(skip)]
    pub device: crate::device::Device,
    /// The parallel layout, the same flags as `ferrotron plan`.
    #[command(flatten)]
    #[serde(skip)]
    pub layout: LayoutFlags,
    /// The layout in a TOML file: its `[parallel]` table (keys as the flags).
    #[arg(skip)]
    #[serde(default)]
    pub parallel: Option<LayoutFlags>,
}

/// The effective configuration, printed at start and saved next to checkpoints, in sections
/// that mirror the `--config` tables. The sections are flattened in JSON: a saved
/// `trainer_state.json` keeps the flat keys of the first checkpoints (and loads in older code).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    #[serde(flatten)]
    pub model: ModelConfig,
    #[serde(flatten)]
    pub data: DataConfig,
    #[serde(flatten)]
    pub optimizer: OptimizerConfig,
    #[serde(flatten)]
    pub precision: PrecisionConfig,
    #[serde(flatten)]
    pub runtime: RuntimeConfig,
    /// The parallel layout (the planner's); data parallelism with ZeRO-1, 2 or 3 for now.
    #[serde(default)]
    pub parallel: Layout,
    #[serde(flatten)]
    pub checkpoint: CheckpointConfig,
    #[serde(flatten)]
    pub observability: ObservabilityConfig,
}

/// What is trained: the architecture and the tokenizer (and the weights it starts from).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// A preset name or an HF config.json.
    #[serde(rename = "model")]
    pub name: String,
    pub tokenizer: Option<PathBuf>,
    /// The model folder whose weights the run started from (`--init-from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// A mixture of experts' capacity factor (`--capacity-factor`; none: exact routing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
}

/// What the model sees and in what order: the shards and the batch shape. The seed is here
/// because, with `seq` and `mbs`, it fixes the data order a checkpoint's loader state refers
/// to (a resumed run keeps all four, and `grad_acc`); it also seeds the initial weights and
/// stochastic rounding, so one seed reproduces the whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataConfig {
    /// Token shards [default: the bundled corpus].
    #[serde(rename = "data")]
    pub dir: Option<PathBuf>,
    pub seq: u64,
    pub mbs: u64,
    pub grad_acc: u64,
    pub seed: u64,
}

/// AdamW and its learning-rate schedule. `steps` is here because it is the schedule's length
/// (the default of `decay_steps`), and `stop_after` because it ends a run within that schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    pub steps: u64,
    /// Step after which this run ends (`--stop-after`); a property of one run, so a checkpoint
    /// does not carry it into the next.
    #[serde(skip)]
    pub stop_after: Option<u64>,
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup: u64,
    pub decay_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub clip: f64,
}

// Mixed precision postdates the first checkpoints: they were fp32, hence the defaults.
/// Number formats: storage and gradient types, rounding, fp16's loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrecisionConfig {
    /// `--precision` with `--fp32-grad-acc` folded in (`bf16-fp32grads`).
    #[serde(rename = "precision", default = "default_precision")]
    pub kind: Precision,
    #[serde(default)]
    pub stochastic_rounding: bool,
    #[serde(default)]
    pub loss_scale: LossScaleConfig,
}

/// How a step is computed, never what: threads, the cross-entropy's chunk and recomputation
/// trade time for memory and leave every number as it is (so a resumed run may change
/// `threads` and `recompute`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuntimeConfig {
    pub threads: u64,
    pub ce_chunk: u64,
    #[serde(default = "default_recompute")]
    pub recompute: Recompute,
    /// MiB of gradients per data-parallel all-reduce bucket.
    #[serde(default = "default_bucket_mb")]
    pub bucket_mb: u64,
    /// Seconds any communication may wait before the job is taken down (`--comm-timeout`).
    #[serde(default = "default_comm_timeout")]
    pub comm_timeout: f64,
    /// Consecutive non-finite steps skipped before the run stops (`--max-skipped-steps`).
    #[serde(default = "default_max_skipped")]
    pub max_skipped_steps: u64,
    /// GiB of device memory the plan must fit (`--device-memory`; `fit::device_budget`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<f64>,
    /// `--offload-dir`: the disk tier of the offloaded optimizer states.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_dir: Option<PathBuf>,
    /// Elements of each state per offload bucket (`--offload-bucket`).
    #[serde(default = "default_offload_bucket")]
    pub offload_bucket: u64,
    /// Micro-batches replayed from a captured CUDA graph (`--cuda-graph`; `trainer::cuda_graph`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub cuda_graph: bool,
}

/// 2^24 elements: 64 MiB of each fp32 state, 192 MiB of master weights and moments per bucket,
/// so three buckets in flight stay under a GiB. (DeepSpeed's `sub_group_size` defaults to 1e9,
/// sized for GPUs with a host of hundreds of GiB behind them.)
fn default_offload_bucket() -> u64 {
    ferrotron_plan::disk_tier::DEFAULT_BUCKET
}

fn default_comm_timeout() -> f64 {
    600.0
}

fn default_max_skipped() -> u64 {
    5
}

fn default_bucket_mb() -> u64 {
    25
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointConfig {
    #[serde(rename = "checkpoint_dir")]
    pub dir: Option<PathBuf>,
    /// Every N steps (0: only at the end when `dir` is set).
    #[serde(rename = "checkpoint_interval")]
    pub interval: u64,
    /// Step-numbered checkpoints kept (`--keep-checkpoints`; none: `dir` itself is the one).
    #[serde(
        default,
        rename = "keep_checkpoints",
        skip_serializing_if = "Option::is_none"
    )]
    pub keep: Option<u64>,
    /// Saves written by a background thread from a staging buffer (`--async-checkpoint`).
    #[serde(default, rename = "async_checkpoint", skip_serializing_if = "is_false")]
    pub background: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// What the run reports about itself; none of it changes the training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObservabilityConfig {
    /// Where the reports go by default (and the bundled corpus is tokenized).
    pub out_dir: PathBuf,
    pub metrics: PathBuf,
    pub eval_interval: u64,
    pub eval_batches: u64,
    pub sample_tokens: u64,
    // Observability settings postdate the first checkpoints: defaults let those load.
    #[serde(default)]
    pub memory_timeline: Option<PathBuf>,
    #[serde(default = "default_timeline_steps")]
    pub memory_timeline_steps: u64,
    #[serde(default)]
    pub trace: Option<PathBuf>,
    #[serde(default = "default_trace_steps")]
    pub trace_steps: u64,
    #[serde(default)]
    pub tensorboard: Option<PathBuf>,
}

fn default_precision() -> Precision {
    Precision::Fp32
}

fn default_recompute() -> Recompute {
    Recompute::None
}

fn default_timeline_steps() -> u64 {
    2
}

fn default_trace_steps() -> u64 {
    3
}

impl OptimizerConfig {
    /// The step this run ends after: `--stop-after`, else `--steps`.
    pub fn last_step(&self) -> u64 {
        self.stop_after.unwrap_or(self.steps)
    }

    /// `--stop-after` must lie after the step the run starts from and not beyond `--steps`.
    pub fn check_stop_after(&self, start: u64) -> Result<(), ConfigError> {
        match self.stop_after {
            Some(n) if n > self.steps => Err(bad(
                "stop_after",
                n,
                &format!(
                    "beyond steps = {}: raise --steps (the schedule's length) or lower --stop-after",
                    self.steps
                ),
            )),
            Some(n) if n <= start => Err(bad(
                "stop_after",
                n,
                &format!("the run starts after step {start}: pass a later step"),
            )),
            _ => Ok(()),
        }
    }
}

/// A bad setting: names the field, the value and the fix.
impl TrainArgs {
    /// `--precision` with `--fp32-grad-acc` folded in (the planner's `bf16-fp32grads`).
    fn precision(&self) -> Result<Precision, ConfigError> {
        let choices = "expected one of fp32, bf16, fp16, fp8";
        let p = match self.precision.as_deref() {
            None => Precision::Fp32,
            Some(s) => match s.parse::<Precision>() {
                Ok(p) => p,
                Err(_) => return Err(bad("precision", s, choices)),
            },
        };
        match (self.fp32_grad_acc.unwrap_or(false), p) {
            (false, p) => Ok(p),
            (true, Precision::Bf16 | Precision::Bf16Fp32grads) => Ok(Precision::Bf16Fp32grads),
            (true, p) => Err(bad(
                "fp32_grad_acc",
                true,
                &format!("applies to --precision bf16 only, not {p}"),
            )),
        }
    }
}

/// One bad setting: `field = value: problem` (or just `problem` when it names the field itself).
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub field: &'static str,
    pub value: String,
    pub problem: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.value.is_empty() {
            f.write_str(&one_line(&self.problem))
        } else {
            // The value comes from a flag or a file: control characters are escaped.
            write!(
                f,
                "{} = {}: {}",
                self.field,
                one_line(&self.value),
                one_line(&self.problem)
            )
        }
    }
}

fn bad(field: &'static str, value: impl ToString, problem: &str) -> ConfigError {
    ConfigError {
        field,
        value: value.to_string(),
        problem: problem.to_string(),
    }
}

/// The communicator backend of `--comm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CommBackend {
    Auto,
    Threads,
    Mpi,
}

/// The layout of the flags, refused unless the trainer runs it: data parallelism with ZeRO-1,
/// 2 or 3 and tensor parallelism for now. The planner already predicts every layout, so the message points there.
pub(crate) fn trainable_layout(flags: &LayoutFlags) -> Result<Layout, ConfigError> {
    let l = flags.resolve().map_err(|e| ConfigError {
        field: "parallel",
        value: String::new(),
        problem: e.to_string(),
    })?;
    for (field, v) in [
        ("dp", l.dp),
        ("tp", l.tp),
        ("pp", l.pp),
        ("cp", l.cp),
        ("ep", l.ep),
    ] {
        if v == 0 {
            return Err(bad(field, v, "must be a positive integer"));
        }
    }
    if l.cp > 1 && l.ep > 1 {
        return Err(bad(
            "cp",
            l.cp,
            "context parallelism does not run with expert parallelism yet: use --cp or --ep, not both",
        ));
    }
    if l.pp_virtual == 0 {
        return Err(bad("pp_virtual", 0, "must be a positive integer"));
    }
    if l.sp && l.tp < 2 {
        return Err(bad(
            "sp",
            true,
            "sequence parallelism divides the tensor-parallel group's activations: add --tp 2 or more",
        ));
    }
    if l.pp > 1 && l.zero >= 2 {
        return Err(bad(
            "zero",
            l.zero,
            "ZeRO-2 and 3 release a unit's gradients (and ZeRO-3 its weights) after each micro-batch's backward, but a pipeline stage holds several micro-batches in flight, so every one would reduce-scatter (and gather) again; with --pp use --zero 1 (the optimizer states sharded) or 0",
        ));
    }
    if l.pp == 1 && l.pp_virtual != 1 {
        return Err(bad(
            "pp_virtual",
            l.pp_virtual,
            "virtual stages interleave a pipeline's model chunks: add --pp 2 or more",
        ));
    }
    Ok(l)
}

/// The tables of a `--config` file and the flag-named keys each holds, in the order of
/// [`TrainConfig`]'s sections (`runtime` holds what none of the others does). `[parallel]` holds
/// the planner's layout flags and is read as they are.
pub const SECTIONS: &[(&str, &[&str])] = &[
    (
        "model",
        &["model", "tokenizer", "init_from", "capacity_factor"],
    ),
    ("data", &["data", "seq", "mbs", "grad_acc", "seed"]),
    (
        "optimizer",
        &[
            "steps",
            "stop_after",
            "lr",
            "min_lr_ratio",
            "warmup",
            "decay_steps",
            "weight_decay",
            "beta1",
            "beta2",
            "eps",
            "clip",
        ],
    ),
    (
        "precision",
        &[
            "precision",
            "fp32_grad_acc",
            "stochastic_rounding",
            "loss_scale_init",
            "loss_scale_growth_interval",
        ],
    ),
    (
        "runtime",
        &[
            "threads",
            "ce_chunk",
            "recompute",
            "bucket_mb",
            "comm_timeout",
            "max_skipped_steps",
            "device_memory",
            "offload_dir",
            "offload_bucket",
            "cuda_graph",
        ],
    ),
    (
        "checkpoint",
        &[
            "checkpoint_dir",
            "checkpoint_interval",
            "keep_checkpoints",
            "async_checkpoint",
        ],
    ),
    (
        "observability",
        &[
            "out_dir",
            "metrics",
            "eval_interval",
            "eval_batches",
            "sample_tokens",
            "peak_gflops",
            "memory_timeline",
            "memory_timeline_steps",
            "trace",
            "trace_steps",
            "tensorboard",
        ],
    ),
];

/// The section a flag-named key belongs in.
fn section_of(key: &str) -> Option<&'static str> {
    SECTIONS
        .iter()
        .find(|(_, keys)| keys.contains(&key))
        .map(|(s, _)| *s)
}

/// Whether `key` is one of the layout flags of `[parallel]` (clap lists them: they are the
/// planner's, kept in one place there).
fn is_layout_key(key: &str) -> bool {
    LayoutFlags::augment_args(clap::Command::new("parallel"))
        .get_arguments()
        .any(|a| a.get_id() == key)
}

/// Moves the keys of the section tables to the top level, where the first (flat) files have
/// them. `model`, `data` and `precision` name both a section and a key: a table is the
/// section, any other value the key. Returns whether the file had any section.
fn flatten_sections(file: &mut toml::Table) -> Result<bool, String> {
    let mut found = false;
    for (section, keys) in SECTIONS {
        if !file.get(*section).is_some_and(toml::Value::is_table) {
            continue;
        }
        let Some(toml::Value::Table(table)) = file.remove(*section) else {
            unreachable!("a table, checked above");
        };
        found = true;
        for (key, value) in table {
            if !keys.contains(&key.as_str()) {
                let home = section_of(&key).or(is_layout_key(&key).then_some("parallel"));
                return Err(match home {
                    Some(home) => format!("[{section}] {key}: belongs in [{home}]"),
                    None => format!(
                        "[{section}] {key}: unknown key (expected one of {})",
                        keys.join(", ")
                    ),
                });
            }
            if file.contains_key(&key) {
                return Err(format!(
                    "{key}: set both at the top level and in [{section}]; keep one"
                ));
            }
            file.insert(key, value);
        }
    }
    // [parallel] keeps the layout's own keys (checked when it is read); a training setting
    // there is misplaced rather than unknown.
    if let Some(toml::Value::Table(layout)) = file.get("parallel") {
        if let Some((key, home)) = layout.keys().find_map(|k| Some((k, section_of(k)?))) {
            return Err(format!("[parallel] {key}: belongs in [{home}]"));
        }
    }
    Ok(found)
}

macro_rules! merge {
    ($cli:ident, $file:ident; $($f:ident),*) => { $( if $cli.$f.is_none() { $cli.$f = $file.$f.take(); } )* };
}

impl TrainArgs {
    /// Fills unset flags from the TOML file named by `--config`, if any.
    pub fn merged(mut self) -> Result<Self, String> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read --config {}: {e}", path.display()))?;
        let in_file = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        let mut table: toml::Table =
            toml::from_str(&text).map_err(|e| toml_error(&path, &text, &e))?;
        let sectioned = flatten_sections(&mut table).map_err(|e| in_file(&one_line(&e)))?;
        // A flat file (the first form) is read from its text so that its errors keep their
        // line and column; a sectioned one from the regrouped keys, whose errors name the key.
        let mut file: TrainArgs = if sectioned {
            table
                .try_into()
                .map_err(|e: toml::de::Error| in_file(&toml_message(&e.to_string())))?
        } else {
            toml::from_str(&text).map_err(|e| toml_error(&path, &text, &e))?
        };
        merge!(self, file; model, data, tokenizer, init_from, capacity_factor, seq, mbs, grad_acc, steps, stop_after, lr, min_lr_ratio,
            warmup, decay_steps, weight_decay, beta1, beta2, eps, clip, seed, threads, eval_interval,
            eval_batches, out_dir, checkpoint_dir, checkpoint_interval, keep_checkpoints,
            async_checkpoint, comm_timeout, max_skipped_steps, device_memory, offload_dir, offload_bucket, cuda_graph, metrics, ce_chunk, recompute, bucket_mb,
            precision, fp32_grad_acc, stochastic_rounding, loss_scale_init,
            loss_scale_growth_interval,
            peak_gflops, sample_tokens, memory_timeline, memory_timeline_steps, trace,
            trace_steps, tensorboard);
        self.layout = self.layout.or(file.parallel.take().unwrap_or_default());
        Ok(self)
    }

    /// The effective configuration with defaults, validated.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        let out_dir = self
            .out_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("runs/default"));
        // The timeline samples the host's heap, which on a GPU holds none of the run's memory
        // (`mem_device_driver` is the GPU's check): no timeline there by default, and one asked
        // for is refused when the backend opens.
        let timeline = match (&self.memory_timeline, self.device) {
            (Some(t), _) => Some(t.clone()),
            (None, crate::device::Device::Cuda) => None,
            (None, _) => Some(out_dir.join("memory_timeline.json")),
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        let recompute = match &self.recompute {
            None => default_recompute(),
            Some(r) => r
                .parse()
                .map_err(|_| bad("recompute", r, "expected one of none, selective, full"))?,
        };
        let precision = self.precision()?;
        let loss_scale = self.loss_scale()?;
        let parallel = trainable_layout(&self.layout)?;
        let tokens = self.mbs.unwrap_or(8) * self.seq.unwrap_or(256);
        if parallel.sp && !tokens.is_multiple_of(parallel.tp) {
            return Err(bad(
                "sp",
                true,
                &format!("sequence parallelism splits a micro-batch's {tokens} tokens (mbs × seq) over tp = {}: make it a multiple", parallel.tp),
            ));
        }
        let stochastic_rounding = self.stochastic_rounding.unwrap_or(false);
        if stochastic_rounding && precision == Precision::Fp32 {
            return Err(bad(
                "stochastic_rounding",
                true,
                "only applies to 16-bit weights: add --precision bf16 (or fp16, fp8)",
            ));
        }
        let cuda_graph = self.cuda_graph.unwrap_or(false);
        if cuda_graph {
            crate::trainer::cuda_graph::check_run(self.device, &parallel)
                .map_err(|problem| bad("cuda_graph", true, problem))?;
        }
        let c = TrainConfig {
            model: self.model_config(),
            data: DataConfig {
                dir: self.data.clone(),
                seq: self.seq.unwrap_or(256),
                mbs: self.mbs.unwrap_or(8),
                grad_acc: self.grad_acc.unwrap_or(1),
                seed: self.seed.unwrap_or(1337),
            },
            optimizer: OptimizerConfig {
                steps: self.steps.unwrap_or(150),
                stop_after: self.stop_after,
                lr: self.lr.unwrap_or(3e-3),
                min_lr_ratio: self.min_lr_ratio.unwrap_or(0.1),
                warmup: self.warmup.unwrap_or(15),
                decay_steps: self.decay_steps.or(self.steps).unwrap_or(150),
                weight_decay: self.weight_decay.unwrap_or(0.1),
                beta1: self.beta1.unwrap_or(0.9),
                beta2: self.beta2.unwrap_or(0.95),
                eps: self.eps.unwrap_or(1e-8),
                clip: self.clip.unwrap_or(1.0),
            },
            precision: PrecisionConfig {
                kind: precision,
                stochastic_rounding,
                loss_scale,
            },
            runtime: RuntimeConfig {
                threads: self.threads.unwrap_or(cores),
                ce_chunk: self.ce_chunk.unwrap_or(1024),
                recompute,
                bucket_mb: self.bucket_mb.unwrap_or(default_bucket_mb()),
                comm_timeout: self.comm_timeout.unwrap_or(default_comm_timeout()),
                max_skipped_steps: self.max_skipped_steps.unwrap_or(default_max_skipped()),
                device_memory: self.device_memory,
                offload_dir: self.offload_dir.clone(),
                offload_bucket: self.offload_bucket.unwrap_or(default_offload_bucket()),
                cuda_graph,
            },
            parallel,
            checkpoint: CheckpointConfig {
                dir: self.checkpoint_dir.clone(),
                interval: self.checkpoint_interval.unwrap_or(0),
                keep: self.keep_checkpoints,
                background: self.async_checkpoint.unwrap_or(false),
            },
            observability: ObservabilityConfig {
                metrics: self
                    .metrics
                    .clone()
                    .unwrap_or_else(|| out_dir.join("metrics.jsonl")),
                out_dir,
                eval_interval: self.eval_interval.unwrap_or(25),
                eval_batches: self.eval_batches.unwrap_or(4),
                sample_tokens: self.sample_tokens.unwrap_or(0),
                memory_timeline: timeline,
                memory_timeline_steps: self
                    .memory_timeline_steps
                    .unwrap_or_else(default_timeline_steps),
                trace: self.trace.clone(),
                trace_steps: self.trace_steps.unwrap_or_else(default_trace_steps),
                tensorboard: self.tensorboard.clone(),
            },
        };
        validate(&c)?;
        if let Some(p) = self.peak_gflops {
            if !(p.is_finite() && p > 0.0) {
                return Err(bad("peak_gflops", p, "must be a positive number"));
            }
        }
        Ok(c)
    }

    /// The model section: the model named, else `--init-from`'s checkpoint, else the default
    /// model; the tokenizer given, else the one `--init-from`'s checkpoint has, if any.
    fn model_config(&self) -> ModelConfig {
        let from = self.init_from.as_ref();
        let model = match (&self.model, from) {
            (Some(m), _) => m.clone(),
            (None, Some(d)) => d.to_string_lossy().into(),
            (None, None) => "ferrotron-12m".into(),
        };
        let tokenizer = self.tokenizer.clone().or_else(|| {
            from.map(|d| d.join("tokenizer.json"))
                .filter(|t| t.is_file())
        });
        ModelConfig {
            name: model,
            tokenizer,
            init_from: self.init_from.clone(),
            capacity_factor: self.capacity_factor,
        }
    }

    /// fp16's loss scaler, from its flags.
    fn loss_scale(&self) -> Result<LossScaleConfig, ConfigError> {
        let mut loss_scale = LossScaleConfig::default();
        if let Some(v) = self.loss_scale_init {
            loss_scale.init_scale = v;
        }
        if let Some(v) = self.loss_scale_growth_interval {
            loss_scale.growth_interval = v;
        }
        loss_scale.validate().map_err(|e| ConfigError {
            field: "loss_scale",
            value: String::new(),
            problem: e,
        })?;
        Ok(loss_scale)
    }
}

/// The checks of a resolved config that need no flag of their own: positive counts, numbers in
/// their ranges, checkpoint options that need a directory.
fn validate(c: &TrainConfig) -> Result<(), ConfigError> {
    for (field, v) in [
        ("seq", c.data.seq),
        ("mbs", c.data.mbs),
        ("grad_acc", c.data.grad_acc),
        ("steps", c.optimizer.steps),
        ("threads", c.runtime.threads),
        ("ce_chunk", c.runtime.ce_chunk),
        ("bucket_mb", c.runtime.bucket_mb),
        ("offload_bucket", c.runtime.offload_bucket),
    ] {
        if v == 0 {
            return Err(bad(field, v, "must be a positive integer"));
        }
    }
    c.optimizer.check_stop_after(0)?;
    if c.observability.eval_interval > 0 && c.observability.eval_batches == 0 {
        return Err(bad(
            "eval_batches",
            0,
            "must be positive when eval_interval > 0",
        ));
    }
    let cf = c.model.capacity_factor.map(|cf| ("capacity_factor", cf));
    let dm = c.runtime.device_memory.map(|g| ("device_memory", g));
    let positive = [("lr", c.optimizer.lr), ("eps", c.optimizer.eps)];
    for (field, v) in positive.into_iter().chain(cf).chain(dm) {
        if !(v.is_finite() && v > 0.0) {
            return Err(bad(field, v, "must be a positive number"));
        }
    }
    for (field, v) in [
        ("beta1", c.optimizer.beta1),
        ("beta2", c.optimizer.beta2),
        ("min_lr_ratio", c.optimizer.min_lr_ratio),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(bad(field, v, "must be in [0, 1]"));
        }
    }
    for (field, v) in [
        ("weight_decay", c.optimizer.weight_decay),
        ("clip", c.optimizer.clip),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(bad(field, v, "must be a non-negative number (0 disables)"));
        }
    }
    let t = c.runtime.comm_timeout;
    if !(t.is_finite() && t > 0.0) {
        return Err(bad(
            "comm_timeout",
            t,
            "must be a positive number of seconds, e.g. 600",
        ));
    }
    if c.checkpoint.keep == Some(0) {
        return Err(bad(
            "keep_checkpoints",
            0,
            "must be at least 1 (leave it out to keep one checkpoint in CHECKPOINT_DIR itself)",
        ));
    }
    if let (true, None) = (c.checkpoint.background, &c.checkpoint.dir) {
        return Err(bad(
            "async_checkpoint",
            true,
            "saves checkpoints in the background: add --checkpoint-dir DIR",
        ));
    }
    if let (Some(k), None) = (c.checkpoint.keep, &c.checkpoint.dir) {
        return Err(bad(
            "keep_checkpoints",
            k,
            "keeps checkpoints in a directory: add --checkpoint-dir DIR",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    /// `merged()` of a `--config` file holding `text`.
    fn from_file(name: &str, text: &str) -> Result<TrainArgs, String> {
        let path =
            std::env::temp_dir().join(format!("ferrotron-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let got = TrainArgs {
            config: Some(path.clone()),
            ..TrainArgs::default()
        }
        .merged()
        .map_err(|e| e.replace(&path.display().to_string(), "FILE"));
        std::fs::remove_file(&path).ok();
        got
    }

    #[test]
    fn every_setting_flag_has_exactly_one_section() {
        // How this invocation runs, not what it trains: flags only, never in a file.
        let not_settings = ["config", "resume", "quiet", "comm", "device", "help"];
        let flags: Vec<String> = Cli::command()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .filter(|id| !not_settings.contains(&id.as_str()) && !is_layout_key(id))
            .collect();
        for f in &flags {
            let homes = SECTIONS
                .iter()
                .filter(|(_, keys)| keys.contains(&f.as_str()));
            assert_eq!(homes.count(), 1, "--{f}");
        }
        let keys = SECTIONS.iter().flat_map(|(_, keys)| keys.iter());
        assert_eq!(keys.count(), flags.len());
    }

    /// `--device cuda` records no memory timeline unless asked (the trainer refuses one there:
    /// it samples the host's heap), so the default GPU run is not refused for it.
    #[test]
    fn a_gpu_run_has_no_memory_timeline_by_default() {
        use crate::device::Device;
        let timeline = |device, path: Option<&str>| {
            let a = TrainArgs {
                device,
                memory_timeline: path.map(PathBuf::from),
                ..TrainArgs::default()
            };
            a.resolve().unwrap().observability.memory_timeline
        };
        assert_eq!(timeline(Device::Cuda, None), None);
        assert_eq!(
            timeline(Device::Cpu, None),
            Some(PathBuf::from("runs/default/memory_timeline.json"))
        );
        assert!(timeline(Device::Emulated, None).is_some());
        assert_eq!(
            timeline(Device::Cuda, Some("t.json")),
            Some(PathBuf::from("t.json"))
        );
    }

    /// The sectioned default file resolves as the flat file it replaced.
    #[test]
    fn sectioned_and_flat_files_resolve_alike() {
        let flat = "model = \"ferrotron-12m\"\nseq = 256\nmbs = 8\ngrad_acc = 1\nsteps = 150\n\
            lr = 3e-3\nwarmup = 15\nweight_decay = 0.1\nclip = 1.0\nrecompute = \"none\"\n\
            seed = 1337\neval_interval = 25\n";
        let sectioned = include_str!("../../../configs/train-default.toml");
        let flat = from_file("flat", flat).unwrap().resolve().unwrap();
        assert_eq!(
            from_file("sectioned", sectioned)
                .unwrap()
                .resolve()
                .unwrap(),
            flat
        );
        // Every section, with a value off its default.
        let every = "[model]\ntokenizer = \"t.json\"\n[data]\nmbs = 2\n[optimizer]\nlr = 1e-3\n\
            [precision]\nprecision = \"bf16\"\nfp32_grad_acc = true\n[runtime]\nce_chunk = 64\n\
            [parallel]\ndp = 1\n[checkpoint]\ncheckpoint_interval = 5\n\
            [observability]\ntrace_steps = 1\n";
        let c = from_file("every", every).unwrap().resolve().unwrap();
        assert_eq!(c.model.tokenizer, Some(PathBuf::from("t.json")));
        assert_eq!(c.data.mbs, 2);
        assert_eq!(c.optimizer.lr, 1e-3);
        assert_eq!(c.precision.kind, Precision::Bf16Fp32grads);
        assert_eq!(c.runtime.ce_chunk, 64);
        assert_eq!(c.checkpoint.interval, 5);
        assert_eq!(c.observability.trace_steps, 1);
        // A section and the flat keys mix; flags still win.
        let mut a = from_file("mixed", "lr = 2e-3\n[data]\nseq = 64\n").unwrap();
        a.seq = a.seq.map(|s| s * 2);
        let c = a.resolve().unwrap();
        assert_eq!((c.optimizer.lr, c.data.seq), (2e-3, 128));
    }

    #[test]
    fn a_key_in_the_wrong_section_names_its_section() {
        let err = |text| from_file("wrong", text).unwrap_err();
        assert_eq!(
            err("[optimizer]\nseq = 64\n"),
            "FILE: [optimizer] seq: belongs in [data]"
        );
        assert_eq!(
            err("[parallel]\nlr = 1e-3\n"),
            "FILE: [parallel] lr: belongs in [optimizer]"
        );
        assert_eq!(
            err("[data]\ndp = 1\n"),
            "FILE: [data] dp: belongs in [parallel]"
        );
        assert_eq!(
            err("[checkpoint]\ninterval = 5\n"),
            "FILE: [checkpoint] interval: unknown key (expected one of checkpoint_dir, checkpoint_interval, keep_checkpoints, async_checkpoint)"
        );
        assert_eq!(
            err("seq = 64\n[data]\nseq = 32\n"),
            "FILE: seq: set both at the top level and in [data]; keep one"
        );
        let e = err("[data]\nseq = \"long\"\n");
        assert!(
            e.starts_with("FILE: ") && e.contains("seq") && !e.contains('\n'),
            "{e}"
        );
    }
}
