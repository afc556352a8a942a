//! Products over 16-bit or fp8-quantised operands on an f32 GEMM (the `gemm` crate, or
//! oneDNN's f32 matmul: `gemm_select`). bf16 operands go to oneDNN's bf16 matmul as they are,
//! without staging, where `gemm_select` chooses it.
//!
//! The CPU has no bf16 matrix unit worth using (PyTorch's bf16 matmul on this machine runs at
//! about 1 GFLOP/s against ~150 for f32), so 16-bit operands are *staged*: widened block by
//! block into f32 scratch and multiplied with sgemm, accumulating in f32; a 16-bit destination
//! is read into an f32 tile once, accumulated over the whole reduction, and rounded once. Only
//! the memory traffic is 16-bit; every product is computed exactly as in fp32.
//!
//! Blocking: the operands that need staging (the right one is usually the weight, the left
//! one the activations or output gradients, the destination a 16-bit tensor) share one
//! workspace of [`STAGING`] floats. [`tiling`] cuts the product into as few column panels ×
//! row tiles as fit it: each gemm call re-packs its operands and forks its threads, which on
//! the default model's shapes cost more than the widening itself, so most products of a small
//! model are one call. Each weight element is widened once per call and each activation
//! element once per panel. The scratch is allocated per call, like the gemm crate's packing
//! buffers, always [`STAGING`] floats, and is part of the workspace the trainer measures into
//! the memory plan.
//!
//! fp8 (Micikevicius et al. 2022): an operand may also be quantise-dequantised to e4m3 or e5m2
//! with a per-tensor scale from its current amax (`numerics::fp8`), which is what an fp8 GEMM
//! with f32 accumulation computes; the speed comes with a GPU backend.

use super::gemm_select::{self, Gemm};
use super::matmul::sgemm;
use super::scratch::KernelScratch;
use crate::dtype::Elem;
use crate::numerics::fp8::{self, Fp8Format};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// The staging workspace, in floats (10 MiB): every staged product allocates exactly this much
/// (and touches what it needs), so the workspace live at any instant of a step is one
/// constant, as a cuBLAS workspace is, and the memory plan's workspace term is exact whichever
/// product runs at the peak.
pub const STAGING: usize = 5 << 19;

/// Longest reduction staged at once; a deeper one (the weight gradient over many tokens) is
/// cut into equal depth chunks. With it a 64 × 64 tiling always fits [`STAGING`].
pub const MAX_DEPTH: usize = 8192;

/// How a staged product is cut: column panels of `cols` columns, each in row tiles of `rows`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    pub rows: usize,
    pub cols: usize,
}

impl Tiling {
    /// The number of gemm calls of an `m × n` product.
    pub fn calls(&self, m: usize, n: usize) -> usize {
        m.div_ceil(self.rows) * n.div_ceil(self.cols)
    }
}

/// The tiling of `dst[m,n] = lhs[m,k]·rhs[k,n]` (`k <= MAX_DEPTH`) with the fewest gemm calls
/// whose staged buffers fit [`STAGING`]: a staged right panel takes `k·cols` floats, a staged
/// left tile `rows·k` and a staged destination tile `rows·cols`. `staged` says which of (lhs,
/// rhs, dst) are staged. Rows are then evened out over the tiles.
pub fn tiling(m: usize, n: usize, k: usize, staged: [bool; 3]) -> Tiling {
    assert!(k <= MAX_DEPTH, "staged gemm: depth {k} > MAX_DEPTH");
    let [sl, sr, sd] = staged.map(usize::from);
    let mut best: Option<(usize, Tiling)> = None;
    for panels in 1..=n.max(1) {
        if best.is_some_and(|(calls, _)| panels >= calls) {
            break;
        }
        let cols = n.div_ceil(panels);
        let rhs = sr * k * cols;
        let per_row = sl * k + sd * cols;
        let rows = match (STAGING.checked_sub(rhs), per_row) {
            (None, _) => continue,
            (Some(_), 0) => m,
            (Some(free), p) => (free / p).min(m),
        };
        if rows == 0 {
            continue;
        }
        let t = Tiling {
            rows: m.div_ceil(m.div_ceil(rows)),
            cols,
        };
        let calls = t.calls(m, n);
        if best.is_none_or(|(c, _)| calls < c) {
            best = Some((calls, t));
        }
    }
    best.expect("a 64 × 64 tiling always fits STAGING").1
}

