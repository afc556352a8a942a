//! A tiny Mixtral and its expert-parallel ranks on the threads backend, shared by the MoE
//! tests: micro-batches of B × T tokens, a forward + backward of one, and a run of `ep` ranks
//! whose gradients are put back where the whole model has them.

use ferrotron_dist::threads::{self, ThreadComm};
use ferrotron_dist::Communicator;
use ferrotron_engine::kernels::{CpuKernels, Kernels, View, ViewMut, IGNORE_INDEX};
use ferrotron_engine::model::{
    BatchShape, EpComm, ExpertParallel, HeapPool, Llama, LlamaConfig, MoeConfig,
};
use std::rc::Rc;
use std::time::Duration;

pub fn cfg(experts: usize, top_k: usize) -> LlamaConfig {
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

pub struct Group(pub ThreadComm);

impl EpComm for Group {
    fn size(&self) -> usize {
        self.0.size()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn exchange(&self, send: View<'_, f32>, sc: &[usize], recv: ViewMut<'_, f32>, rc: &[usize]) {
        self.0
            .all_to_all_v(send, sc, recv, rc, &mut Default::default())
            .unwrap()
    }
}

pub const B: usize = 2;
pub const T: usize = 8;

/// Micro-batch `r`'s tokens and targets (one ignored target each).
pub fn batch(r: usize) -> (Vec<u32>, Vec<u32>) {
    let n = B * T;
    let tokens = (0..n).map(|i| ((i * 7 + r * 13 + 3) % 48) as u32).collect();
    let mut targets: Vec<u32> = (0..n).map(|i| ((i * 5 + r * 11 + 1) % 48) as u32).collect();
    targets[r + 2] = IGNORE_INDEX;
    (tokens, targets)
}

/// Targets of micro-batches `0..ranks`.
pub fn targets_in(ranks: usize) -> usize {
    (0..ranks)
        .map(|r| batch(r).1.iter().filter(|&&x| x != IGNORE_INDEX).count())
        .sum()
}

/// Forward + backward of micro-batch `r` into `grads`, normalised by `nt` targets; the loss
/// sum.
pub fn step(model: &Llama, params: &[f32], grads: &mut [f32], r: usize, nt: usize) -> f64 {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let mut pool = HeapPool::new();
    let (tokens, targets) = batch(r);
    let shape = BatchShape { b: B, t: T };
    let (acts, l) = model.forward_train(k, &mut pool, params, grads, shape, &tokens, &targets, nt);
    model.backward(k, &mut pool, params, grads, acts, &tokens);
    assert_eq!(pool.live_bytes, 0, "every buffer returned");
    l.sum
}

/// What `ep` expert-parallel ranks (threads) computed on micro-batches `0..ep`, one each:
/// the summed loss, the gradients placed where the whole model has them (an expert's from
/// the rank holding it, the dense ones summed over the ranks as data parallelism would), and
/// how many ranks gave each expert parameter.
pub fn expert_parallel_run<F>(
    c: &LlamaConfig,
    ep: usize,
    params: &[f32],
    nt: usize,
    build: F,
) -> (f64, Vec<f32>, Vec<usize>)
where
    F: Fn(Llama) -> Llama + Send + Sync + Copy + 'static,
{
    let (p, cc) = (params.to_vec(), c.clone());
    let ranks = threads::run(ep, Duration::from_secs(60), move |r, comm| {
        let par = ExpertParallel::new(&cc, Rc::new(Group(comm))).map_err(|e| e.to_string())?;
        let model = build(Llama::expert_parallel(cc.clone(), par).with_rope());
        let whole = Llama::new(cc.clone());
        // This rank's tensors, by name, from the whole model's.
        let placed: Vec<_> = (model.params.entries.iter())
            .map(|e| {
                let w = whole.params.get(&e.name).unwrap().range();
                (e.range(), w, e.name.clone())
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
        Ok::<_, String>((loss, out))
    });
    let mut got = vec![0.0f32; params.len()];
    let mut expert_seen = vec![0usize; params.len()];
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
    (loss, got, expert_seen)
}
