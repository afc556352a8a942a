//! Golden tests against HF transformers (PyTorch, CPU, fp32) fixtures written by
//! `tests/reference/llama_reference.py` into `tests/fixtures/<name>/`:
//! `config.json`, `params.safetensors` (HF names; tied models have no `lm_head.weight`),
//! `io.safetensors` (`input_ids` i64 [B,T], `targets` i64 [B,T] with -100 = ignore, `logits`
//! f32 [B,T,V], `loss` f32 [1]), `grads.safetensors` (d mean-loss / d param),
//! `activations.safetensors` (`embed`, `layer.{i}` outputs), `adamw.json` (hyper-parameters,
//! 10-step loss / pre-clip grad-norm trajectory), `params_after_10.safetensors`.
//!
//! Tolerances (max |ours − torch| / max |torch| per tensor): logits and hidden states 1e-5,
//! loss 1e-5 relative, gradients 1e-4, the 10-step AdamW trajectory (with grad clipping) 1e-4
//! relative on losses and pre-clip grad norms, and parameters after 10 steps within
//! 1e-2·lr·steps absolute, 3e-2 for k-proj biases (see `check_adamw_trajectory` for why).

mod common;

use common::fixture::{f32s, load, load_params, num_targets, read};
use common::rel_err;
use ferrotron_engine::kernels::{AdamWParams, CpuKernels, Kernels, NO_PARAMS};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use ferrotron_engine::model::HeapPool;
use safetensors::SafeTensors;

fn check_forward_backward(name: &str) {
    let f = load(name);
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::new();
    let io_bytes = read(&f.dir, "io.safetensors");
    let io = SafeTensors::deserialize(&io_bytes).unwrap();

    // Logits of every position.
    let (_, want_logits) = f32s(&io, "logits");
    let mut logits = vec![0.0; f.batch.n() * f.model.config.vocab];
    f.model
        .forward_logits(k, &mut pool, &f.params, f.batch, &f.tokens, &mut logits);
    let e = rel_err(&logits, &common::to64(&want_logits));
    assert!(e < 1e-5, "{name}: logits rel err {e:.2e}");

    // Last-position logits (sampling path) agree with the full forward.
    let v = f.model.config.vocab;
    let mut last = vec![0.0; f.batch.b * v];
    f.model
        .forward_logits_last(k, &mut pool, &f.params, f.batch, &f.tokens, &mut last);
    for b in 0..f.batch.b {
        let row = (b * f.batch.t + f.batch.t - 1) * v;
        let e = rel_err(
            &last[b * v..(b + 1) * v],
            &common::to64(&want_logits[row..row + v]),
        );
        assert!(e < 1e-5, "{name}: last logits rel err {e:.2e}");
    }

    // Training forward: loss and hidden states.
    let (_, want_loss) = f32s(&io, "loss");
    let mut grads = vec![0.0f32; f.model.num_params()];
    let nt = num_targets(&f);
    let (acts, loss) = f.model.forward_train(
        k, &mut pool, &f.params, &mut grads, f.batch, &f.tokens, &f.targets, nt,
    );
    assert_eq!(loss.count, nt);
    let rel = (loss.mean() - want_loss[0] as f64).abs() / want_loss[0] as f64;
    assert!(
        rel < 1e-5,
        "{name}: loss {} vs torch {} (rel {rel:.2e})",
        loss.mean(),
        want_loss[0]
    );
    let ab = read(&f.dir, "activations.safetensors");
    let act = SafeTensors::deserialize(&ab).unwrap();
    for (i, la) in acts.layers.iter().enumerate() {
        let key = if i == 0 {
            "embed".to_string()
        } else {
            format!("layer.{}", i - 1)
        };
        let (_, want) = f32s(&act, &key);
        let e = rel_err(&la.input, &common::to64(&want));
        assert!(e < 1e-5, "{name}: hidden state {key} rel err {e:.2e}");
    }
    let (_, want) = f32s(&act, &format!("layer.{}", f.model.config.layers - 1));
    let e = rel_err(&acts.final_input, &common::to64(&want));
    assert!(e < 1e-5, "{name}: last layer output rel err {e:.2e}");

    // Backward: every parameter gradient.
    f.model
        .backward(k, &mut pool, &f.params, &mut grads, acts, &f.tokens);
    assert_eq!(pool.live_bytes, 0, "all activations returned to the pool");
    let gb = read(&f.dir, "grads.safetensors");
    let want_grads = load_params(&f.model, &gb);
    let mut worst = (0.0f64, String::new());
    for e in &f.model.params.entries {
        let err = rel_err(&grads[e.range()], &common::to64(&want_grads[e.range()]));
        if err > worst.0 {
            worst = (err, e.name.clone());
        }
    }
    eprintln!("{name}: worst grad rel err {:.2e} ({})", worst.0, worst.1);
    assert!(
        worst.0 < 1e-4,
        "{name}: grad {} rel err {:.2e} > 1e-4",
        worst.1,
        worst.0
    );
}