/// One operand of `dst[m,n] (=|+=) lhs[m,k]·rhs[k,n]`: the whole slice, its (row, col) strides,
/// and optionally the fp8 format it is quantised to.
#[derive(Clone, Copy)]
pub struct Operand<'a, T> {
    pub data: &'a [T],
    pub strides: (usize, usize),
    pub fp8: Option<Fp8Format>,
}

impl<'a, T: Elem> Operand<'a, T> {
    pub fn new(data: &'a [T], strides: (usize, usize)) -> Self {
        Operand {
            data,
            strides,
            fp8: None,
        }
    }
    pub fn fp8(mut self, fmt: Option<Fp8Format>) -> Self {
        self.fp8 = fmt;
        self
    }
    /// Per-tensor scale of the whole operand ("current" scaling: this call's amax).
    fn scale(&self) -> Option<(Fp8Format, f32)> {
        self.fp8.map(|f| (f, fp8::scale_for(f, amax(self.data))))
    }
}

/// Largest magnitude (order-independent, so deterministic).
fn amax<T: Elem>(x: &[T]) -> f32 {
    x.par_chunks(1 << 14)
        .map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.to_f32().abs())))
        .reduce(|| 0.0, f32::max)
}

/// Widens (and quantises) the block `rows × cols` at (`r0`, `c0`) of `op` into `buf`, keeping
/// the operand's contiguous direction contiguous; returns the block and its strides. `buf` may
/// be uninitialised: every element of the block is written before it is returned.
fn stage<'b, T: Elem>(
    op: &Operand<T>,
    q: Option<(Fp8Format, f32)>,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    buf: &'b mut [MaybeUninit<f32>],
) -> (&'b [f32], (usize, usize)) {
    let (rs, cs) = op.strides;
    let buf = &mut buf[..rows * cols];
    // Contiguous along rows (cs == 1) or along columns (rs == 1, a transposed view).
    let (inner, strides) = if cs == 1 || rs != 1 {
        (cols, (cols, 1))
    } else {
        (rows, (1, rows))
    };
    let chunk = (1usize << 14).div_ceil(inner).max(1);
    buf.par_chunks_mut(chunk * inner)
        .enumerate()
        .for_each(|(ci, out)| {
            for (j, line) in out.chunks_mut(inner).enumerate() {
                let o = ci * chunk + j;
                let line = if strides.1 == 1 && cs == 1 {
                    let off = (r0 + o) * rs + c0;
                    T::load_uninit(&op.data[off..off + inner], line)
                } else if strides.1 == 1 {
                    for (c, x) in line.iter_mut().enumerate() {
                        x.write(op.data[(r0 + o) * rs + (c0 + c) * cs].to_f32());
                    }
                    // SAFETY: every element of `line` was written just above.
                    unsafe { assume_init_mut(line) }
                } else {
                    let off = (c0 + o) * cs + r0;
                    T::load_uninit(&op.data[off..off + inner], line)
                };
                if let Some((f, s)) = q {
                    let inv = 1.0 / s;
                    for x in line.iter_mut() {
                        *x = fp8::round_trip(f, *x * s) * inv;
                    }
                }
            }
        });
    // SAFETY: the loop above wrote every line of `buf`.
    (unsafe { assume_init_mut(buf) }, strides)
}

