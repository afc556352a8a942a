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
//! The tile products are small sgemms (`gemm` crate, single threaded, f32 operands read in
//! place; 16-bit q/k/v/o/dO tiles are widened into task-local tiles first, and outputs
//! rounded on store; dQ/dK/dV accumulate in task-local f32 before their one rounding). Parallelism: forward over (batch, query head); backward over (batch, kv head), so the
//! dK/dV rows a task accumulates into are owned by it (all query heads of a GQA group add into
//! the same kv head) and the dQ rows of the group's heads too.

use super::matmul::sgemm_raw;
use super::simd::{dot, exp_f32, SendPtr};
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

/// Online-softmax update of one score row (already scaled and masked with -inf): rescales the
/// row's output accumulator, turns the scores into unnormalised probabilities in place.
#[inline(always)]
fn softmax_row_generic<const F: bool>(srow: &mut [f32], acc: &mut [f32], m: &mut f32, l: &mut f32) {
    let mb = srow.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    let m_new = m.max(mb);
    if m_new == f32::NEG_INFINITY {
        srow.fill(0.0); // fully masked so far: contributes nothing
        return;
    }
    let alpha = exp_f32::<F>(*m - m_new);
    if alpha != 1.0 {
        *l *= alpha;
        acc.iter_mut().for_each(|a| *a *= alpha);
    }
    let mut ls = 0.0f32;
    for x in srow.iter_mut() {
        *x = exp_f32::<F>(*x - m_new);
        ls += *x;
    }
    *l += ls;
    *m = m_new;
}
dispatch_fma!(fn softmax_row => softmax_row_generic(srow: &mut [f32], acc: &mut [f32], m: &mut f32, l: &mut f32));

/// `P = exp(S·scale − lse)` and `dS = scale·P ⊙ (dP − D)` for one tile row, causal-masked at
/// column `valid` (entries `≥ valid` are zeroed). `P` overwrites `S`, `dS` overwrites `dP`.
#[inline(always)]
fn grad_row_generic<const F: bool>(
    s: &mut [f32],
    dp: &mut [f32],
    valid: usize,
    scale: f32,
    lse: f32,
    di: f32,
) {
    let n = s.len();
    let dp = &mut dp[..n];
    for c in 0..n {
        if c < valid {
            let p = exp_f32::<F>(s[c] * scale - lse);
            s[c] = p;
            dp[c] = scale * p * (dp[c] - di);
        } else {
            s[c] = 0.0;
            dp[c] = 0.0;
        }
    }
}
dispatch_fma!(fn grad_row => grad_row_generic(s: &mut [f32], dp: &mut [f32], valid: usize, scale: f32, lse: f32, di: f32));

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

