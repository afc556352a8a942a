//! fp8 layer products on the GPU (`--precision fp8`, issue #32 item 4): the CPU's fp8 path
//! (`kernels/cpu/staged_gemm.rs`) on cuBLASLt's fp8 tensor-core products.
//!
//! Each product quantises its two operands as the CPU does, piece by piece where the CPU
//! works in pieces (a ragged product's, `cpu::matmul::pieces`): the operand's amax, its
//! per-tensor scale (a power of two) and its e4m3 (weights, activations) or e5m2 (gradients)
//! codes, bit for bit the CPU's (`cu/fp8.cu`); a weight's once per call, not per piece. cuBLASLt multiplies the codes with f32
//! accumulation and multiplies back by both inverse scales (its A and B scale pointers), so
//! the product is the CPU's up to the order of the sums.
//!
//! Hopper's fp8 products read both operands with k contiguous (TN): the forward's are so as
//! stored; the input gradient reads the weight transposed, and the weight gradient both the
//! activations and the output gradient transposed, written so by `fp8_quantize_t` with the
//! token dimension padded to a multiple of 16 (`gemm::fp8_backward_weight`).
//!
//! The codes live in the backend's `Fp8` scratch, reserved for the model's largest product
//! (`reserve_fp8`) and so charged to the plan's overhead with cuBLASLt's workspace:
//! [`Layout`] says where.

use super::*;
use crate::kernels::cpu::matmul::{pieces, PIECE_ROWS};
use crate::numerics::fp8::Fp8Format;

/// The `Fp8` scratch: a 256-byte header (the two operands' amax as `u32` bit patterns at 0 and
/// 4, their inverse scales as `f32` at 8 and 12), then A's codes, then B's, each at a 256-byte
/// boundary.
struct Layout {
    base: u64,
    b_at: usize,
}

const HEADER: usize = 256;

impl Layout {
    fn bytes(a: usize, b: usize) -> usize {
        HEADER + a.next_multiple_of(256) + b.next_multiple_of(256)
    }
    fn amax(&self, operand: usize) -> u64 {
        self.base + 4 * operand as u64
    }
    fn scale_inv(&self, operand: usize) -> u64 {
        self.base + 8 + 4 * operand as u64
    }
    fn codes(&self, operand: usize) -> u64 {
        self.base + if operand == 0 { HEADER } else { self.b_at } as u64
    }
}

/// An operand to quantise: `rows × cols` row-major elements at device address `at`, in format
/// `fmt`, written as is or transposed into rows of `ld` (≥ `rows`, the rest zeros).
#[derive(Clone, Copy)]
struct Source {
    at: u64,
    rows: usize,
    cols: usize,
    fmt: Fp8Format,
    transposed_ld: Option<usize>,
}

impl Source {
    fn plain(at: u64, rows: usize, cols: usize, fmt: Fp8Format) -> Source {
        Source {
            at,
            rows,
            cols,
            fmt,
            transposed_ld: None,
        }
    }
    fn transposed(at: u64, rows: usize, cols: usize, fmt: Fp8Format, ld: usize) -> Source {
        Source {
            transposed_ld: Some(ld),
            ..Source::plain(at, rows, cols, fmt)
        }
    }
    fn code_bytes(&self) -> usize {
        self.cols * self.transposed_ld.unwrap_or(self.rows)
    }
}

/// Bytes of `Fp8` scratch the products of a `in_features × out_features` weight over at most
/// `rows` rows take at most (the forward and the input gradient: the weight and one
/// activation's codes; the weight gradient: both transposed, padded).
pub fn scratch_bytes(rows: usize, in_features: usize, out_features: usize) -> usize {
    let (i, o) = (in_features, out_features);
    let pad = padded(rows);
    let forward = Layout::bytes(o * i, rows * i.max(o));
    forward.max(Layout::bytes(pad * i, pad * o))
}

/// The device address of row `r` of a row-major matrix of `S`, `width` wide, at `base`.
fn row<S: Elem>(base: u64, r: usize, width: usize) -> u64 {
    base + (r * width) as u64 * S::DTYPE.bytes()
}

/// The token count a weight gradient's transposed operands are padded to.
fn padded(rows: usize) -> usize {
    rows.next_multiple_of(16)
}

impl CudaKernels {
    /// The layer products in fp8 (`Some`: `--precision fp8`, Hopper and later) or on the
    /// storage type.
    pub fn set_fp8(&mut self, fp8: Option<Fp8Inputs>) {
        self.fp8 = fp8;
    }

    /// Whether the GPU has fp8 tensor cores (Ada and Hopper on: sm_89 and later), which
    /// cuBLASLt's fp8 products need.
    pub fn fp8_capable(&self) -> bool {
        let arch = self.gpu.arch.trim_start_matches("sm_");
        arch.parse::<u32>().is_ok_and(|v| v >= 89)
    }

    /// Allocates now the fp8 scratch of products over at most `rows` rows of the weights
    /// `shapes` (`in_features`, `out_features`), so that no step allocates it. With `ragged`
    /// (a mixture of experts' expert products, whose rows follow the routing) also over a
    /// ragged product's largest piece, `PIECE_ROWS` rows.
    pub fn reserve_fp8(&self, rows: usize, ragged: bool, shapes: &[(usize, usize)]) {
        let rows = if ragged { rows.max(PIECE_ROWS) } else { rows };
        let bytes = shapes
            .iter()
            .map(|&(i, o)| scratch_bytes(rows, i, o))
            .max()
            .unwrap_or(0);
        if self.fp8.is_some() && bytes > 0 {
            self.scratch(Scratch::Fp8, bytes);
        }
    }