/// `dst[m,n] (=|+=) lhs[m,k]·rhs[k,n] (+ bias[n])` for any element types; `dst` is row-major
/// with row stride `ldd`. Plain sgemm when everything is f32 and unquantised. The bias, stored
/// like the right operand, is widened and added in f32 before the one rounding of a 16-bit
/// destination.
#[allow(clippy::too_many_arguments)]
pub fn gemm<D: Elem, L: Elem, R: Elem>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [D],
    ldd: usize,
    lhs: Operand<L>,
    rhs: Operand<R>,
    mut accumulate: bool,
    mut bias: Option<&[R]>,
    backend: Gemm,
) {
    if m == 0 || n == 0 {
        return;
    }
    if let (Some(b), Some(d)) = (bias, D::as_f32_mut(dst)) {
        // Seed an f32 destination with the bias (or add it to the residual it holds), then
        // let the product accumulate.
        assert_eq!(b.len(), n, "matmul bias len");
        d.par_chunks_mut(ldd).for_each(|row| {
            let row = &mut row[..n];
            if accumulate {
                row.iter_mut().zip(b).for_each(|(r, bi)| *r += bi.to_f32());
            } else {
                row.iter_mut().zip(b).for_each(|(r, bi)| *r = bi.to_f32());
            }
        });
        accumulate = true;
        bias = None;
    }
    let plain = lhs.fp8.is_none() && rhs.fp8.is_none();
    // oneDNN multiplies f32 or bf16 operands as they are stored (bf16 without staging).
    if plain
        && gemm_select::product(
            backend,
            (m, n, k),
            dst,
            ldd,
            (lhs.data, lhs.strides),
            (rhs.data, rhs.strides),
            accumulate,
            bias,
        )
    {
        return;
    }
    if let (Some(l), Some(r), true) = (L::as_f32(lhs.data), R::as_f32(rhs.data), plain) {
        if let Some(d) = D::as_f32_mut(dst) {
            sgemm(
                m,
                n,
                k,
                d,
                (ldd, 1),
                l,
                lhs.strides,
                r,
                rhs.strides,
                accumulate,
                true,
            );
            return;
        }
    }
    let (ql, qr) = (lhs.scale(), rhs.scale());
    // A reduction deeper than MAX_DEPTH (the weight gradient over many tokens) is cut into
    // equal chunks accumulated one after the other (fixed order); a 16-bit destination is then
    // rounded once per chunk.
    if k > MAX_DEPTH {
        let parts = k.div_ceil(MAX_DEPTH);
        let kb = k.div_ceil(parts);
        let mut p0 = 0;
        while p0 < k {
            let kl = kb.min(k - p0);
            let l = Operand {
                data: &lhs.data[p0 * lhs.strides.1..],
                ..lhs
            };
            let r = Operand {
                data: &rhs.data[p0 * rhs.strides.0..],
                ..rhs
            };
            staged(
                m,
                n,
                kl,
                dst,
                ldd,
                (l, ql),
                (r, qr),
                accumulate || p0 > 0,
                bias,
                backend,
            );
            bias = None;
            p0 += kl;
        }
        return;
    }
    staged(
        m,
        n,
        k,
        dst,
        ldd,
        (lhs, ql),
        (rhs, qr),
        accumulate,
        bias,
        backend,
    );
}

/// The staged product for `k <= MAX_DEPTH`, with the operands' fp8 scales already known.
#[allow(clippy::too_many_arguments)]
fn staged<D: Elem, L: Elem, R: Elem>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [D],
    ldd: usize,
    (lhs, ql): (Operand<L>, Option<(Fp8Format, f32)>),
    (rhs, qr): (Operand<R>, Option<(Fp8Format, f32)>),
    accumulate: bool,
    bias: Option<&[R]>,
    backend: Gemm,
) {
    let staged_lhs = L::as_f32(lhs.data).is_none() || ql.is_some();
    let staged_rhs = R::as_f32(rhs.data).is_none() || qr.is_some();
    let staged_dst = D::as_f32_mut(dst).is_none();
    let Tiling { rows: tm, cols: nc } = tiling(m, n, k, [staged_lhs, staged_rhs, staged_dst]);
    // One allocation of the full staging size (see STAGING), carved into the three tiles. It
    // is left uninitialised: staging writes every element it hands to sgemm, and zeroing up to
    // 10 MiB per call would cost a sizable share of a small model's products. It is the
    // product's scratch (`scratch`), as the gemm crate's packing is.
    let _scratch = KernelScratch::enter();
    let mut ws: Vec<f32> = Vec::with_capacity(STAGING);
    let sizes = [
        usize::from(staged_rhs) * k * nc,
        usize::from(staged_lhs) * tm * k,
        usize::from(staged_dst) * tm * nc,
    ];
    let (rbuf, rest) = ws.spare_capacity_mut().split_at_mut(sizes[0]);
    let (lbuf, dbuf) = rest.split_at_mut(sizes[1]);
    let mut j0 = 0;
    while j0 < n {
        let ncols = nc.min(n - j0);
        // An f32 operand that needs no quantisation is read in place.
        let (r_f32, r_str): (&[f32], (usize, usize)) = match (R::as_f32(rhs.data), qr) {
            (Some(r), None) => (&r[j0 * rhs.strides.1..], rhs.strides),
            _ => stage(&rhs, qr, (0, k), (j0, ncols), &mut *rbuf),
        };
        let mut i0 = 0;
        while i0 < m {
            let rows = tm.min(m - i0);
            let (l_f32, l_str): (&[f32], (usize, usize)) = match (L::as_f32(lhs.data), ql) {
                (Some(l), None) => (&l[i0 * lhs.strides.0..], lhs.strides),
                _ => stage(&lhs, ql, (i0, rows), (0, k), &mut *lbuf),
            };
            let d_off = i0 * ldd + j0;
            match D::as_f32_mut(dst) {
                Some(d) => gemm_select::sgemm(
                    backend,
                    (rows, ncols, k),
                    &mut d[d_off..],
                    (ldd, 1),
                    (l_f32, l_str),
                    (r_f32, r_str),
                    accumulate,
                ),
                None => {
                    let tile = &mut dbuf[..rows * ncols];
                    let span = |r: usize| d_off + r * ldd..d_off + r * ldd + ncols;
                    // The tile starts as the destination (accumulate), the bias, both, or
                    // nothing: sgemm then overwrites it without reading.
                    let seeded = accumulate || bias.is_some() || k == 0;
                    tile.par_chunks_mut(ncols).enumerate().for_each(|(r, t)| {
                        if !seeded {
                            return;
                        }
                        let t = if accumulate {
                            D::load_uninit(&dst[span(r)], t)
                        } else {
                            t.iter_mut().for_each(|x| {
                                x.write(0.0);
                            });
                            // SAFETY: every element was written just above.
                            unsafe { assume_init_mut(t) }
                        };
                        if let Some(b) = bias {
                            t.iter_mut()
                                .zip(&b[j0..j0 + ncols])
                                .for_each(|(x, bi)| *x += bi.to_f32());
                        }
                    });
                    // SAFETY: `tile` is `rows × ncols` floats, row stride `ncols`, owned here;
                    // the operands are in bounds (asserted inside).
                    unsafe {
                        gemm_select::sgemm_raw(
                            backend,
                            (rows, ncols, k),
                            tile.as_mut_ptr().cast(),
                            (ncols, 1),
                            (l_f32, l_str),
                            (r_f32, r_str),
                            seeded,
                        )
                    };
                    // SAFETY: seeded above, or written whole by sgemm (k > 0, no read).
                    store_rows(unsafe { assume_init_mut(tile) }, ncols, dst, d_off, ldd);
                }
            }
            i0 += rows;
        }
        j0 += ncols;
    }
}

