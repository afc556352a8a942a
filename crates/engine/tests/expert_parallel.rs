//! Expert parallelism against one rank: 2 and 4 ranks (threads of this process, talking through
//! `ferrotron_dist`'s threads backend), each holding its share of the experts and training on
//! its own micro-batch, give what one rank holding every expert gives on the same micro-batches
//! in turn: the loss (with the load-balancing term of each micro-batch), the summed dense
//! gradients and every expert's gradient, under every recompute policy.

use ferrotron_dist::threads::{self, ThreadComm};
use ferrotron_dist::Communicator;
use ferrotron_engine::kernels::{CpuKernels, Kernels, IGNORE_INDEX};
use ferrotron_engine::model::{
    BatchShape, EpComm, ExpertParallel, HeapPool, Llama, LlamaConfig, MoeConfig, Recompute,
};
use std::rc::Rc;
use std::time::Duration;

fn cfg(experts: usize, top_k: usize) -> LlamaConfig {
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
            experts,
            top_k,
            norm_topk: true,
            aux_loss_coef: 0.05,
        }),
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

const B: usize = 2;
const T: usize = 8;

/// Micro-batch `r`'s tokens and targets (one ignored target each).
fn batch(r: usize) -> (Vec<u32>, Vec<u32>) {
    let n = B * T;
    let tokens = (0..n).map(|i| ((i * 7 + r * 13 + 3) % 48) as u32).collect();
    let mut targets: Vec<u32> = (0..n).map(|i| ((i * 5 + r * 11 + 1) % 48) as u32).collect();
    targets[r + 2] = IGNORE_INDEX;
    (tokens, targets)
}

fn targets_in(ranks: usize) -> usize {
    (0..ranks)
        .map(|r| batch(r).1.iter().filter(|&&x| x != IGNORE_INDEX).count())
        .sum()
}

/// Forward + backward of micro-batch `r` into `grads`; the loss sum.
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

fn close(what: &str, want: &[f32], got: &[f32], tol: f32) {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in want.iter().zip(got).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

#[test]
fn expert_parallel_ranks_give_the_one_rank_loss_and_gradients() {
    for (ep, experts, top_k, rc) in [
        (2, 4, 2, Recompute::None),
        (2, 4, 2, Recompute::Selective),
        (4, 4, 2, Recompute::Full),
        (4, 8, 3, Recompute::None),
    ] {
        let what = format!("ep {ep} experts {experts} top-{top_k} {rc}");
        let c = cfg(experts, top_k);
        let one = Llama::new(c.clone()).with_recompute(rc);
        let params = one.params.init(5, 0.2);
        let nt = targets_in(ep);
        let mut want = vec![0.0f32; one.num_params()];
        let want_loss: f64 = (0..ep).map(|r| step(&one, &params, &mut want, r, nt)).sum();

        let (p, cc) = (params.clone(), c.clone());
        let ranks = threads::run(ep, Duration::from_secs(60), move |r, comm| {
            let group = Rc::new(Group(comm));
            let par = ExpertParallel::new(&cc, group).map_err(|e| e.to_string())?;
            let model = Llama::expert_parallel(cc.clone(), par).with_recompute(rc);
            let whole = Llama::new(cc.clone());
            // This rank's tensors, by name, from the whole model's.
            let placed: Vec<_> = model
                .params
                .entries
                .iter()
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
            let out: Vec<_> = placed
                .into_iter()
                .map(|(l, w, name)| (w, name, grads[l].to_vec()))
                .collect();
            Ok((loss, out))
        });
        let mut got = vec![0.0f32; want.len()];
        let mut expert_seen = vec![0usize; want.len()];
        let mut loss = 0.0;
        for rank in ranks {
            let (l, placed) = rank.unwrap();
            loss += l;
            for (w, name, g) in placed {
                if name.contains(".experts.") {
                    // Each expert lives on one rank, which saw every rank's copies.
                    expert_seen[w.start] += 1;
                    got[w].copy_from_slice(&g);
                } else {
                    // Dense weights are replicated: the data-parallel sum of the ranks'.
                    got[w].iter_mut().zip(&g).for_each(|(s, x)| *s += x);
                }
            }
        }
        let rel = (loss - want_loss).abs() / want_loss.abs();
        assert!(rel < 1e-5, "{what}: loss {loss} vs {want_loss}");
        for e in &one.params.entries {
            if e.name.contains(".experts.") {
                assert_eq!(expert_seen[e.offset], 1, "{what}: {} on one rank", e.name);
            }
            close(
                &format!("{what} {}", e.name),
                &want[e.range()],
                &got[e.range()],
                1e-5,
            );
        }
    }
}

#[test]
fn an_ep_that_does_not_divide_the_experts_is_refused() {
    let c = cfg(6, 2);
    let out = threads::run(4, Duration::from_secs(10), move |_, comm| {
        Ok::<_, String>(
            ExpertParallel::new(&c, Rc::new(Group(comm)))
                .unwrap_err()
                .to_string(),
        )
    });
    for e in out {
        assert_eq!(
            e.unwrap(),
            "config field `num_local_experts` = 6: expert parallelism gives each of the ep = 4 ranks as many experts: ep must divide it"
        );
    }
}
