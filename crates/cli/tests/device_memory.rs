//! `train --device-memory GiB`: a plan above the budget is refused in one line, before
//! anything is written, with the planner's same-GPU fixes and their predicted peak and time;
//! on the emulated device (the trainer's device path) and on the CPU alike.

use std::process::Command;

#[test]
fn a_plan_above_the_device_budget_is_refused_before_anything_is_written() {
    for device in ["emulated", "cpu"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let o = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(["train", "--device", device, "--model", "llama-3.2-1b"])
            .args(["--device-memory", "16", "--out-dir"])
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{device}: {err}");
        assert_eq!(err.lines().count(), 1, "{device}: {err}");
        assert!(
            err.starts_with("error: device_memory = 16: the plan's peak is ")
                && err.contains(" GiB on rank 0 (more than 16 GiB): nothing was allocated; same-GPU fixes (times predicted on a 16 GiB h100): ")
                && err.contains("--offload optimizer (peak ")
                && err.contains("--recompute full (peak "),
            "{device}: {err}"
        );
        assert!(
            !out.exists(),
            "{device}: a refused run wrote {}",
            out.display()
        );
    }
}

#[test]
fn a_device_budget_that_is_not_a_positive_number_is_refused() {
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["train", "--device-memory", "-2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim(),
        "error: device_memory = -2: must be a positive number"
    );
}

/// What the GPU has free now (the driver's count; `FERROTRON_DEVICE_FREE` stands in for it
/// here): two ranks sharing one device each need their plan there, so a plan that fits one
/// rank's share but not two is refused before anything is written, with the ranks named.
#[test]
fn ranks_that_do_not_fit_the_free_device_memory_together_are_refused() {
    let run = |free: &str, dp: &str, out: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .env("FERROTRON_DEVICE_FREE", free)
            .args(["train", "--device", "emulated", "--dp", dp, "--steps", "1"])
            .args([
                "--seq",
                "64",
                "--mbs",
                "1",
                "--eval-interval",
                "0",
                "--sample-tokens",
                "0",
            ])
            .arg("--out-dir")
            .arg(out)
            .output()
            .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // One rank's plan fits 400 MB (the default model at seq 64 plans ~270 MB per rank); two
    // ranks' do not.
    let one = run("400000000", "1", &out);
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    std::fs::remove_dir_all(&out).unwrap();
    let o = run("400000000", "2", &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: device: the plan needs ")
            && err.contains(" GiB on a GPU (peak ")
            && err.contains(" GiB on rank 0 × 2 ranks on it) but 0.37 GiB is free there: nothing was allocated; same-GPU fixes (times predicted on a 0.37 GiB free h100): "),
        "{err}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
    let bad = run("lots", "1", &out);
    assert_eq!(
        String::from_utf8_lossy(&bad.stderr).trim(),
        "error: FERROTRON_DEVICE_FREE = lots: must be a number of bytes, or unset"
    );
}
