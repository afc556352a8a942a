//! Model-level invariants that do not need fixtures: gradient accumulation equivalence,
//! LM-head chunking invariance, buffer-pool accounting against the activation inventory.

mod common;

use common::{rel_err, to64, Rng};
use ferrotron_engine::kernels::{AsView, CpuKernels, Kernels, View, IGNORE_INDEX};
use ferrotron_engine::model::{
    BatchShape, BufName, BufferPool, HeapPool, Llama, LlamaConfig, Recompute,
};
use std::collections::HashMap;

fn cfg(tie: bool, bias: bool) -> LlamaConfig {
    common::dense_cfg(tie, bias)
}

fn data(rng: &mut Rng, n: usize, vocab: u32) -> (Vec<u32>, Vec<u32>) {
    let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab)).collect();
    let mut targets: Vec<u32> = (0..n).map(|_| rng.below(vocab)).collect();
    targets[1] = IGNORE_INDEX;
    targets[n - 2] = IGNORE_INDEX;
    (tokens, targets)
}

/// Gradients of the global mean loss, computed over `micro` micro-batches of `b / micro`.
fn grads_accumulated(
    model: &Llama,
    params: &[f32],
    tokens: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    micro: usize,
) -> (Vec<f32>, f64) {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::new();
    let mut grads = vec![0.0f32; model.num_params()];
    let nt = targets.iter().filter(|&&x| x != IGNORE_INDEX).count();
    let mbs = b / micro;
    let mut loss = 0.0;
    for m in 0..micro {
        let r = m * mbs * t..(m + 1) * mbs * t;
        let batch = BatchShape { b: mbs, t };
        let (acts, l) = model.forward_train(
            k,
            &mut pool,
            params,
            &mut grads,
            batch,
            &tokens[r.clone()],
            &targets[r.clone()],
            nt,
        );
        model.backward(k, &mut pool, params, &mut grads, acts, &tokens[r]);
        loss += l.sum;
    }
    assert_eq!(pool.live_bytes, 0);
    (grads, loss / nt as f64)
}

#[test]
fn gradient_accumulation_matches_full_batch() {
    let model = Llama::new(cfg(false, true));
    let params = model.params.init(7, 0.1);
    let (b, t) = (4, 24);
    let (tokens, targets) = data(&mut Rng::new(3), b * t, 80);
    let (full, loss_full) = grads_accumulated(&model, &params, &tokens, &targets, b, t, 1);
    assert!(full.iter().any(|&g| g != 0.0));
    for micro in [2, 4] {
        let (acc, loss) = grads_accumulated(&model, &params, &tokens, &targets, b, t, micro);
        assert!(
            (loss - loss_full).abs() < 1e-6 * loss_full,
            "loss {loss} vs {loss_full}"
        );
        // Per tensor, relative to the tensor's max magnitude: 1e-5 (f32 summation order only).
        for e in &model.params.entries {
            let err = rel_err(&acc[e.range()], &to64(&full[e.range()]));
            assert!(
                err < 1e-5,
                "{} x{micro}: {} rel err {err:.2e}",
                micro,
                e.name
            );
        }
    }
}

#[test]
fn lm_head_chunking_does_not_change_results() {
    let base = Llama::new(cfg(true, false));
    let params = base.params.init(11, 0.1);
    let (b, t) = (2, 20);
    let (tokens, targets) = data(&mut Rng::new(4), b * t, 80);
    let (g_big, l_big) = grads_accumulated(&base, &params, &tokens, &targets, b, t, 1);
    let small = base.clone().with_ce_chunk_tokens(7); // 40 rows = 5 chunks of 7 + 5
    let (g_small, l_small) = grads_accumulated(&small, &params, &tokens, &targets, b, t, 1);
    assert!((l_big - l_small).abs() < 1e-6 * l_big);
    let err = rel_err(&g_small, &to64(&g_big));
    assert!(err < 1e-5, "chunked head grads rel err {err:.2e}");
}

