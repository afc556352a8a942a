//! The `ferrotron` command line.

#[cfg(test)]
mod help_lines;
mod http;
mod plan_cmd;
mod report_cmd;
mod search_cmd;
mod serve_cmd;
mod train_cmd;

/// Every allocation is counted, so each training run can compare its measured memory with
/// the plan's prediction.
#[global_allocator]
static ALLOC: ferrotron_train::alloc::Tracking = ferrotron_train::alloc::Tracking;

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
    /// Predict per-rank memory, step time and a fit verdict (`plan search`: rank layouts).
    Plan(plan_cmd::PlanCmd),
    /// Serve the interactive planner page and its JSON API (loopback by default).
    Serve(serve_cmd::ServeArgs),
    /// Train a Llama-family or Mixtral model from its memory plan: any layout of dp, tp, sp, pp,
    /// cp, ep and ZeRO, its ranks as threads or mpirun processes, on the CPU or one GPU
    /// (--device cuda).
    Train(Box<ferrotron_train::config::TrainArgs>),
    /// Tokenize text files into train and validation token shards for `train --data`.
    Data(train_cmd::DataArgs),
    /// Generate text from a checkpoint, continuing a prompt.
    Sample(train_cmd::SampleArgs),
    /// Mean next-token loss of a checkpoint or Hugging Face model over token sequences.
    Eval(train_cmd::EvalArgs),
    /// Write an HTML report (loss, throughput, memory timeline) of a training run directory.
    Report(report_cmd::ReportArgs),
}

/// Lets a closed pipe end the process quietly (`ferrotron plan --list-presets | head -1`), as
/// it does for other command-line tools: Rust ignores SIGPIPE, so `println!` would panic on the
/// write error instead. Not for `serve`, where a client that hangs up must not kill the server
/// (there the ignored signal turns into an error on that one connection).
fn quiet_on_closed_pipe() {
    // POSIX: SIGPIPE is 13 on Linux, macOS and the BSDs; SIG_DFL is 0.
    set_signal(13, 0);
}

/// A write past the file-size limit (`ulimit -f`) fails with EFBIG instead of killing the
/// process with SIGXFSZ, so a checkpoint that cannot be written is an error that names the
/// file, and the previous checkpoint stays the latest (Linux: SIGXFSZ is 25; SIG_IGN is 1).
fn file_size_limit_is_an_error() {
    #[cfg(target_os = "linux")]
    set_signal(25, 1);
}

fn set_signal(signum: i32, handler: usize) {
    #[cfg(unix)]
    {
        extern "C" {
            fn signal(signum: i32, handler: usize) -> usize;
        }
        // SAFETY: sets the disposition of one signal before any thread exists.
        unsafe {
            signal(signum, handler);
        }
    }
    #[cfg(not(unix))]
    let _ = (signum, handler);
}

fn main() {
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Serve(_)) {
        quiet_on_closed_pipe();
    }
    file_size_limit_is_an_error();
    let result = match cli.cmd {
        Cmd::Plan(args) => plan_cmd::dispatch(args),
        Cmd::Serve(args) => serve_cmd::run(args),
        Cmd::Train(args) => train_cmd::train(*args),
        Cmd::Data(args) => train_cmd::data(args),
        Cmd::Sample(args) => train_cmd::sample(args),
        Cmd::Eval(args) => train_cmd::eval(args),
        Cmd::Report(args) => report_cmd::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
