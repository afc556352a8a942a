//! `ferrotron plan`: flags, an optional TOML file mirroring them, and the output formats.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferrotron_plan::api::{Resolved, Settings};
use ferrotron_plan::cluster::{gpus, networks, ClusterFile};
use ferrotron_plan::presets::{preset, preset_names};
use ferrotron_plan::report::{build_with_time, html::to_html, json::to_json, table::render};
use ferrotron_plan::{inventory, plan, ModelSource, ModelSpec};
use ferrotron_train::config::toml_error;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// `ferrotron plan [FLAGS]` or `ferrotron plan search [FLAGS]`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct PlanCmd {
    #[command(subcommand)]
    pub sub: Option<PlanSub>,
    #[command(flatten)]
    pub args: Box<PlanArgs>,
}

#[derive(Subcommand, Debug)]
pub enum PlanSub {
    /// Search the layouts of N GPUs that fit, ranked by predicted tokens/s.
    Search(Box<crate::search_cmd::SearchArgs>),
}

/// Runs `ferrotron plan` or one of its subcommands.
pub fn dispatch(cmd: PlanCmd) -> Result<()> {
    match cmd.sub {
        Some(PlanSub::Search(a)) => crate::search_cmd::run(*a),
        None => run(*cmd.args),
    }
}

