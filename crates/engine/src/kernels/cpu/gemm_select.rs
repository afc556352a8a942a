//! Which GEMM kernel multiplies a layer's operands: oneDNN's matmul primitive ([`onednn`]) where
//! the library is installed and the CPU has the instructions that make it faster, else the
//! `gemm` crate ("portable": AVX2/AVX-512 sgemm on any CPU, [`matmul::sgemm`]).
//!
//! Measured on a 2-core Xeon with AMX (docs/BENCHMARKS.md): oneDNN runs the default model's f32
//! products about 1.7× as fast as the gemm crate (AVX-512 brgemm), and bf16 ones over 10× (AMX
//! tiles), where the portable path widens bf16 to f32 first (`staged_gemm`).
//!
//! The choice, made once per process (`FERROTRON_GEMM`):
//! - `auto` or unset: f32 products on oneDNN when the CPU has AVX-512, bf16 ones when it has
//!   AVX512-BF16 or AMX; everything else, and every product when the library is missing, on
//!   the gemm crate;
//! - `portable`: the gemm crate only;
//! - `onednn`: oneDNN for every product it has a fast implementation of, whatever the CPU.
//!
//! The choice is fixed for the process, so a run is deterministic as before; but its results
//! now depend on the machine: the gemm crate sums in the same order on every CPU (see
//! [`matmul::MAX_DEPTH`]), oneDNN does not. Attention's small per-task tile products always
//! stay on the gemm crate (they run inside rayon tasks, single-threaded).

use super::matmul;
use super::onednn::{self, Dt, Onednn, Product, ISA_AVX512_CORE, ISA_AVX512_CORE_BF16};
use crate::dtype::Elem;
use std::ffi::c_void;
use std::sync::OnceLock;

/// Which GEMM a [`super::CpuKernels`] uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Gemm {
    /// The process's choice (`FERROTRON_GEMM`, the CPU, the library): see the module docs.
    #[default]
    Auto,
    /// The gemm crate only.
    Portable,
    /// oneDNN for every product it supports, where the library loads.
    Onednn,
}

/// The oneDNN library for each input type, when it runs those products.
#[derive(Clone, Copy, Default)]
struct Choice {
    f32: Option<&'static Onednn>,
    bf16: Option<&'static Onednn>,
}

/// `FERROTRON_GEMM`, read once (unset or empty: `auto`).
fn requested() -> Gemm {
    static REQUESTED: OnceLock<Gemm> = OnceLock::new();
    *REQUESTED.get_or_init(|| {
        let v = std::env::var("FERROTRON_GEMM").unwrap_or_default();
        parse_requested(&v).unwrap_or(Gemm::Auto)
    })
}

/// A `FERROTRON_GEMM` value, or the one line that says what is wrong with it.
pub fn parse_requested(v: &str) -> Result<Gemm, String> {
    match v {
        "portable" => Ok(Gemm::Portable),
        "onednn" => Ok(Gemm::Onednn),
        "auto" | "" => Ok(Gemm::Auto),
        other => Err(format!(
            "FERROTRON_GEMM = {other:?}: expected one of portable, onednn, auto (or leave it unset)"
        )),
    }
}

/// Refuses a `FERROTRON_GEMM` the process cannot honour, before anything runs: a typo would
/// otherwise silently measure the wrong kernels.
pub fn check_env() -> Result<(), String> {
    match std::env::var("FERROTRON_GEMM") {
        Ok(v) => parse_requested(&v).map(|_| ()),
        Err(_) => Ok(()),
    }
}

impl Gemm {
    /// What this setting resolves to on this machine.
    fn choice(self) -> Choice {
        match self {
            Gemm::Auto => match requested() {
                Gemm::Auto => {
                    let lib = onednn::library().ok();
                    let with = |isa: u32| lib.filter(|l| l.has(isa));
                    Choice {
                        f32: with(ISA_AVX512_CORE),
                        bf16: with(ISA_AVX512_CORE_BF16),
                    }
                }
                forced => forced.choice(),
            },
            Gemm::Portable => Choice::default(),
            Gemm::Onednn => match onednn::library() {
                Ok(lib) => Choice {
                    f32: Some(lib),
                    bf16: Some(lib),
                },
                Err(why) => {
                    static NOTED: OnceLock<()> = OnceLock::new();
                    NOTED.get_or_init(|| {
                        eprintln!("note: oneDNN requested but {why}: using the gemm crate")
                    });
                    Choice::default()
                }
            },
        }
    }

    /// One line for the trainer's log and metrics: `onednn 2.6.3 (avx512_core_amx): f32 bf16`
    /// or `portable (gemm crate; libdnnl.so.2 not found ...)`.
    pub fn describe(self) -> String {
        let c = self.choice();
        let types: Vec<&str> = [("f32", c.f32), ("bf16", c.bf16)]
            .into_iter()
            .filter_map(|(t, l)| l.map(|_| t))
            .collect();
        match c.f32.or(c.bf16) {
            Some(lib) => {
                let rest = if c.f32.is_none() {
                    "; f32 on the gemm crate"
                } else if c.bf16.is_none() {
                    "; bf16 staged to f32"
                } else {
                    ""
                };
                format!(
                    "onednn {} ({}): {}{rest}",
                    lib.version,
                    onednn::isa_name(lib.isa),
                    types.join("+")
                )
            }
            None => {
                // Portable by request: the library is not even opened.
                let requested_portable =
                    self == Gemm::Portable || (self == Gemm::Auto && requested() == Gemm::Portable);
                let why = if requested_portable {
                    "requested".to_string()
                } else {
                    match onednn::library() {
                        Err(why) => why.to_string(),
                        Ok(lib) => format!(
                            "oneDNN {} has no faster path on this CPU ({})",
                            lib.version,
                            onednn::isa_name(lib.isa)
                        ),
                    }
                };
                format!("portable (gemm crate; {why})")
            }
        }
    }

