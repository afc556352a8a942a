//! The GPU's hot path allocates nothing on the host: once a first micro-batch has run (the
//! backend's scratch, its cuBLASLt descriptors and the host's grouping buffers sized), a
//! forward and backward launched op by op makes no heap allocation (a launch names its kernel
//! on the stack and passes its arguments from it), and neither does the launch of the same
//! micro-batch captured into a graph, with its grouping rebuilt for new ids. Counted by the
//! binary's allocator (`common/counting.rs`), the activations in one device region.

use super::counting::allocations;
use super::gpu;
use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::cuda::{upload, CudaAlloc, CudaKernels, DeviceBlock};
use ferrotron_engine::kernels::*;
use ferrotron_engine::model::*;
use half::bf16;
use std::ptr::NonNull;
use std::sync::Arc;

/// Every buffer one after the other in one device block, rewound before each micro-batch.
struct Region {
    block: DeviceBlock,
    at: usize,
}

impl BufferPool for Region {
    fn did_alloc(&mut self, _: BufName, _: u64) {}
    fn did_free(&mut self, _: BufName, _: u64) {}
    fn place(&mut self, _: BufName, bytes: u64) -> Option<NonNull<u8>> {
        let start = self.at.next_multiple_of(BUF_ALIGN);
        self.at = start + bytes as usize;
        assert!(
            self.at <= self.block.bytes(),
            "the test's region is too small"
        );
        NonNull::new((self.block.ptr() as usize + start) as *mut u8)
    }
    fn memory(&self) -> Memory {
        self.block.view::<u8>(0).memory()
    }
}

/// The batch's ids on the device, with the host's copy announced (as the trainer does).
fn load<S: Elem>(
    k: &CudaKernels,
    (tb, gb): (&mut DeviceBuf<u32>, &mut DeviceBuf<u32>),
    (tokens, targets): (&[u32], &[u32]),
) {
    tb.copy_from_host(tokens);
    gb.copy_from_host(targets);
    Kernels::<S>::host_ids(k, tb.view(), tokens);
    Kernels::<S>::host_ids(k, gb.view(), targets);
}

/// Heap allocations of the third eager micro-batch in storage `S`, and of a launch of it
/// captured, on ids the capture did not see.
fn micro_batch_allocations<S: Elem>(k: &CudaKernels) -> (usize, usize) {
    let model = Llama::new(super::common::dense_cfg(true, false)).with_rope();
    let ctx = &k.gpu().ctx;
    let params: Vec<S> = (model.params.init(3, 0.2).iter())
        .map(|&x| S::from_f32(x))
        .collect();
    let p = upload(ctx, &params).unwrap();
    let mut g = upload(ctx, &vec![S::from_f32(0.0); params.len()]).unwrap();
    let (batch, n, vocab) = (BatchShape { b: 2, t: 8 }, 16, model.config.vocab as u32);
    let ids = |seed: u32| -> Vec<u32> { (0..n as u32).map(|i| (i * seed + 1) % vocab).collect() };
    let alloc: Arc<dyn DeviceAlloc> = Arc::new(CudaAlloc::new(ctx.clone(), k.baseline()));
    let (mut tb, mut gb) = (
        DeviceBuf::<u32>::zeros(&alloc, n).unwrap(),
        DeviceBuf::<u32>::zeros(&alloc, n).unwrap(),
    );
    load::<S>(k, (&mut tb, &mut gb), (&ids(7), &ids(5)));
    let (tok, tgt) = (tb.view(), gb.view());
    let staging = if S::DTYPE == ferrotron_plan::DType::F32 {
        0
    } else {
        n * model.config.vocab * 2
    };
    k.reserve(
        staging,
        n * model.config.heads,
        n,
        model.config.hidden,
        &model.rope,
    );
    let mut pool = Region {
        block: DeviceBlock::new(ctx, 64 << 20).unwrap(),
        at: 0,
    };
    let mut micro_batch = |pool: &mut Region| {
        pool.at = 0;
        let src = &mut WholeParams(p.view::<S>(params.len()));
        let grads = &mut Whole(g.view_mut::<S>(params.len()));
        let done = &mut |_: GradsDone, _: &mut dyn GradBuf<S>| {};
        let (acts, _) = model.forward_train_scaled(k, pool, src, grads, batch, &tok, &tgt, n, 1.0);
        model.backward_notify(k, pool, src, grads, acts, &tok, done);
    };
    micro_batch(&mut pool);
    micro_batch(&mut pool);
    let eager = allocations(|| micro_batch(&mut pool));
    k.begin_capture().expect("the capture starts");
    micro_batch(&mut pool);
    let work = k.end_capture().expect("the capture ends");
    // New ids where the graph reads them, as the trainer writes them before a launch.
    load::<S>(k, (&mut tb, &mut gb), (&ids(11), &ids(3)));
    k.replay(&work).expect("the graph launches");
    let replayed = allocations(|| k.replay(&work).expect("the graph launches"));
    Kernels::<S>::synchronize(k);
    let _ = Kernels::<S>::take_loss(k);
    (eager, replayed)
}

#[test]
fn a_micro_batch_on_the_gpu_allocates_nothing_on_the_host() {
    let Some(k) = gpu() else { return };
    assert_eq!(
        micro_batch_allocations::<f32>(&k),
        (0, 0),
        "fp32: eager, replayed"
    );
    assert_eq!(
        micro_batch_allocations::<bf16>(&k),
        (0, 0),
        "bf16: eager, replayed"
    );
}
