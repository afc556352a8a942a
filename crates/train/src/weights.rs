//! A flat model buffer (parameters or gradients) in its storage type, so the trainer holds one
//! value whatever the precision and dispatches once per step to code generic over the type.

use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use half::{bf16, f16};

/// One flat buffer: f32, bf16 or f16.
#[derive(Debug, Clone, PartialEq)]
pub enum Flat {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Flat {
    /// `n` zeros of `dtype` (f32, bf16 or f16).
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::Bf16 => Flat::Bf16(vec![bf16::ZERO; n]),
            DType::F16 => Flat::F16(vec![f16::ZERO; n]),
            _ => Flat::F32(vec![0.0; n]),
        }
    }

    /// `src` rounded to nearest into `dtype`.
    pub fn from_f32(dtype: DType, src: &[f32]) -> Self {
        fn round<T: Elem>(src: &[f32]) -> Vec<T> {
            src.iter().map(|&x| T::from_f32(x)).collect()
        }
        match dtype {
            DType::Bf16 => Flat::Bf16(round(src)),
            DType::F16 => Flat::F16(round(src)),
            _ => Flat::F32(src.to_vec()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Flat::F32(v) => v.len(),
            Flat::Bf16(v) => v.len(),
            Flat::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match self {
            Flat::F32(_) => DType::F32,
            Flat::Bf16(_) => DType::Bf16,
            Flat::F16(_) => DType::F16,
        }
    }

    /// Elements `range` widened to f32.
    pub fn to_f32(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        fn widen<T: Elem>(v: &[T]) -> Vec<f32> {
            v.iter().map(|x| x.to_f32()).collect()
        }
        match self {
            Flat::F32(v) => v[range].to_vec(),
            Flat::Bf16(v) => widen(&v[range]),
            Flat::F16(v) => widen(&v[range]),
        }
    }

    /// All elements as f32, without a copy when they already are.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Flat::F32(v) => v,
            other => other.to_f32(0..other.len()),
        }
    }

    /// Elements `range` as little-endian bytes (the safetensors layout).
    pub fn le_bytes(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        match self {
            Flat::F32(v) => v[range].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Flat::Bf16(v) => v[range].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Flat::F16(v) => v[range].iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Overwrites elements from `offset` with little-endian `bytes` of this buffer's type.
    pub fn read_le_bytes(&mut self, offset: usize, bytes: &[u8]) {
        match self {
            Flat::F32(v) => {
                for (o, c) in v[offset..].iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Flat::Bf16(v) => {
                for (o, c) in v[offset..].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]);
                }
            }
            Flat::F16(v) => {
                for (o, c) in v[offset..].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]);
                }
            }
        }
    }

    /// Sets every element to zero without reallocating.
    pub fn fill_zero(&mut self) {
        match self {
            Flat::F32(v) => v.fill(0.0),
            Flat::Bf16(v) => v.fill(bf16::ZERO),
            Flat::F16(v) => v.fill(f16::ZERO),
        }
    }
}

/// Little-endian f32, bf16 or f16 `bytes` (a safetensors tensor) widened into `out`.
pub fn widen_le_bytes(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Runs `$body` with `$p` and `$g` bound to the typed vectors of a parameter and a gradient
/// [`Flat`], for every (storage, gradient) pair the precisions use.
#[macro_export]
macro_rules! with_flat_types {
    ($params:expr, $grads:expr, |$p:ident, $g:ident| $body:expr) => {
        match ($params, $grads) {
            ($crate::weights::Flat::F32($p), $crate::weights::Flat::F32($g)) => $body,
            ($crate::weights::Flat::Bf16($p), $crate::weights::Flat::Bf16($g)) => $body,
            ($crate::weights::Flat::Bf16($p), $crate::weights::Flat::F32($g)) => $body,
            ($crate::weights::Flat::F16($p), $crate::weights::Flat::F16($g)) => $body,
            (p, g) => unreachable!(
                "no precision stores weights as {:?} with {:?} gradients",
                p.dtype(),
                g.dtype()
            ),
        }
    };
}