/// Task-local f32 tiles: scores, a second score-sized tile, and staged q/k/v (16-bit inputs).
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
        |(st, acc, qb, kb, vb), task| {
            let (bh, blk) = (task / nblk, task % nblk);
            let (b, h) = (bh / hh, bh % hh);
            let kvh = h / (hh / kv);
            let i0 = blk * BR;
            let nr = BR.min(t - i0);
            let q0 = ((b * t + i0) * hh + h) * d;
            let (qt, qst) = rows_f32(q, q0, nr, qs, d, qb);
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
                // S = Q_i K_jᵀ
                unsafe {
                    sgemm_raw(
                        nr,
                        nc,
                        d,
                        st.as_mut_ptr(),
                        (BC, 1),
                        qt,
                        (qst, 1),
                        kt,
                        (1, kst),
                        false,
                        false,
                    )
                };
                for r in 0..nr {
                    let i = i0 + r;
                    let row = &mut st[r * BC..r * BC + nc];
                    for (c, x) in row.iter_mut().enumerate() {
                        *x = if j0 + c <= i {
                            *x * scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                    softmax_row(row, &mut acc[r * d..(r + 1) * d], &mut m[r], &mut l[r]);
                }
                // O += P V_j
                unsafe {
                    sgemm_raw(
                        nr,
                        d,
                        nc,
                        acc.as_mut_ptr(),
                        (d, 1),
                        st,
                        (BC, 1),
                        vt,
                        (vst, 1),
                        true,
                        false,
                    )
                };
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
    // Per task: the score tiles, f32 accumulators for its dK/dV rows ([T, D] each) and for one
    // dQ tile, and staged q/k/v/o/dO tiles (16-bit inputs).
    (0..s.b * kv).into_par_iter().for_each_init(
        || {
            (
                (vec![0.0f32; BR * BC], vec![0.0f32; BR * BC]),
                (
                    vec![0.0f32; t * d],
                    vec![0.0f32; t * d],
                    vec![0.0f32; BR * d],
                ),
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()),
            )
        },
        |((st, dpt), (dk_acc, dv_acc, dq_acc), (qb, kb, vb, ob, dob)), task| {
            let (b, kvh) = (task / kv, task % kv);
            let kvrow = |j: usize| ((b * t + j) * kv + kvh) * d;
            dk_acc.fill(0.0);
            dv_acc.fill(0.0);
            for h in kvh * group..(kvh + 1) * group {
                let mut i0 = 0;
                while i0 < t {
                    let nr = BR.min(t - i0);
                    let q0 = ((b * t + i0) * hh + h) * d;
                    let (qt, qst) = rows_f32(q, q0, nr, qs, d, qb);
                    let (dot, dost) = rows_f32(d_o, q0, nr, qs, d, dob);
                    let (ot, ost) = rows_f32(o, q0, nr, qs, d, ob);
                    let mut di = [0.0f32; BR];
                    for (r, x) in di.iter_mut().enumerate().take(nr) {
                        *x = dot_d(&dot[r * dost..r * dost + d], &ot[r * ost..r * ost + d]);
                    }
                    dq_acc[..nr * d].fill(0.0);
                    let kend = i0 + nr;
                    let mut j0 = 0;
                    while j0 < kend {
                        let nc = BC.min(kend - j0);
                        let k0 = kvrow(j0);
                        let (kt, kst) = rows_f32(k, k0, nc, ks, d, kb);
                        let (vt, vst) = rows_f32(v, k0, nc, ks, d, vb);
                        // SAFETY (all sgemm_raw below): every destination is task-local.
                        unsafe {
                            // S = Q_i K_jᵀ, dP = dO_i V_jᵀ
                            sgemm_raw(
                                nr,
                                nc,
                                d,
                                st.as_mut_ptr(),
                                (BC, 1),
                                qt,
                                (qst, 1),
                                kt,
                                (1, kst),
                                false,
                                false,
                            );
                            sgemm_raw(
                                nr,
                                nc,
                                d,
                                dpt.as_mut_ptr(),
                                (BC, 1),
                                dot,
                                (dost, 1),
                                vt,
                                (1, vst),
                                false,
                                false,
                            );
                        }
                        for r in 0..nr {
                            let i = i0 + r;
                            let valid = (i + 1).saturating_sub(j0).min(nc);
                            let l = lse[(b * hh + h) * t + i];
                            grad_row(
                                &mut st[r * BC..r * BC + nc],
                                &mut dpt[r * BC..r * BC + nc],
                                valid,
                                scale,
                                l,
                                di[r],
                            );
                        }
                        unsafe {
                            // dV_j += Pᵀ dO_i ; dK_j += dSᵀ Q_i ; dQ_i += dS K_j  (dS already scaled)
                            sgemm_raw(
                                nc,
                                d,
                                nr,
                                dv_acc.as_mut_ptr().add(j0 * d),
                                (d, 1),
                                st,
                                (1, BC),
                                dot,
                                (dost, 1),
                                true,
                                false,
                            );
                            sgemm_raw(
                                nc,
                                d,
                                nr,
                                dk_acc.as_mut_ptr().add(j0 * d),
                                (d, 1),
                                dpt,
                                (1, BC),
                                qt,
                                (qst, 1),
                                true,
                                false,
                            );
                            sgemm_raw(
                                nr,
                                d,
                                nc,
                                dq_acc.as_mut_ptr(),
                                (d, 1),
                                dpt,
                                (BC, 1),
                                kt,
                                (kst, 1),
                                true,
                                false,
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
