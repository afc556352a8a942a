//! Per-shape GFLOP/s of the model's linear layers in each direction (forward, backward input,
//! backward weight), as the kernels call them, in f32 and with bf16 storage, on each GEMM
//! kernel (the portable gemm crate, where bf16 is staged through f32, and oneDNN where it
//! loads), with the oneDNN / portable ratio. Median of `reps`; the four (kernel, storage)
//! variants alternate within every repetition so that a noisy neighbour hits all alike.
//! `cargo run --release -p ferrotron-engine --example shape_bench -- [reps]`
//! (`DNNL_VERBOSE=1` makes oneDNN print the implementation of every product.)
use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::{Accum, CpuKernels, Gemm, Kernels, MatmulShape};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use half::bf16;
use std::time::Instant;

/// Seconds of one call of each direction: forward, backward input, backward weight.
fn directions<S: Elem>(s: MatmulShape, head: bool, gemm: Gemm) -> [Box<dyn FnMut() -> f64>; 3] {
    let k = CpuKernels::PLAIN.with_gemm(gemm);
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let x = vec![S::from_f32(0.01); n * i];
    let w = vec![S::from_f32(0.01); o * i];
    let timed = |mut f: Box<dyn FnMut()>| -> Box<dyn FnMut() -> f64> {
        Box::new(move || {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
    };
    let (x1, w1, w2, x2) = (x.clone(), w.clone(), w.clone(), x);
    if head {
        // The LM head: f32 logits and logit gradients.
        let mut y = vec![0.0f32; n * o];
        let dy = vec![0.01f32; n * o];
        let dy2 = dy.clone();
        let (mut dx, mut dw) = (vec![S::default(); n * i], vec![S::default(); o * i]);
        return [
            timed(Box::new(move || {
                Kernels::<S>::head_forward(&k, s, x1.view(), w1.view(), y.view_mut())
            })),
            timed(Box::new(move || {
                Kernels::<S>::head_backward_input(&k, s, dy.view(), w2.view(), dx.view_mut())
            })),
            timed(Box::new(move || {
                Kernels::<S>::head_backward_weight(&k, s, dy2.view(), x2.view(), dw.view_mut())
            })),
        ];
    }
    let mut y = vec![S::default(); n * o];
    let dy = vec![S::from_f32(0.01); n * o];
    let dy2 = dy.clone();
    let (mut dx, mut dw) = (vec![S::default(); n * i], vec![S::default(); o * i]);
    [
        timed(Box::new(move || {
            Kernels::<S>::matmul_forward(
                &k,
                s,
                x1.view(),
                w1.view(),
                None,
                y.view_mut(),
                Accum::Overwrite,
            )
        })),
        timed(Box::new(move || {
            Kernels::<S>::matmul_backward_input(
                &k,
                s,
                dy.view(),
                w2.view(),
                dx.view_mut(),
                Accum::Overwrite,
            )
        })),
        timed(Box::new(move || {
            Kernels::<S>::matmul_backward_weight(&k, s, dy2.view(), x2.view(), dw.view_mut(), None)
        })),
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let reps: usize = std::env::args().nth(1).map_or(5, |s| s.parse().unwrap());
    Kernels::<f32>::warm_up(&CpuKernels::PLAIN);
    println!(
        "rayon threads {}; auto: {}",
        rayon::current_num_threads(),
        Gemm::Auto.describe()
    );
    let shapes = [
        ("q      2048x384->384", 2048, 384, 384, false),
        ("kv     2048x384->128", 2048, 384, 128, false),
        ("gate   2048x384->1024", 2048, 384, 1024, false),
        ("down   2048x1024->384", 2048, 1024, 384, false),
        ("head   2048x384->8192", 2048, 384, 8192, true),
    ];
    println!(
        "{:>28} {:>22} {:>22} {:>22}",
        "GFLOP/s portable / onednn (×)", "forward", "backward input", "backward weight"
    );
    for (name, n, i, o, head) in shapes {
        let s = MatmulShape {
            n,
            in_features: i,
            out_features: o,
            ragged: false,
        };
        let fl = 2.0 * (n * i * o) as f64 / 1e9;
        // (portable, onednn) for f32, then for bf16.
        let mut variants = [
            directions::<f32>(s, head, Gemm::Portable),
            directions::<f32>(s, head, Gemm::Onednn),
            directions::<bf16>(s, head, Gemm::Portable),
            directions::<bf16>(s, head, Gemm::Onednn),
        ];
        let mut rows = [format!("{name:>20} f32  "), format!("{name:>20} bf16 ")];
        for d in 0..3 {
            let mut times = [(); 4].map(|_| Vec::with_capacity(reps));
            // One untimed call each: oneDNN creates its primitives on the first.
            variants.iter_mut().for_each(|v| {
                v[d]();
            });
            for _ in 0..reps.max(1) {
                for (v, t) in variants.iter_mut().zip(times.iter_mut()) {
                    t.push(v[d]());
                }
            }
            let gf = times.map(|t| fl / median(t));
            for (row, pair) in rows.iter_mut().zip(gf.chunks(2)) {
                *row += &format!(
                    " {:6.1} {:6.1} ({:5.2})",
                    pair[0],
                    pair[1],
                    pair[1] / pair[0]
                );
            }
        }
        println!("{}\n{}", rows[0], rows[1]);
    }
}
