// Shared by the trainer's integration tests: the bundled corpus tokenized once per test binary,
// and a tiny Llama config that trains in a fraction of a second per step.
#![allow(dead_code)]

use ferrotron_train::config::TrainArgs;
use ferrotron_train::data::{build_shards, Tokenizer};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A fresh directory `NAME-PID` under cargo's test scratch folder. The first call of a test
/// binary also removes the directories that test binaries no longer running left there: each
/// run used to leave its own, and a developer's target/tmp grew by gigabytes.
pub fn tmp(name: &str) -> PathBuf {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(sweep_dead);
    let p = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

/// Removes the `NAME-PID` directories whose process has ended (Linux's /proc tells; elsewhere
/// nothing is removed). A live binary's directories are never touched.
fn sweep_dead() {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(env!("CARGO_TARGET_TMPDIR")) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.rsplit_once('-')) else {
            continue;
        };
        if pid.1.parse::<u32>().is_ok() && !Path::new("/proc").join(pid.1).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Token shards of the bundled corpus (built once per test binary).
pub fn shards() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tmp("shards");
        let corpus =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus/shakespeare.txt");
        build_shards(&[corpus], &Tokenizer::bundled().unwrap(), &dir, 0.05).unwrap();
        dir
    })
}

/// A 2-layer GQA Llama with the bundled tokenizer's vocabulary.
pub fn tiny_model(dir: &Path, vocab: u64, max_pos: u64) -> PathBuf {
    write_llama(dir.join("config.json"), (64, 160, 2), vocab, max_pos)
}

/// A GQA Llama (4 heads, 2 KV heads, tied embeddings, the bundled tokenizer's 8192 tokens, 128
/// positions) of `hidden`, `ffn` and `layers`, in `dir`.
pub fn llama_config(dir: &Path, hidden: u64, ffn: u64, layers: u64) -> PathBuf {
    let p = dir.join(format!("llama-{hidden}-{ffn}-{layers}.json"));
    write_llama(p, (hidden, ffn, layers), 8192, 128)
}

fn write_llama(
    p: PathBuf,
    (hidden, ffn, layers): (u64, u64, u64),
    vocab: u64,
    pos: u64,
) -> PathBuf {
    let cfg = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": layers,
        "vocab_size": vocab, "max_position_embeddings": pos, "tie_word_embeddings": true,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0
    });
    std::fs::write(&p, cfg.to_string()).unwrap();
    p
}

/// A 2-layer Mixtral (4 experts, top-2) with the bundled tokenizer's vocabulary.
pub fn tiny_moe_model(dir: &Path) -> PathBuf {
    let cfg = serde_json::json!({
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "vocab_size": 8192, "max_position_embeddings": 128, "tie_word_embeddings": true,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0
    });
    let p = dir.join("config.json");
    std::fs::write(&p, cfg.to_string()).unwrap();
    p
}

/// Flags of a short, quiet run of the default model (ferrotron-12m) on the bundled corpus,
/// without evaluation, under recompute policy `rc`.
pub fn default_model_args(out: &Path, steps: u64, rc: &str) -> TrainArgs {
    TrainArgs {
        data: Some(shards().to_path_buf()),
        steps: Some(steps),
        eval_interval: Some(0),
        out_dir: Some(out.to_path_buf()),
        peak_gflops: Some(100.0),
        recompute: Some(rc.into()),
        quiet: true,
        ..TrainArgs::default()
    }
}

/// Flags of a short, quiet run of the tiny model.
/// Flags that resume checkpoint `ck`, writing into `out` (metrics to `metrics_file`).
pub fn resume_args(ck: &Path, out: &Path, steps: Option<u64>, metrics_file: &str) -> TrainArgs {
    TrainArgs {
        resume: Some(ck.to_path_buf()),
        steps,
        out_dir: Some(out.to_path_buf()),
        metrics: Some(out.join(metrics_file)),
        quiet: true,
        peak_gflops: Some(100.0),
        ..TrainArgs::default()
    }
}

