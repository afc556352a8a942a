//! The `ferrotron` command line.

mod plan_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferrotron",
    version,
    about = "Where does the memory go? An LLM training planner and trainer."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Predict per-rank memory, a timeline and a fit verdict for a training setup.
    Plan(plan_cmd::PlanArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Plan(args) => plan_cmd::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
