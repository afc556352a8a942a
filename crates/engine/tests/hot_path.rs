//! The engine's hot path allocates nothing of its own: once a first micro-batch has run (the
//! routing's containers sized), a forward and backward takes every buffer from the pool — in
//! the trainer, the arena at the plan's offsets — and nothing from the heap but the kernels'
//! scratch inside an op (`kernels::cpu::scratch`). Any other heap allocation there is memory
//! no plan lists. Checked with a global allocator counting this thread's allocations and a
//! pool that places every buffer in one preallocated region.

mod common;
#[path = "common/counting.rs"]
mod counting;

use counting::allocations;
use ferrotron_engine::kernels::{CpuKernels, Kernels, View, ViewMut, IGNORE_INDEX};
use ferrotron_engine::model::{
    BatchShape, BufName, BufferPool, EpComm, ExpertParallel, Llama, LlamaConfig, MoeConfig,
    Recompute,
};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::{Arc, Barrier, Mutex};

/// Places every buffer one after the other in a region allocated up front (freed buffers are
/// not reused: the region is as large as a micro-batch's every buffer together), rewound
/// before each micro-batch.
struct Region {
    block: Vec<u64>,
    at: usize,
}

impl BufferPool for Region {
    fn did_alloc(&mut self, _: BufName, _: u64) {}
    fn did_free(&mut self, _: BufName, _: u64) {}
    fn place(&mut self, _: BufName, bytes: u64) -> Option<NonNull<u8>> {
        let align = ferrotron_engine::model::BUF_ALIGN;
        let base = self.block.as_mut_ptr() as usize;
        let start = (base + self.at).next_multiple_of(align) - base;
        let end = start + bytes as usize;
        assert!(
            end <= self.block.len() * 8,
            "the test's region is too small"
        );
        self.at = end;
        NonNull::new((base + start) as *mut u8)
    }
}

fn moe_cfg() -> LlamaConfig {
    LlamaConfig {
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            norm_topk: true,
            aux_loss_coef: 0.05,
        }),
        ..common::dense_cfg(true, false)
    }
}

/// Rank `rank` of an expert-parallel group of two threads of this test: each exchange drops
/// every block into its destination's mailbox (reused, so the exchange allocates nothing after
/// the first), and takes its own once both ranks have posted.
struct Pair {
    rank: usize,
    shared: Arc<(Barrier, Mutex<[Vec<f32>; 4]>)>,
}

impl EpComm for Pair {
    fn size(&self) -> usize {
        2
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn exchange(&self, send: View<'_, f32>, sc: &[usize], recv: ViewMut<'_, f32>, rc: &[usize]) {
        let (barrier, boxes) = &*self.shared;
        let (send, recv) = (send.host(), recv.host_mut());
        {
            let mut boxes = boxes.lock().unwrap();
            // Mailbox 2·dest + src.
            let mine = sc[0]..sc[0] + sc[1];
            for (dest, part) in [(0, &send[..sc[0]]), (1, &send[mine])] {
                let b = &mut boxes[2 * dest + self.rank];
                b.clear();
                b.extend_from_slice(part);
            }
        }
        barrier.wait();
        {
            let boxes = boxes.lock().unwrap();
            let mut at = 0;
            for (src, &n) in rc.iter().enumerate() {
                recv[at..at + n].copy_from_slice(&boxes[2 * self.rank + src][..n]);
                at += n;
            }
        }
        barrier.wait();
    }
}

/// Heap allocations of the second of two identical micro-batches (forward and backward) of
/// the model of `cfg` under `rc`; with `ep`, as that rank of an expert-parallel group.
fn second_micro_batch_allocations(cfg: LlamaConfig, rc: Recompute, ep: Option<Pair>) -> usize {
    // On a worker of a pool of its own, so that the kernels' parallel loops queue their work
    // on this thread's deque (reused) rather than injecting it into the global pool's queue
    // (which allocates now and then, whatever the engine does).
    let threads = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    threads.install(move || {
        let model = match ep {
            Some(pair) => {
                let group = ExpertParallel::new(&cfg, Rc::new(pair)).unwrap();
                Llama::expert_parallel(cfg, group).with_rope()
            }
            None => Llama::new(cfg),
        }
        .with_recompute(rc);
        let k: &dyn Kernels = &CpuKernels::PLAIN;
        let mut rng = common::Rng::new(7);
        let params = model.params.init(3, 0.2);
        let mut grads = vec![0.0f32; model.num_params()];
        let shape = BatchShape { b: 2, t: 8 };
        let n = shape.b * shape.t;
        let tokens: Vec<u32> = (0..n)
            .map(|_| rng.below(model.config.vocab as u32))
            .collect();
        let mut targets = tokens.clone();
        targets.rotate_left(1);
        targets[n - 1] = IGNORE_INDEX;
        let mut pool = Region {
            block: vec![0; 8 << 20],
            at: 0,
        };
        let mut micro_batch = |pool: &mut Region| {
            pool.at = 0;
            let (acts, _) = model.forward_train(
                k,
                pool,
                &params,
                &mut grads,
                shape,
                &tokens,
                &targets,
                n - 1,
            );
            model.backward(k, pool, &params, &mut grads, acts, &tokens);
        };
        micro_batch(&mut pool);
        allocations(|| micro_batch(&mut pool))
    })
}

#[test]
fn a_dense_micro_batch_allocates_nothing_outside_its_pool() {
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        let cfg = common::dense_cfg(true, false);
        assert_eq!(
            second_micro_batch_allocations(cfg, rc, None),
            0,
            "dense, {rc}"
        );
    }
}

#[test]
fn a_mixture_of_experts_micro_batch_allocates_nothing_outside_its_pool() {
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        let one = second_micro_batch_allocations(moe_cfg(), rc, None);
        assert_eq!(one, 0, "MoE, {rc}");
        // Two expert-parallel ranks, each on its own thread, each counting its own.
        let shared = Arc::new((Barrier::new(2), Mutex::new(Default::default())));
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let pair = Pair {
                    rank,
                    shared: shared.clone(),
                };
                std::thread::spawn(move || {
                    second_micro_batch_allocations(moe_cfg(), rc, Some(pair))
                })
            })
            .collect();
        for (rank, r) in ranks.into_iter().enumerate() {
            assert_eq!(
                r.join().unwrap(),
                0,
                "MoE, {rc}, expert-parallel rank {rank} of 2"
            );
        }
    }
}
