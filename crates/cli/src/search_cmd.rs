//! `ferrotron plan search`: the layouts of N GPUs that fit, ranked by predicted tokens/s.

use crate::plan_cmd::{load_cluster, load_model};
use anyhow::Result;
use clap::Args;
use ferrotron_plan::api::{search_to_json, SearchSettings};
use ferrotron_plan::search::{search, SearchResult, SearchSpec};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SearchArgs {
    /// Built-in preset name or path to an HF config.json.
    #[arg(long, allow_negative_numbers = true)]
    pub model: Option<String>,
    /// Number of GPUs to lay out.
    #[arg(long, allow_negative_numbers = true)]
    pub gpus: Option<u64>,
    /// GPUs per node [default: 8].
    #[arg(long, allow_negative_numbers = true)]
    pub gpus_per_node: Option<u64>,
    /// GPU kind [default: h100].
    #[arg(long, allow_negative_numbers = true)]
    pub gpu: Option<String>,
    /// Cluster file (TOML); --gpu and --gpus-per-node win over it.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Fused attention kernel for the time model: flash2 | triton [default: flash2].
    #[arg(long, allow_negative_numbers = true)]
    pub attention: Option<String>,
    /// Sequence length [default: min(4096, model max positions)].
    #[arg(long, allow_negative_numbers = true)]
    pub seq: Option<u64>,
    /// Context length the run extends the model to: overrides its max_position_embeddings.
    #[arg(long, allow_negative_numbers = true)]
    pub max_seq: Option<u64>,
    /// Global batch in tokens per optimizer step [default: seq × gpus].
    #[arg(long, allow_negative_numbers = true)]
    pub gbs_tokens: Option<u64>,
    /// fp32 | bf16 | bf16-fp32grads | fp16 | fp8 [default: bf16].
    #[arg(long, allow_negative_numbers = true)]
    pub precision: Option<String>,
    /// adamw | sgd [default: adamw].
    #[arg(long, allow_negative_numbers = true)]
    pub optimizer: Option<String>,
    /// Memory convention: ferrotron | megatron | zero-paper | playbook | torchtitan |
    /// megatron-lm | deepspeed [default: ferrotron].
    #[arg(long, allow_negative_numbers = true)]
    pub convention: Option<String>,
    /// FLOPs convention for MFU [default: ferrotron].
    #[arg(long, allow_negative_numbers = true)]
    pub flops_convention: Option<String>,
    /// Fraction of GPU memory a layout may use [default: 0.8].
    #[arg(long, allow_negative_numbers = true)]
    pub margin: Option<f64>,
    /// How many layouts to show [default: 5].
    #[arg(long, allow_negative_numbers = true)]
    pub top: Option<u64>,
    /// Largest micro-batch to try [default: 64].
    #[arg(long, allow_negative_numbers = true)]
    pub max_mbs: Option<u64>,
    /// Runtime context per rank in GiB [default: 1.0].
    #[arg(long, allow_negative_numbers = true)]
    pub overhead_gib: Option<f64>,
    /// Fragmentation margin as a fraction of allocated memory [default: 0.05].
    #[arg(long, allow_negative_numbers = true)]
    pub fragmentation: Option<f64>,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The top-k table.
pub fn render(r: &SearchResult, s: &SearchSpec) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "ferrotron plan search: {} on {} × {} ({} per node), seq {}, {} tokens per step",
        s.model.name, s.gpus, s.cluster.gpu.name, s.cluster.gpus_per_node, s.seq, s.gbs_tokens
    );
    let _ = writeln!(
        o,
        "  {} layouts timed, {} memory plans; budget {:.1} GiB ({:.0}% of {:.1} GiB); memory convention {}, MFU by {} FLOPs\n",
        r.evaluated,
        r.memory_planned,
        gib(r.budget),
        s.margin * 100.0,
        gib(r.capacity),
        s.convention,
        s.flops
    );
    let _ = writeln!(
        o,
        "  {:>2}  {:<30} {:>4} {:<9} {:>9} {:>9} {:>9} {:>12} {:>6} {:>7} {:>6}",
        "#",
        "dp×tp×pp×cp×ep (v)",
        "zero",
        "recompute",
        "mbs×acc",
        "peak GiB",
        "step s",
        "tokens/s",
        "MFU",
        "bubble",
        "comm"
    );
    for (i, c) in r.top.iter().enumerate() {
        let l = &c.layout;
        let t = &c.time;
        let shape = format!(
            "{}×{}×{}×{}×{}{}",
            l.dp,
            l.tp,
            l.pp,
            l.cp,
            l.ep,
            if l.pp_virtual > 1 {
                format!(" (v={})", l.pp_virtual)
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            o,
            "  {:>2}  {:<30} {:>4} {:<9} {:>9} {:>9.1} {:>9.3} {:>12.0} {:>5.1}% {:>6.1}% {:>5.1}%",
            i + 1,
            shape,
            l.zero,
            c.recipe.recompute.to_string(),
            format!("{}×{}", c.recipe.mbs, c.recipe.grad_acc),
            gib(c.peak),
            t.step_s,
            t.tokens_per_s,
            t.mfu * 100.0,
            t.breakdown.bubble_s / t.step_s * 100.0,
            t.breakdown.exposed_comm_s / t.step_s * 100.0
        );
    }
    let _ = writeln!(o, "\nWhy #1: {}", r.reason);
    let _ = writeln!(
        o,
        "\nReproduce #1: ferrotron plan --model {} --seq {} --gpu {} --gpus-per-node {} {}",
        s.model.name, s.seq, s.cluster.gpu.name, s.cluster.gpus_per_node, r.top[0].flags
    );
    o
}

pub fn run(a: SearchArgs) -> Result<()> {
    let model = match &a.model {
        Some(m) => Some(load_model(m)?),
        None => None,
    };
    let settings = SearchSettings {
        model: None,
        config: None,
        gpus: a.gpus,
        gpu: a.gpu.clone(),
        gpus_per_node: a.gpus_per_node,
        cluster: a.cluster.as_deref().map(load_cluster).transpose()?,
        attention: a.attention.clone(),
        seq: a.seq,
        max_seq: a.max_seq,
        gbs_tokens: a.gbs_tokens,
        precision: a.precision.clone(),
        optimizer: a.optimizer.clone(),
        convention: a.convention.clone(),
        flops_convention: a.flops_convention.clone(),
        margin: a.margin,
        top: a.top,
        max_mbs: a.max_mbs,
        overhead_gib: a.overhead_gib,
        fragmentation: a.fragmentation,
    };
    let spec = settings.resolve(model)?;
    let r = search(&spec)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&search_to_json(&r, &spec))?
        );
    } else {
        print!("{}", render(&r, &spec));
    }
    Ok(())
}
