//! A flat model buffer (parameters or gradients) in its storage type, so the trainer holds one
//! value whatever the precision and dispatches once per step to code generic over the type.
//!
//! Its elements are a [`Region`]: in a training rank, the plan's place for the state in the
//! rank's resident region (`memory::resident`, [`Flat::carve`]); elsewhere (a checkpoint read
//! whole, a device's weights copied back for a sample, tests and tools) a region over a `Vec`.

use crate::memory::resident::Resident;
use ferrotron_dist::Region;
use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use half::{bf16, f16};

/// One flat buffer: f32, bf16 or f16.
#[derive(Debug)]
pub enum Flat {
    F32(Region<f32>),
    Bf16(Region<bf16>),
    F16(Region<f16>),
}

impl Clone for Flat {
    /// A copy on the heap (a region is its span's only owner).
    fn clone(&self) -> Self {
        match self {
            Flat::F32(v) => Flat::F32(v.to_vec().into()),
            Flat::Bf16(v) => Flat::Bf16(v.to_vec().into()),
            Flat::F16(v) => Flat::F16(v.to_vec().into()),
        }
    }
}

impl PartialEq for Flat {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Flat::F32(a), Flat::F32(b)) => a[..] == b[..],
            (Flat::Bf16(a), Flat::Bf16(b)) => a[..] == b[..],
            (Flat::F16(a), Flat::F16(b)) => a[..] == b[..],
            _ => false,
        }
    }
}

impl Flat {
    /// `n` zeros of `dtype` (f32, bf16 or f16), on the heap.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::Bf16 => Flat::Bf16(vec![bf16::ZERO; n].into()),
            DType::F16 => Flat::F16(vec![f16::ZERO; n].into()),
            _ => Flat::F32(vec![0.0; n].into()),
        }
    }

    /// The planned buffers `names` of `resident` (a state and its windows, laid out back to
    /// back) as one zeroed buffer of `dtype`; `None` when the plan has none of them there.
    pub fn carve(resident: &mut Resident, dtype: DType, names: &[&str]) -> Option<Self> {
        Some(match dtype {
            DType::Bf16 => Flat::Bf16(resident.carve_span(names)?),
            DType::F16 => Flat::F16(resident.carve_span(names)?),
            _ => Flat::F32(resident.carve_span(names)?),
        })
    }

    /// `src` rounded to nearest into `dtype`, on the heap.
    pub fn from_f32(dtype: DType, src: &[f32]) -> Self {
        let mut out = Flat::zeros(dtype, src.len());
        out.set_from_f32(src);
        out
    }

    /// Overwrites every element with `src` rounded to nearest (same length), in place.
    pub fn set_from_f32(&mut self, src: &[f32]) {
        fn round<T: Elem>(out: &mut [T], src: &[f32]) {
            assert_eq!(out.len(), src.len(), "internal: a state of another length");
            for (o, &x) in out.iter_mut().zip(src) {
                *o = T::from_f32(x);
            }
        }
        match self {
            Flat::F32(v) => round(v, src),
            Flat::Bf16(v) => round(v, src),
            Flat::F16(v) => round(v, src),
        }
    }

    /// Overwrites every element with `src`'s (same type and length), in place: a state loaded
    /// or gathered elsewhere written into its planned place.
    pub fn copy_from(&mut self, src: &Flat) {
        match (self, src) {
            (Flat::F32(o), Flat::F32(s)) => o.copy_from_slice(s),
            (Flat::Bf16(o), Flat::Bf16(s)) => o.copy_from_slice(s),
            (Flat::F16(o), Flat::F16(s)) => o.copy_from_slice(s),
            (o, s) => unreachable!(
                "internal: a {:?} state written from {:?}",
                o.dtype(),
                s.dtype()
            ),
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

    /// All elements as f32, without a copy when they already are, on the heap.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Flat::F32(v) => v.into_vec().unwrap_or_else(|v| v.to_vec()),
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