pub fn tiny_args(out: &Path, steps: u64) -> TrainArgs {
    let model = tiny_model(out, 8192, 128);
    TrainArgs {
        model: Some(model.to_string_lossy().into()),
        data: Some(shards().to_path_buf()),
        seq: Some(32),
        mbs: Some(4),
        steps: Some(steps),
        warmup: Some(2),
        eval_interval: Some(0),
        out_dir: Some(out.to_path_buf()),
        peak_gflops: Some(100.0),
        quiet: true,
        ..TrainArgs::default()
    }
}

/// A fresh empty directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let p =
            std::env::temp_dir().join(format!("ferrotron-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The f32 tensors of a safetensors file, by name.
pub fn f32_tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let v = t.data().chunks(4);
            let v = v.map(|b| f32::from_le_bytes(b.try_into().unwrap()));
            (name, v.collect())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// |a − b| / |b|.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// `other`'s losses follow `one`'s within `tol` relative, step by step (and its gradient norms,
/// with `grad_norm`).
pub fn assert_follows(
    one: &[ferrotron_train::metrics::StepMetrics],
    other: &[ferrotron_train::metrics::StepMetrics],
    tol: f64,
    grad_norm: bool,
    what: &str,
) {
    for (x, y) in one.iter().zip(other) {
        let what = format!("{what} step {}", y.step);
        assert_eq!(x.step, y.step, "{what}");
        assert!(
            rel(x.loss, y.loss) < tol,
            "{what}: loss {} vs {}",
            x.loss,
            y.loss
        );
        if grad_norm {
            let (a, b) = (x.grad_norm, y.grad_norm);
            assert!(rel(a, b) < tol, "{what}: grad norm {a} vs {b}");
        }
    }
}

/// Every rank of every step within 1% of its own plan.
pub fn assert_within_plans(steps: &[ferrotron_train::metrics::StepMetrics], what: &str) {
    for m in steps {
        for r in &m.rank_mem {
            let dev = rel(r.mem_peak_measured as f64, r.mem_peak_planned as f64);
            assert!(dev < 0.01, "{what} step {} rank {}: {r:?}", m.step, r.rank);
        }
    }
}

/// Every step's host↔device bytes of the offload tiers, as counted by the device they copy
/// through, equal to the plan's (`ferrotron_plan::host_transfer`); returns the last step's.
pub fn assert_transfers_as_planned(
    steps: &[ferrotron_train::metrics::StepMetrics],
    what: &str,
) -> ferrotron_train::metrics::HostTransferBytes {
    let mut last = None;
    for m in steps {
        let t = m.host_transfer;
        let t = t.unwrap_or_else(|| panic!("{what} step {}: no host transfer counted", m.step));
        assert!(t.planned_up > 0 && t.planned_down > 0, "{what}: {t:?}");
        let (got, planned) = ((t.up, t.down), (t.planned_up, t.planned_down));
        assert_eq!(got, planned, "{what} step {}: bytes up and down", m.step);
        last = Some(t);
    }
    last.expect("a step")
}

/// Two runs the same bit for bit: every step's loss, learning rate and gradient norm, and the
/// sample of the weights at the end.
pub fn assert_same_run(
    what: &str,
    a: &ferrotron_train::run::RunSummary,
    b: &ferrotron_train::run::RunSummary,
) {
    assert_same_trajectory(what, &a.steps, &b.steps);
    for (x, y) in a.steps.iter().zip(&b.steps) {
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits(), "{what}");
    }
    assert!(a.sample.as_ref().is_some_and(|s| !s.is_empty()));
    assert_eq!(a.sample, b.sample, "{what}: the weights at the end");
}

/// Every step's loss and learning rate, bit for bit, in `a` and `b`.
pub fn assert_same_trajectory(
    what: &str,
    a: &[ferrotron_train::metrics::StepMetrics],
    b: &[ferrotron_train::metrics::StepMetrics],
) {
    assert_eq!(a.len(), b.len(), "{what}: step counts");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.step, y.step, "{what}");
        assert_eq!(
            x.loss.to_bits(),
            y.loss.to_bits(),
            "{what} step {}: loss {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
        assert_eq!(
            x.lr.to_bits(),
            y.lr.to_bits(),
            "{what} step {}: lr {} vs {}",
            x.step,
            x.lr,
            y.lr
        );
    }
}
