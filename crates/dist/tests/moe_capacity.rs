//! A mixture of experts with a capacity factor (Fedus et al. 2021 §2.1): each expert takes at
//! most ⌈cf · tokens · top_k / E⌉ of a micro-batch's copies, the later ones are dropped.
//! With room for every copy the model is exact routing, bit for bit; with drops its gradient
//! is the derivative of its loss (checked against central differences along a random
//! direction, in f64 sums of f32 losses), under every recompute policy; and expert-parallel
//! ranks, each dropping its own copies, equal one rank running their micro-batches in turn.

mod common;
use common::moe::{cfg, expert_parallel_run, step, targets_in};
use ferrotron_engine::model::{Llama, Recompute};

#[test]
fn room_for_every_copy_is_exact_routing() {
    let exact = Llama::new(cfg(4, 2));
    let params = exact.params.init(5, 0.2);
    // cf = E / top_k: each expert has room for every token.
    let roomy = Llama::new(cfg(4, 2)).with_capacity_factor(Some(2.0));
    let (mut g0, mut g1) = (vec![0.0; exact.num_params()], vec![0.0; exact.num_params()]);
    let nt = targets_in(1);
    let l0 = step(&exact, &params, &mut g0, 0, nt);
    let l1 = step(&roomy, &params, &mut g1, 0, nt);
    assert_eq!(l0, l1);
    assert_eq!(g0, g1);
}

#[test]
fn with_drops_the_gradient_is_the_loss_derivative() {
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        // Room for half the copies: ⌈0.5 · 16 · 2 / 4⌉ = 4 of each expert's.
        let model = Llama::new(cfg(4, 2))
            .with_capacity_factor(Some(0.5))
            .with_recompute(rc);
        let exact = Llama::new(cfg(4, 2)).with_recompute(rc);
        let params = model.params.init(7, 0.2);
        let nt = targets_in(2);
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

#[test]
fn expert_parallel_ranks_drop_what_one_rank_drops() {
    let c = cfg(4, 2);
    let one = Llama::new(c.clone()).with_capacity_factor(Some(0.5));
    let params = one.params.init(5, 0.2);
    let nt = targets_in(2);
    let mut want = vec![0.0f32; one.num_params()];
    let want_loss: f64 = (0..2).map(|r| step(&one, &params, &mut want, r, nt)).sum();
    let (loss, got, _) =
        expert_parallel_run(&c, 2, &params, nt, |m| m.with_capacity_factor(Some(0.5)));
    assert!(
        (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
        "loss {loss} vs {want_loss}"
    );
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in want.iter().zip(&got).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "gradient {i}: {x} vs {y}");
    }
}
