//! Storage element types. Every kernel computes in f32; tensors are *stored* as f32, bf16 or
//! f16 (mixed precision, Micikevicius et al. 2018): a kernel widens what it reads to f32 and
//! rounds what it writes (round to nearest even), so the only difference between precisions is
//! where values are rounded, never the arithmetic in between.
//!
//! Code is generic over [`Elem`]; for `f32` the widening and rounding are the identity and the
//! generic code compiles to what a hand-written f32 kernel would be.

use ferrotron_plan::DType;
use half::{bf16, f16};
use std::fmt::Debug;
use std::mem::MaybeUninit;

/// A storage element type.
pub trait Elem: Copy + Default + Send + Sync + Debug + PartialEq + 'static {
    /// The planner's name for this type (its size is what the memory plan counts).
    const DTYPE: DType;
    /// Exact widening.
    fn to_f32(self) -> f32;
    /// Round to nearest, ties to even (identity for f32).
    fn from_f32(x: f32) -> Self;
    /// Stochastic rounding with 32 random bits (Gupta et al. 2015): rounds up with probability
    /// equal to the distance from the lower neighbour, so the expectation is `x` (identity for
    /// f32).
    fn from_f32_stochastic(x: f32, noise: u32) -> Self;
    /// The slice itself when `Self` is f32 (no conversion needed), else `None`.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    /// The slice itself when `Self` is bf16 (oneDNN multiplies bf16 operands as they are
    /// stored), else `None`.
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }
    fn as_bf16_mut(_: &mut [Self]) -> Option<&mut [bf16]> {
        None
    }
    /// `dst = widen(src)`.
    fn load(src: &[Self], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "load lens");
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
    /// `dst = widen(src)` into uninitialised memory, returned initialised (staging buffers are
    /// not zeroed first).
    fn load_uninit<'a>(src: &[Self], dst: &'a mut [MaybeUninit<f32>]) -> &'a mut [f32] {
        assert_eq!(src.len(), dst.len(), "load lens");
        dst.iter_mut().zip(src).for_each(|(d, s)| {
            d.write(s.to_f32());
        });
        // SAFETY: every element was written just above; MaybeUninit<f32> has f32's layout.
        unsafe { &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32]) }
    }
    /// `dst = round(src)`.
    fn store(src: &[f32], dst: &mut [Self]) {
        assert_eq!(src.len(), dst.len(), "store lens");
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = Self::from_f32(*s));
    }
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn from_f32_stochastic(x: f32, _noise: u32) -> Self {
        x
    }
    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

/// f32 → bf16, round to nearest even, without branches on the common path so the store loops
/// vectorise (bit-identical to `half::bf16::from_f32`, which branches). NaN stays a quiet NaN.
#[inline(always)]
pub fn bf16_rne(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x0040;
    let is_nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    bf16::from_bits(if is_nan { nan } else { rounded } as u16)
}

impl Elem for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16_rne(x)
    }
    #[inline(always)]
    fn from_f32_stochastic(x: f32, noise: u32) -> Self {
        crate::numerics::rounding::bf16_stochastic(x, noise)
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    fn as_bf16(s: &[Self]) -> Option<&[bf16]> {
        Some(s)
    }
    fn as_bf16_mut(s: &mut [Self]) -> Option<&mut [bf16]> {
        Some(s)
    }
}

impl Elem for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn from_f32_stochastic(x: f32, noise: u32) -> Self {
        crate::numerics::rounding::f16_stochastic(x, noise)
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    // half's slice conversions use F16C when the CPU has it.
    fn load(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
    fn load_uninit<'a>(src: &[Self], dst: &'a mut [MaybeUninit<f32>]) -> &'a mut [f32] {
        use half::slice::HalfFloatSliceExt;
        assert_eq!(src.len(), dst.len(), "load lens");
        // Through a stack block, so the conversion keeps F16C.
        let mut block = [0.0f32; 256];
        for (d, s) in dst.chunks_mut(256).zip(src.chunks(256)) {
            let b = &mut block[..s.len()];
            s.convert_to_f32_slice(b);
            d.iter_mut().zip(b.iter()).for_each(|(d, x)| {
                d.write(*x);
            });
        }
        // SAFETY: every element was written above; MaybeUninit<f32> has f32's layout.
        unsafe { &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32]) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rne_matches_half_on_edge_cases() {
        let cases = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0, // exactly halfway between two bf16 values: ties to even
            1.0 + 3.0 / 256.0, // halfway, odd lower neighbour: rounds up
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.0e38,
            -123.456,
        ];
        for x in cases {
            assert_eq!(bf16_rne(x).to_bits(), bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(bf16_rne(f32::NAN).is_nan());
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(s);
            if !x.is_nan() {
                assert_eq!(bf16_rne(x).to_bits(), bf16::from_f32(x).to_bits(), "{x}");
            }
        }
    }
}
