//! `ferrotron eval`: the mean next-token cross-entropy of a model folder (a ferrotron
//! checkpoint or a Hugging Face model) over token sequences given as JSON, in f32 — the number
//! `AutoModelForCausalLM(...)(ids, labels=ids).loss` gives over the same tokens.

use crate::checkpoint::hf::load_model;
use anyhow::{bail, Result};
use ferrotron_engine::kernels::CpuKernels;
use ferrotron_engine::model::{BatchShape, HeapPool, Llama, LossSum};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalResult {
    /// Mean cross-entropy (nats) over every predicted token.
    pub loss: f64,
    /// Predicted tokens: Σ (length − 1) over the sequences.
    pub tokens: u64,
}

/// Token sequences from a JSON file holding a list of lists of token ids.
pub fn read_sequences(path: &Path) -> Result<Vec<Vec<u32>>> {
    let name = path.display();
    let text =
        std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("tokens = {name}: {e}"))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("tokens = {name}: not valid JSON ({e})"))?;
    let Some(list) = v.as_array() else {
        bail!("tokens = {name}: expected a JSON list of token-id lists, like [[1, 2, 3], [4, 5]]");
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        let Some(ids) = s.as_array() else {
            bail!("tokens = {name}: sequence {i} is not a list of token ids");
        };
        let mut seq = Vec::with_capacity(ids.len());
        for (j, id) in ids.iter().enumerate() {
            match id.as_u64().and_then(|x| u32::try_from(x).ok()) {
                Some(x) => seq.push(x),
                None => bail!(
                    "tokens = {name}: sequence {i}, position {j}: {id} is not a token id (a non-negative integer)"
                ),
            }
        }
        out.push(seq);
    }
    Ok(out)
}

/// Mean next-token loss of `model` with f32 `params` over `seqs`, one sequence at a time.
pub fn evaluate(model: &Llama, params: &[f32], seqs: &[Vec<u32>]) -> Result<EvalResult> {
    let c = &model.config;
    for (i, s) in seqs.iter().enumerate() {
        if let Some((j, &id)) = s.iter().enumerate().find(|(_, &id)| id as usize >= c.vocab) {
            bail!(
                "tokens: sequence {i}, position {j}: token {id} is outside the model's vocabulary of {}",
                c.vocab
            );
        }
        if s.len() > c.max_pos + 1 {
            bail!(
                "tokens: sequence {i} has {} tokens; the model reads at most max_position_embeddings = {} (+1 predicted): split it",
                s.len(),
                c.max_pos
            );
        }
    }
    let mut pool = HeapPool::new();
    let mut loss = LossSum::default();
    for s in seqs.iter().filter(|s| s.len() >= 2) {
        let t = s.len() - 1;
        let l = model.forward_eval(
            &CpuKernels::PLAIN,
            &mut pool,
            params,
            BatchShape { b: 1, t },
            &s[..t],
            &s[1..],
        );
        loss.sum += l.sum;
        loss.count += l.count;
    }
    if loss.count == 0 {
        bail!("tokens: no sequence has 2 or more tokens, so there is nothing to predict");
    }
    Ok(EvalResult {
        loss: loss.mean(),
        tokens: loss.count as u64,
    })
}

/// `ferrotron eval --checkpoint DIR --tokens FILE`.
pub fn eval_dir(dir: &Path, tokens: &Path) -> Result<EvalResult> {
    ferrotron_engine::kernels::cpu::gemm_select::check_env().map_err(anyhow::Error::msg)?;
    let seqs = read_sequences(tokens)?;
    let m = load_model(dir)?;
    evaluate(&m.model, &m.params, &seqs)
}
