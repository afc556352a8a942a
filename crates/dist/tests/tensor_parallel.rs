//! Tensor parallelism against one rank: the same weights split over 2 and 4 ranks (threads of
//! this process, talking through `ferrotron_dist`'s threads backend) give the one-rank loss,
//! every gradient (each rank's slice, and the replicated norms on every rank), the evaluation
//! loss and the logits, within f32 rounding of a different summation order.

use ferrotron_dist::threads::{self, ThreadComm};
use ferrotron_dist::Communicator;
use ferrotron_engine::kernels::{CpuKernels, Kernels, IGNORE_INDEX};
use ferrotron_engine::model::tensor_parallel::{replicated, shard_config, shard_pieces, TpOp};
use ferrotron_engine::model::{
    BatchShape, HeapPool, Llama, LlamaConfig, Recompute, TensorParallel, TpComm,
};
use std::rc::Rc;
use std::time::Duration;

fn cfg(tied: bool, bias: bool) -> LlamaConfig {
    LlamaConfig {
        hidden: 32,
        intermediate: 64,
        heads: 4,
        kv_heads: 4,
        head_dim: 8,
        layers: 2,
        vocab: 48,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        tie_embeddings: tied,
        qkv_bias: bias,
        max_pos: 64,
        moe: None,
    }
}

/// The group's collectives over a threads-backend communicator.
struct Group(ThreadComm);

impl TpComm for Group {
    fn size(&self) -> usize {
        self.0.size()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn run(&self, op: TpOp, len: usize, io: &mut dyn FnMut(&mut [f32], bool)) {
        let mut buf = vec![0.0; len];
        io(&mut buf, true);
        let pending = match op {
            TpOp::AllReduce => self.0.all_reduce_start(buf.into()),
            TpOp::AllGather => self.0.all_gather_start(buf.into()),
            TpOp::ReduceScatter => self.0.reduce_scatter_start(buf.into()),
        };
        io(&mut pending.wait().unwrap(), false);
    }
}

struct Out {
    loss: f64,
    eval: f64,
    grads: Vec<f32>,
    logits: Vec<f32>,
}

/// One training micro-batch (forward + backward), an evaluation forward and the logits.
fn step(model: &Llama, params: &[f32], tokens: &[u32], targets: &[u32], t: usize) -> Out {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::new();
    let batch = BatchShape {
        b: tokens.len() / t,
        t,
    };
    let nt = targets.iter().filter(|&&x| x != IGNORE_INDEX).count();
    let mut grads = vec![0.0f32; model.num_params()];
    let (acts, l) =
        model.forward_train(k, &mut pool, params, &mut grads, batch, tokens, targets, nt);
    model.backward(k, &mut pool, params, &mut grads, acts, tokens);
    let eval = model.forward_eval(k, &mut pool, params, batch, tokens, targets);
    let mut logits = vec![0.0; tokens.len() * model.full_config().vocab];
    model.forward_logits(k, &mut pool, params, batch, tokens, &mut logits);
    assert_eq!(pool.live_bytes, 0, "every buffer returned");
    Out {
        loss: l.sum / nt as f64,
        eval: eval.sum / eval.count as f64,
        grads,
        logits,
    }
}

fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

#[test]
fn tensor_parallel_ranks_give_the_one_rank_loss_and_gradients() {
    let (b, t) = (2, 12);
    let n = b * t;
    for (tied, bias, tp, rc, sp) in [
        (true, false, 2, Recompute::None, false),
        (false, true, 2, Recompute::Selective, false),
        (false, false, 4, Recompute::Full, false),
        (true, false, 2, Recompute::None, true),
        (false, true, 4, Recompute::Selective, true),
        (true, true, 2, Recompute::Full, true),
    ] {
        let full_cfg = cfg(tied, bias);
        let one = Llama::new(full_cfg.clone()).with_recompute(rc);
        let params = one.params.init(11, 0.2);
        let tokens: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % 48) as u32).collect();
        let mut targets: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % 48) as u32).collect();
        targets[5] = IGNORE_INDEX;
        let want = step(&one, &params, &tokens, &targets, t);
        let what = format!("tp {tp} sp {sp} tied {tied} bias {bias} {rc}");

        let (p, tk, tg, fc) = (params.clone(), tokens.clone(), targets.clone(), full_cfg);
        let ranks = threads::run(tp, Duration::from_secs(60), move |_, comm| {
            let group = Rc::new(Group(comm));
            let tpar = TensorParallel::new(fc.clone(), group)
                .map_err(|e| e.to_string())?
                .with_sp(sp);
            let model = Llama::tensor_parallel(tpar)
                .map_err(|e| e.to_string())?
                .with_rope()
                .with_recompute(rc);
            let full = Llama::new(fc.clone());
            let rank = model.tp.as_ref().unwrap().rank;
            let pieces = shard_pieces(&full.params, &model.params, rank);
            let mut local = vec![0.0; model.num_params()];
            for (l, f) in &pieces {
                local[l.clone()].copy_from_slice(&p[f.clone()]);
            }
            let out = step(&model, &local, &tk, &tg, t);
            // Each slice's gradient where it sits in the whole model, and which are the
            // replicated norms'.
            let placed: Vec<(std::ops::Range<usize>, Vec<f32>, bool)> = pieces
                .iter()
                .map(|(l, f)| {
                    let rep = replicated(&full.params, &model.params, l.start);
                    (f.clone(), out.grads[l.clone()].to_vec(), rep)
                })
                .collect();
            Ok((out.loss, out.eval, out.logits, placed))
        });
        let mut grads = vec![f32::NAN; want.grads.len()];
        for r in ranks {
            let (loss, eval, logits, placed) = r.unwrap();
            let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
            assert!(
                rel(loss, want.loss) < 1e-5,
                "{what}: loss {loss} vs {}",
                want.loss
            );
            assert!(
                rel(eval, want.eval) < 1e-5,
                "{what}: eval {eval} vs {}",
                want.eval
            );
            close(&format!("{what} logits"), &want.logits, &logits, 1e-5);
            for (f, g, rep) in placed {
                if rep && sp {
                    // A norm under sequence parallelism: each rank has its tokens' share (the
                    // trainer sums them); the shares add up to the whole gradient.
                    for (s, x) in grads[f].iter_mut().zip(&g) {
                        *s = if s.is_nan() { *x } else { *s + x };
                    }
                    continue;
                }
                if rep {
                    // A norm: every rank has the whole gradient.
                    close(
                        &format!("{what} norm {f:?}"),
                        &want.grads[f.clone()],
                        &g,
                        1e-5,
                    );
                }
                grads[f].copy_from_slice(&g);
            }
        }
        assert!(
            grads.iter().all(|g| g.is_finite()),
            "{what}: every gradient placed"
        );
        close(&format!("{what} gradients"), &want.grads, &grads, 1e-5);
    }
}

#[test]
fn a_tp_that_does_not_divide_the_heads_is_refused_with_the_fix() {
    let mut c = cfg(true, false);
    c.kv_heads = 2;
    let e = shard_config(&c, 4).unwrap_err().to_string();
    assert_eq!(
        e,
        "config field `num_key_value_heads` = 2: tensor parallelism splits the key/value heads over the ranks: tp = 4 must divide it (this model splits at tp = 2)"
    );
    c.kv_heads = 4;
    c.vocab = 50;
    let e = shard_config(&c, 4).unwrap_err().to_string();
    assert_eq!(
        e,
        "config field `vocab_size` = 50: tensor parallelism splits the vocabulary over the ranks: tp = 4 must divide it (this model splits at tp = 2)"
    );
}
