//! The kernel library's own workspace. The gemm crate allocates packing buffers inside every
//! product (one per thread of a parallel product), and oneDNN takes a scratchpad from the Rust
//! heap on every call, much as cuBLAS needs a workspace on a GPU.
//! It is real memory at the step's peak, so the plan includes it: measured once at startup by
//! running this model's matmul shapes under the tracking allocator.

use crate::memory::alloc;
use ferrotron_engine::kernels::{Accum, CpuKernels, Kernels, MatmulShape};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use ferrotron_engine::model::LlamaConfig;
use ferrotron_engine::Elem;

/// The (rows, in, out) of every linear layer of a training step with `n` tokens per
/// micro-batch and LM-head chunks of `chunk` rows.
fn shapes(c: &LlamaConfig, n: usize, chunk: usize) -> Vec<MatmulShape> {
    let (h, f) = (c.hidden, c.intermediate);
    [
        (n, h, c.q_dim()),
        (n, h, c.kv_dim()),
        (n, c.q_dim(), h),
        (n, h, f),
        (n, f, h),
        (chunk.min(n), h, c.vocab),
    ]
    .into_iter()
    .map(|(n, in_features, out_features)| MatmulShape {
        n,
        in_features,
        out_features,
        ragged: false,
    })
    .collect()
}

/// Largest transient allocation of the model's products, in bytes: the layers' linear
/// products, and the LM head's (the loss phase runs only those). The plan's overhead term is
/// the larger; the trainer's planned step peak charges each phase its own, since the two differ
/// by a few hundred KiB to a few MiB with the shapes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelWorkspace {
    pub layers: u64,
    pub head: u64,
    /// The part live at every instant, the optimizer step's included: none of the host's
    /// (its products' scratch comes and goes), all of a GPU's (cuBLASLt's workspace and the
    /// backend's scratch, allocated once).
    pub resident: u64,
}

impl KernelWorkspace {
    pub fn max(&self) -> u64 {
        self.layers.max(self.head)
    }
}

/// The [`KernelWorkspace`] of the model's products with activations stored as `S` and
/// gradients as `G`; zero when the tracking allocator is not installed (nothing can be
/// measured). 16-bit and fp8 products stage their operands in f32 scratch (`staged_gemm`),
/// and oneDNN's products have their scratchpad (`kernels::cpu::onednn`): this includes both.
pub fn measure<S: Elem, G: Elem>(
    k: &CpuKernels,
    c: &LlamaConfig,
    n: usize,
    chunk: usize,
) -> KernelWorkspace {
    if !alloc::installed() {
        return KernelWorkspace::default();
    }
    // The first pass also creates whatever the gemm crate keeps per thread once it has seen a
    // shape (it stays allocated and falls into the baseline, as it will be in the step); only
    // the second pass measures what is transient. Measuring the first overstated the fp32
    // selective plan by 1 MiB in a fresh process.
    once::<S, G>(k, c, n, chunk);
    once::<S, G>(k, c, n, chunk)
}

fn once<S: Elem, G: Elem>(
    k: &CpuKernels,
    c: &LlamaConfig,
    n: usize,
    chunk: usize,
) -> KernelWorkspace {
    let k: &dyn Kernels<S, G> = k;
    let during = |worst: &mut u64, f: &mut dyn FnMut()| {
        let live = alloc::live();
        alloc::reset_peak();
        f();
        *worst = (*worst).max(alloc::peak().saturating_sub(live));
    };
    let v = |len: usize| vec![S::from_f32(0.01); len];
    let mut ws = KernelWorkspace::default();
    let mut shapes = shapes(c, n, chunk);
    // The LM head, with its f32 logits.
    let s = shapes.pop().expect("the LM head shape");
    for s in shapes {
        let (x, w) = (v(s.n * s.in_features), v(s.out_features * s.in_features));
        let mut y = v(s.n * s.out_features);
        let mut dx = v(s.n * s.in_features);
        let mut dw = vec![G::default(); s.out_features * s.in_features];
        let l = &mut ws.layers;
        // Both modes: oneDNN runs `+=` as another primitive (a sum post-op), whose scratchpad
        // may differ.
        for accum in [Accum::Overwrite, Accum::Add] {
            during(l, &mut || {
                k.matmul_forward(s, x.view(), w.view(), None, y.view_mut(), accum)
            });
            during(l, &mut || {
                k.matmul_backward_input(s, y.view(), w.view(), dx.view_mut(), accum)
            });
        }
        during(l, &mut || {
            k.matmul_backward_weight(s, y.view(), x.view(), dw.view_mut(), None)
        });
    }
    let (x, w) = (v(s.n * s.in_features), v(s.out_features * s.in_features));
    let mut logits = vec![0.01f32; s.n * s.out_features];
    let mut dx = v(s.n * s.in_features);
    let mut dw = vec![G::default(); s.out_features * s.in_features];
    let h = &mut ws.head;
    during(h, &mut || {
        k.head_forward(s, x.view(), w.view(), logits.view_mut())
    });
    during(h, &mut || {
        k.head_backward_input(s, logits.view(), w.view(), dx.view_mut())
    });
    during(h, &mut || {
        k.head_backward_weight(s, logits.view(), x.view(), dw.view_mut())
    });
    ws
}
