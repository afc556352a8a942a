//! Finding the CUDA libraries cudarc loads at run time (`dynamic-loading`): cudarc asks the
//! dynamic loader for them by name, which finds them only on the loader's path. NVIDIA's
//! libraries often sit elsewhere: in the toolkit's `lib64` when no `ld.so.conf` entry names
//! it, or in the PyPI wheels (`nvidia-cuda-nvrtc`, `nvidia-cublas`; PyTorch brings them). A
//! library found in one of those is loaded once by its full path, globally, and the loader
//! then hands cudarc the same library when it asks by soname.

use std::path::{Path, PathBuf};

/// Directories to look in after the loader's path: `$CUDA_HOME/lib64`, the toolkit's
/// default, and the NVIDIA wheels of a Python environment (the repository's `.venv`,
/// `tests/reference/setup_venv.sh`, from the workspace or a crate directory).
fn dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(Path::new(&h).join("lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    for root in [".venv", "../../.venv"] {
        let site = Path::new(root).join("lib/python3.11/site-packages/nvidia");
        for sub in ["cu13/lib", "cuda_nvrtc/lib", "cublas/lib"] {
            dirs.push(site.join(sub));
        }
    }
    dirs
}

/// Whether a library loads: `present()` (cudarc's own probe by soname) as things are, or
/// after loading the file that `env` names, or the first of `names` found in [`dirs`].
pub fn load(env: &str, names: &[&str], present: impl Fn() -> bool) -> bool {
    if present() {
        return true;
    }
    let mut files: Vec<PathBuf> = std::env::var_os(env)
        .map(PathBuf::from)
        .into_iter()
        .collect();
    for d in dirs() {
        files.extend(names.iter().map(|n| d.join(n)));
    }
    for f in files {
        let Some(c) = f.to_str().and_then(|s| std::ffi::CString::new(s).ok()) else {
            continue;
        };
        // SAFETY: a dlopen of a library file; the handle is never closed, which is what
        // lets the soname lookup find it later.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !h.is_null() {
            return present();
        }
    }
    false
}
