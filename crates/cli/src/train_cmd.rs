//! `ferrotron train`, `ferrotron data` and `ferrotron sample`.

use anyhow::Result;
use clap::Args;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::run;
use ferrotron_train::sample::{self, SampleOptions};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct DataArgs {
    /// Input files (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet), or directories of them
    /// (read recursively, in name order).
    #[arg(long, num_args = 1.., required = true)]
    pub input: Vec<PathBuf>,
    /// Output directory for train_*.tok / val_*.tok shards.
    #[arg(long)]
    pub out: PathBuf,
    /// HF tokenizer.json [default: the bundled BPE tokenizer].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Fraction of tokens held out for validation.
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub val_fraction: f64,
    /// JSON Lines field / Parquet column holding the document text (a nested Parquet column
    /// by its dotted path).
    #[arg(long, default_value = "text")]
    pub text_field: String,
}

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// Checkpoint directory written by `ferrotron train --checkpoint-dir`.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Text the generated tokens continue.
    #[arg(long, default_value = "ROMEO:")]
    pub prompt: String,
    /// File of prompts, one per line (blank lines skipped), each continued in turn (each from
    /// --seed, as if alone), the samples apart by a blank line (instead of --prompt).
    #[arg(long, conflicts_with = "prompt")]
    pub prompts: Option<PathBuf>,
    /// Tokens to generate, printed as they come; with the prompt's they must fit the model's
    /// context (max_position_embeddings).
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Softmax temperature of the sampling; 0 means greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Seed of the sampling's random numbers.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Recompute the whole prefix for every token instead of decoding over a KV cache (the
    /// same tokens, quadratically slower: for comparison).
    #[arg(long)]
    pub no_kv_cache: bool,
}

#[derive(Args)]
pub struct EvalArgs {
    /// Model folder: a ferrotron checkpoint, or a Hugging Face model (config.json with
    /// model.safetensors or a sharded model.safetensors.index.json) of a supported family.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// JSON file holding a list of token-id sequences, e.g. [[1, 5, 9], [2, 7]].
    #[arg(long)]
    pub tokens: PathBuf,
    /// Print {"loss": x, "tokens": n} instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// Mean next-token cross-entropy of a model folder over the given sequences.
pub fn eval(a: EvalArgs) -> Result<()> {
    let r = ferrotron_train::eval::eval_dir(&a.checkpoint, &a.tokens)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "loss {:.6} (perplexity {:.3}) over {} predicted tokens",
            r.loss,
            r.loss.exp(),
            r.tokens
        );
    }
    Ok(())
}

pub fn train(args: TrainArgs) -> Result<()> {
    run::run(args).map(|_| ())
}

pub fn data(a: DataArgs) -> Result<()> {
    use std::io::IsTerminal;
    let opts = ferrotron_train::data::BuildOptions {
        val_fraction: a.val_fraction,
        text_field: a.text_field,
        // The bar is for people watching; logs and pipes get the summary only.
        progress: std::io::stderr().is_terminal(),
        ..Default::default()
    };
    run::data(&a.input, &a.out, a.tokenizer.as_deref(), &opts)
}

pub fn sample(a: SampleArgs) -> Result<()> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        anyhow::bail!(
            "temperature = {}: must be a non-negative number (0 is greedy)",
            a.temperature
        );
    }
    let o = SampleOptions {
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        context: usize::MAX,
        kv_cache: !a.no_kv_cache,
    };
    let prompts = match &a.prompts {
        Some(file) => sample::read_prompts(file)?,
        None => vec![a.prompt.clone()],
    };
    let m = sample::SampleModel::open(&a.checkpoint)?;
    let texts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let mut sampler = sample::Sampler::new(&m.model, &m.weights, &m.tok, &o, &texts)?;
    // Each prompt, then each token's text as it comes (flushed: a terminal shows it at once);
    // nothing on stdout when the checkpoint or the request is refused.
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for (i, prompt) in prompts.iter().enumerate() {
        if i > 0 {
            writeln!(out)?;
        }
        write!(out, "{prompt}")?;
        out.flush()?;
        let mut failed = None;
        sampler.generate(i, &mut |piece| {
            if failed.is_none() {
                failed = write!(out, "{piece}").and_then(|_| out.flush()).err();
            }
        })?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        writeln!(out)?;
    }
    Ok(())
}
