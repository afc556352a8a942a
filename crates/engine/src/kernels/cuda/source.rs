//! The CUDA C++ of the backend's kernels (`cu/*.cu`), compiled at run time by NVRTC for the
//! GPU found (`sm_XY` from its compute capability) and cached on disk, and the list of entry
//! points the backend launches.
//!
//! The program includes no CUDA header (`cu/common.cuh`), so NVRTC alone compiles it: on the
//! GPU machine from the driver's CUDA install, and on a machine without a GPU from the
//! `nvidia-cuda-nvrtc` wheel, which is how CI checks every kernel for sm_90 and sm_80 without
//! a GPU (`tests/cuda_source.rs`).

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

/// The whole program: the shared header first, then each op family's file.
pub fn program() -> String {
    [
        include_str!("cu/common.cuh"),
        include_str!("cu/elementwise.cu"),
        include_str!("cu/rmsnorm.cu"),
        include_str!("cu/rope_swiglu.cu"),
        include_str!("cu/embedding.cu"),
        include_str!("cu/cross_entropy.cu"),
        include_str!("cu/vocab_parallel_ce.cu"),
        include_str!("cu/adamw.cu"),
        include_str!("cu/attention.cu"),
        include_str!("cu/flash_attention.cu"),
        include_str!("cu/ring_attention.cu"),
        include_str!("cu/bias.cu"),
        include_str!("cu/moe.cu"),
        include_str!("cu/fp8.cu"),
    ]
    .join("\n")
}

/// Suffixes of the storage types (`FOR_STORAGE` in `common.cuh`).
pub const STORAGE: [&str; 3] = ["f32", "bf16", "f16"];
/// The head dims the tensor-core attention is built for (`FLASH_DIMS` in
/// `cu/flash_attention.cu`); the plain kernels take every other.
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];
/// Suffixes of the (storage, gradient) pairs (`FOR_GRADS`).
pub const GRADS: [&str; 4] = ["f32_f32", "bf16_bf16", "bf16_f32", "f16_f16"];

/// Every entry point the program defines: the backend loads each by name at start-up, so a
/// kernel missing here or there fails the first run, and the compile test checks the PTX.
pub fn entry_points() -> Vec<String> {
    let per_storage = [
        "add",
        "add_inplace",
        "scale",
        "round_params",
        "widen",
        "sum_squares",
        "sum_squares_add",
        "rmsnorm_forward",
        "add_rmsnorm_forward",
        "rmsnorm_backward_input",
        "rmsnorm_weight_partial",
        "column_partials_add",
        "rope",
        "swiglu_forward",
        "swiglu_backward",
        "embedding_forward",
        "attention_forward",
        "attention_backward_q",
        "attention_backward_kv",
        "ring_forward",
        "ring_backward_q",
        "ring_backward_kv",
        "bias_add",
        "bias_grad_partial",
        "moe_permute",
        "moe_unpermute",
        "moe_scale_rows",
        "moe_row_dot",
        "fp8_amax",
        "fp8_quantize",
        "fp8_quantize_t",
    ];
    let per_grads = ["embedding_backward", "adamw"];
    let mut names: Vec<String> = [
        "count_targets",
        "cross_entropy",
        "cross_entropy_staged_bf16",
        "cross_entropy_staged_f16",
        "ce_shard_stats",
        "ce_shard_finish",
        "loss_accumulate",
        "loss_reset",
        "router_topk",
        "router_load",
        "router_backward",
        "moe_gather_copies",
        "moe_scatter_copies",
        "fp8_amax_reset",
    ]
    .map(String::from)
    .into();
    for k in per_storage {
        names.extend(STORAGE.iter().map(|s| format!("{k}_{s}")));
    }
    for k in per_grads {
        names.extend(GRADS.iter().map(|s| format!("{k}_{s}")));
    }
    // Tensor-core attention: 16-bit storage, head dims 64 and 128 (`cu/flash_attention.cu`).
    for k in ["flash_forward", "flash_backward_q", "flash_backward_kv"] {
        for d in FLASH_HEAD_DIMS {
            names.extend(["bf16", "f16"].map(|s| format!("{k}_{d}_{s}")));
        }
    }
    names
}

