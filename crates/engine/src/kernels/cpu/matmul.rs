//! Linear layers, and the portable sgemm on the `gemm` crate (BLIS-style packed sgemm, runtime
//! AVX2/AVX-512 dispatch). Which kernel runs a layer's product is `gemm_select`'s choice.
//!
//! Weights are `[out, in]` row-major (PyTorch `nn.Linear`), so every product below is expressed
//! with strides and no transpose is ever materialised. `gemm::gemm` computes
//! `dst = alpha·dst + beta·lhs·rhs` (`alpha` ignored when `read_dst = false`).

use super::scratch::KernelScratch;
use super::staged_gemm::{gemm, Operand};
use super::CpuKernels;
use crate::dtype::Elem;
use crate::kernels::{Accum, MatmulShape};
use crate::numerics::fp8::Fp8Format;
use gemm::Parallelism;
use rayon::prelude::*;

/// Largest operand (k × n or m × k floats) handed to one gemm call: 1 Mi floats, 4 MiB.
pub const MAX_PACKED_RHS: usize = 1 << 20;

/// Longest reduction handed to one gemm call (see [`sgemm_raw`]).
///
/// 512 makes the summation order the same on every CPU. The gemm crate cuts a depth `k` into
/// blocks of `kc` that it derives from the L1 cache's geometry
/// (`gemm_common::cache::kernel_params`: at least 512, e.g. 512 on an AMD EPYC with a 32 KiB
/// 8-way L1d, 1024 on an Intel Xeon with a 48 KiB 12-way one), and adds each block's partial
/// sums into dst. For `k ≤ 512` every machine takes the whole depth as one block, so each
/// output element is one fused multiply-add chain in `k` order, then added to dst: results are
/// bit-identical across machine kinds. With 2048 they were not, and a loss curve of the fp8
/// tiny model moved from 0.114 to 0.166 nats from fp32 between the two machines.
pub const MAX_DEPTH: usize = 512;
const _: () = assert!(
    MAX_DEPTH <= 512,
    "gemm takes depths up to 512 in one block on every CPU"
);

/// Column-major-agnostic strided sgemm: `dst[m,n] (=|+=) lhs[m,k]·rhs[k,n]`, strides in elements
/// as `(row stride, col stride)`.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_strides: (usize, usize),
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Bounds: the furthest element each operand is addressed at must lie inside its slice,
    // which makes the raw-pointer call below memory safe.
    let last = |r: usize, c: usize, s: (usize, usize)| (r - 1) * s.0 + (c - 1) * s.1;
    assert!(last(m, n, dst_strides) < dst.len(), "sgemm: dst too small");
    // SAFETY: bounds checked above; dst does not alias lhs/rhs (distinct borrows).
    unsafe {
        sgemm_raw(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_strides,
            lhs,
            lhs_strides,
            rhs,
            rhs_strides,
            accumulate,
            parallel,
        )
    }
}

/// [`sgemm`] writing through a raw pointer, for strided destinations whose span interleaves
/// rows owned by other threads (attention tiles), where a `&mut [f32]` would alias.
///
/// # Safety
/// Every `dst` element `(r, c)` for `r < m`, `c < n` at `r·rs + c·cs` must be valid for writes
/// and not accessed concurrently; lhs/rhs must be in bounds (asserted).
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_strides: (usize, usize),
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |r: usize, c: usize, s: (usize, usize)| (r - 1) * s.0 + (c - 1) * s.1;
    if k > 0 {
        assert!(last(m, k, lhs_strides) < lhs.len(), "sgemm: lhs too small");
        assert!(last(k, n, rhs_strides) < rhs.len(), "sgemm: rhs too small");
    }
    // The gemm crate allocates its packing buffers on every call, sized by the operands it
    // packs: 16 MiB for the 8192-row LM-head weight gradient. That memory is outside the memory
    // plan, so large products are split into row, then column, blocks whose packed operands
    // stay under MAX_PACKED_RHS floats; the blocks write disjoint parts of dst.
    // A long reduction (the LM head's input gradient reduces over the vocabulary) is first cut
    // into equal depth chunks of at most MAX_DEPTH, accumulated into dst one after the other
    // (fixed order, so deterministic). Otherwise the row blocking below would leave thin
    // 64–128-row products that re-pack the whole right-hand side for every block.
    if k > MAX_DEPTH {
        let parts = k.div_ceil(MAX_DEPTH);
        let kb = k.div_ceil(parts);
        let mut k0 = 0;
        while k0 < k {
            let kl = kb.min(k - k0);
            sgemm_raw(
                m,
                n,
                kl,
                dst,
                dst_strides,
                &lhs[k0 * lhs_strides.1..],
                lhs_strides,
                &rhs[k0 * rhs_strides.0..],
                rhs_strides,
                accumulate || k0 > 0,
                parallel,
            );
            k0 += kl;
        }
        return;
    }
    let block = (MAX_PACKED_RHS / k.max(1)).max(64) / 64 * 64;
    if m > block {
        // Same for the packed left-hand side (m × k), e.g. the LM head's weight gradient.
        let mut r0 = 0;
        while r0 < m {
            let mb = block.min(m - r0);
            sgemm_raw(
                mb,
                n,
                k,
                dst.add(r0 * dst_strides.0),
                dst_strides,
                &lhs[r0 * lhs_strides.0..],
                lhs_strides,
                rhs,
                rhs_strides,
                accumulate,
                parallel,
            );
            r0 += mb;
        }
        return;
    }
    if n > block {
        let mut c0 = 0;
        while c0 < n {
            let nb = block.min(n - c0);
            sgemm_raw(
                m,
                nb,
                k,
                dst.add(c0 * dst_strides.1),
                dst_strides,
                lhs,
                lhs_strides,
                &rhs[c0 * rhs_strides.1..],
                rhs_strides,
                accumulate,
                parallel,
            );
            c0 += nb;
        }
        return;
    }
    let par = if parallel {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // Its packing buffers are the product's scratch.
    let _scratch = KernelScratch::enter();
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dst_strides.1 as isize,
        dst_strides.0 as isize,
        accumulate,
        lhs.as_ptr(),
        lhs_strides.1 as isize,
        lhs_strides.0 as isize,
        rhs.as_ptr(),
        rhs_strides.1 as isize,
        rhs_strides.0 as isize,
        1.0f32,
        1.0f32,
        false,
        false,
        false,
        par,
    );
}

