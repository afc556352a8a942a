//! Text generation from a checkpoint: temperature and top-k sampling.

use crate::data::{SplitMix64, Tokenizer};
use anyhow::{bail, Result};
use ferrotron_engine::kernels::CpuKernels;
use ferrotron_engine::model::{BatchShape, HeapPool, Llama};

#[derive(Debug, Clone)]
pub struct SampleOptions {
    pub tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
    /// Longest context fed to the model (the oldest tokens are dropped beyond it).
    pub context: usize,
}

/// Picks the next token from `logits` (one row of V).
fn pick(logits: &mut [f32], o: &SampleOptions, rng: &mut SplitMix64) -> u32 {
    if o.temperature <= 0.0 {
        return logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0 as u32;
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = if o.top_k == 0 {
        logits.len()
    } else {
        o.top_k.min(logits.len())
    };
    idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
    idx.truncate(k);
    let max = idx
        .iter()
        .map(|&i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - max) / o.temperature) as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (j, wj) in w.iter().enumerate() {
        u -= wj;
        if u <= 0.0 {
            return idx[j] as u32;
        }
    }
    idx[k - 1] as u32
}

/// Continues `prompt` by `o.tokens` tokens; returns the generated text (prompt excluded).
pub fn generate(
    model: &Llama,
    params: &[f32],
    tok: &Tokenizer,
    prompt: &str,
    o: &SampleOptions,
) -> Result<String> {
    let mut ids = tok.encode(prompt)?;
    if ids.is_empty() {
        match tok.eos_id().or(tok.bos_id()) {
            Some(id) => ids.push(id),
            None => bail!("prompt is empty and the tokenizer has no BOS/EOS token to start from"),
        }
    }
    let start = ids.len();
    let mut rng = SplitMix64::new(o.seed);
    let mut pool = HeapPool::new();
    let mut logits = vec![0.0f32; model.config.vocab];
    let context = o.context.min(model.config.max_pos).max(1);
    for _ in 0..o.tokens {
        let window = &ids[ids.len().saturating_sub(context)..];
        let batch = BatchShape {
            b: 1,
            t: window.len(),
        };
        model.forward_logits_last(
            &CpuKernels::PLAIN,
            &mut pool,
            params,
            batch,
            window,
            &mut logits,
        );
        let next = pick(&mut logits, o, &mut rng);
        if Some(next) == tok.eos_id() {
            break;
        }
        ids.push(next);
    }
    Ok(tok.decode(&ids[start..])?)
}
