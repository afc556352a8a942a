//! Text generation from a checkpoint: temperature and top-k sampling, decoding over a KV cache
//! (`ferrotron_engine::model::kv_cache`), one prompt or a file of them.

use crate::data::{SplitMix64, Tokenizer};
use crate::{checkpoint, setup};
use anyhow::{bail, Result};
use ferrotron_engine::kernels::CpuKernels;
use ferrotron_engine::model::{BatchShape, HeapPool, KvCache, Llama};
use std::path::Path;

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
    /// Decode over a KV cache (each token computed once) when the generation fits the
    /// context whole; `false`: each token recomputes the whole prefix (for comparison).
    pub kv_cache: bool,
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

/// A checkpoint opened for sampling: the model, its weights in f32 (whatever the checkpoint's
/// storage type) and its tokenizer.
pub struct SampleModel {
    pub model: Llama,
    pub weights: Vec<f32>,
    pub tok: Tokenizer,
}

impl SampleModel {
    /// Opens checkpoint directory `dir` (a `--keep-checkpoints` directory: its newest
    /// checkpoint).
    pub fn open(dir: &Path) -> Result<Self> {
        ferrotron_engine::kernels::cpu::gemm_select::check_env().map_err(anyhow::Error::msg)?;
        let l = checkpoint::open(dir)?;
        let dir = l.dir.as_path();
        let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
        let model = Llama::new(setup::llama_config(&l.spec)?);
        let widened = checkpoint::hf::Dtypes::Widened;
        let weights = checkpoint::load_weights(dir, &model.params, widened)?.into_f32();
        Ok(SampleModel {
            model,
            weights,
            tok,
        })
    }
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
    Sampler::new(model, params, tok, o, &[prompt])?.generate(0, on_text)
}

/// Continues several prompts, one after another, with one KV cache: sized for the longest
/// prompt plus `o.tokens` and allocated once, up front.
pub struct Sampler<'m> {
    model: &'m Llama,
    params: &'m [f32],
    tok: &'m Tokenizer,
    o: SampleOptions,
    /// Each prompt's tokens.
    prompts: Vec<Vec<u32>>,
    /// `None` without a cache: each token then recomputes the whole prefix (or the window
    /// of the last `o.context` tokens).
    cache: Option<KvCache<f32>>,
}

impl<'m> Sampler<'m> {
    /// Encodes the prompts and checks each against the model's context (with `o.context ==
    /// usize::MAX`); refused in one line naming the prompt when there are several.
    pub fn new(
        model: &'m Llama,
        params: &'m [f32],
        tok: &'m Tokenizer,
        o: &SampleOptions,
        prompts: &[&str],
    ) -> Result<Self> {
        let max_pos = model.config.max_pos;
        let mut ids = Vec::with_capacity(prompts.len());
        for (i, p) in prompts.iter().enumerate() {
            let mut t = tok.encode(p)?;
            if t.is_empty() {
                match tok.eos_id().or(tok.bos_id()) {
                    Some(id) => t.push(id),
                    None => bail!(
                        "prompt is empty and the tokenizer has no BOS/EOS token to start from"
                    ),
                }
            }
            if o.context == usize::MAX {
                check_context(t.len(), o.tokens, max_pos).map_err(|e| match prompts.len() {
                    1 => e,
                    n => anyhow::anyhow!("prompt {} of {n} ({:?}): {e}", i + 1, shortened(p)),
                })?;
            }
            ids.push(t);
        }
        let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
        // The last token generated is never fed back: the cache needs one position less.
        let positions = longest + o.tokens.saturating_sub(1);
        // A window that slides shifts every position: the cache only serves generations that
        // fit in it whole.
        let window = o.context.min(max_pos);
        let cached = o.kv_cache && o.tokens > 0 && positions <= window;
        let cache = cached.then(|| KvCache::new(model, 1, positions));
        Ok(Sampler {
            model,
            params,
            tok,
            o: o.clone(),
            prompts: ids,
            cache,
        })
    }

    /// Continues prompt `i`, giving each new piece of text to `on_text` as it decodes; returns
    /// the generated text. Every prompt starts from `o.seed`, as if sampled alone.
    pub fn generate(&mut self, i: usize, on_text: &mut dyn FnMut(&str)) -> Result<String> {
        let (model, tok, o) = (self.model, self.tok, &self.o);
        let mut ids = self.prompts[i].clone();
        let start = ids.len();
        let mut printed = String::new();
        let mut rng = SplitMix64::new(o.seed);
        let mut pool = HeapPool::new();
        let mut logits = vec![0.0f32; model.config.vocab];
        let context = o.context.min(model.config.max_pos).max(1);
        let k = &CpuKernels::PLAIN;
        if let Some(c) = self.cache.as_mut() {
            c.clear();
        }
        for _ in 0..o.tokens {
            match self.cache.as_mut() {
                // The tokens not yet in the cache: the prompt, then the last one chosen.
                Some(c) => {
                    let new = &ids[c.len()..];
                    model.forward_cached(k, &mut pool, self.params, c, new, &mut logits)
                }
                None => {
                    let window = &ids[ids.len().saturating_sub(context)..];
                    let batch = BatchShape {
                        b: 1,
                        t: window.len(),
                    };
                    let p = self.params;
                    model.forward_logits_last(k, &mut pool, p, batch, window, &mut logits);
                }
            }
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
}

/// A prompt as an error message quotes it: its first 40 characters.
fn shortened(p: &str) -> String {
    match p.char_indices().nth(40) {
        Some((at, _)) => format!("{}…", &p[..at]),
        None => p.to_string(),
    }
}

/// The prompts of a `--prompts` file: one per line, blank lines skipped. Refused in one line
/// naming the file when it cannot be read, is not UTF-8 text or holds no prompt.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("--prompts {shown}: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        anyhow::anyhow!(
            "--prompts {shown}: line {line} is not UTF-8 text; the file holds one prompt per line"
        )
    })?;
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if prompts.is_empty() {
        bail!("--prompts {shown}: no prompt in the file; write one prompt per line");
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    fn prompts_error(name: &str, bytes: &[u8]) -> String {
        let path =
            std::env::temp_dir().join(format!("ferrotron-prompts-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let e = super::read_prompts(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        e.replace(&path.display().to_string(), "FILE")
    }

    #[test]
    fn a_prompts_file_holds_one_prompt_per_line() {
        let path =
            std::env::temp_dir().join(format!("ferrotron-prompts-{}-ok", std::process::id()));
        std::fs::write(&path, "ROMEO:\n\n  \nJULIET: O \u{e9}t\u{e9}\r\nKING:").unwrap();
        let p = super::read_prompts(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(p, ["ROMEO:", "JULIET: O \u{e9}t\u{e9}", "KING:"]);
    }

    #[test]
    fn a_bad_prompts_file_is_refused_in_one_line_naming_it() {
        let e = super::read_prompts(Path::new("/nonexistent/prompts.txt")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--prompts /nonexistent/prompts.txt: No such file or directory (os error 2)"
        );
        assert_eq!(
            prompts_error("empty", b"\n \n"),
            "--prompts FILE: no prompt in the file; write one prompt per line"
        );
        assert_eq!(
            prompts_error("binary", b"ROMEO:\nJULIET\xff\n"),
            "--prompts FILE: line 2 is not UTF-8 text; the file holds one prompt per line"
        );
    }

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