/// Every flag is optional here so that a TOML file (`--config`) can supply it; flags given on
/// the command line win. TOML keys are the flag names with `_` for `-` (e.g. `grad_acc = 8`).
#[derive(Args, Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
pub struct PlanArgs {
    /// TOML file with any of these settings.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Built-in preset name (see --list-presets) or path to an HF config.json.
    #[arg(long, allow_negative_numbers = true)]
    pub model: Option<String>,
    /// Bare parameter count (e.g. 7.5e9): model states only, sharded uniformly over tp·pp.
    #[arg(long, allow_negative_numbers = true)]
    pub params: Option<String>,
    /// With --params: parameters of the largest layer (e.g. 1e9), what ZeRO-3 gathers at once.
    #[arg(long, allow_negative_numbers = true)]
    pub largest_layer: Option<String>,
    /// Sequence length [default: min(4096, model max positions)].
    #[arg(long, allow_negative_numbers = true)]
    pub seq: Option<u64>,
    /// Context length the run extends the model to: overrides its max_position_embeddings.
    #[arg(long, allow_negative_numbers = true)]
    pub max_seq: Option<u64>,
    /// Micro-batch size per rank [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub mbs: Option<u64>,
    /// Micro-batches per optimizer step [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub grad_acc: Option<u64>,
    /// Global batch in sequences (sets grad-acc = gbs / (mbs·dp·ep)).
    #[arg(long, allow_negative_numbers = true)]
    pub gbs: Option<u64>,
    /// fp32 | bf16 | bf16-fp32grads | fp16 | fp8 [default: bf16].
    #[arg(long, allow_negative_numbers = true)]
    pub precision: Option<String>,
    /// adamw | sgd [default: adamw].
    #[arg(long, allow_negative_numbers = true)]
    pub optimizer: Option<String>,
    /// none | selective | full [default: none].
    #[arg(long, allow_negative_numbers = true)]
    pub recompute: Option<String>,
    #[arg(long, allow_negative_numbers = true)]
    pub dp: Option<u64>,
    #[arg(long, allow_negative_numbers = true)]
    pub tp: Option<u64>,
    #[arg(long, allow_negative_numbers = true)]
    pub pp: Option<u64>,
    #[arg(long, allow_negative_numbers = true)]
    pub cp: Option<u64>,
    #[arg(long, allow_negative_numbers = true)]
    pub ep: Option<u64>,
    /// ZeRO stage 0..3.
    #[arg(long, allow_negative_numbers = true)]
    pub zero: Option<u64>,
    /// Sequence parallelism (with tp > 1); `--sp` alone means true.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub sp: Option<bool>,
    /// afab | 1f1b | interleaved [default: 1f1b].
    #[arg(long, allow_negative_numbers = true)]
    pub pp_schedule: Option<String>,
    /// Model chunks per stage for the interleaved schedule.
    #[arg(long, allow_negative_numbers = true)]
    pub pp_virtual: Option<u64>,
    /// Layers per pipeline stage, e.g. 7,8*14,7 (126 layers on 16 stages), or per model chunk
    /// (pp × pp-virtual counts, model order) [default: even].
    #[arg(long, allow_negative_numbers = true)]
    pub pp_layers: Option<String>,
    /// Layers of the first pipeline stage, the others sharing the rest evenly (Megatron-LM's
    /// --decoder-first-pipeline-num-layers).
    #[arg(long, allow_negative_numbers = true)]
    pub pp_first_layers: Option<u64>,
    /// Layers of the last pipeline stage (Megatron-LM's --decoder-last-pipeline-num-layers).
    #[arg(long, allow_negative_numbers = true)]
    pub pp_last_layers: Option<u64>,
    /// Expert-parallel all-to-alls overlapped with another micro-batch's compute, as
    /// DeepSeek-V3's DualPipe runs them (default: exposed, as Megatron-LM's default); `--ep-overlap`
    /// alone means true.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub ep_overlap: Option<bool>,
    /// none | optimizer | params.
    #[arg(long, allow_negative_numbers = true)]
    pub offload: Option<String>,
    /// GPU kind for the verdict and the time model (h100, h100-96, h200, a100-40, a100-80, b200,
    /// mi300x, h100-pcie, l40s, rtx4090) [default: h100].
    #[arg(long, allow_negative_numbers = true)]
    pub gpu: Option<String>,
    /// GPUs per node: groups that fit in a node use its links, larger ones the network
    /// [default: 8].
    #[arg(long, allow_negative_numbers = true)]
    pub gpus_per_node: Option<u64>,
    /// Cluster file (TOML): GPU kind or a custom GPU, GPUs per node, link bandwidths and
    /// latencies (see configs/cluster-example.toml). --gpu and --gpus-per-node win over it.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Fused attention kernel the framework runs, for the time model: flash2 (PyTorch SDPA,
    /// flash-attn 2) | triton (flash_attn_triton) [default: flash2, or the cluster file's].
    #[arg(long, allow_negative_numbers = true)]
    pub attention: Option<String>,
    /// FLOPs convention for MFU: ferrotron | torchtitan | nanotron | megatron | 6n
    /// [default: ferrotron].
    #[arg(long, allow_negative_numbers = true)]
    pub flops_convention: Option<String>,
    /// Memory and kernel accounting: ferrotron | megatron | zero-paper | playbook | torchtitan |
    /// megatron-lm | deepspeed [default: ferrotron].
    #[arg(long, allow_negative_numbers = true)]
    pub convention: Option<String>,
    /// Runtime context per rank in GiB [default: 1.0].
    #[arg(long, allow_negative_numbers = true)]
    pub overhead_gib: Option<f64>,
    /// Fragmentation margin as a fraction of allocated memory [default: 0.05].
    #[arg(long, allow_negative_numbers = true)]
    pub fragmentation: Option<f64>,
    /// Rows of logits the chunked cross-entropy materialises at once [default: 1024].
    #[arg(long, allow_negative_numbers = true)]
    pub ce_chunk: Option<u64>,
    /// Gradient bucket size in MiB: ZeRO-2 bucket buffers, and one latency per bucket in the
    /// data-parallel reduction time [default: 25].
    #[arg(long, allow_negative_numbers = true)]
    pub bucket_mb: Option<u64>,
    /// A mixture of experts' capacity factor: each expert takes at most ⌈cf · tokens · top_k /
    /// E⌉ of a micro-batch's routed copies, the rest are dropped [default: exact routing].
    #[arg(long, allow_negative_numbers = true)]
    pub capacity_factor: Option<f64>,
    /// Print JSON instead of the table.
    #[arg(long)]
    #[serde(skip)]
    pub json: bool,
    /// Also write a self-contained HTML report to this file.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Print the tensor inventory (HF names and shapes).
    #[arg(long)]
    #[serde(skip)]
    pub inventory: bool,
    /// List the built-in model presets.
    #[arg(long)]
    #[serde(skip)]
    pub list_presets: bool,
    /// List the built-in GPU kinds and networks with their specs.
    #[arg(long)]
    #[serde(skip)]
    pub list_gpus: bool,
}

macro_rules! merge {
    ($cli:ident, $file:ident; $($f:ident),*) => { $( if $cli.$f.is_none() { $cli.$f = $file.$f.take(); } )* };
}

impl PlanArgs {
    fn merged(mut self) -> Result<Self> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read --config {}", path.display()))?;
        let mut file: PlanArgs =
            toml::from_str(&text).map_err(|e| anyhow::anyhow!(toml_error(&path, &text, &e)))?;
        merge!(self, file; model, params, largest_layer, seq, max_seq, mbs, grad_acc, gbs, precision, optimizer, recompute,
            dp, tp, pp, cp, ep, zero, sp, pp_schedule, pp_virtual, pp_layers, pp_first_layers, pp_last_layers, ep_overlap, offload, gpu, gpus_per_node,
            cluster, attention, flops_convention, convention, overhead_gib, fragmentation, ce_chunk,
            bucket_mb, capacity_factor, html);
        Ok(self)
    }
}