/// `buf` as initialised floats.
///
/// # Safety
/// Every element of `buf` must have been written.
unsafe fn assume_init_mut(buf: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: MaybeUninit<f32> has f32's layout; the caller guarantees initialisation.
    unsafe { &mut *(buf as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// Rounds the f32 tile `src` (`ncols` wide) into `dst` rows starting at `off`, stride `ldd`.
fn store_rows<D: Elem>(src: &[f32], ncols: usize, dst: &mut [D], off: usize, ldd: usize) {
    let rows = src.len() / ncols;
    if rows == 0 {
        return;
    }
    let span = &mut dst[off..off + (rows - 1) * ldd + ncols];
    // Rows of the destination are `ldd` apart; split the span into row-starting chunks.
    span.par_chunks_mut(ldd)
        .zip(src.par_chunks(ncols))
        .for_each(|(d, s)| D::store(s, &mut d[..ncols]));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Staged floats of a tiling, as `staged()` carves them.
    fn footprint(t: Tiling, k: usize, [sl, sr, sd]: [bool; 3]) -> usize {
        usize::from(sr) * k * t.cols + t.rows * (usize::from(sl) * k + usize::from(sd) * t.cols)
    }

    #[test]
    fn tiling_fits_the_workspace_and_covers_the_product() {
        let mut seed = 0x9E37_79B9u32;
        let mut next = |hi: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            1 + seed as usize % hi
        };
        for _ in 0..2000 {
            let (m, n, k) = (next(20_000), next(20_000), next(MAX_DEPTH));
            let staged = [next(2) == 1, next(2) == 1, next(2) == 1];
            let t = tiling(m, n, k, staged);
            assert!(t.rows >= 1 && t.rows <= m && t.cols >= 1 && t.cols <= n);
            assert!(
                footprint(t, k, staged) <= STAGING,
                "{m}×{n}×{k} {staged:?}: {t:?}"
            );
        }
    }

    #[test]
    fn small_model_products_are_one_call() {
        // ferrotron-12m, 2048 tokens: q/o projections, the MLP's down projection and its
        // input gradient, all 16-bit.
        for (m, n, k) in [(2048, 384, 384), (2048, 384, 1024), (2048, 1024, 384)] {
            let t = tiling(m, n, k, [true; 3]);
            assert!(t.calls(m, n) <= 2, "{m}×{n}×{k}: {t:?}");
        }
        assert_eq!(tiling(2048, 384, 384, [true; 3]).calls(2048, 384), 1);
        // Nothing staged: one call whatever the size.
        assert_eq!(
            tiling(100_000, 50_000, 4096, [false; 3]).calls(100_000, 50_000),
            1
        );
    }
}
