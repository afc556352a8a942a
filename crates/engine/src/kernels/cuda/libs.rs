//! Finding the CUDA libraries cudarc loads at run time (`dynamic-loading`): cudarc asks the
//! dynamic loader for them by name, which finds them only on the loader's path. NVIDIA's
//! libraries often sit elsewhere: in the toolkit's `lib64` when no `ld.so.conf` entry names
//! it, in the driver's directory of NVIDIA's containers (`/usr/local/nvidia/lib64`), or in the
//! PyPI wheels (`nvidia-cuda-nvrtc`, `nvidia-cublas`, `nvidia-nccl-cu13`; PyTorch brings them,
//! in whatever Python its environment has). A library found in one of those is loaded once by
//! its full path, globally, and the loader then hands cudarc the same library when it asks by
//! soname. [`found`] says where each one came from, for the GPU kit's summary.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Extra directories to search first, colon-separated, as `PATH` is.
pub const DIRS_ENV: &str = "FERROTRON_CUDA_LIB_DIRS";

/// Python environments whose `nvidia/*/lib` wheels are searched: the active one, the
/// repository's `.venv` (`tests/reference/setup_venv.sh`, from the workspace or a crate
/// directory) and PyTorch's on the lent GPU machine.
const VENVS: [&str; 3] = [".venv", "../../.venv", "/opt/torch/.venv"];

/// What each library was loaded from, in load order (`FERROTRON_NVRTC: /path/libnvrtc.so.13`).
static FOUND: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Where each library that [`load`] was asked for came from, or that it was not found.
pub fn found() -> Vec<String> {
    FOUND.lock().map(|f| f.clone()).unwrap_or_default()
}

fn record(line: String) {
    if let Ok(mut f) = FOUND.lock() {
        if !f.contains(&line) {
            f.push(line);
        }
    }
}

/// Directories to look in after the loader's path, in order.
fn dirs() -> Vec<PathBuf> {
    let mut venvs: Vec<PathBuf> = std::env::var_os("VIRTUAL_ENV")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    venvs.extend(VENVS.iter().map(PathBuf::from));
    dirs_from(
        std::env::var_os(DIRS_ENV),
        std::env::var_os("CUDA_HOME"),
        &venvs,
    )
}

/// The search order: the override, `$CUDA_HOME/lib64`, the toolkit's default, the driver's
/// directory of NVIDIA's containers, then every `site-packages/nvidia/*/lib` of each
/// environment under any `python3.X` (the machine here has 3.11, the GPU machine 3.12).
fn dirs_from(
    over: Option<OsString>,
    cuda_home: Option<OsString>,
    venvs: &[PathBuf],
) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = over
        .map(|o| std::env::split_paths(&o).collect())
        .unwrap_or_default();
    if let Some(h) = cuda_home {
        dirs.push(Path::new(&h).join("lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/nvidia/lib64".into());
    for venv in venvs {
        for python in sorted_entries(&venv.join("lib")) {
            let is_python = python
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"));
            if !is_python {
                continue;
            }
            for wheel in sorted_entries(&python.join("site-packages/nvidia")) {
                let lib = wheel.join("lib");
                if lib.is_dir() {
                    dirs.push(lib);
                }
            }
        }
    }
    dirs
}

/// The entries of `dir`, sorted (none when it cannot be read).
fn sorted_entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| r.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Whether a library loads: `present()` (cudarc's own probe by soname) as things are, or
/// after loading the file that `env` names, or the first of `names` found in [`dirs`].
pub fn load(env: &str, names: &[&str], present: impl Fn() -> bool) -> bool {
    if present() {
        record(format!("{env}: {} on the loader's path", names[0]));
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
            let ok = present();
            record(format!(
                "{env}: {}{}",
                f.display(),
                if ok {
                    ""
                } else {
                    " (loaded, but its symbols are not the expected ones)"
                }
            ));
            return ok;
        }
    }
    record(format!(
        "{env}: {} not found (set {env} to the file, or {DIRS_ENV} to its directory)",
        names[0]
    ));
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_libraries_are_searched_in_every_python_environments_nvidia_wheels() {
        let root = std::env::temp_dir().join(format!("ferrotron-cuda-libs-{}", std::process::id()));
        let venv = root.join("venv");
        for sub in [
            "python3.12/site-packages/nvidia/cu13/lib",
            "python3.12/site-packages/nvidia/nccl/lib",
        ] {
            std::fs::create_dir_all(venv.join("lib").join(sub)).unwrap();
        }
        // Not a wheel's library directory, not a Python: neither is searched.
        std::fs::create_dir_all(venv.join("lib/python3.12/site-packages/nvidia/include")).unwrap();
        std::fs::create_dir_all(venv.join("lib/perl5/site-packages/nvidia/x/lib")).unwrap();
        let over = std::env::join_paths(["/a", "/b"]).unwrap();
        let dirs = dirs_from(
            Some(over),
            Some("/opt/cuda".into()),
            &[venv.clone(), root.join("missing")],
        );
        let site = venv.join("lib/python3.12/site-packages/nvidia");
        let want: Vec<PathBuf> = vec![
            "/a".into(),
            "/b".into(),
            "/opt/cuda/lib64".into(),
            "/usr/local/cuda/lib64".into(),
            "/usr/local/nvidia/lib64".into(),
            site.join("cu13/lib"),
            site.join("nccl/lib"),
        ];
        assert_eq!(dirs, want);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_cuda_library_that_is_nowhere_is_reported_with_the_fix() {
        let env = "FERROTRON_TEST_NO_SUCH_LIBRARY";
        assert!(!load(env, &["libferrotron-no-such-library.so.1"], || false));
        let line = format!("{env}: libferrotron-no-such-library.so.1 not found (set {env} to the file, or {DIRS_ENV} to its directory)");
        assert!(found().contains(&line), "{:?}", found());
    }
}
