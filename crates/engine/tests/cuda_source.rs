//! The CUDA backend's kernels compile with NVRTC for the GPUs users have (Hopper sm_90,
//! Ampere sm_80), and the PTX defines every entry point the backend loads. No GPU is needed:
//! NVRTC runs on the CPU (from the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel that
//! scripts/test.sh installs). Skips with a message where NVRTC is absent.
#![cfg(feature = "cuda")]

use ferrotron_engine::kernels::cuda::source::{compile, entry_points, nvrtc_present};

#[test]
fn every_kernel_compiles_for_hopper_and_ampere() {
    if !nvrtc_present() {
        eprintln!(
            "skipped: NVRTC not found (pip install nvidia-cuda-nvrtc, or set FERROTRON_NVRTC)"
        );
        return;
    }
    for arch in ["sm_90", "sm_80"] {
        let ptx = compile(arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains(&format!(".target {arch}")),
            "{arch}: {}",
            &ptx[..300]
        );
        for name in entry_points() {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
    }
}

#[test]
fn a_compile_error_names_the_line() {
    if !nvrtc_present() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    // The same compiler path with a broken program: the error carries NVRTC's log.
    let err = ferrotron_engine::kernels::cuda::source::compile_program(
        "extern \"C\" __global__ void k() { undefined_thing(); }".into(),
        "sm_90",
    )
    .expect_err("a broken program must not compile");
    let msg = err.to_string();
    assert!(
        msg.contains("NVRTC failed to compile the CUDA kernels for sm_90"),
        "{msg}"
    );
    assert!(msg.contains("undefined_thing"), "{msg}");
}
