//! `ferrotron plan`: flags, an optional TOML file mirroring them, and the output formats.

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotron_plan::hardware::{gpu, Overhead};
use ferrotron_plan::presets::{preset, preset_names};
use ferrotron_plan::report::{build, html::to_html, json::to_json, table::render};
use ferrotron_plan::{
    inventory, plan, Convention, Layout, ModelSource, ModelSpec, Offload, Optimizer, PlanInput,
    PpSchedule, Precision, Recipe, Recompute,
};
use serde::Deserialize;
use std::path::{Path, PathBuf};

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
    /// Sequence length [default: min(4096, model max positions)].
    #[arg(long, allow_negative_numbers = true)]
    pub seq: Option<u64>,
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
    /// none | optimizer | params.
    #[arg(long, allow_negative_numbers = true)]
    pub offload: Option<String>,
    /// GPU kind for the verdict (h100, h200, a100-40, a100-80, b200, mi300x, l40s, rtx4090).
    #[arg(long, allow_negative_numbers = true)]
    pub gpu: Option<String>,
    /// ferrotron | megatron | zero-paper | playbook [default: ferrotron].
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
    /// ZeRO-2 gradient bucket size in MiB [default: 25].
    #[arg(long, allow_negative_numbers = true)]
    pub bucket_mb: Option<u64>,
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
        let mut file: PlanArgs = toml::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.message().trim()))?;
        merge!(self, file; model, params, seq, mbs, grad_acc, gbs, precision, optimizer, recompute,
            dp, tp, pp, cp, ep, zero, sp, pp_schedule, pp_virtual, offload, gpu, convention,
            overhead_gib, fragmentation, ce_chunk, bucket_mb, html);
        Ok(self)
    }
}

fn parse<T: std::str::FromStr<Err = ferrotron_plan::PlanError>>(
    v: &Option<String>,
    default: T,
) -> Result<T> {
    match v {
        None => Ok(default),
        Some(s) => Ok(s.parse()?),
    }
}

/// Parses a parameter count such as `7.5e9` or `7000000000` exactly.
fn parse_params(s: &str) -> Result<u64> {
    let bad = || {
        anyhow::anyhow!(
            "params = {s}: expected a positive parameter count such as 7.5e9 or 125000000"
        )
    };
    if let Ok(n) = s.parse::<u64>() {
        return if n > 0 { Ok(n) } else { Err(bad()) };
    }
    let x: f64 = s.parse().map_err(|_| bad())?;
    if !(x >= 1.0 && x < 9.0e18 && x.fract() == 0.0) {
        return Err(bad());
    }
    Ok(x as u64)
}

fn load_model(name: &str) -> Result<ModelSpec> {
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

/// Turns the merged flags into a planner input (and the GPU to judge against).
pub fn input_from(a: &PlanArgs) -> Result<(PlanInput, ferrotron_plan::hardware::Gpu)> {
    let model = match (&a.model, &a.params) {
        (Some(_), Some(_)) => bail!("give either --model or --params, not both"),
        (None, None) => bail!("no model: pass --model PRESET_OR_CONFIG_JSON or --params N"),
        (Some(m), None) => ModelSource::Spec(load_model(m)?),
        (None, Some(p)) => ModelSource::Params(parse_params(p)?),
    };
    let max_pos = match &model {
        ModelSource::Spec(m) => m.max_positions,
        ModelSource::Params(_) => u64::MAX,
    };
    let zero = a.zero.unwrap_or(0);
    if zero > 3 {
        bail!("zero = {zero}: ZeRO stages are 0, 1, 2 or 3");
    }
    let layout = Layout {
        dp: a.dp.unwrap_or(1),
        tp: a.tp.unwrap_or(1),
        pp: a.pp.unwrap_or(1),
        cp: a.cp.unwrap_or(1),
        ep: a.ep.unwrap_or(1),
        zero: zero as u8,
        sp: a.sp.unwrap_or(false),
        pp_schedule: parse(&a.pp_schedule, PpSchedule::OneFOneB)?,
        pp_virtual: a.pp_virtual.unwrap_or(1),
        offload: parse(&a.offload, Offload::None)?,
    };
    let mbs = a.mbs.unwrap_or(1);
    let grad_acc = match (a.gbs, a.grad_acc) {
        (None, ga) => ga.unwrap_or(1),
        (Some(gbs), ga) => {
            let per_step = mbs * layout.dp * layout.ep;
            if per_step == 0 || gbs == 0 || gbs % per_step != 0 {
                bail!("gbs = {gbs}: must be a positive multiple of mbs·dp·ep = {per_step}");
            }
            let derived = gbs / per_step;
            if let Some(g) = ga {
                if g != derived {
                    bail!("grad_acc = {g} contradicts gbs = {gbs} (which implies grad_acc = {derived}); give one of them");
                }
            }
            derived
        }
    };
    let recipe = Recipe {
        seq: a.seq.unwrap_or(4096.min(max_pos)),
        mbs,
        grad_acc,
        precision: parse(&a.precision, Precision::Bf16)?,
        optimizer: parse(&a.optimizer, Optimizer::Adamw)?,
        recompute: parse(&a.recompute, Recompute::None)?,
        ce_chunk_tokens: a.ce_chunk.unwrap_or(1024),
    };
    let overhead = Overhead {
        context_bytes: {
            let g = a.overhead_gib.unwrap_or(1.0);
            if !(0.0..=1024.0).contains(&g) {
                bail!("overhead_gib = {g}: expected GiB between 0 and 1024");
            }
            (g * (1u64 << 30) as f64) as u64
        },
        fragmentation: a.fragmentation.unwrap_or(0.05),
    };
    overhead.validate()?;
    let convention: Convention = parse(&a.convention, Convention::Ferrotron)?;
    let gpu = gpu(a.gpu.as_deref().unwrap_or("h100"))?;
    let bucket_bytes = a
        .bucket_mb
        .unwrap_or(25)
        .checked_mul(1 << 20)
        .context("bucket_mb too large")?;
    Ok((
        PlanInput {
            model,
            recipe,
            layout,
            convention,
            overhead,
            bucket_bytes,
        },
        gpu,
    ))
}

/// Writes `text` to `path` atomically: a temp file beside it, then a rename.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename to {}", path.display()))?;
    Ok(())
}

pub fn run(args: PlanArgs) -> Result<()> {
    if args.list_presets {
        for name in preset_names() {
            let m = preset(name)?;
            let c = inventory::count(&m, &inventory::inventory(&m));
            println!("{name:<16} {:>18} params  {}", c.total, m.model_type);
        }
        return Ok(());
    }
    let args = args.merged()?;
    let (input, gpu) = input_from(&args)?;
    let result = plan(&input)?;
    if args.inventory {
        for t in &result.tensors {
            println!("{:<60} {:?} {}", t.name, t.shape, t.numel());
        }
        println!("total {}", result.params.total);
        return Ok(());
    }
    let report = build(&input, &result, Some(&gpu), args.html.is_some())?;
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
