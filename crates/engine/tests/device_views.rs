//! The model drives a backend whose memory the host cannot read (issue #10, device-neutral
//! kernels): under `OnDevice` every parameter, gradient, activation and token id is tagged as
//! device memory, so a host access to any of them, or a host slice handed to a kernel, stops
//! the step. A step that completes gives the plain CPU step's bits.

mod common;

use common::Rng;
use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::{
    emulated, emulated_mut, AsView, AsViewMut, CpuKernels, DevicePool, Kernels, OnDevice,
    IGNORE_INDEX,
};
use ferrotron_engine::model::{
    BatchShape, BufName, BufferPool, GradBuf, GradsDone, HeapPool, Llama, LlamaConfig, Recompute,
    Whole, WholeParams,
};
use ferrotron_plan::tensors::Edge;
use half::bf16;

fn cfg(tie: bool, bias: bool) -> LlamaConfig {
    common::dense_cfg(tie, bias)
}

/// Loss sums of a training micro-batch and of an evaluation, and the gradients, on `k` with
/// inputs in `ordinal`'s memory (`None`: the host's).
fn step<S: Elem>(
    model: &Llama,
    k: &dyn Kernels<S>,
    ordinal: Option<u32>,
    params: &[S],
    (tokens, targets): (&[u32], &[u32]),
) -> (f64, f64, Vec<S>) {
    let batch = BatchShape { b: 2, t: 24 };
    let nt = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let mut grads = vec![S::from_f32(0.0); model.num_params()];
    let done = &mut |_: GradsDone, _: &mut dyn GradBuf<S>| {};
    let (train, eval) = match ordinal {
        Some(d) => {
            let mut pool = DevicePool::new(d);
            let (tok, tgt) = (emulated(tokens, d), emulated(targets, d));
            let src = &mut WholeParams(emulated(params, d));
            let g = &mut Whole(emulated_mut(&mut grads, d));
            let (acts, loss) =
                model.forward_train_scaled(k, &mut pool, src, g, batch, &tok, &tgt, nt, 1.0);
            model.backward_notify(k, &mut pool, src, g, acts, &tok, done);
            let eval = model.forward_eval_from(k, &mut pool, src, batch, &tok, &tgt);
            (loss.sum, eval.sum)
        }
        None => {
            let mut pool = HeapPool::new();
            let src = &mut WholeParams::host(params);
            let g = &mut Whole::host(&mut grads);
            let (acts, loss) =
                model.forward_train_scaled(k, &mut pool, src, g, batch, tokens, targets, nt, 1.0);
            model.backward_notify(k, &mut pool, src, g, acts, tokens, done);
            let eval = model.forward_eval_from(k, &mut pool, src, batch, tokens, targets);
            (loss.sum, eval.sum)
        }
    };
    (train, eval, grads)
}

fn data() -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(11);
    let tokens: Vec<u32> = (0..48).map(|_| rng.below(80)).collect();
    let mut targets: Vec<u32> = (0..48).map(|_| rng.below(80)).collect();
    targets[5] = IGNORE_INDEX;
    (tokens, targets)
}

/// The same bits on the emulated device as on the host: the views reach the same kernels.
fn same_step<S: Elem + PartialEq + std::fmt::Debug>(model: &Llama, what: &str) {
    let cpu = CpuKernels::PLAIN;
    let dev = OnDevice { inner: cpu };
    let params: Vec<S> = model
        .params
        .init(3, 0.1)
        .iter()
        .map(|&x| S::from_f32(x))
        .collect();
    let (tokens, targets) = data();
    let want = step::<S>(model, &cpu, None, &params, (&tokens, &targets));
    let got = step::<S>(model, &dev, Some(0), &params, (&tokens, &targets));
    assert!(
        want.0.is_finite() && want.0 > 0.0,
        "{what}: loss {}",
        want.0
    );
    assert_eq!(got.0.to_bits(), want.0.to_bits(), "{what}: training loss");
    assert_eq!(got.1.to_bits(), want.1.to_bits(), "{what}: evaluation loss");
    assert!(got.2 == want.2, "{what}: gradients differ");
    assert!(
        want.2.iter().any(|g| g.to_f32() != 0.0),
        "{what}: no gradient"
    );
}

#[test]
fn a_training_step_runs_on_device_memory_with_the_host_steps_bits() {
    for (tie, bias) in [(true, true), (false, false)] {
        for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let model = Llama::new(cfg(tie, bias)).with_recompute(rc);
            same_step::<f32>(&model, &format!("fp32 tied {tie} bias {bias} {rc:?}"));
        }
    }
    let model = Llama::new(cfg(false, true)).with_recompute(Recompute::Selective);
    same_step::<bf16>(&model, "bf16 selective");
}

#[test]
#[should_panic(expected = "op embedding_forward was handed host memory on a device backend")]
fn host_token_ids_are_refused_by_a_device_backend() {
    let model = Llama::new(cfg(true, false));
    let params = model.params.init(3, 0.1);
    let (tokens, _) = data();
    let dev = OnDevice {
        inner: CpuKernels::PLAIN,
    };
    let k: &dyn Kernels = &dev;
    let src = &mut WholeParams(emulated(&params, 0));
    // The ids stay in host memory: the first kernel to read them refuses.
    let _ = model.embed_forward(k, &mut DevicePool::new(0), src, &tokens);
}

#[test]
#[should_panic(expected = "a host slice was asked of a view of device 2 memory")]
fn a_device_buffer_is_never_read_on_the_host() {
    let mut pool = DevicePool::new(2);
    let pool: &mut dyn BufferPool = &mut pool;
    let mut buf = pool.alloc::<f32>(BufName::Edge(Edge::Losses), 8);
    let k = OnDevice {
        inner: CpuKernels::PLAIN,
    };
    let one = emulated(&[1.0f32; 8], 2);
    // Through a kernel it is fine …
    Kernels::<f32>::copy(&k, one, buf.view_mut());
    Kernels::<f32>::add_inplace(&k, buf.view_mut(), one);
    // … on the host it is not.
    let _ = buf[0];
}

#[test]
fn a_device_backend_refuses_a_host_slice_naming_the_op() {
    let k = OnDevice {
        inner: CpuKernels::PLAIN,
    };
    let (mut acc, x) = (vec![1.0f32; 4], vec![2.0f32; 4]);
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Kernels::<f32>::add_inplace(&k, emulated_mut(&mut acc, 0), x.view())
    }))
    .expect_err("a host view reached a device op");
    let msg = err.downcast_ref::<String>().expect("a formatted message");
    assert!(
        msg.contains("op add_inplace was handed host memory on a device backend"),
        "{msg}"
    );
    // The same op on device views runs the inner kernel.
    Kernels::<f32>::add_inplace(&k, emulated_mut(&mut acc, 0), emulated(&x, 0));
    assert_eq!(acc, [3.0; 4]);
}
