//! Per-step metrics as JSON lines, and the machine's matmul peak for MFU.

// The per-dimension bytes are the mesh's (`ferrotron_dist::comm_bytes`); the metrics carry them.
pub use ferrotron_dist::comm_bytes::{CommByDim, CommBytes};
use ferrotron_engine::kernels::DeviceOpsReport;
use ferrotron_plan::cluster::Dim;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub hfu: f64,
    pub step_ms: f64,
    /// Live heap bytes of the training state at its highest during this step, over the
    /// process baseline taken once the rank's tables (its plan, the model's parameter tables)
    /// are built and before any buffer its plan lists is.
    pub mem_peak_measured: u64,
    pub mem_peak_planned: u64,
    /// On a GPU: the device's memory in use at the end of the step by the driver's count
    /// (`cuMemGetInfo`), over what was in use before the trainer allocated anything: a check
    /// of `mem_peak_measured` (what the trainer asked for) by the one who gave it. Every
    /// buffer is allocated by the plan and kept, so the end of a step is its peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_device_driver: Option<u64>,
    /// On a GPU: what this step asked of the driver (`ferrotron_engine::kernels::device_ops`):
    /// blocking host synchronisations in all and by site, and launches (kernels, cuBLASLt
    /// calls, device copies), counted from the step's start to its end (an evaluation between
    /// steps is not in it). Issue #32's before and after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_ops: Option<DeviceOpsReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// fp16: the loss scale this step ran with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// The optimizer step was skipped on every rank: fp16's gradients overflowed, or (fp32,
    /// bf16) the loss or gradient norm was not finite (`--max-skipped-steps` in a row stop
    /// the run).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Data parallelism: every rank's planned and measured peak (the top-level pair is the
    /// largest of each over the ranks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_mem: Vec<RankMem>,
    /// Bytes this rank sent this step in each parallel dimension it takes part in, keyed by
    /// the dimension (`dp`: gradient reductions and ZeRO's parameter all-gathers, as the ring
    /// algorithms send them; `tp`: the model's collectives; `ep`: the token exchanges, whose
    /// plan assumes balanced routing; `cp`: the ring's key/value blocks and their gradients),
    /// beside the planner's prediction for the layout.
    #[serde(default, skip_serializing_if = "CommByDim::is_empty")]
    pub comm: CommByDim,
    /// Data parallelism: milliseconds this rank was blocked waiting for its gradient
    /// reductions and parameter all-gathers (the communication not hidden behind compute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_exposed_ms: Option<f64>,
    /// Offload on a device: bytes this rank's offload tiers copied between host and device
    /// memory this step, beside the planner's (`ferrotron_plan::host_transfer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_transfer: Option<HostTransferBytes>,
    /// Pipeline parallelism: each stage's measured bubble this step (time blocked in its
    /// transfers over its time computing, stage order) and the planner's (p − 1)/(v·m).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pp_bubble: Vec<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_bubble_planned: Option<f64>,
    /// The GEMM kernel the products ran on (`Gemm::describe`): results depend on it.
    #[serde(default)]
    pub gemm: String,
}

impl StepMetrics {
    /// Bytes this rank sent in dimension `d` this step (`None`: it takes no part in one).
    pub fn comm_sent(&self, d: Dim) -> Option<u64> {
        self.comm.get(d).map(|c| c.sent)
    }

    /// The planner's prediction of [`StepMetrics::comm_sent`].
    pub fn comm_planned(&self, d: Dim) -> Option<u64> {
        self.comm.get(d).map(|c| c.planned)
    }
}

/// Bytes copied host → device (`up`) and device → host (`down`) in a step, measured and
/// planned, and where the offloaded update's time went (microseconds; 0 in a step without
/// one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostTransferBytes {
    pub up: u64,
    pub down: u64,
    pub planned_up: u64,
    pub planned_down: u64,
    /// Of `up`, the bytes copied ahead on the device's copy stream (`--offload params`'
    /// weights), which `copy_us` does not time.
    #[serde(default)]
    pub up_ahead: u64,
    /// Time in the copies the host made itself, over every thread that made one.
    #[serde(default)]
    pub copy_us: u64,
    /// The offloaded optimizer step, all of it.
    #[serde(default)]
    pub update_us: u64,
    /// AdamW on the host, within it.
    #[serde(default)]
    pub host_adamw_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMem {
    pub rank: usize,
    pub mem_peak_planned: u64,
    pub mem_peak_measured: u64,
    /// The kernel workspace measured at start-up and included in the plan (`workspace`):
    /// the plan's one measured input, so a plan that is off can be traced to it.
    #[serde(default)]
    pub kernel_workspace: u64,
}

