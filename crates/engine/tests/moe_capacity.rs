//! A mixture of experts with a capacity factor (Fedus et al. 2021 §2.1): each expert takes at
//! most ⌈cf · tokens · top_k / E⌉ of a micro-batch's copies, the later ones are dropped.
//! With room for every copy the model is exact routing, bit for bit; with drops its gradient
//! is the derivative of its loss (checked against central differences along a random
//! direction, in f64 sums of f32 losses), under every recompute policy; and expert-parallel
//! ranks, each dropping its own copies, equal one rank running their micro-batches in turn.

use ferrotron_dist::threads::{self, ThreadComm};
use ferrotron_dist::Communicator;
use ferrotron_engine::kernels::{CpuKernels, Kernels};
use ferrotron_engine::model::{
    BatchShape, EpComm, ExpertParallel, HeapPool, Llama, LlamaConfig, MoeConfig, Recompute,
};
use std::rc::Rc;
use std::time::Duration;

fn cfg() -> LlamaConfig {
    LlamaConfig {
        hidden: 32,
        intermediate: 48,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        layers: 2,
        vocab: 48,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        tie_embeddings: true,
        qkv_bias: false,
        max_pos: 64,
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            norm_topk: true,
            aux_loss_coef: 0.05,
        }),
    }
}

const B: usize = 2;
const T: usize = 8;

fn batch(r: usize) -> (Vec<u32>, Vec<u32>) {
    let n = B * T;
    let tokens = (0..n).map(|i| ((i * 7 + r * 13 + 3) % 48) as u32).collect();
    let targets = (0..n).map(|i| ((i * 5 + r * 11 + 1) % 48) as u32).collect();
    (tokens, targets)
}

/// Loss sum of micro-batch `r` and (accumulated into `grads`) its gradient, normalised by `nt`
/// target tokens.
fn step(model: &Llama, params: &[f32], grads: &mut [f32], r: usize, nt: usize) -> f64 {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::new();
    let (tokens, targets) = batch(r);
    let shape = BatchShape { b: B, t: T };
    let (acts, l) = model.forward_train(k, &mut pool, params, grads, shape, &tokens, &targets, nt);
    model.backward(k, &mut pool, params, grads, acts, &tokens);
    assert_eq!(pool.live_bytes, 0, "every buffer returned");
    l.sum
}

#[test]
fn room_for_every_copy_is_exact_routing() {
    let exact = Llama::new(cfg());
    let params = exact.params.init(5, 0.2);
    // cf = E / top_k: each expert has room for every token.
    let roomy = Llama::new(cfg()).with_capacity_factor(Some(2.0));
    let (mut g0, mut g1) = (vec![0.0; exact.num_params()], vec![0.0; exact.num_params()]);
    let l0 = step(&exact, &params, &mut g0, 0, B * T);
    let l1 = step(&roomy, &params, &mut g1, 0, B * T);
    assert_eq!(l0, l1);
    assert_eq!(g0, g1);
}

#[test]
fn with_drops_the_gradient_is_the_loss_derivative() {
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        // Room for half the copies: ⌈0.5 · 16 · 2 / 4⌉ = 4 of each expert's.
        let model = Llama::new(cfg())
            .with_capacity_factor(Some(0.5))
            .with_recompute(rc);
        let exact = Llama::new(cfg()).with_recompute(rc);
        let params = model.params.init(7, 0.2);
        let nt = B * T;
        let mut g = vec![0.0f32; model.num_params()];
        let loss = step(&model, &params, &mut g, 1, nt);
        let mut g_exact = vec![0.0f32; model.num_params()];
        let loss_exact = step(&exact, &params, &mut g_exact, 1, nt);
        assert!(
            (loss - loss_exact).abs() > 1e-3 * loss_exact.abs(),
            "{rc}: the capacity dropped nothing ({loss} vs {loss_exact})"
        );
        // A direction of ±1 per parameter, and the loss's change along it. The loss is smooth
        // only between routing decisions (a top-k choice or a drop flips where two logits or
        // two tokens' claims meet), so a step that crosses one jumps: the derivative is taken
        // at two small steps and the better one must agree (a wrong gradient fails both).
        let dir: Vec<f32> = (0..params.len())
            .map(|i| {
                if (i * 2654435761usize) >> 7 & 1 == 0 {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect();
        let at = |s: f32| -> f64 {
            let p: Vec<f32> = params.iter().zip(&dir).map(|(p, d)| p + s * d).collect();
            let mut scratch = vec![0.0f32; model.num_params()];
            step(&model, &p, &mut scratch, 1, nt) / nt as f64
        };
        let analytic: f64 = g
            .iter()
            .zip(&dir)
            .map(|(g, d)| (*g as f64) * (*d as f64))
            .sum();
        let errors: Vec<f64> = [3e-4f32, 1e-4]
            .iter()
            .map(|&eps| {
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps as f64);
                (numeric - analytic).abs() / analytic.abs()
            })
            .collect();
        let best = errors.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(
            best < 2e-2,
            "{rc}: the backward's directional derivative {analytic} is off the central differences by {errors:?}"
        );
    }
}

struct Group(ThreadComm);

impl EpComm for Group {
    fn size(&self) -> usize {
        self.0.size()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn exchange(&self, send: &[f32], sc: &[usize], recv: &mut [f32], rc: &[usize]) {
        self.0
            .all_to_all_v(send, sc, recv, rc, &mut Vec::new())
            .unwrap()
    }
}

#[test]
fn expert_parallel_ranks_drop_what_one_rank_drops() {
    let c = cfg();
    let one = Llama::new(c.clone()).with_capacity_factor(Some(0.5));
    let params = one.params.init(5, 0.2);
    let nt = 2 * B * T;
    let mut want = vec![0.0f32; one.num_params()];
    let want_loss: f64 = (0..2).map(|r| step(&one, &params, &mut want, r, nt)).sum();
    let p = params.clone();
    let ranks = threads::run(2, Duration::from_secs(60), move |r, comm| {
        let par = ExpertParallel::new(&c, Rc::new(Group(comm))).map_err(|e| e.to_string())?;
        let model = Llama::expert_parallel(c.clone(), par).with_capacity_factor(Some(0.5));
        let whole = Llama::new(c.clone());
        let placed: Vec<_> = (model.params.entries.iter())
            .map(|e| {
                (
                    e.range(),
                    whole.params.get(&e.name).unwrap().range(),
                    e.name.clone(),
                )
            })
            .collect();
        let mut local = vec![0.0; model.num_params()];
        for (l, w, _) in &placed {
            local[l.clone()].copy_from_slice(&p[w.clone()]);
        }
        let mut grads = vec![0.0; model.num_params()];
        let loss = step(&model, &local, &mut grads, r, nt);
        let out: Vec<_> = (placed.into_iter())
            .map(|(l, w, name)| (w, name, grads[l].to_vec()))
            .collect();
        Ok((loss, out))
    });
    let mut got = vec![0.0f32; want.len()];
    let mut loss = 0.0;
    for rank in ranks {
        let (l, placed) = rank.unwrap();
        loss += l;
        for (w, name, g) in placed {
            match name.contains(".experts.") {
                true => got[w].copy_from_slice(&g),
                false => got[w].iter_mut().zip(&g).for_each(|(s, x)| *s += x),
            }
        }
    }
    assert!(
        (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
        "loss {loss} vs {want_loss}"
    );
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in want.iter().zip(&got).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "gradient {i}: {x} vs {y}");
    }
}
