//! Causal grouped-query attention, flash style (Dao et al. 2022, FlashAttention, Alg. 1 forward
//! and Alg. 2 backward, with the FlashAttention-2 loop order and `lse` bookkeeping, Dao 2023).
//!
//! Layouts: q `[B,T,H,D]`, k/v `[B,T,KV,D]`, o `[B,T,H,D]`, lse `[B,H,T]`. Query head `h` reads
//! kv head `h / (H/KV)`. No T×T matrix exists: queries are processed in blocks of `BR` rows and
//! keys in blocks of `BC`; the only score storage is one `BR×BC` tile per task.
//!
//! Forward (per query block, over key blocks `j ≤ i`): `S = scale·Q_i K_jᵀ` (causal mask on the
//! diagonal tile), running row max `m`, `P = exp(S − m_new)`, `l ← e^{m−m_new}·l + rowsum(P)`,
//! `O ← e^{m−m_new}·O + P V_j`; finally `O /= l` and `lse = m + ln l` is saved.
//!
//! Backward, recomputing `P = exp(scale·Q_i K_jᵀ − lse)` and with `D_i = rowsum(dO_i ⊙ O_i)`:
//! `dP = dO_i V_jᵀ`, `dS = P ⊙ (dP − D_i)`, `dV_j += Pᵀ dO_i`, `dK_j += scale·dSᵀ Q_i`,
//! `dQ_i += scale·dS K_j`.
//!
//! Scores are kept transposed, `Sᵀ = K_j Q_iᵀ` (key rows, query columns), so that every tile
//! product has its right operand's rows contiguous, which the AVX-512 tile kernel needs
//! ([`super::tile_gemm`]; elsewhere the gemm crate runs the same products with the same sums,
//! so the results are the same bits on either), and so that the online softmax and the
//! gradient, which work per query, run across queries in vector lanes. `Qᵀ` and `dOᵀ` of a query
//! block are transposed once per task. f32 operands are read in place; 16-bit q/k/v/o/dO tiles
//! are widened into task-local tiles first, and outputs rounded on store; dQ/dK/dV accumulate
//! in task-local f32 before their one rounding. Parallelism: forward over (batch, query head,
//! query block); backward over (batch, kv head), so the dK/dV rows a task accumulates into are
//! owned by it (all query heads of a GQA group add into the same kv head) and the dQ rows of
//! the group's heads too.

use super::simd::{dot, exp_f32, SendPtr};
use super::tile_gemm::product as tile;
use crate::dispatch_fma;
use crate::dtype::Elem;
use crate::kernels::AttnShape;
use rayon::prelude::*;

/// Query rows per tile.
const BR: usize = 64;
/// Key rows per tile.
const BC: usize = 64;
/// Largest supported head dim.
pub const MAX_HEAD_DIM: usize = 512;

fn check(s: &AttnShape) {
    assert!(
        s.kv_heads > 0 && s.heads.is_multiple_of(s.kv_heads),
        "heads {} not a multiple of kv_heads {}",
        s.heads,
        s.kv_heads
    );
    assert!(
        s.head_dim <= MAX_HEAD_DIM,
        "head_dim {} > {MAX_HEAD_DIM}",
        s.head_dim
    );
}

