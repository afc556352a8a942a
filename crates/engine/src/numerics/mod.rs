//! Low-precision number formats, simulated on the CPU: OCP FP8 (E4M3 / E5M2) with per-tensor
//! scaling ([`fp8`]) and stochastic rounding of f32 to bf16 / f16 ([`rounding`]).

pub mod fp8;
pub mod rounding;

pub use fp8::Fp8Format;