/// The fp8 formats of a layer's GEMM inputs (Micikevicius et al. 2022 §3): e4m3 for weights
/// and activations, e5m2 (more range) for gradients; `None` for 16/32-bit products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Inputs {
    pub forward: Fp8Format,
    pub gradient: Fp8Format,
}

pub const FP8_HYBRID: Fp8Inputs = Fp8Inputs {
    forward: Fp8Format::E4M3,
    gradient: Fp8Format::E5M2,
};

/// `y (=|+=) x·Wᵀ + bias`.
pub fn forward<S: Elem, Y: Elem>(
    s: MatmulShape,
    x: &[S],
    w: &[S],
    bias: Option<&[S]>,
    y: &mut [Y],
    y_accum: Accum,
    kernels: &CpuKernels,
) {
    let MatmulShape {
        n,
        in_features: k,
        out_features: o,
        ragged,
    } = s;
    assert_eq!(x.len(), n * k, "matmul x len");
    assert_eq!(w.len(), o * k, "matmul w len");
    assert_eq!(y.len(), n * o, "matmul y len");
    if let Some(b) = bias {
        assert_eq!(b.len(), o, "matmul bias len");
    }
    let f = kernels.fp8.map(|f| f.forward);
    // y[n,o] = x[n,k] · Wᵀ[k,o];  Wᵀ[i][j] = W[j*k + i] → strides (1, k).
    for (at, m) in pieces(n, ragged) {
        gemm(
            m,
            o,
            k,
            &mut y[at * o..(at + m) * o],
            o,
            Operand::new(&x[at * k..(at + m) * k], (k, 1)).fp8(f),
            Operand::new(w, (1, k)).fp8(f),
            y_accum == Accum::Add,
            bias,
            kernels.gemm,
        );
    }
}

/// The most rows a piece of a ragged product has ([`pieces`]).
pub(crate) const PIECE_ROWS: usize = 256;

/// Rows `(first, count)` a product of `n` rows runs as: all at once, or for a ragged product
/// blocks of 256 rows and the rest in powers of two (1000 = 3 × 256 + 128 + 64 + 16 + 8), so
/// that a backend compiling a kernel per shape (oneDNN) compiles at most nine per product
/// family however the row count changes (a mixture of experts changed it every step, and a
/// kernel per count grew a 16M-parameter Mixtral's resident memory past 5 GiB in 60 steps).
/// Rows are independent, so the pieces give the whole product's values; a weight gradient
/// sums its pieces' contributions in turn.
pub(crate) fn pieces(n: usize, ragged: bool) -> impl Iterator<Item = (usize, usize)> {
    const BLOCK: usize = PIECE_ROWS;
    let (blocks, rest) = match ragged {
        true => (n / BLOCK, n % BLOCK),
        false => (0, n),
    };
    let whole = (!ragged && n > 0).then_some(n);
    let binary = (0..usize::BITS)
        .rev()
        .map(|b| 1usize << b)
        .filter(move |&bit| ragged && rest & bit != 0);
    std::iter::repeat_n(BLOCK, blocks)
        .chain(whole)
        .chain(binary)
        .scan(0, |at, m| {
            *at += m;
            Some((*at - m, m))
        })
}