/// Recomputation rebuilds dropped activations with the forward's own kernels on the same
/// inputs, so every policy gives the same losses and gradients, bit for bit, step after step
/// (a few plain SGD steps, two micro-batches each).
#[test]
fn recompute_policies_give_bit_identical_gradients() {
    for (tie, bias) in [(false, true), (true, false)] {
        let base = Llama::new(cfg(tie, bias)).with_ce_chunk_tokens(16);
        let (b, t) = (4, 20);
        let (tokens, targets) = data(&mut Rng::new(21), b * t, 80);
        let run = |rc: Recompute| {
            let model = base.clone().with_recompute(rc);
            let mut params = model.params.init(13, 0.1);
            let mut out = Vec::new();
            for _ in 0..3 {
                let (g, loss) = grads_accumulated(&model, &params, &tokens, &targets, b, t, 2);
                for (p, g) in params.iter_mut().zip(&g) {
                    *p -= 0.5 * g;
                }
                out.push((g, loss));
            }
            out
        };
        let none = run(Recompute::None);
        assert!(none[0].0.iter().any(|&g| g != 0.0));
        assert!(none[2].1 < none[0].1, "SGD lowers the loss");
        for rc in [Recompute::Selective, Recompute::Full] {
            for (step, ((g, l), (g0, l0))) in run(rc).iter().zip(&none).enumerate() {
                assert_eq!(
                    l.to_bits(),
                    l0.to_bits(),
                    "{rc} step {step}: loss {l} vs {l0}"
                );
                let same = g.iter().zip(g0).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rc} step {step}: gradients differ");
            }
        }
    }
}

#[test]
fn pool_sees_exactly_the_inventory() {
    let mut peaks = Vec::new();
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        peaks.push(pool_sees_exactly_the_inventory_with(rc));
    }
    // Each policy keeps less than the one before it.
    assert!(peaks[0] > peaks[1] && peaks[1] > peaks[2], "{peaks:?}");
}

/// The buffers of a training step under the model's policy, from the planner's table: each
/// layer's kept tensors, the workspace of the dropped ones, the head's and the backward's.
fn inventory(model: &Llama, n: usize) -> HashMap<String, usize> {
    use ferrotron_plan::tensors::{Edge, LayerTensor};
    let rc = model.recompute;
    let mut names = Vec::new();
    for i in 0..model.config.layers {
        let kept = LayerTensor::of_layer(false).filter(|t| t.kept_by(rc));
        names.extend(kept.map(|t| BufName::Layer(i as u32, t)));
    }
    let dropped = LayerTensor::of_layer(false).filter(|t| !t.kept_by(rc));
    names.extend(dropped.map(BufName::Recompute));
    let edges = [
        Edge::FinalNormInput,
        Edge::FinalNormRstd,
        Edge::FinalNormOut,
        Edge::LogitsChunk,
        Edge::Losses,
        Edge::GradResid,
    ];
    names.extend(edges.into_iter().chain(Edge::SCRATCH).map(BufName::Edge));
    names
        .into_iter()
        .map(|b| (b.to_string(), model.len(b, n)))
        .collect()
}

