//! The `megatron-lm` convention: Megatron-LM's own memory report
//! (`megatron/training/theoretical_memory_usage.py`, `report_theoretical_memory`, NVIDIA/
//! Megatron-LM at commit 00caa53af30912914981c86f39db123961678bbd), on the vocabulary Megatron
//! pads (`_vocab_size_with_padding`, `megatron/training/tokenizer/tokenizer.py`).
//!
//! - States: 18 bytes per parameter, 6 + 12/d with the distributed optimizer (ZeRO-1 here):
//!   bf16 weights, fp32 `main_grad`, fp32 master weights and Adam moments (as `megatron`).
//! - The vocabulary is padded up to a multiple of `make_vocab_size_divisible_by` (128) × tp,
//!   so the embedding and the output layer hold the padded rows.
//! - Activations per micro-batch, s sequence, b micro-batch, h hidden, f FFN width, t tp:
//!   with sequence parallelism and selective recomputation `compute_activation_memory`: per
//!   layer s·b·h·(18 + 4f/h), the embedding's input ids 8·s·b and dropout s·b·h, the last
//!   stage's output layer and loss 4·s·b·h·(1 + V/h), all divided by t; otherwise
//!   `compute_activation_memory_without_sp`: per layer s·b·h·(10 + 24/t), the same embedding
//!   terms, the logits and final norm output (s·b·V/t + s·b·h)·2, all times 1.05 ("buffer for
//!   optimizer and miscellaneous temporaries (5% overhead)"). The report applies the second
//!   formula to every other case, full recomputation included, and so does this convention.
//!   The planner's schedule supplies the micro-batches in flight (the report's pp and
//!   interleaving factors), and puts the output layer on the last stage whatever pp is (the
//!   report adds it only when pp = 1).

/// `make_vocab_size_divisible_by`'s default.
const VOCAB_MULTIPLE: u64 = 128;

/// The report's overhead on activations without sequence parallelism, as a fraction (× 1.05).
const TEMPORARIES_PERCENT: u64 = 5;

/// The vocabulary Megatron-LM allocates: `vocab` rounded up to a multiple of 128 × tp.
pub fn padded_vocab(vocab: u64, tp: u64) -> u64 {
    vocab.next_multiple_of(VOCAB_MULTIPLE * tp.max(1))
}

/// Which of the report's two formulas applies.
pub fn with_sp(sp: bool, recompute: crate::recipe::Recompute) -> bool {
    sp && recompute == crate::recipe::Recompute::Selective
}

/// Bytes of one layer's activations for `sbh` = s·b·h, FFN width `f`, hidden `h`, tp `t`.
pub fn layer_bytes(sbh: u64, f: u64, h: u64, t: u64, sp: bool) -> u64 {
    if sp {
        // s·b·h·(18 + 4f/h) / t
        (18 * sbh + 4 * sbh / h * f) / t
    } else {
        with_temporaries(10 * sbh + 24 * sbh / t)
    }
}

/// Bytes of the embedding's activations (input ids and dropout mask), for `sb` tokens.
pub fn embedding_bytes(sb: u64, h: u64, t: u64, sp: bool) -> u64 {
    let b = 8 * sb + sb * h;
    if sp {
        b / t
    } else {
        with_temporaries(b)
    }
}

/// Bytes of the output layer's and the loss's activations on the padded vocabulary `v`.
pub fn head_bytes(sb: u64, h: u64, v: u64, t: u64, sp: bool) -> u64 {
    if sp {
        4 * sb * (h + v) / t
    } else {
        with_temporaries((sb * v / t + sb * h) * 2)
    }
}

fn with_temporaries(bytes: u64) -> u64 {
    bytes + bytes * TEMPORARIES_PERCENT / 100
}
