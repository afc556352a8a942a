//! The memory traffic fp8 training adds around each linear layer: the GEMM takes fp8 operands,
//! so every operand is first cast from its 16-bit storage, and the weight-gradient GEMM needs
//! the transposed operands too.
//!
//! Transformer Engine's `Linear` (NVIDIA/TransformerEngine, `pytorch/module/linear.py`, 1.x, as
//! llm-foundry's `fc_type: te` runs it) calls one fused cast + transpose kernel per operand: in
//! the forward `fp8_cast_transpose_fused` on the input and on the weight (recast every
//! micro-batch unless the caller passes `is_first_microbatch`, which llm-foundry does not); in
//! the backward `fp8_cast_transpose_bgrad_fused` on the output gradient ("cast, transpose,
//! bgrad fused": the bias gradient comes from the same pass). Each reads the 16-bit tensor and
//! writes it in fp8 twice (as is and transposed): st + 2 bytes per element.

/// Bytes one fused cast + transpose moves per element of an `st`-byte tensor.
fn cast_transpose(st: f64) -> f64 {
    st + 2.0
}

/// Bytes the fp8 casts of `batch` linear layers [rows, k] × [k, n] move: (forward: input and
/// weight, backward: output gradient, its bias gradient included).
pub(super) fn cast_bytes(rows: u64, k: u64, n: u64, batch: u64, st: f64) -> (f64, f64) {
    let b = cast_transpose(st);
    (
        b * ((rows * k + k * n) * batch) as f64,
        b * (rows * n * batch) as f64,
    )
}
