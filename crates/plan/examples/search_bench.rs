//! Times the layout search: `cargo run --release -p ferrotron-plan --example search_bench`.
use ferrotron_plan::cluster::{gpu, Cluster};
use ferrotron_plan::presets::preset;
use ferrotron_plan::search::{search, SearchSpec};
use std::time::Instant;

fn main() {
    for (model, gpus, seq, gbs_tokens) in [
        ("llama-3-70b", 1024u64, 4096u64, 4u64 << 20),
        ("llama-3-8b", 1024, 4096, 4 << 20),
        ("llama-3.1-405b", 1024, 8192, 16 << 20),
        ("mixtral-8x7b", 1024, 4096, 4 << 20),
    ] {
        let spec = SearchSpec::new(
            preset(model).unwrap(),
            gpus,
            Cluster::of(gpu("h100").unwrap(), 8).unwrap(),
            seq,
            gbs_tokens,
        );
        let t0 = Instant::now();
        let r = search(&spec);
        let dt = t0.elapsed();
        match r {
            Ok(r) => println!(
                "{model:<16} {gpus} GPUs: {:.3} s, {} layouts evaluated, {} memory plans; best {} ({:.0} tok/s, MFU {:.1}%)",
                dt.as_secs_f64(),
                r.evaluated,
                r.memory_planned,
                r.top[0].flags,
                r.top[0].time.tokens_per_s,
                r.top[0].time.mfu * 100.0
            ),
            Err(e) => println!("{model}: {:.3} s, error {e}", dt.as_secs_f64()),
        }
    }
}