/// Loads `--model`: a built-in preset, a config.json file, or a directory holding one.
pub fn load_model(name: &str) -> Result<ModelSpec> {
    if preset_names().any(|n| n == name) {
        return Ok(preset(name)?);
    }
    let path = Path::new(name);
    if path.is_dir() && path.join("config.json").is_file() {
        return load_model(&path.join("config.json").to_string_lossy());
    }
    if path.is_file() {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        return Ok(ModelSpec::from_json_str(
            &text,
            &path.display().to_string(),
        )?);
    }
    bail!(
        "model = {name}: neither a built-in preset nor a config.json file (run `ferrotron plan --list-presets`)"
    )
}

/// Reads a cluster file (TOML).
pub fn load_cluster(path: &Path) -> Result<ClusterFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --cluster {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!(toml_error(path, &text, &e)))
}

/// Turns the merged flags into a planner input, its cluster and FLOPs convention.
pub fn input_from(a: &PlanArgs) -> Result<Resolved> {
    if a.model.is_some() && a.params.is_some() {
        bail!("give either --model or --params, not both");
    }
    let model = match &a.model {
        Some(m) => Some(ModelSource::Spec(load_model(m)?)),
        None => None,
    };
    let settings = Settings {
        model: None,
        config: None,
        params: a.params.clone(),
        largest_layer: a.largest_layer.clone(),
        seq: a.seq,
        max_seq: a.max_seq,
        mbs: a.mbs,
        grad_acc: a.grad_acc,
        gbs: a.gbs,
        precision: a.precision.clone(),
        optimizer: a.optimizer.clone(),
        recompute: a.recompute.clone(),
        dp: a.dp,
        tp: a.tp,
        pp: a.pp,
        cp: a.cp,
        ep: a.ep,
        zero: a.zero,
        sp: a.sp,
        pp_schedule: a.pp_schedule.clone(),
        pp_virtual: a.pp_virtual,
        pp_layers: a.pp_layers.clone(),
        pp_first_layers: a.pp_first_layers,
        pp_last_layers: a.pp_last_layers,
        ep_overlap: a.ep_overlap,
        offload: a.offload.clone(),
        gpu: a.gpu.clone(),
        gpus_per_node: a.gpus_per_node,
        cluster: a.cluster.as_deref().map(load_cluster).transpose()?,
        attention: a.attention.clone(),
        flops_convention: a.flops_convention.clone(),
        convention: a.convention.clone(),
        overhead_gib: a.overhead_gib,
        fragmentation: a.fragmentation,
        ce_chunk: a.ce_chunk,
        bucket_mb: a.bucket_mb,
        capacity_factor: a.capacity_factor,
    };
    Ok(settings.resolve(model)?)
}

/// Writes `text` to `path` atomically: a temp file beside it, then a rename.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename to {}", path.display()))?;
    Ok(())
}

fn list_gpus() {
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>8} {:>9} {:>7} {:>6}  note",
        "gpu", "GiB", "bf16 TF", "fp8 TF", "fp32 TF", "HBM GB/s", "link", "MAMF"
    );
    for g in gpus() {
        println!(
            "{:<10} {:>9.1} {:>9.1} {:>9.1} {:>8.1} {:>9.0} {:>7.0} {:>5.1}%  {}",
            g.name,
            g.capacity as f64 / (1u64 << 30) as f64,
            g.bf16_flops / 1e12,
            g.fp8_flops / 1e12,
            g.fp32_flops / 1e12,
            g.hbm_bw / 1e9,
            g.link_bw / 1e9,
            g.mamf_bf16 * 100.0,
            g.note
        );
    }
    println!("\nnetworks (per GPU, per direction):");
    for n in networks() {
        println!(
            "  {:<10} {:>6.1} GB/s  {:.1} us/hop  {}",
            n.name,
            n.bw / 1e9,
            n.latency * 1e6,
            n.note
        );
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    if args.list_gpus {
        list_gpus();
        return Ok(());
    }
    if args.list_presets {
        for name in preset_names() {
            let m = preset(name)?;
            let c = inventory::count(&m, &inventory::inventory(&m));
            println!("{name:<16} {:>18} params  {}", c.total, m.model_type);
        }
        return Ok(());
    }
    let args = args.merged()?;
    let Resolved {
        input,
        cluster,
        flops,
        notes,
    } = input_from(&args)?;
    let result = plan(&input)?;
    if args.inventory {
        for t in &result.tensors {
            println!("{:<60} {:?} {}", t.name, t.shape, t.numel());
        }
        println!("total {}", result.params.total);
        return Ok(());
    }
    let mut report = build_with_time(&input, &result, &cluster, flops, args.html.is_some())?;
    if let Some(t) = report.time.as_mut() {
        t.notes.extend(notes);
    }
    if let Some(path) = &args.html {
        write_atomic(path, &to_html(&report))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&report))?);
    } else {
        print!("{}", render(&report));
        if let Some(path) = &args.html {
            println!("\nHTML report: {}", path.display());
        }
    }
    Ok(())
}