    /// Whether bf16 × bf16 products run on oneDNN (without staging through f32).
    pub fn runs_bf16_natively(self) -> bool {
        self.choice().bf16.is_some()
    }

    /// The library that runs products with inputs of type `dt`, if any.
    fn library_for(self, dt: Dt) -> Option<&'static Onednn> {
        let c = self.choice();
        match dt {
            Dt::F32 => c.f32,
            Dt::Bf16 => c.bf16,
        }
    }
}

/// The oneDNN element type of `T`'s storage, if it has one.
fn dt_of<T: Elem>(x: &[T]) -> Option<Dt> {
    if T::as_f32(x).is_some() {
        Some(Dt::F32)
    } else if T::as_bf16(x).is_some() {
        Some(Dt::Bf16)
    } else {
        None
    }
}

/// Offset of the last element of a `rows × cols` operand with strides `s` (rows, cols ≥ 1).
fn last(rows: usize, cols: usize, s: (usize, usize)) -> usize {
    (rows - 1) * s.0 + (cols - 1) * s.1
}

/// `dst[m,n] (=|+=) lhs[m,k]·rhs[k,n] (+ bias[n])` on oneDNN, when `gemm` selects it for these
/// element types (both inputs f32, or both bf16; dst f32 or bf16); `dst` has row stride `ldd`.
/// Returns `false`, having written nothing, when the caller must compute the product itself.
#[allow(clippy::too_many_arguments)]
pub fn product<D: Elem, L: Elem, R: Elem>(
    gemm: Gemm,
    (m, n, k): (usize, usize, usize),
    dst: &mut [D],
    ldd: usize,
    (lhs, lhs_strides): (&[L], (usize, usize)),
    (rhs, rhs_strides): (&[R], (usize, usize)),
    accumulate: bool,
    bias: Option<&[R]>,
) -> bool {
    let (Some(inputs), Some(output)) = (dt_of(lhs), dt_of(dst)) else {
        return false;
    };
    if dt_of(rhs) != Some(inputs) || m == 0 || n == 0 || k == 0 {
        return false;
    }
    let Some(lib) = gemm.library_for(inputs) else {
        return false;
    };
    // The same bounds as the portable path: they make the raw pointers below memory safe.
    assert!(last(m, n, (ldd, 1)) < dst.len(), "gemm: dst too small");
    assert!(last(m, k, lhs_strides) < lhs.len(), "gemm: lhs too small");
    assert!(last(k, n, rhs_strides) < rhs.len(), "gemm: rhs too small");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "matmul bias len");
    }
    let p = Product {
        m,
        n,
        k,
        lhs: lhs_strides,
        rhs: rhs_strides,
        dst: (ldd, 1),
        inputs,
        output,
        bias: bias.is_some(),
        accumulate,
    };
    let bias = bias.map_or(std::ptr::null(), |b| b.as_ptr().cast::<c_void>());
    // SAFETY: bounds asserted above; the types match `p` (from `dt_of`); dst is borrowed
    // mutably, so nothing else touches it; the bias is non-null exactly when `p.bias`.
    unsafe {
        lib.execute(
            &p,
            dst.as_mut_ptr().cast(),
            lhs.as_ptr().cast(),
            rhs.as_ptr().cast(),
            bias,
        )
    }
}

/// [`sgemm_raw`] into a slice: bounds checked.
pub fn sgemm(
    gemm: Gemm,
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_strides: (usize, usize),
    lhs: (&[f32], (usize, usize)),
    rhs: (&[f32], (usize, usize)),
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(last(m, n, dst_strides) < dst.len(), "sgemm: dst too small");
    // SAFETY: dst bounds checked above (lhs/rhs inside); the borrow is exclusive.
    unsafe {
        sgemm_raw(
            gemm,
            (m, n, k),
            dst.as_mut_ptr(),
            dst_strides,
            lhs,
            rhs,
            accumulate,
        )
    }
}

/// [`matmul::sgemm_raw`] (multi-threaded) on oneDNN when `gemm` selects it for f32, else on
/// the gemm crate.
///
/// # Safety
/// As [`matmul::sgemm_raw`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_raw(
    gemm: Gemm,
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_strides: (usize, usize),
    (lhs, lhs_strides): (&[f32], (usize, usize)),
    (rhs, rhs_strides): (&[f32], (usize, usize)),
    accumulate: bool,
) {
    if m > 0 && n > 0 && k > 0 {
        if let Some(lib) = gemm.library_for(Dt::F32) {
            assert!(last(m, k, lhs_strides) < lhs.len(), "sgemm: lhs too small");
            assert!(last(k, n, rhs_strides) < rhs.len(), "sgemm: rhs too small");
            let p = Product {
                m,
                n,
                k,
                lhs: lhs_strides,
                rhs: rhs_strides,
                dst: dst_strides,
                inputs: Dt::F32,
                output: Dt::F32,
                bias: false,
                accumulate,
            };
            // SAFETY: lhs/rhs bounds asserted above; dst is the caller's contract.
            let done = unsafe {
                lib.execute(
                    &p,
                    dst.cast(),
                    lhs.as_ptr().cast(),
                    rhs.as_ptr().cast(),
                    std::ptr::null(),
                )
            };
            if done {
                return;
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe {
        matmul::sgemm_raw(
            m,
            n,
            k,
            dst,
            dst_strides,
            lhs,
            lhs_strides,
            rhs,
            rhs_strides,
            accumulate,
            true,
        )
    }
}
