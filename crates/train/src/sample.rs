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
    /// Longest context fed to the model (the oldest tokens are dropped beyond it). `usize::MAX`:
    /// the model's whole context, and a prompt plus `tokens` longer than it is refused (what
    /// `ferrotron sample` asks for: nothing is silently forgotten).
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
    generate_streaming(model, params, tok, prompt, o, &mut |_| {})
}

/// The prompt's tokens plus the tokens asked for must fit the model's context when sampling
/// is not to slide a window over it.
fn check_context(prompt: usize, tokens: usize, max_pos: usize) -> Result<()> {
    if prompt.saturating_add(tokens) > max_pos {
        bail!(
            "tokens = {tokens}: the prompt's {prompt} tokens plus {tokens} pass the model's context of {max_pos} positions (max_position_embeddings); ask for at most {} tokens",
            max_pos.saturating_sub(prompt)
        );
    }
    Ok(())
}

/// As [`generate`], giving each new piece of text to `on_text` as soon as it decodes (a
/// token that ends inside a multi-byte character waits for the next one).
pub fn generate_streaming(
    model: &Llama,
    params: &[f32],
    tok: &Tokenizer,
    prompt: &str,
    o: &SampleOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<String> {
    let mut ids = tok.encode(prompt)?;
    if ids.is_empty() {
        match tok.eos_id().or(tok.bos_id()) {
            Some(id) => ids.push(id),
            None => bail!("prompt is empty and the tokenizer has no BOS/EOS token to start from"),
        }
    }
    let start = ids.len();
    if o.context == usize::MAX {
        check_context(start, o.tokens, model.config.max_pos)?;
    }
    let mut printed = String::new();
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
        let text = tok.decode(&ids[start..])?;
        if let Some(new) = text.strip_prefix(printed.as_str()) {
            if !new.is_empty() && !new.ends_with('\u{FFFD}') {
                on_text(new);
                printed = text;
            }
        }
    }
    let text = tok.decode(&ids[start..])?;
    if let Some(rest) = text.strip_prefix(printed.as_str()) {
        if !rest.is_empty() {
            on_text(rest);
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_prompt_and_tokens_past_the_context_are_refused() {
        assert!(super::check_context(3, 253, 256).is_ok());
        let e = super::check_context(3, 2000, 256).unwrap_err().to_string();
        assert_eq!(e, "tokens = 2000: the prompt's 3 tokens plus 2000 pass the model's context of 256 positions (max_position_embeddings); ask for at most 253 tokens");
        assert!(super::check_context(300, 1, 256)
            .unwrap_err()
            .to_string()
            .ends_with("ask for at most 0 tokens"));
    }
}
