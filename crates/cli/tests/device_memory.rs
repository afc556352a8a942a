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
