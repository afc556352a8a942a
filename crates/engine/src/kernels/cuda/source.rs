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
        include_str!("cu/adamw.cu"),
        include_str!("cu/attention.cu"),
        include_str!("cu/bias.cu"),
    ]
    .join("\n")
}

/// Suffixes of the storage types (`FOR_STORAGE` in `common.cuh`).
pub const STORAGE: [&str; 3] = ["f32", "bf16", "f16"];
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
        "sum_squares",
        "rmsnorm_forward",
        "rmsnorm_backward_input",
        "rope",
        "swiglu_forward",
        "swiglu_backward",
        "embedding_forward",
        "attention_forward",
        "attention_backward_q",
        "attention_backward_kv",
        "bias_add",
    ];
    let per_grads = [
        "rmsnorm_backward_weight",
        "embedding_backward",
        "adamw",
        "bias_grad",
    ];
    let mut names: Vec<String> = ["count_targets", "cross_entropy"].map(String::from).into();
    for k in per_storage {
        names.extend(STORAGE.iter().map(|s| format!("{k}_{s}")));
    }
    for k in per_grads {
        names.extend(GRADS.iter().map(|s| format!("{k}_{s}")));
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
pub fn compile(arch: &'static str) -> Result<String, CompileError> {
    compile_program(program(), arch)
}

/// `src` as PTX for `arch`, with the backend's options ([`compile`]).
pub fn compile_program(src: String, arch: &'static str) -> Result<String, CompileError> {
    if !nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(true),
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
            assert!(
                src.contains(&format!("void {base}_##sfx("))
                    || src.contains(&format!("void {base}(")),
                "{name}: no kernel in the CUDA source"
            );
        }
    }
}
