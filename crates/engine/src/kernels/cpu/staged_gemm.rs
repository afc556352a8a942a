//! Products over 16-bit or fp8-quantised operands on the f32 `gemm` crate.
//!
//! The CPU has no bf16 matrix unit worth using (PyTorch's bf16 matmul on this machine runs at
//! about 1 GFLOP/s against ~150 for f32), so 16-bit operands are *staged*: widened block by
//! block into f32 scratch and multiplied with sgemm, accumulating in f32; a 16-bit destination
//! is read into an f32 tile once, accumulated over the whole reduction, and rounded once. Only
//! the memory traffic is 16-bit; every product is computed exactly as in fp32.
//!
//! Blocking: the right operand (the weight, mostly) is staged in column panels of at most
//! [`RHS_PANEL`] floats, each converted once; for each panel the left operand is staged in row
//! tiles of at most [`LHS_TILE`] floats. So each weight element is widened once per call and
//! each activation element once per panel (one panel for most layers of a small model). The
//! scratch is allocated per call, like the gemm crate's packing buffers, always [`STAGING`]
//! floats, and is part of the workspace the trainer measures into the memory plan.
//!
//! fp8 (Micikevicius et al. 2022): an operand may also be quantise-dequantised to e4m3 or e5m2
//! with a per-tensor scale from its current amax (`numerics::fp8`), which is what an fp8 GEMM
//! with f32 accumulation computes; the speed comes with a GPU backend.

use super::matmul::sgemm;
use crate::dtype::Elem;
use crate::numerics::fp8::{self, Fp8Format};
use rayon::prelude::*;

/// Largest staged right-operand panel, in floats (4 MiB).
pub const RHS_PANEL: usize = 1 << 20;
/// Largest staged left-operand tile, in floats (2 MiB).
pub const LHS_TILE: usize = 1 << 19;
/// Row cap of a left tile and column cap of a panel, which bound the f32 destination tile.
const MAX_TILE_ROWS: usize = 512;
const MAX_PANEL_COLS: usize = 2048;
/// The staging workspace, in floats: every staged product allocates exactly this much (and
/// touches what it needs), so the workspace live at any instant of a step is one constant,
/// as a cuBLAS workspace is, and the memory plan's workspace term is exact whichever product
/// runs at the peak.
pub const STAGING: usize = RHS_PANEL + LHS_TILE + MAX_TILE_ROWS * MAX_PANEL_COLS;

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
/// the operand's contiguous direction contiguous; returns the block's strides in `buf`.
fn stage<T: Elem>(
    op: &Operand<T>,
    q: Option<(Fp8Format, f32)>,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    buf: &mut [f32],
) -> (usize, usize) {
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
                if strides.1 == 1 && cs == 1 {
                    let off = (r0 + o) * rs + c0;
                    T::load(&op.data[off..off + inner], line);
                } else if strides.1 == 1 {
                    for (c, x) in line.iter_mut().enumerate() {
                        *x = op.data[(r0 + o) * rs + (c0 + c) * cs].to_f32();
                    }
                } else {
                    let off = (c0 + o) * cs + r0;
                    T::load(&op.data[off..off + inner], line);
                }
                if let Some((f, s)) = q {
                    let inv = 1.0 / s;
                    for x in line.iter_mut() {
                        *x = fp8::round_trip(f, *x * s) * inv;
                    }
                }
            }
        });
    strides
}

/// `dst[m,n] (=|+=) lhs[m,k]·rhs[k,n] (+ bias[n])` for any element types; `dst` is row-major
/// with row stride `ldd`. Plain sgemm when everything is f32 and unquantised. The bias is added
/// in f32 before the one rounding of a 16-bit destination.
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
    mut bias: Option<&[f32]>,
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
                row.iter_mut().zip(b).for_each(|(r, bi)| *r += bi);
            } else {
                row.copy_from_slice(b);
            }
        });
        accumulate = true;
        bias = None;
    }
    let plain = lhs.fp8.is_none() && rhs.fp8.is_none();
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
            );
            bias = None;
            p0 += kl;
        }
        return;
    }
    staged(m, n, k, dst, ldd, (lhs, ql), (rhs, qr), accumulate, bias);
}

/// Longest reduction staged at once; with it the tiles below always fit [`STAGING`].
const MAX_DEPTH: usize = LHS_TILE / 64;

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
    bias: Option<&[f32]>,
) {
    let kk = k.max(1);
    let nc = n.min((RHS_PANEL / kk).max(64)).min(MAX_PANEL_COLS);
    let tm = m.min((LHS_TILE / kk).max(64)).min(MAX_TILE_ROWS);
    // One allocation of the full staging size (see STAGING), carved into the three tiles.
    let mut ws: Vec<f32> = Vec::with_capacity(STAGING);
    ws.resize(k * nc + tm * k + tm * nc, 0.0);
    let (rbuf, rest) = ws.split_at_mut(k * nc);
    let (lbuf, dbuf) = rest.split_at_mut(tm * k);
    let mut j0 = 0;
    while j0 < n {
        let ncols = nc.min(n - j0);
        // An f32 operand that needs no quantisation is read in place.
        let (r_f32, r_str): (&[f32], (usize, usize)) = match (R::as_f32(rhs.data), qr) {
            (Some(r), None) => (&r[j0 * rhs.strides.1..], rhs.strides),
            _ => {
                let st = stage(&rhs, qr, (0, k), (j0, ncols), rbuf);
                (&*rbuf, st)
            }
        };
        let mut i0 = 0;
        while i0 < m {
            let rows = tm.min(m - i0);
            let (l_f32, l_str): (&[f32], (usize, usize)) = match (L::as_f32(lhs.data), ql) {
                (Some(l), None) => (&l[i0 * lhs.strides.0..], lhs.strides),
                _ => {
                    let st = stage(&lhs, ql, (i0, rows), (0, k), lbuf);
                    (&*lbuf, st)
                }
            };
            let d_off = i0 * ldd + j0;
            match D::as_f32_mut(dst) {
                Some(d) => sgemm(
                    rows,
                    ncols,
                    k,
                    &mut d[d_off..],
                    (ldd, 1),
                    l_f32,
                    l_str,
                    r_f32,
                    r_str,
                    accumulate,
                    true,
                ),
                None => {
                    let dbuf = &mut dbuf[..rows * ncols];
                    if !accumulate {
                        dbuf.fill(0.0);
                    }
                    let span = |r: usize| d_off + r * ldd..d_off + r * ldd + ncols;
                    if accumulate {
                        dbuf.par_chunks_mut(ncols)
                            .enumerate()
                            .for_each(|(r, t)| D::load(&dst[span(r)], t));
                    }
                    if let Some(b) = bias {
                        let b = &b[j0..j0 + ncols];
                        dbuf.par_chunks_mut(ncols)
                            .for_each(|t| t.iter_mut().zip(b).for_each(|(x, bi)| *x += bi));
                    }
                    sgemm(
                        rows,
                        ncols,
                        k,
                        dbuf,
                        (ncols, 1),
                        l_f32,
                        l_str,
                        r_f32,
                        r_str,
                        accumulate || bias.is_some(),
                        true,
                    );
                    store_rows(dbuf, ncols, dst, d_off, ldd);
                }
            }
            i0 += rows;
        }
        j0 += ncols;
    }
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