/// One training step under `rc`: every buffer is in the inventory with its size, allocated once
/// (a `recompute.*` buffer once per layer in the forward and once in the backward) and freed.
/// Returns the pool's peak bytes.
fn pool_sees_exactly_the_inventory_with(rc: Recompute) -> u64 {
    let model = Llama::new(cfg(false, true))
        .with_ce_chunk_tokens(16)
        .with_recompute(rc);
    let params = model.params.init(1, 0.02);
    let batch = BatchShape { b: 2, t: 12 };
    let (tokens, targets) = data(&mut Rng::new(5), batch.n(), 80);
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::recording();
    let mut grads = vec![0.0; model.num_params()];
    let (acts, _) = model.forward_train(
        k, &mut pool, &params, &mut grads, batch, &tokens, &targets, 20,
    );
    model.backward(k, &mut pool, &params, &mut grads, acts, &tokens);
    assert_eq!(pool.live_bytes, 0, "everything freed");
    let events = pool.events.take().unwrap();
    let inventory = inventory(&model, batch.n());
    let mut seen: HashMap<String, (usize, i32)> = HashMap::new();
    for e in &events {
        let name = e.name.to_string();
        let want = inventory
            .get(&name)
            .unwrap_or_else(|| panic!("{name} not in inventory"));
        assert_eq!(e.bytes as usize, want * 4, "{name} size");
        let s = seen.entry(name).or_insert((0, 0));
        s.0 += e.alloc as usize;
        s.1 += if e.alloc { 1 } else { -1 };
    }
    for (name, _) in inventory.iter() {
        let (allocs, balance) = seen
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("{name} never allocated"));
        let want = if name.starts_with("recompute.") {
            2 * model.config.layers
        } else {
            1
        };
        assert_eq!(allocs, want, "{name} allocations per step under {rc}");
        assert_eq!(balance, 0, "{name} freed");
    }
    let workspace = inventory
        .keys()
        .filter(|n| n.starts_with("recompute."))
        .count();
    assert_eq!(workspace, [0, 3, 13][rc as usize], "{rc}");
    if rc != Recompute::None {
        return pool.peak_bytes;
    }
    // Peak: either the end of the forward (all layers + head buffers) or the backward once the
    // scratch exists (all layers + final-norm input/rstd/out + grad.act.resid, or all layers +
    // all grad.act.* after the final-norm buffers are freed).
    let sum = |names: &[&str]| -> usize { names.iter().map(|n| inventory[*n]).sum() };
    let layers: usize = inventory
        .iter()
        .filter(|(n, _)| n.starts_with("act.layers."))
        .map(|(_, v)| v)
        .sum();
    let finals = sum(&[
        "act.final_norm.input",
        "act.final_norm.rstd",
        "act.final_norm.out",
    ]);
    let scratch: usize = inventory
        .iter()
        .filter(|(n, _)| n.starts_with("grad.act."))
        .map(|(_, v)| v)
        .sum();
    let want = [
        layers + finals + sum(&["act.logits_chunk", "act.losses"]),
        layers + finals + sum(&["grad.act.resid"]),
        layers + scratch,
    ]
    .into_iter()
    .max()
    .unwrap();
    assert_eq!(pool.peak_bytes as usize, want * 4);
    pool.peak_bytes
}

/// A pool that hands out NaN-filled buffers: proves no kernel reads a buffer before writing it.
struct PoisonPool;
impl BufferPool for PoisonPool {
    fn did_alloc(&mut self, _: BufName, _: u64) {}
    fn did_free(&mut self, _: BufName, _: u64) {}
    fn poison(&self) -> bool {
        true
    }
}

#[test]
fn buffers_are_written_before_read() {
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        written_before_read(rc);
    }
}

fn written_before_read(rc: Recompute) {
    let model = Llama::new(cfg(false, true))
        .with_ce_chunk_tokens(10)
        .with_recompute(rc);
    let params = model.params.init(2, 0.05);
    let batch = BatchShape { b: 2, t: 9 };
    let (tokens, targets) = data(&mut Rng::new(6), batch.n(), 80);
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut grads = vec![0.0; model.num_params()];
    let (acts, loss) = model.forward_train(
        k,
        &mut PoisonPool,
        &params,
        &mut grads,
        batch,
        &tokens,
        &targets,
        16,
    );
    model.backward(k, &mut PoisonPool, &params, &mut grads, acts, &tokens);
    assert!(loss.sum.is_finite());
    assert!(
        grads.iter().all(|g| g.is_finite()),
        "NaN leaked from an unwritten buffer"
    );
    let eval = model.forward_eval(k, &mut PoisonPool, &params, batch, &tokens, &targets);
    assert!(
        (eval.sum - loss.sum).abs() < 1e-4 * loss.sum.abs(),
        "eval {} vs train {}",
        eval.sum,
        loss.sum
    );
}