/// NVRTC's diagnostics, or why it could not run.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("NVRTC (libnvrtc.so) is not installed: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`, or point FERROTRON_NVRTC at libnvrtc.so")]
    NoNvrtc,
    #[error("NVRTC failed to compile the CUDA kernels for {arch}: {log}")]
    Failed { arch: String, log: String },
}

/// The program as PTX for `arch` (`"sm_90"`). Arithmetic is IEEE (no fast math, precise
/// division and square root, no flush to zero) so that results follow the CPU backend's
/// within rounding; contraction into FMA is allowed, as the CPU's FMA tier does.
///
/// From the on-disk cache when this exact program was compiled for `arch` before
/// (`$FERROTRON_CACHE/cuda`, else `~/.cache/ferrotron/cuda`; keyed by a hash of the source, the
/// options and `arch`), else compiled and stored there, so a run starts without NVRTC's
/// seconds (and a cached program loads even where NVRTC is missing).
pub fn compile(arch: &'static str) -> Result<String, CompileError> {
    let src = program();
    let file = cache_dir().map(|d| d.join(format!("{:016x}-{arch}.ptx", cache_key(&src, arch))));
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(ptx);
    }
    let ptx = compile_program(src, arch)?;
    if let Some(f) = file {
        // Written whole, then renamed into place: a reader never sees half a file.
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        let stored = f.parent().map(std::fs::create_dir_all).transpose().is_ok()
            && std::fs::write(&tmp, &ptx).is_ok()
            && std::fs::rename(&tmp, &f).is_ok();
        if !stored {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(ptx)
}

/// Where compiled programs are kept (`None`: nowhere, compile every time).
pub fn cache_dir() -> Option<std::path::PathBuf> {
    let root = match std::env::var_os("FERROTRON_CACHE") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::Path::new(&std::env::var_os("HOME")?).join(".cache/ferrotron"),
    };
    Some(root.join("cuda"))
}

/// FNV-1a over the source, the compile options and the architecture: stable across builds
/// and Rust versions (unlike `DefaultHasher`), so a cache outlives the binary that wrote it.
fn cache_key(src: &str, arch: &str) -> u64 {
    let opts = format!("{OPTIONS:?}");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in [src, &opts, arch].iter().flat_map(|s| s.bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// NVRTC's flush-to-zero, precise square root, precise division and FMA contraction.
const OPTIONS: [bool; 4] = [false, true, true, true];

/// `src` as PTX for `arch`, with the backend's options ([`compile`]).
pub fn compile_program(src: String, arch: &'static str) -> Result<String, CompileError> {
    if !nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let [ftz, prec_sqrt, prec_div, fmad] = OPTIONS.map(Some);
    let opts = CompileOptions {
        ftz,
        prec_sqrt,
        prec_div,
        fmad,
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts)
        .map(|p| p.to_src())
        .map_err(|e| CompileError::Failed {
            arch: arch.into(),
            log: format!("{e:?}"),
        })
}

/// Whether NVRTC can be loaded (see [`super::libs`]).
pub fn nvrtc_present() -> bool {
    // SAFETY: a dlopen probe, as cudarc does before its first call.
    super::libs::load(
        "FERROTRON_NVRTC",
        &["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"],
        || unsafe { cudarc::nvrtc::sys::is_culib_present() },
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_entry_point_is_defined_in_the_source() {
        let src = super::program();
        for name in super::entry_points() {
            // An instantiation macro writes `NAME_##sfx`; the pairs' suffixes first, since
            // `bf16_f32` also ends in `_f32`.
            let base = super::GRADS
                .iter()
                .chain(super::STORAGE.iter())
                .find_map(|s| name.strip_suffix(&format!("_{s}")))
                .unwrap_or(&name);
            // The tensor-core kernels are instantiated per head dim too: `NAME_##D##_##sfx`.
            let per_dim = super::FLASH_HEAD_DIMS
                .iter()
                .find_map(|d| base.strip_suffix(&format!("_{d}")));
            assert!(
                src.contains(&format!("void {base}_##sfx("))
                    || src.contains(&format!("void {base}("))
                    || per_dim.is_some_and(|b| src.contains(&format!("void {b}_##D##_##sfx("))),
                "{name}: no kernel in the CUDA source"
            );
        }
    }
}