/// `dx (=|+=) dy·W`.
pub fn backward_input<S: Elem, Y: Elem>(
    s: MatmulShape,
    dy: &[Y],
    w: &[S],
    dx: &mut [S],
    dx_accum: Accum,
    kernels: &CpuKernels,
) {
    let fp8 = kernels.fp8;
    let MatmulShape {
        n,
        in_features: k,
        out_features: o,
        ragged,
    } = s;
    assert_eq!(dy.len(), n * o, "matmul dy len");
    assert_eq!(w.len(), o * k, "matmul w len");
    assert_eq!(dx.len(), n * k, "matmul dx len");
    // dx[n,k] = dy[n,o] · W[o,k]
    for (at, m) in pieces(n, ragged) {
        gemm(
            m,
            k,
            o,
            &mut dx[at * k..(at + m) * k],
            k,
            Operand::new(&dy[at * o..(at + m) * o], (o, 1)).fp8(fp8.map(|f| f.gradient)),
            Operand::new(w, (k, 1)).fp8(fp8.map(|f| f.forward)),
            dx_accum == Accum::Add,
            None,
            kernels.gemm,
        );
    }
}

/// `dW += dyᵀ·x`, `dbias += Σ dy`.
pub fn backward_weight<S: Elem, Y: Elem, G: Elem>(
    s: MatmulShape,
    dy: &[Y],
    x: &[S],
    dw: &mut [G],
    dbias: Option<&mut [G]>,
    kernels: &CpuKernels,
) {
    let fp8 = kernels.fp8;
    let MatmulShape {
        n,
        in_features: k,
        out_features: o,
        ragged,
    } = s;
    assert_eq!(dy.len(), n * o, "matmul dy len");
    assert_eq!(x.len(), n * k, "matmul x len");
    assert_eq!(dw.len(), o * k, "matmul dw len");
    // dW[o,k] += dyᵀ[o,n] · x[n,k];  dyᵀ[i][j] = dy[j*o + i] → strides (1, o).
    for (at, m) in pieces(n, ragged) {
        gemm(
            o,
            k,
            m,
            dw,
            k,
            Operand::new(&dy[at * o..(at + m) * o], (1, o)).fp8(fp8.map(|f| f.gradient)),
            Operand::new(&x[at * k..(at + m) * k], (k, 1)).fp8(fp8.map(|f| f.forward)),
            true,
            None,
            kernels.gemm,
        );
    }
    if let Some(db) = dbias {
        assert_eq!(db.len(), o, "matmul dbias len");
        bias_backward(dy, o, db);
    }
}

/// `db[j] += Σ_rows dy[r, j]`, parallel over column blocks (no partial-sum buffers needed),
/// summed in f32 and rounded once.
fn bias_backward<Y: Elem, G: Elem>(dy: &[Y], o: usize, db: &mut [G]) {
    const BLOCK: usize = 64;
    let rows = dy.len() / o;
    db.par_chunks_mut(BLOCK).enumerate().for_each(|(blk, dbb)| {
        let c0 = blk * BLOCK;
        let mut acc = [0.0f32; BLOCK];
        let acc = &mut acc[..dbb.len()];
        acc.iter_mut()
            .zip(dbb.iter())
            .for_each(|(a, d)| *a = d.to_f32());
        for r in 0..rows {
            let row = &dy[r * o + c0..r * o + c0 + acc.len()];
            acc.iter_mut().zip(row).for_each(|(d, g)| *d += g.to_f32());
        }
        dbb.iter_mut()
            .zip(acc.iter())
            .for_each(|(d, a)| *d = G::from_f32(*a));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_products_run_in_a_few_shapes_that_tile_the_rows() {
        let p: Vec<_> = pieces(1000, true).collect();
        assert_eq!(
            p,
            [
                (0, 256),
                (256, 256),
                (512, 256),
                (768, 128),
                (896, 64),
                (960, 32),
                (992, 8)
            ]
        );
        assert_eq!(pieces(1000, false).collect::<Vec<_>>(), [(0, 1000)]);
        assert_eq!(pieces(0, true).count(), 0);
        // Every count up to 4096 uses only 256 and the powers of two below it.
        let shapes: std::collections::BTreeSet<usize> = (1..4096)
            .flat_map(|n| pieces(n, true).map(|p| p.1))
            .collect();
        assert_eq!(shapes.len(), 9);
    }
}