/// The backend's head_dim limit is checked where the backend is chosen, with the message the
/// config check gave before the limit moved to the backend; the wrapper reports its inner
/// backend's limits.
#[test]
fn head_dim_over_the_backend_limit_is_a_config_error() {
    let cpu = CpuKernels::PLAIN;
    let traced = ferrotron_engine::kernels::Tracing::new(cpu);
    let limits = Kernels::<f32>::limits(&cpu);
    assert_eq!(Kernels::<f32>::limits(&traced), limits);
    let mut c = cfg(false, false);
    c.head_dim = limits.max_head_dim;
    assert!(c.validate().is_ok() && c.check_backend(limits).is_ok());
    c.head_dim = 1024;
    assert!(
        c.validate().is_ok(),
        "the limit is the backend's, not the model's"
    );
    assert_eq!(
        c.check_backend(limits).unwrap_err().to_string(),
        "config field `head_dim` = 1024: the CPU attention kernel supports head_dim <= 512"
    );
}

#[test]
fn stage_entry_points_compose_to_the_whole_step_bit_for_bit() {
    // A 4-layer model cut into two "pipeline stages" at every layer boundary, run stage by
    // stage (embedding + layers 0..cut, then layers cut..4 + head; the backward in reverse),
    // gives the whole step's loss and gradients bit for bit, with the same buffer events; the
    // gradient-ready callback names the final norm, then layers 3, 2, 1, 0, then the embedding.
    use ferrotron_engine::model::{BackwardState, GradBuf, GradsDone, WholeParams};
    let mut c = cfg(false, true);
    c.layers = 4;
    let model = Llama::new(c).with_recompute(Recompute::Selective);
    let params = model.params.init(5, 0.1);
    let (b, t) = (2, 16);
    let batch = BatchShape { b, t };
    let (tokens, targets) = data(&mut Rng::new(9), b * t, 80);
    let nt = targets.iter().filter(|&&x| x != IGNORE_INDEX).count();
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let whole = || {
        let mut pool = HeapPool::recording();
        let mut grads = vec![0.0f32; model.num_params()];
        let (acts, l) = model.forward_train(
            k, &mut pool, &params, &mut grads, batch, &tokens, &targets, nt,
        );
        model.backward(k, &mut pool, &params, &mut grads, acts, &tokens);
        (grads, l.sum, pool.events.unwrap())
    };
    let (want, want_loss, want_events) = whole();
    for cut in 0..=4 {
        let mut pool = HeapPool::recording();
        let mut grads = vec![0.0f32; model.num_params()];
        let mut order = Vec::new();
        let mut done = |d: GradsDone, _: &mut dyn GradBuf<f32>| {
            order.push(match d {
                GradsDone::FinalNorm(_) => "norm".to_string(),
                GradsDone::Layer(i, idx) => {
                    assert_eq!(idx.ln1, model.params.layers[i].ln1);
                    format!("layer {i}")
                }
                GradsDone::Embedding(_) => "embed".to_string(),
            })
        };
        let p = &mut WholeParams::host(&params);
        // Stage A forward.
        let x = model.embed_forward(k, &mut pool, p, &tokens);
        let (acts_a, x) = model.layers_forward(k, &mut pool, p, batch, 0..cut, x);
        // Stage B forward, head included.
        let (acts_b, x) = model.layers_forward(k, &mut pool, p, batch, cut..4, x);
        let (head, loss) = model.head_forward(k, &mut pool, p, &mut grads, x, &targets, nt, 1.0);
        // Stage B backward, then stage A's.
        let mut state: BackwardState<f32> =
            model.head_backward(k, &mut pool, p, &mut grads, head, batch, &mut done);
        let g = &mut grads;
        model.layers_backward(
            k,
            &mut pool,
            p,
            g,
            batch,
            cut..4,
            acts_b,
            &mut state,
            &mut done,
        );
        model.layers_backward(
            k,
            &mut pool,
            p,
            g,
            batch,
            0..cut,
            acts_a,
            &mut state,
            &mut done,
        );
        model.embed_backward(k, &mut pool, g, &tokens, state, &mut done);
        assert_eq!(loss.sum.to_bits(), want_loss.to_bits(), "cut {cut}: loss");
        let differ = grads
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "cut {cut}: {differ} gradients differ");
        assert_eq!(
            pool.events.as_ref().unwrap(),
            &want_events,
            "cut {cut}: buffer events"
        );
        assert_eq!(pool.live_bytes, 0);
        let want_order = ["norm", "layer 3", "layer 2", "layer 1", "layer 0", "embed"];
        assert_eq!(order, want_order, "cut {cut}");
    }
}