    /// `d (=|+=) p` on the codes of `a` and `b` (storage `S`), D of type `out`. With
    /// `a_ready`, A's codes and scale are the last call's (the same weight for the next piece
    /// of a ragged product: its amax, scale and codes would come out the same).
    #[allow(clippy::too_many_arguments)]
    fn fp8_product<S: Elem>(
        &self,
        op: &str,
        p: Product,
        [a, b]: [Source; 2],
        a_ready: bool,
        out: DType,
        d: u64,
        acc: bool,
    ) {
        let (ab, bb) = (a.code_bytes(), b.code_bytes());
        let base = self.scratch(Scratch::Fp8, Layout::bytes(ab, bb));
        let l = Layout {
            base,
            b_at: HEADER + ab.next_multiple_of(256),
        };
        let amax = l.amax(0);
        launch!(self, "fp8_amax_reset", one_thread(); amax);
        for (i, src) in [a, b].into_iter().enumerate().skip(a_ready as usize) {
            self.quantize::<S>(&l, i, src);
        }
        let ab = Inputs::Fp8 {
            a: a.fmt,
            b: b.fmt,
            scales: [l.scale_inv(0), l.scale_inv(1)],
        };
        self.product_of(op, p, ab, out, [l.codes(0), l.codes(1), d], acc, None);
    }

    /// Operand `i`'s amax (its slot zeroed by the caller), scale and codes into `l`.
    fn quantize<S: Elem>(&self, l: &Layout, i: usize, src: Source) {
        let (amax, sinv, out) = (l.amax(i), l.scale_inv(i), l.codes(i));
        let n = (src.rows * src.cols) as u64;
        // A fixed grid, as the gradient norm's: one atomic max per warp.
        let cfg = LaunchConfig {
            grid_dim: ((n.div_ceil(BLOCK as u64) as u32).clamp(1, SUM_BLOCKS), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, name::<S>("fp8_amax"), cfg; src.at, n, amax);
        let f = (src.fmt == Fp8Format::E5M2) as i32;
        match src.transposed_ld {
            None => {
                launch!(self, name::<S>("fp8_quantize"), elementwise(n); src.at, n, f, amax, out, sinv)
            }
            Some(ld) => {
                let (rows, cols, ld) = (src.rows as u64, src.cols as u64, ld as u64);
                let cfg = LaunchConfig {
                    grid_dim: (cols.div_ceil(32) as u32, ld.div_ceil(32) as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                launch!(self, name::<S>("fp8_quantize_t"), cfg; src.at, rows, cols, ld, f, amax, out, sinv);
            }
        }
    }

    /// `y (=|+=) x·Wᵀ` in fp8, piece by piece as the CPU: `[x, w, y]` device addresses.
    pub(super) fn fp8_forward<S: Elem>(
        &self,
        s: MatmulShape,
        f: Fp8Inputs,
        [x, w, y]: [u64; 3],
        acc: bool,
    ) {
        let (i, o) = (s.in_features, s.out_features);
        let a = Source::plain(w, o, i, f.forward);
        for (k, (at, m)) in pieces(s.n, s.ragged).enumerate() {
            let piece = MatmulShape { n: m, ..s };
            let b = Source::plain(row::<S>(x, at, i), m, i, f.forward);
            let (p, d) = (gemm::forward(piece), row::<S>(y, at, o));
            self.fp8_product::<S>("matmul_forward", p, [a, b], k > 0, S::DTYPE, d, acc);
        }
    }

    /// `dx (=|+=) dy·W` in fp8: `[dy, w, dx]`.
    pub(super) fn fp8_backward_input<S: Elem>(
        &self,
        s: MatmulShape,
        f: Fp8Inputs,
        [dy, w, dx]: [u64; 3],
        acc: bool,
    ) {
        let (i, o) = (s.in_features, s.out_features);
        let a = Source::transposed(w, o, i, f.forward, o);
        for (k, (at, m)) in pieces(s.n, s.ragged).enumerate() {
            let piece = MatmulShape { n: m, ..s };
            let b = Source::plain(row::<S>(dy, at, o), m, o, f.gradient);
            let (p, d) = (gemm::fp8_backward_input(piece), row::<S>(dx, at, i));
            self.fp8_product::<S>("matmul_backward_input", p, [a, b], k > 0, S::DTYPE, d, acc);
        }
    }

    /// `dW += dyᵀ·x` in fp8, the pieces' contributions added in turn: `[dy, x, dw]`.
    pub(super) fn fp8_backward_weight<S: Elem, G: Elem>(
        &self,
        s: MatmulShape,
        f: Fp8Inputs,
        [dy, x, dw]: [u64; 3],
    ) {
        let (i, o) = (s.in_features, s.out_features);
        for (at, m) in pieces(s.n, s.ragged) {
            let (piece, k) = (MatmulShape { n: m, ..s }, padded(m));
            let a = Source::transposed(row::<S>(x, at, i), m, i, f.forward, k);
            let b = Source::transposed(row::<S>(dy, at, o), m, o, f.gradient, k);
            let p = gemm::fp8_backward_weight(piece, k);
            self.fp8_product::<S>(
                "matmul_backward_weight",
                p,
                [a, b],
                false,
                G::DTYPE,
                dw,
                true,
            );
        }
    }
}
