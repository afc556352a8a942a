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

/// Records where `env`'s library came from, once: a later probe finds it loaded by soname
/// (after the file it was loaded from), which says nothing new.
fn record(line: String) {
    let env = line.split(':').next().unwrap_or_default().to_string() + ":";
    if let Ok(mut f) = FOUND.lock() {
        if !f.iter().any(|l| l.starts_with(&env)) {
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

/// Libraries a library loads by soname at run time, from its own directory: NVRTC opens
/// `libnvrtc-builtins.so.<version>` when it first compiles, and the 13.0 wheel's does not look
/// beside itself (its `$ORIGIN` run path is not used for that `dlopen`: "failed to open
/// libnvrtc-builtins.so.13.0"), so a compile fails where the library itself loaded. PyTorch
/// preloads it for the same reason.
const COMPANIONS: [(&str, &str); 1] = [("libnvrtc.so", "libnvrtc-builtins.so")];

/// Loads, globally, the companions of `lib` found beside it (see [`COMPANIONS`]), so that
/// the soname lookup of the library's own `dlopen` finds them loaded.
fn companions(lib: &Path) {
    let (Some(dir), Some(name)) = (lib.parent(), lib.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    for (owner, companion) in COMPANIONS {
        if !name.starts_with(owner) {
            continue;
        }
        for f in companion_files(&sorted_entries(dir), companion) {
            let Some(c) = f.to_str().and_then(|s| std::ffi::CString::new(s).ok()) else {
                continue;
            };
            // SAFETY: as in `load`: a library file, its handle never closed.
            unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        }
    }
}

/// The files of `entries` that are `prefix` with a version (`libnvrtc-builtins.so.13.0`), not
/// the `.alt` variants NVIDIA ships beside them.
fn companion_files(entries: &[PathBuf], prefix: &str) -> Vec<PathBuf> {
    entries
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .cloned()
        .collect()
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
        // (A bare name, `FERROTRON_NVRTC=libnvrtc.so.13`, is still the loader's to find.)
        if f.is_file() {
            companions(&f);
        }
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

    /// The 13.0 NVRTC wheel's directory: the builtins are preloaded, not their `.alt`.
    #[test]
    fn nvrtcs_builtins_are_its_companions() {
        let dir = Path::new("/site-packages/nvidia/cu13/lib");
        let entries: Vec<PathBuf> = [
            "libnvrtc-builtins.alt.so.13.0",
            "libnvrtc-builtins.so.13.0",
            "libnvrtc.alt.so.13",
            "libnvrtc.so.13",
        ]
        .iter()
        .map(|n| dir.join(n))
        .collect();
        assert_eq!(
            companion_files(&entries, COMPANIONS[0].1),
            vec![dir.join("libnvrtc-builtins.so.13.0")]
        );
        assert!("libnvrtc.so.13".starts_with(COMPANIONS[0].0));
    }

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