fn check_adamw_trajectory(name: &str) {
    let f = load(name);
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::new();
    let j: serde_json::Value =
        serde_json::from_slice(&read(&f.dir, "adamw.json")).expect("adamw.json");
    let num = |key: &str| {
        j[key]
            .as_f64()
            .unwrap_or_else(|| panic!("adamw.json {key}"))
    };
    let betas = j["betas"].as_array().unwrap();
    let steps = j["steps"].as_u64().unwrap();
    let max_norm = num("max_grad_norm");
    let want_losses: Vec<f64> = j["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let want_norms: Vec<f64> = j["grad_norms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();

    let n = f.model.num_params();
    let mut params = f.params.clone();
    let (mut grads, mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let nt = num_targets(&f);
    for step in 1..=steps {
        grads.fill(0.0);
        let (acts, loss) = f.model.forward_train(
            k, &mut pool, &params, &mut grads, f.batch, &f.tokens, &f.targets, nt,
        );
        f.model
            .backward(k, &mut pool, &params, &mut grads, acts, &f.tokens);
        let norm = k.sum_squares(grads.view()).sqrt();
        // torch.nn.utils.clip_grad_norm_: coef = min(1, max_norm / (norm + 1e-6)), always applied.
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        k.scale(grads.view_mut(), coef as f32);
        let s = (step - 1) as usize;
        let (le, ne) = (
            (loss.mean() - want_losses[s]).abs() / want_losses[s],
            (norm - want_norms[s]).abs() / want_norms[s],
        );
        assert!(
            le < 1e-4,
            "{name}: step {step} loss {} vs {} (rel {le:.2e})",
            loss.mean(),
            want_losses[s]
        );
        assert!(
            ne < 1e-4,
            "{name}: step {step} grad norm {norm} vs {} (rel {ne:.2e})",
            want_norms[s]
        );
        let h = AdamWParams {
            lr: num("lr"),
            beta1: betas[0].as_f64().unwrap(),
            beta2: betas[1].as_f64().unwrap(),
            eps: num("eps"),
            weight_decay: num("weight_decay"),
            grad_scale: 1.0,
            step,
        };
        k.adamw_step(
            h,
            params.view_mut(),
            grads.view(),
            m.view_mut(),
            v.view_mut(),
            NO_PARAMS,
        );
    }
    let pb = read(&f.dir, &format!("params_after_{steps}.safetensors"));
    let want = load_params(&f.model, &pb);
    // Adam's m/sqrt(v) is ill-conditioned where a gradient entry is nearly zero. k-proj biases
    // are the extreme case: softmax is shift invariant, so only RoPE gives them a gradient at
    // all. Measured on tiny-qwen2: multiplying every gradient by (1 ± 1e-6) (noise far below
    // f32 kernel differences) moves layer-1 k_proj.bias by 7.3e-4 after 10 steps, while all
    // other tensors move < 1e-4. Parameters are therefore compared in absolute terms against
    // the distance Adam can move a parameter in `steps` steps (≈ lr·steps): ≤ 1% of it, ≤ 3%
    // for k_proj biases.
    let budget = num("lr") * steps as f64;
    for e in &f.model.params.entries {
        let diff = params[e.range()]
            .iter()
            .zip(&want[e.range()])
            .fold(0.0f64, |a, (x, y)| a.max((*x as f64 - *y as f64).abs()));
        let tol = if e.name.ends_with("k_proj.bias") {
            3e-2
        } else {
            1e-2
        };
        assert!(
            diff < tol * budget,
            "{name}: param {} after {steps} steps off by {diff:.2e} = {:.2e}·lr·steps > {tol}",
            e.name,
            diff / budget
        );
    }
}

#[test]
fn golden_tiny_tied() {
    check_forward_backward("tiny-tied");
}

#[test]
fn golden_tiny_gqa() {
    check_forward_backward("tiny-gqa");
}

#[test]
fn golden_tiny_qwen2_bias() {
    check_forward_backward("tiny-qwen2");
}

/// Mixtral (`MixtralForCausalLM`, 4 experts, top-2, load-balancing loss weight 0.05): logits,
/// the loss with its load-balancing term, every gradient (router and experts included).
#[test]
fn golden_tiny_mixtral() {
    check_forward_backward("tiny-mixtral");
}

#[test]
fn golden_adamw_trajectory_tiny_mixtral() {
    check_adamw_trajectory("tiny-mixtral");
}

#[test]
fn golden_adamw_trajectory_tiny_tied() {
    check_adamw_trajectory("tiny-tied");
}

#[test]
fn golden_adamw_trajectory_tiny_gqa() {
    check_adamw_trajectory("tiny-gqa");
}

#[test]
fn golden_adamw_trajectory_tiny_qwen2() {
    check_adamw_trajectory("tiny-qwen2");
}
