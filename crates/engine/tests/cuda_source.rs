//! The CUDA backend's kernels compile with NVRTC for the GPUs users have (Hopper sm_90,
//! Ampere sm_80), and the PTX defines every entry point the backend loads. No GPU is needed:
//! NVRTC runs on the CPU (from the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel that
//! scripts/test.sh installs). Skips with a message where NVRTC is absent.
#![cfg(feature = "cuda")]

use ferrotron_engine::kernels::cuda::source::{
    compile, compile_program, entry_points, nvrtc_present, program,
};
use ferrotron_engine::kernels::cuda::{device, libs, ptx_version, skip};

#[test]
fn every_kernel_compiles_for_hopper_and_ampere() {
    if !nvrtc_present() {
        skip::unavailable(
            "NVRTC not found (pip install nvidia-cuda-nvrtc, or set FERROTRON_NVRTC)",
        );
        return;
    }
    // Where the libraries came from, for the GPU kit's summary.
    device::driver_present();
    eprintln!("libraries: {}", libs::found().join("; "));
    for arch in ["sm_90", "sm_80"] {
        // Compiled, never from the cache (`compile`'s, tested below).
        let ptx = compile_program(program(), arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains(&format!(".target {arch}")),
            "{arch}: {}",
            &ptx[..300]
        );
        // The ISA the driver will be asked to load (`ptx_version`), for the kit's summary.
        let isa = ptx_version::isa(&ptx).unwrap_or_else(|| panic!("{arch}: no .version line"));
        let driver = match device::driver_present() {
            true => match device::driver_cuda_version() {
                Ok(v) => match ptx_version::fit(&ptx, v) {
                    ptx_version::Fit::AsIs => {
                        format!("driver CUDA {}: loads as is", ptx_version::cuda_name(v))
                    }
                    ptx_version::Fit::Lowered { to, .. } => format!(
                        "driver CUDA {}: newer than it loads, lowered to {}.{}",
                        ptx_version::cuda_name(v),
                        to.0,
                        to.1
                    ),
                },
                Err(e) => format!("{e}"),
            },
            false => "no driver here".into(),
        };
        eprintln!("ptx: {arch} ISA {}.{} ({driver})", isa.0, isa.1);
        for name in entry_points() {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
        assemble(&ptx, arch);
    }
}

/// `FERROTRON_PTXAS`, else `ptxas` where the toolkit puts it (the GPU machine's).
fn ptxas() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("FERROTRON_PTXAS") {
        return Some(p.into());
    }
    ["/usr/local/cuda/bin/ptxas"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
}

/// The PTX through NVIDIA's assembler for `arch`: NVRTC copies inline PTX (the tensor cores'
/// `mma.sync`, the `cvt`s) into its output unchecked, so an operand the instruction does not
/// take would otherwise first fail when a GPU's driver loads the program. CI installs ptxas
/// from the `nvidia-cuda-nvcc` wheel (scripts/cuda_check.sh). Prints the tensor-core kernels'
/// registers and spills.
fn assemble(ptx: &str, arch: &str) {
    let Some(ptxas) = ptxas() else {
        eprintln!("ptxas: not found (set FERROTRON_PTXAS): the PTX for {arch} was not assembled");
        return;
    };
    let file = std::env::temp_dir().join(format!("ferrotron-{}-{arch}.ptx", std::process::id()));
    std::fs::write(&file, ptx).expect("writing the PTX");
    let out = std::process::Command::new(&ptxas)
        .args(["-v", &format!("-arch={arch}"), "-o", "/dev/null"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("ptxas ({}): {e}", ptxas.display()));
    let _ = std::fs::remove_file(&file);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ptxas rejects the PTX for {arch}: {}",
        log.lines()
            .filter(|l| !l.starts_with("ptxas info"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // `-v` says, per entry: "Compiling entry function 'NAME' for 'sm_90'", then its stack
    // frame and spills, then its registers.
    let mut entry = "";
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            entry = rest.split('\'').next().unwrap_or_default();
        } else if entry.starts_with("flash_") && line.contains("ptxas info    :") {
            let what = line.trim_start_matches("ptxas info    :").trim();
            if what.starts_with("Used") || what.contains("spill") {
                eprintln!("ptxas: {arch} {entry}: {what}");
            }
        }
    }
}

#[test]
fn a_compile_error_names_the_line() {
    if !nvrtc_present() {
        skip::unavailable("NVRTC not found");
        return;
    }
    // The same compiler path with a broken program: the error carries NVRTC's log.
    let err = compile_program(
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

#[test]
fn a_compiled_program_is_cached_and_read_back() {
    if !nvrtc_present() {
        skip::unavailable("NVRTC not found");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ferrotron-ptx-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: set before this test's compiles read it. The test beside it compiles for sm_90
    // and sm_80 meanwhile, and may write its programs here too (a cold compile takes
    // seconds): this one compiles for sm_86, which nothing else does, and counts only those.
    unsafe { std::env::set_var("FERROTRON_CACHE", &dir) };
    let first = compile("sm_86").unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.join("cuda"))
        .unwrap()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().ends_with("-sm_86.ptx"))
        .collect();
    assert_eq!(files.len(), 1, "one cached program: {files:?}");
    // The second compile is the file: changed on disk, the change comes back.
    let marked = format!("{first}// cached\n");
    std::fs::write(files[0].path(), &marked).unwrap();
    assert_eq!(compile("sm_86").unwrap(), marked);
    std::fs::remove_dir_all(&dir).unwrap();
}