#[test]
fn the_model_asks_for_each_units_parameters_in_the_order_zero3_gathers_them() {
    // ZeRO-3 gathers a unit's parameters just before the model asks for them, prefetching by
    // the documented order (`ferrotron_plan::zero3`): the model must ask in exactly that order,
    // and read only the unit it asked for (a read outside it panics here).
    use ferrotron_engine::model::{GradBuf, GradsDone, ParamBuf, ParamSource, Unit};
    use ferrotron_plan::zero3::{eval_sequence, train_sequence};
    struct Asked<'a> {
        all: &'a [f32],
        model: &'a Llama,
        log: Vec<Unit>,
    }
    impl ParamBuf<f32> for Asked<'_> {
        fn slice(&self, r: std::ops::Range<usize>) -> View<'_, f32> {
            let t = &self.model.params;
            let inside = |u: &std::ops::Range<usize>| r.start >= u.start && r.end <= u.end;
            let ok = match self.log.last() {
                Some(Unit::Embedding) => inside(&t.embed),
                Some(Unit::Layer(i)) => t.layers[*i].ranges().any(|x| *x == r),
                Some(Unit::Head) => inside(&t.norm) || r == t.lm_head,
                None => false,
            };
            assert!(ok, "{r:?} read while {:?} was asked for", self.log.last());
            self.all[r].view()
        }
    }
    impl ParamSource<f32> for Asked<'_> {
        fn unit(&mut self, u: Unit) -> &dyn ParamBuf<f32> {
            self.log.push(u);
            self
        }
    }
    for tie in [true, false] {
        let mut c = cfg(tie, true);
        c.layers = 3;
        let model = Llama::new(c).with_recompute(Recompute::Full);
        let params = model.params.init(5, 0.1);
        let batch = BatchShape { b: 1, t: 8 };
        let (tokens, targets) = data(&mut Rng::new(3), 8, 80);
        let k: &dyn Kernels = &CpuKernels::PLAIN;
        let mut pool = HeapPool::default();
        let mut grads = vec![0.0f32; model.num_params()];
        let mut src = Asked {
            all: &params,
            model: &model,
            log: vec![],
        };
        let g = &mut ferrotron_engine::model::Whole::host(&mut grads);
        let (acts, _) =
            model.forward_train_scaled(k, &mut pool, &mut src, g, batch, &tokens, &targets, 8, 1.0);
        let done = &mut |_: GradsDone, _: &mut dyn GradBuf<f32>| {};
        model.backward_notify(k, &mut pool, &mut src, g, acts, &tokens, done);
        assert_eq!(src.log, train_sequence(3), "training, tied {tie}");
        src.log.clear();
        model.forward_eval_from(k, &mut pool, &mut src, batch, &tokens, &targets);
        assert_eq!(src.log, eval_sequence(3), "evaluation, tied {tie}");
    }
}