pub struct MetricsWriter {
    file: std::io::BufWriter<std::fs::File>,
    /// `--tensorboard`: the same values as event files.
    tensorboard: Option<crate::observe::tensorboard::TensorBoardWriter>,
}

impl MetricsWriter {
    /// Appends when `append` (a resumed run continues its file), else truncates.
    pub fn open(path: &Path, append: bool) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| anyhow::anyhow!("metrics = {}: cannot open: {e}", path.display()))?;
        Ok(MetricsWriter {
            file: std::io::BufWriter::new(file),
            tensorboard: None,
        })
    }

    /// Also writes each step's metrics as TensorBoard events into `dir` (a new event file).
    pub fn with_tensorboard(mut self, dir: Option<&Path>) -> anyhow::Result<Self> {
        if let Some(dir) = dir {
            self.tensorboard = Some(crate::observe::tensorboard::TensorBoardWriter::create(dir)?);
        }
        Ok(self)
    }

    pub fn write(&mut self, m: &StepMetrics) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.file, m)?;
        self.file.write_all(b"\n")?;
        self.file.flush()?;
        if let Some(tb) = &mut self.tensorboard {
            tb.write(m)?;
        }
        Ok(())
    }
}

/// The cache file of the peak with `threads` threads on the GEMM kernel `gemm` (its name's
/// first word: "onednn" or "portable"; the portable f32 peak keeps its old file name), for
/// bf16 or f32 products.
fn cache_path(threads: usize, gemm: &str, bf16: bool) -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let mut kernel = match gemm.split_whitespace().next() {
        Some("portable") | None => String::new(),
        Some(k) => format!("_{k}"),
    };
    if bf16 {
        kernel += "_bf16";
    }
    Some(PathBuf::from(home).join(format!(
        ".cache/ferrotron/matmul_peak_{threads}threads{kernel}.json"
    )))
}

/// The matmul peak (GFLOP/s) of this machine with the current thread pool, on the GEMM kernel
/// the trainer uses: measured once (about a second) and cached in ~/.cache/ferrotron. It is
/// the f32 peak, or with `bf16_storage` the bf16 one where bf16 products run on oneDNN (AMX:
/// about 10× the f32 peak, which would put MFU far above 100%).
pub fn matmul_peak_gflops(bf16_storage: bool) -> f64 {
    // Callers on several threads at once (tests) measure one at a time; the later ones read the
    // first one's cache.
    static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let (threads, name, bf16) = peak_kernel(bf16_storage);
    let cache_path = |threads| cache_path(threads, &name, bf16);
    let cached = cache_path(threads)
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["gflops"].as_f64())
        .filter(|g| *g > 0.0);
    if let Some(g) = cached {
        return g;
    }
    let g = measure(bf16);
    save(cache_path(threads), g, threads);
    g
}

/// What a matmul peak is measured on: the thread count, the GEMM kernel's name, and whether
/// its products are bf16 (with 16-bit storage, where oneDNN runs bf16 natively).
fn peak_kernel(bf16_storage: bool) -> (usize, String, bool) {
    let gemm = ferrotron_engine::kernels::Gemm::Auto;
    let bf16 = bf16_storage && gemm.runs_bf16_natively();
    (rayon::current_num_threads(), gemm.describe(), bf16)
}

fn measure(bf16: bool) -> f64 {
    if bf16 {
        ferrotron_engine::peak::measure_matmul_peak_gflops_of::<half::bf16>()
    } else {
        ferrotron_engine::measure_matmul_peak_gflops()
    }
}

fn save(path: Option<PathBuf>, gflops: f64, threads: usize) {
    if let Some(p) = path {
        if let Some(d) = p.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let _ = std::fs::write(
            p,
            serde_json::json!({"gflops": gflops, "threads": threads}).to_string(),
        );
    }
}

/// A run's MFU above 100% means the cached peak it was measured against is low: it was
/// measured while the machine was busy (another build, another run). Measures the peak again,
/// keeps the higher of the two in the cache for the next run, and returns the factor by which
/// this run's MFU figures shrink against it (1 when the cached peak stands).
pub fn remeasure_low_peak(bf16_storage: bool, cached: f64) -> f64 {
    let (threads, name, bf16) = peak_kernel(bf16_storage);
    let fresh = measure(bf16);
    if fresh <= cached {
        return 1.0;
    }
    save(cache_path(threads, &name, bf16), fresh, threads);
    cached / fresh
}

/// Peak resident set size of this process in bytes (VmHWM), where /proc exists.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
