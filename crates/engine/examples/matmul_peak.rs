//! Prints sgemm GFLOP/s for square and model-like shapes (the MFU denominator).
//! `cargo run --release -p ferrotron-engine --example matmul_peak`

use ferrotron_engine::peak::sgemm_gflops;

fn main() {
    println!("rayon threads: {}", rayon::current_num_threads());
    println!("{:>28} {:>10}", "shape y[m,n] = x[m,k]·Wᵀ", "GFLOP/s");
    let shapes: &[(&str, usize, usize, usize)] = &[
        ("square 512", 512, 512, 512),
        ("square 1024", 1024, 1024, 1024),
        ("square 2048", 2048, 2048, 2048),
        ("qkv  N=4096 C=512", 4096, 512, 512),
        ("mlp up N=4096 512->1536", 4096, 1536, 512),
        ("mlp down N=4096 1536->512", 4096, 512, 1536),
        ("lm_head N=1024 512->32000", 1024, 32000, 512),
        ("qkv N=4096 C=768", 4096, 768, 768),
        ("mlp up N=4096 768->3072", 4096, 3072, 768),
    ];
    for &(name, m, n, k) in shapes {
        println!("{name:>28} {:>10.1}", sgemm_gflops(m, n, k, 5));
    }
    println!(
        "measure_matmul_peak_gflops() = {:.1}",
        ferrotron_engine::measure_matmul_peak_gflops()
    );
}
