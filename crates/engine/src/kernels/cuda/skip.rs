//! What a GPU test does where the GPU or a library it needs is missing. CI has no GPU, so
//! there it skips with a message; the GPU kit (`scripts/cuda_check.sh bundle`, whose `run.sh`
//! sets `FERROTRON_GPU_REQUIRED=1`) fails instead, so that a missing driver or library can
//! never pass as green on the machine where the GPU is the point.

/// The environment variable that turns a skip into a failure.
pub const REQUIRED_ENV: &str = "FERROTRON_GPU_REQUIRED";

/// Whether this run must have its GPU and libraries (`FERROTRON_GPU_REQUIRED` set, not `0`).
pub fn required() -> bool {
    std::env::var(REQUIRED_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Skips (prints `skipped: reason`) or, where the GPU is required, panics with the reason.
pub fn unavailable(reason: &str) {
    if required() {
        panic!("{REQUIRED_ENV} is set, and {reason}");
    }
    eprintln!("skipped: {reason}");
}