/// Online-softmax update of one tile of raw scores `Kⱼ·Qᵢᵀ`, stored transposed: `st[c·BR + r]`
/// for key `j0 + c` (`c < nc`) and query `i0 + r` (`r < nr`). Scales and causally masks the
/// scores, then per query (a column of `st`, so the loops run across queries and vectorise):
/// updates the running max `m` and sum `l`, rescales the query's output row of `acc` (`d`
/// wide), and turns the scores into unnormalised probabilities in place. Each query's sum
/// runs over its keys in order from zero, as a row-wise loop would.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax_cols_generic<const F: bool>(
    st: &mut [f32],
    (nr, nc): (usize, usize),
    (i0, j0): (usize, usize),
    scale: f32,
    acc: &mut [f32],
    d: usize,
    m: &mut [f32; BR],
    l: &mut [f32; BR],
) {
    // Every per-query array cut to `nr` first, and zipped: no bounds checks in the loops, which
    // would keep them scalar.
    let mut m_new = *m;
    let m_new = &mut m_new[..nr];
    for c in 0..nc {
        let row = &mut st[c * BR..c * BR + nr];
        for (r, (x, mn)) in row.iter_mut().zip(m_new.iter_mut()).enumerate() {
            *x = if j0 + c <= i0 + r {
                *x * scale
            } else {
                f32::NEG_INFINITY
            };
            *mn = mn.max(*x);
        }
    }
    // A query that sees no key yet (all −inf) keeps its state: probability 0, no rescaling.
    let mut ls = [0.0f32; BR];
    let ls = &mut ls[..nr];
    for c in 0..nc {
        let row = &mut st[c * BR..c * BR + nr];
        for ((x, &mn), s) in row.iter_mut().zip(m_new.iter()).zip(ls.iter_mut()) {
            let e = exp_f32::<F>(*x - mn);
            *x = if mn == f32::NEG_INFINITY { 0.0 } else { e };
            *s += *x;
        }
    }
    // Rescaling factors first, in a loop of their own so that it vectorises (`l·1` is `l`).
    let mut alpha = [1.0f32; BR];
    let alpha = &mut alpha[..nr];
    for ((a, (mo, &mn)), (lo, &s)) in alpha
        .iter_mut()
        .zip(m[..nr].iter_mut().zip(m_new.iter()))
        .zip(l[..nr].iter_mut().zip(ls.iter()))
    {
        let e = exp_f32::<F>(*mo - mn);
        *a = if mn == f32::NEG_INFINITY { 1.0 } else { e };
        *lo = *lo * *a + s;
        *mo = mn;
    }
    for (row, &a) in acc.chunks_exact_mut(d).zip(alpha.iter()) {
        if a != 1.0 {
            row.iter_mut().for_each(|x| *x *= a);
        }
    }
}
dispatch_fma!(fn softmax_cols => softmax_cols_generic(st: &mut [f32], nrc: (usize, usize), origin: (usize, usize), scale: f32, acc: &mut [f32], d: usize, m: &mut [f32; BR], l: &mut [f32; BR]));

/// `P = exp(S·scale − lse)` and `dS = scale·P ⊙ (dP − D)` for one tile stored transposed as in
/// [`softmax_cols`] (`S` in `st`, `dP` in `dpt`), causally masked (masked entries zeroed);
/// `lse` and `di` per query. `P` overwrites `S`, `dS` overwrites `dP`.
#[inline(always)]
fn grad_cols_generic<const F: bool>(
    st: &mut [f32],
    dpt: &mut [f32],
    (nr, nc): (usize, usize),
    (i0, j0): (usize, usize),
    scale: f32,
    lse: &[f32],
    di: &[f32],
) {
    let (lse, di) = (&lse[..nr], &di[..nr]);
    for c in 0..nc {
        let s = &mut st[c * BR..c * BR + nr];
        let dp = &mut dpt[c * BR..c * BR + nr];
        for r in 0..nr {
            if j0 + c <= i0 + r {
                let p = exp_f32::<F>(s[r] * scale - lse[r]);
                s[r] = p;
                dp[r] = scale * p * (dp[r] - di[r]);
            } else {
                s[r] = 0.0;
                dp[r] = 0.0;
            }
        }
    }
}
dispatch_fma!(fn grad_cols => grad_cols_generic(st: &mut [f32], dpt: &mut [f32], nrc: (usize, usize), origin: (usize, usize), scale: f32, lse: &[f32], di: &[f32]));

#[inline(always)]
fn dot_generic<const F: bool>(a: &[f32], b: &[f32]) -> f32 {
    dot::<F>(a, b)
}
dispatch_fma!(fn dot_d => dot_generic(a: &[f32], b: &[f32]) -> f32);

/// Rows `0..rows` (row stride `rs`, `d` wide) of `x` from element `off`, as f32: in place for
/// f32, else widened into `buf`. Returns the tile and its row stride.
fn rows_f32<'a, S: Elem>(
    x: &'a [S],
    off: usize,
    rows: usize,
    rs: usize,
    d: usize,
    buf: &'a mut Vec<f32>,
) -> (&'a [f32], usize) {
    if let Some(x) = S::as_f32(x) {
        return (&x[off..], rs);
    }
    buf.clear();
    buf.resize(rows * d, 0.0);
    for (r, out) in buf.chunks_exact_mut(d).enumerate() {
        S::load(&x[off + r * rs..off + r * rs + d], out);
    }
    (buf, d)
}

