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

use super::scratch::KernelScratch;
use super::simd::{dot, exp_f32, SendPtr};
use super::tile_gemm::product as tile;
use crate::dispatch_fma;
use crate::dtype::Elem;
use crate::kernels::{AttnShape, RingShape, SeqPart};
use rayon::prelude::*;

/// Query rows per tile.
const BR: usize = 64;
/// Key rows per tile.
const BC: usize = 64;
/// Largest supported head dim.
pub const MAX_HEAD_DIM: usize = 512;

pub(super) fn check(s: &AttnShape) {
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
/// scores (key `c` is visible to query `r` when `kp[c] ≤ qp[r]`, their positions), then per query (a column of `st`, so the loops run across queries and vectorise):
/// updates the running max `m` and sum `l`, rescales the query's output row of `acc` (`d`
/// wide), and turns the scores into unnormalised probabilities in place. Each query's sum
/// runs over its keys in order from zero, as a row-wise loop would.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax_cols_generic<const F: bool>(
    st: &mut [f32],
    (nr, nc): (usize, usize),
    (qp, kp): (&[u32], &[u32]),
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
    let qp = &qp[..nr];
    for (c, &kc) in kp[..nc].iter().enumerate() {
        let row = &mut st[c * BR..c * BR + nr];
        for ((x, mn), &qr) in row.iter_mut().zip(m_new.iter_mut()).zip(qp) {
            *x = if kc <= qr {
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
dispatch_fma!(fn softmax_cols => softmax_cols_generic(st: &mut [f32], nrc: (usize, usize), pos: (&[u32], &[u32]), scale: f32, acc: &mut [f32], d: usize, m: &mut [f32; BR], l: &mut [f32; BR]));

/// `P = exp(S·scale − lse)` and `dS = scale·P ⊙ (dP − D)` for one tile stored transposed as in
/// [`softmax_cols`] (`S` in `st`, `dP` in `dpt`), causally masked (masked entries zeroed);
/// `lse` and `di` per query. `P` overwrites `S`, `dS` overwrites `dP`.
#[inline(always)]
fn grad_cols_generic<const F: bool>(
    st: &mut [f32],
    dpt: &mut [f32],
    (nr, nc): (usize, usize),
    (qp, kp): (&[u32], &[u32]),
    scale: f32,
    lse: &[f32],
    di: &[f32],
) {
    let (lse, di, qp) = (&lse[..nr], &di[..nr], &qp[..nr]);
    for (c, &kc) in kp[..nc].iter().enumerate() {
        let s = &mut st[c * BR..c * BR + nr];
        let dp = &mut dpt[c * BR..c * BR + nr];
        for r in 0..nr {
            if kc <= qp[r] {
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
dispatch_fma!(fn grad_cols => grad_cols_generic(st: &mut [f32], dpt: &mut [f32], nrc: (usize, usize), pos: (&[u32], &[u32]), scale: f32, lse: &[f32], di: &[f32]));

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

/// Which tokens the queries and the keys are (see [`SeqPart`]), and so which keys a query
/// sees.
#[derive(Clone, Copy)]
struct Parts {
    q: SeqPart,
    kv: SeqPart,
    t: usize,
}

impl Parts {
    fn causal(t: usize) -> Self {
        Parts {
            q: SeqPart::WHOLE,
            kv: SeqPart::WHOLE,
            t,
        }
    }

    /// Positions of queries `i0..i0 + nr` into `qp`; returns the latest.
    fn queries(&self, i0: usize, nr: usize, qp: &mut [u32; BR]) -> u32 {
        for (r, p) in qp.iter_mut().enumerate().take(nr) {
            *p = self.q.position(i0 + r, self.t) as u32;
        }
        qp[..nr].iter().copied().max().unwrap_or(0)
    }

    /// Positions of the keys of the tile at `j0` into `kp`, and how many of them to take: up
    /// to the last one visible from position `latest` (0: none is). The keys after it are
    /// left out rather than masked, so that the causal case runs the tiles the plain loop
    /// `j0 < i0 + nr` runs, to the same bits.
    fn keys(&self, j0: usize, latest: u32, kp: &mut [u32; BC]) -> usize {
        let nc = BC.min(self.t - j0);
        let mut take = 0;
        for (c, p) in kp.iter_mut().enumerate().take(nc) {
            *p = self.kv.position(j0 + c, self.t) as u32;
            if *p <= latest {
                take = c + 1;
            }
        }
        take
    }
}

/// `dst (=|+=) src`, rounding once into `O`.
fn put<O: Elem>(src: &[f32], dst: &mut [O], add: bool) {
    match add {
        true => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = O::from_f32(d.to_f32() + s)),
        false => O::store(src, dst),
    }
}

pub fn forward<S: Elem>(s: AttnShape, q: &[S], k: &[S], v: &[S], o: &mut [S], lse: &mut [f32]) {
    forward_core(s, Parts::causal(s.t), q, k, v, o, lse, false)
}

/// One step of ring attention: see `Kernels::attention_forward_ring`.
pub fn forward_ring<S: Elem>(
    s: RingShape,
    q: &[S],
    k: &[f32],
    v: &[f32],
    o: &mut [f32],
    lse: &mut [f32],
    first: bool,
) {
    let a = s.attn;
    assert!(
        s.q.ranks == 1 || a.t.is_multiple_of(2),
        "ring attention: {} tokens do not split into two chunks",
        a.t
    );
    let parts = Parts {
        q: s.q,
        kv: s.kv,
        t: a.t,
    };
    forward_core(a, parts, q, k, v, o, lse, !first)
}

/// The forward over queries of type `S`, keys and values of type `K`, into `o` of type `O`.
/// With `merge`, the online softmax starts from the running output and log-sum-exp already in
/// `o` and `lse` (the state `m = lse`, `l = 1`, `acc = o` is the same softmax), so that the
/// keys of this call are merged into those of earlier calls.
#[allow(clippy::too_many_arguments)]
fn forward_core<S: Elem, K: Elem, O: Elem>(
    s: AttnShape,
    parts: Parts,
    q: &[S],
    k: &[K],
    v: &[K],
    o: &mut [O],
    lse: &mut [f32],
    merge: bool,
) {
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
            let _scratch = KernelScratch::enter();
            (
                vec![0.0f32; BR * BC],
                vec![0.0f32; BR * d],
                Vec::new(),
                Vec::new(),
                Vec::new(),
            )
        },
        |(st, acc, qtb, kb, vb), task| {
            // The staged tiles grow to their size in the task's first use.
            let _scratch = KernelScratch::enter();
            let (bh, blk) = (task / nblk, task % nblk);
            let (b, h) = (bh / hh, bh % hh);
            let kvh = h / (hh / kv);
            let i0 = blk * BR;
            let nr = BR.min(t - i0);
            let q0 = ((b * t + i0) * hh + h) * d;
            let qt = transposed(q, q0, nr, qs, d, qtb);
            let (mut qp, mut kp) = ([0u32; BR], [0u32; BC]);
            let latest = parts.queries(i0, nr, &mut qp);
            let mut m = [f32::NEG_INFINITY; BR];
            let mut l = [0.0f32; BR];
            acc[..nr * d].fill(0.0);
            if merge {
                for r in 0..nr {
                    let i = i0 + r;
                    // SAFETY: row (b, i, h) of o and entry (b, h, i) of lse belong to this task.
                    let orow = unsafe { op.slice_mut(((b * t + i) * hh + h) * d, d) };
                    O::load(orow, &mut acc[r * d..(r + 1) * d]);
                    m[r] = unsafe { *lp.ptr().add((b * hh + h) * t + i) };
                    l[r] = 1.0;
                }
            }
            let mut j0 = 0;
            while j0 < t {
                let nc = parts.keys(j0, latest, &mut kp);
                if nc == 0 {
                    j0 += BC;
                    continue;
                }
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
                softmax_cols(st, (nr, nc), (&qp, &kp), scale, acc, d, &mut m, &mut l);
                // O += P V_j, P read from Sᵀ by columns
                unsafe { tile((nr, d, nc), acc.as_mut_ptr(), d, st, (1, BR), vt, vst, true) };
                j0 += BC;
            }
            for r in 0..nr {
                let i = i0 + r;
                // SAFETY: row (b, i, h) of o and entry (b, h, i) of lse belong to this task.
                let orow = unsafe { op.slice_mut(((b * t + i) * hh + h) * d, d) };
                let inv = 1.0 / l[r];
                for (x, a) in orow.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                    *x = O::from_f32(a * inv);
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
    let parts = Parts::causal(s.t);
    backward_core(s, parts, q, k, v, o, lse, d_o, (dq, dk, dv), false)
}

/// One step of ring attention's backward: see `Kernels::attention_backward_ring`.
#[allow(clippy::too_many_arguments)]
pub fn backward_ring<S: Elem>(
    s: RingShape,
    q: &[S],
    k: &[f32],
    v: &[f32],
    o: &[S],
    lse: &[f32],
    d_o: &[S],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let parts = Parts {
        q: s.q,
        kv: s.kv,
        t: s.attn.t,
    };
    backward_core(s.attn, parts, q, k, v, o, lse, d_o, (dq, dk, dv), true)
}

/// The backward over queries (and `o`, `dO`) of type `S`, keys and values of type `K`, into
/// gradients of type `D`, overwritten or (`add`) added to.
#[allow(clippy::too_many_arguments)]
fn backward_core<S: Elem, K: Elem, D: Elem>(
    s: AttnShape,
    parts: Parts,
    q: &[S],
    k: &[K],
    v: &[K],
    o: &[S],
    lse: &[f32],
    d_o: &[S],
    (dq, dk, dv): (&mut [D], &mut [D], &mut [D]),
    add: bool,
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
            let _scratch = KernelScratch::enter();
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
            let _scratch = KernelScratch::enter();
            let (b, kvh) = (task / kv, task % kv);
            let kvrow = |j: usize| ((b * t + j) * kv + kvh) * d;
            let (mut qp, mut kp) = ([0u32; BR], [0u32; BC]);
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
                    let latest = parts.queries(i0, nr, &mut qp);
                    let mut di = [0.0f32; BR];
                    for (r, x) in di.iter_mut().enumerate().take(nr) {
                        *x = dot_d(&dor[r * dost..r * dost + d], &or[r * ost..r * ost + d]);
                    }
                    dq_acc[..nr * d].fill(0.0);
                    let mut j0 = 0;
                    while j0 < t {
                        let nc = parts.keys(j0, latest, &mut kp);
                        if nc == 0 {
                            j0 += BC;
                            continue;
                        }
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
                        grad_cols(st, dpt, (nr, nc), (&qp, &kp), scale, lse_i, &di);
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
                        j0 += BC;
                    }
                    for r in 0..nr {
                        // SAFETY: dq row (b, i0 + r, h) belongs to this task (h in its group).
                        let row = unsafe { dqp.slice_mut(q0 + r * qs, d) };
                        put(&dq_acc[r * d..(r + 1) * d], row, add);
                    }
                    i0 += nr;
                }
            }
            for j in 0..t {
                // SAFETY: the (b, ·, kvh) rows of dk/dv belong to this task.
                put(
                    &dk_acc[j * d..(j + 1) * d],
                    unsafe { dkp.slice_mut(kvrow(j), d) },
                    add,
                );
                put(
                    &dv_acc[j * d..(j + 1) * d],
                    unsafe { dvp.slice_mut(kvrow(j), d) },
                    add,
                );
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
        for (i0, j0) in [(0, 0), (64, 0)] {
            let qp: [u32; BR] = std::array::from_fn(|r| (i0 + r) as u32);
            let kp: [u32; BC] = std::array::from_fn(|c| (j0 + c) as u32);
            let origin = (&qp[..], &kp[..]);
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

    /// Ring attention over `ranks` ranks (each rank's queries against every rank's block,
    /// merged step by step; every block's dK, dV summed over the ranks) equals causal attention
    /// over the whole sequence, forward and backward, on sequences whose chunks do not fill
    /// the tiles.
    #[test]
    fn ring_steps_equal_the_whole_sequence() {
        for ranks in [2usize, 3] {
            let (b, c, hh, kv, d) = (2, 40, 4, 2, 16);
            let (tl, t) = (2 * c, 2 * c * ranks);
            let whole = AttnShape {
                b,
                t,
                heads: hh,
                kv_heads: kv,
                head_dim: d,
            };
            let local = AttnShape { t: tl, ..whole };
            let (q, k, v, d_o) = (
                random(whole.q_len(), 31, 1.0),
                random(whole.kv_len(), 32, 1.0),
                random(whole.kv_len(), 33, 1.0),
                random(whole.q_len(), 34, 1.0),
            );
            let mut o = vec![0.0f32; whole.q_len()];
            let mut lse = vec![0.0f32; whole.lse_len()];
            forward(whole, &q, &k, &v, &mut o, &mut lse);
            let (mut dq, mut dk, mut dv) = (
                vec![0.0f32; whole.q_len()],
                vec![0.0f32; whole.kv_len()],
                vec![0.0f32; whole.kv_len()],
            );
            backward(whole, &q, &k, &v, &o, &lse, &d_o, &mut dq, &mut dk, &mut dv);
            let part = |r| SeqPart { rank: r, ranks };
            // Rows `[b, i, ·]` of rank r's tokens, `w` wide, from a whole-sequence tensor.
            let rows = |x: &[f32], r: usize, w: usize| -> Vec<f32> {
                let mut out = Vec::new();
                for bi in 0..b {
                    for i in 0..tl {
                        let p = part(r).position(i, tl);
                        out.extend_from_slice(&x[(bi * t + p) * w..(bi * t + p + 1) * w]);
                    }
                }
                out
            };
            let (qw, kw) = (hh * d, kv * d);
            let (mut dk_ring, mut dv_ring) = (vec![0.0f32; dk.len()], vec![0.0f32; dv.len()]);
            let blocks: Vec<_> = (0..ranks)
                .map(|r| (rows(&k, r, kw), rows(&v, r, kw)))
                .collect();
            let mut grads =
                vec![(vec![0.0f32; local.kv_len()], vec![0.0f32; local.kv_len()]); ranks];
            for r in 0..ranks {
                let (ql, dol) = (rows(&q, r, qw), rows(&d_o, r, qw));
                let mut ol = vec![0.0f32; local.q_len()];
                let mut lsel = vec![0.0f32; local.lse_len()];
                // Step `step` of rank r's ring: the block of rank r − step, and its shape.
                let ring = |step: usize| {
                    let src = (r + ranks - step) % ranks;
                    let s = RingShape {
                        attn: local,
                        q: part(r),
                        kv: part(src),
                    };
                    (src, s)
                };
                for step in 0..ranks {
                    let (src, s) = ring(step);
                    let (kb, vb) = &blocks[src];
                    forward_ring(s, &ql, kb, vb, &mut ol, &mut lsel, step == 0);
                }
                let close = |what: &str, a: &[f32], e: &[f32]| {
                    for (x, y) in a.iter().zip(e) {
                        assert!(
                            (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
                            "cp {ranks} rank {r} {what}: {x} vs {y}"
                        );
                    }
                };
                close("o", &ol, &rows(&o, r, qw));
                let lse_r: Vec<f32> = (0..b * hh)
                    .flat_map(|bh| {
                        let lse = &lse;
                        (0..tl).map(move |i| lse[bh * t + part(r).position(i, tl)])
                    })
                    .collect();
                close("lse", &lsel, &lse_r);
                let mut dql = vec![0.0f32; local.q_len()];
                for step in 0..ranks {
                    let (src, s) = ring(step);
                    let (kb, vb) = &blocks[src];
                    let (dkb, dvb) = &mut grads[src];
                    backward_ring(s, &ql, kb, vb, &ol, &lsel, &dol, &mut dql, dkb, dvb);
                }
                close("dq", &dql, &rows(&dq, r, qw));
            }
            for (r, (dkb, dvb)) in grads.iter().enumerate() {
                for bi in 0..b {
                    for i in 0..tl {
                        let p = part(r).position(i, tl);
                        let (at, from) = ((bi * t + p) * kw, (bi * tl + i) * kw);
                        dk_ring[at..at + kw].copy_from_slice(&dkb[from..from + kw]);
                        dv_ring[at..at + kw].copy_from_slice(&dvb[from..from + kw]);
                    }
                }
            }
            for (what, a, e) in [("dk", &dk_ring, &dk), ("dv", &dv_ring, &dv)] {
                for (x, y) in a.iter().zip(e.iter()) {
                    assert!(
                        (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
                        "cp {ranks} {what}: {x} vs {y}"
                    );
                }
            }
        }
    }
}
