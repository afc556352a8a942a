//! `ferrotron plan search`: the layouts of N GPUs that fit, ranked by predicted tokens/s.

use anyhow::Result;
use clap::Args;
use ferrotron_plan::api::search_to_json;
use ferrotron_plan::search::{search, SearchResult, SearchSpec};
use ferrotron_plan::SearchFlags;

/// The search's flags ([`SearchFlags`], shared with Python's keywords) and the output format.
#[derive(Args, Debug)]
pub struct SearchArgs {
    #[command(flatten)]
    pub flags: SearchFlags,
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
    let spec = a.flags.resolve(None)?;
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