/// `Xᵀ` of the tile of `rows` rows of `x` from element `off` (row stride `rs`, `d` wide), as
/// f32 in `buf`: `buf[p·BR + r]` is element `p` of row `r` (the right operand of `K·Qᵀ`, whose
/// rows the tile kernel needs contiguous).
fn transposed<'a, S: Elem>(
    x: &[S],
    off: usize,
    rows: usize,
    rs: usize,
    d: usize,
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    buf.clear();
    buf.resize(d * BR, 0.0);
    for r in 0..rows {
        for (p, e) in x[off + r * rs..off + r * rs + d].iter().enumerate() {
            buf[p * BR + r] = e.to_f32();
        }
    }
    buf
}

/// Task-local f32 tiles: transposed scores, the output accumulator, and staged `Qᵀ`, k and v.
type Tiles = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

pub fn forward<S: Elem>(s: AttnShape, q: &[S], k: &[S], v: &[S], o: &mut [S], lse: &mut [f32]) {
    check(&s);
    assert_eq!(q.len(), s.q_len(), "attention q len");
    assert_eq!(k.len(), s.kv_len(), "attention k len");
    assert_eq!(v.len(), s.kv_len(), "attention v len");
    assert_eq!(o.len(), s.q_len(), "attention o len");
    assert_eq!(lse.len(), s.lse_len(), "attention lse len");
    let (op, lp) = (SendPtr(o.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    let (t, hh, kv, d) = (s.t, s.heads, s.kv_heads, s.head_dim);
    let (qs, ks) = (hh * d, kv * d);
    let scale = 1.0 / (d as f32).sqrt();
    // One task per (batch, head, query block): enough tasks to balance the causal triangle.
    let nblk = t.div_ceil(BR);
    (0..s.b * hh * nblk).into_par_iter().for_each_init(
        || -> Tiles {
            (
                vec![0.0f32; BR * BC],
                vec![0.0f32; BR * d],
                Vec::new(),
                Vec::new(),
                Vec::new(),
            )
        },
        |(st, acc, qtb, kb, vb), task| {
            let (bh, blk) = (task / nblk, task % nblk);
            let (b, h) = (bh / hh, bh % hh);
            let kvh = h / (hh / kv);
            let i0 = blk * BR;
            let nr = BR.min(t - i0);
            let q0 = ((b * t + i0) * hh + h) * d;
            let qt = transposed(q, q0, nr, qs, d, qtb);
            let mut m = [f32::NEG_INFINITY; BR];
            let mut l = [0.0f32; BR];
            acc[..nr * d].fill(0.0);
            let kend = i0 + nr; // keys 0..kend are visible to some row of the block
            let mut j0 = 0;
            while j0 < kend {
                let nc = BC.min(kend - j0);
                let k0 = ((b * t + j0) * kv + kvh) * d;
                let (kt, kst) = rows_f32(k, k0, nc, ks, d, kb);
                let (vt, vst) = rows_f32(v, k0, nc, ks, d, vb);
                // SAFETY (both tiles): the destinations are task-local.
                // Sᵀ = K_j Q_iᵀ
                unsafe {
                    tile(
                        (nc, nr, d),
                        st.as_mut_ptr(),
                        BR,
                        kt,
                        (kst, 1),
                        qt,
                        BR,
                        false,
                    )
                };
                softmax_cols(st, (nr, nc), (i0, j0), scale, acc, d, &mut m, &mut l);
                // O += P V_j, P read from Sᵀ by columns
                unsafe { tile((nr, d, nc), acc.as_mut_ptr(), d, st, (1, BR), vt, vst, true) };
                j0 += nc;
            }
            for r in 0..nr {
                let i = i0 + r;
                // SAFETY: row (b, i, h) of o and entry (b, h, i) of lse belong to this task.
                let orow = unsafe { op.slice_mut(((b * t + i) * hh + h) * d, d) };
                let inv = 1.0 / l[r];
                for (x, a) in orow.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                    *x = S::from_f32(a * inv);
                }
                unsafe { *lp.ptr().add((b * hh + h) * t + i) = m[r] + l[r].ln() };
            }
        },
    );
}

#[allow(clippy::too_many_arguments)]
pub fn backward<S: Elem>(
    s: AttnShape,
    q: &[S],
    k: &[S],
    v: &[S],
    o: &[S],
    lse: &[f32],
    d_o: &[S],
    dq: &mut [S],
    dk: &mut [S],
    dv: &mut [S],
) {
    check(&s);
    for (name, n, len) in [
        ("q", q.len(), s.q_len()),
        ("o", o.len(), s.q_len()),
        ("do", d_o.len(), s.q_len()),
        ("k", k.len(), s.kv_len()),
        ("v", v.len(), s.kv_len()),
        ("lse", lse.len(), s.lse_len()),
    ] {
        assert_eq!(n, len, "attention backward {name} len");
    }
    assert!(
        dq.len() == s.q_len() && dk.len() == s.kv_len() && dv.len() == s.kv_len(),
        "attention grad lens"
    );
    let (dqp, dkp, dvp) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    let (t, hh, kv, d) = (s.t, s.heads, s.kv_heads, s.head_dim);
    let group = hh / kv;
    let (qs, ks) = (hh * d, kv * d);
    let scale = 1.0 / (d as f32).sqrt();
    // Per task: the transposed score tiles, f32 accumulators for its dK/dV rows ([T, D] each)
    // and for one dQ tile, `Qᵀ` and `dOᵀ` of the query block, and staged q/k/v/o/dO tiles
    // (16-bit inputs).
    (0..s.b * kv).into_par_iter().for_each_init(
        || {
            (
                (vec![0.0f32; BR * BC], vec![0.0f32; BR * BC]),
                (
                    vec![0.0f32; t * d],
                    vec![0.0f32; t * d],
                    vec![0.0f32; BR * d],
                ),
                (Vec::new(), Vec::new()),
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()),
            )
        },
        |((st, dpt), (dk_acc, dv_acc, dq_acc), (qtb, dotb), (qb, kb, vb, ob, dob)), task| {
            let (b, kvh) = (task / kv, task % kv);
            let kvrow = |j: usize| ((b * t + j) * kv + kvh) * d;
            dk_acc.fill(0.0);
            dv_acc.fill(0.0);
            for h in kvh * group..(kvh + 1) * group {
                let lse_h = &lse[(b * hh + h) * t..(b * hh + h + 1) * t];
                let mut i0 = 0;
                while i0 < t {
                    let nr = BR.min(t - i0);
                    let q0 = ((b * t + i0) * hh + h) * d;
                    let (qr, qst) = rows_f32(q, q0, nr, qs, d, qb);
                    let (dor, dost) = rows_f32(d_o, q0, nr, qs, d, dob);
                    let (or, ost) = rows_f32(o, q0, nr, qs, d, ob);
                    let qt = transposed(q, q0, nr, qs, d, qtb);
                    let dot = transposed(d_o, q0, nr, qs, d, dotb);
                    let mut di = [0.0f32; BR];
                    for (r, x) in di.iter_mut().enumerate().take(nr) {
                        *x = dot_d(&dor[r * dost..r * dost + d], &or[r * ost..r * ost + d]);
                    }
                    dq_acc[..nr * d].fill(0.0);
                    let kend = i0 + nr;
                    let mut j0 = 0;
                    while j0 < kend {
                        let nc = BC.min(kend - j0);
                        let (kt, kst) = rows_f32(k, kvrow(j0), nc, ks, d, kb);
                        let (vt, vst) = rows_f32(v, kvrow(j0), nc, ks, d, vb);
                        // SAFETY (all tiles below): every destination is task-local.
                        unsafe {
                            // Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ
                            tile(
                                (nc, nr, d),
                                st.as_mut_ptr(),
                                BR,
                                kt,
                                (kst, 1),
                                qt,
                                BR,
                                false,
                            );
                            tile(
                                (nc, nr, d),
                                dpt.as_mut_ptr(),
                                BR,
                                vt,
                                (vst, 1),
                                dot,
                                BR,
                                false,
                            );
                        }
                        let lse_i = &lse_h[i0..i0 + nr];
                        grad_cols(st, dpt, (nr, nc), (i0, j0), scale, lse_i, &di);
                        unsafe {
                            // dV_j += Pᵀ dO_i ; dK_j += dSᵀ Q_i ; dQ_i += dS K_j  (dS already scaled)
                            let (dvj, dkj) = (dv_acc.as_mut_ptr(), dk_acc.as_mut_ptr());
                            tile(
                                (nc, d, nr),
                                dvj.add(j0 * d),
                                d,
                                st,
                                (BR, 1),
                                dor,
                                dost,
                                true,
                            );
                            tile((nc, d, nr), dkj.add(j0 * d), d, dpt, (BR, 1), qr, qst, true);
                            tile(
                                (nr, d, nc),
                                dq_acc.as_mut_ptr(),
                                d,
                                dpt,
                                (1, BR),
                                kt,
                                kst,
                                true,
                            );
                        }
                        j0 += nc;
                    }
                    for r in 0..nr {
                        // SAFETY: dq row (b, i0 + r, h) belongs to this task (h in its group).
                        let row = unsafe { dqp.slice_mut(q0 + r * qs, d) };
                        S::store(&dq_acc[r * d..(r + 1) * d], row);
                    }
                    i0 += nr;
                }
            }
            for j in 0..t {
                // SAFETY: the (b, ·, kvh) rows of dk/dv belong to this task.
                S::store(&dk_acc[j * d..(j + 1) * d], unsafe {
                    dkp.slice_mut(kvrow(j), d)
                });
                S::store(&dv_acc[j * d..(j + 1) * d], unsafe {
                    dvp.slice_mut(kvrow(j), d)
                });
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::{agree, random, stored, widened};
    use crate::kernels::cpu::simd::{pool_with_tier, Tier};
    use half::bf16;

    /// Forward and backward of a GQA shape whose length is not a multiple of the tiles, on
    /// `threads` workers pinned to tier `t`; every output widened. `None` without `t`.
    fn run<S: Elem>(t: Tier, s: AttnShape) -> Option<Vec<f32>> {
        let pool = pool_with_tier(t, 2)?;
        let (q, k, v, d_o) = (
            stored::<S>(&random(s.q_len(), 21, 1.0)),
            stored::<S>(&random(s.kv_len(), 22, 1.0)),
            stored::<S>(&random(s.kv_len(), 23, 1.0)),
            stored::<S>(&random(s.q_len(), 24, 1.0)),
        );
        let mut o = vec![S::default(); s.q_len()];
        let mut lse = vec![0.0f32; s.lse_len()];
        let (mut dq, mut dk, mut dv) = (
            vec![S::default(); s.q_len()],
            vec![S::default(); s.kv_len()],
            vec![S::default(); s.kv_len()],
        );
        pool.install(|| {
            forward(s, &q, &k, &v, &mut o, &mut lse);
            backward(s, &q, &k, &v, &o, &lse, &d_o, &mut dq, &mut dk, &mut dv);
        });
        Some([widened(&o), lse, widened(&dq), widened(&dk), widened(&dv)].concat())
    }

    #[test]
    fn tile_kernel_gives_the_gemm_crates_bits() {
        let s = AttnShape {
            b: 2,
            t: 150,
            heads: 4,
            kv_heads: 2,
            head_dim: 40,
        };
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (name, avx2, avx512) in [
            (
                "f32",
                run::<f32>(Tier::Avx2, s),
                run::<f32>(Tier::Avx512, s),
            ),
            (
                "bf16",
                run::<bf16>(Tier::Avx2, s),
                run::<bf16>(Tier::Avx512, s),
            ),
        ] {
            let (Some(avx2), Some(avx512)) = (avx2, avx512) else {
                eprintln!("attention {name}: no AVX-512 on this CPU, the tile kernel is not used");
                continue;
            };
            assert_eq!(
                bits(avx512),
                bits(avx2),
                "attention {name}: tile kernel vs gemm crate"
            );
        }
    }

    #[test]
    fn every_simd_tier_agrees() {
        // A tile on the diagonal (part masked) and one below it, rows not a multiple of lanes.
        let (nr, nc, d) = (BR - 3, BC - 5, 64);
        let s0 = random(BR * BC, 15, 4.0);
        let acc0 = random(BR * d, 16, 1.0);
        let m0: [f32; BR] =
            std::array::from_fn(|r| if r % 7 == 0 { f32::NEG_INFINITY } else { 1.5 });
        for origin in [(0, 0), (64, 0)] {
            agree("attention online softmax tile", 1e-5, || {
                let (mut st, mut acc) = (s0.clone(), acc0.clone());
                let (mut m, mut l) = (m0, [3.0f32; BR]);
                softmax_cols(
                    &mut st,
                    (nr, nc),
                    origin,
                    0.125,
                    &mut acc,
                    d,
                    &mut m,
                    &mut l,
                );
                [st, acc, m.to_vec(), l.to_vec()].concat()
            });
            let (dp0, lse, di) = (
                random(BR * BC, 17, 1.0),
                random(BR, 18, 2.0),
                random(BR, 19, 0.5),
            );
            agree("attention gradient tile", 1e-5, || {
                let (mut st, mut dp) = (s0.clone(), dp0.clone());
                grad_cols(&mut st, &mut dp, (nr, nc), origin, 0.125, &lse, &di);
                [st, dp].concat()
            });
        }
        agree("attention row dot", 1e-5, || {
            vec![dot_d(&s0, &acc0[..s0.len().min(acc0.len())])]
        });
    }
}
