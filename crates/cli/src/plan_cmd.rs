//! `ferrotron plan`: the planner's flags ([`PlanFlags`]), an optional TOML file mirroring
//! them, and the output formats.

use anyhow::Result;
use clap::{Args, Subcommand};
use ferrotron_plan::cluster::{gpus, networks};
use ferrotron_plan::presets::{preset, preset_names};
use ferrotron_plan::report::{json::to_json, table::render};
use ferrotron_plan::{inventory, plan, PlanFlags};
use std::path::PathBuf;

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

/// The planner's flags ([`PlanFlags`], shared with the TOML file and Python's keywords) and
/// the command's own: the settings file and the output formats.
#[derive(Args, Default, Debug)]
pub struct PlanArgs {
    /// TOML file with any of these settings (keys are the flag names with `_` for `-`); flags
    /// given on the command line win [default: none].
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub flags: PlanFlags,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Print the tensor inventory (HF names and shapes).
    #[arg(long)]
    pub inventory: bool,
    /// List the built-in model presets.
    #[arg(long)]
    pub list_presets: bool,
    /// List the built-in GPU kinds and networks with their specs.
    #[arg(long)]
    pub list_gpus: bool,
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
    let flags = args.flags.merged(args.config.as_deref())?;
    let resolved = flags.resolve(None)?;
    let result = plan(&resolved.input)?;
    if args.inventory {
        for t in &result.tensors {
            println!("{:<60} {:?} {}", t.name, t.shape, t.numel());
        }
        println!("total {}", result.params.total);
        return Ok(());
    }
    let report = flags.report(&resolved, &result)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&report))?);
    } else {
        print!("{}", render(&report));
        if let Some(path) = &flags.html {
            println!("\nHTML report: {}", path.display());
        }
    }
    Ok(())
}
