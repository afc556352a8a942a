//! Hands freed small-block pages back to the kernel after work that frees what it allocates.
//!
//! Large blocks (the activation arena, gemm packing and staging buffers) are the tracking
//! allocator's own and stay mapped for reuse (`big_blocks`). Small ones are glibc's, which
//! keeps the freed memory of each thread's arena. Work before training that frees what it
//! allocates, such as tokenizing the bundled corpus on every rayon worker, would then leave its
//! high-water mark resident in every worker's arena for the whole run: peak RSS grew with the
//! core count and with which workers happened to get work (#34).

/// Runs `f`, then hands every freed page of every glibc arena back to the kernel
/// (`malloc_trim(0)`).
pub fn trimmed<T>(f: impl FnOnce() -> T) -> T {
    let out = f();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages.
    unsafe {
        libc::malloc_trim(0);
    }
    out
}

/// glibc's settings for the blocks that libraries written in C allocate per call (oneDNN's
/// scratchpads, a few MiB each): from the heap, not a fresh `mmap` faulted in on every call,
/// and the heap's free top kept up to [`KEEP_TOP`]. Rust's own large blocks never reach glibc
/// (`big_blocks`), so what this keeps is bounded by those libraries' largest working set.
pub fn keep_library_blocks() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_ABOVE as i32);
        libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_TOP as i32);
    }
}

/// glibc blocks of at least this size are still mapped on their own.
const MMAP_ABOVE: usize = 32 << 20;
/// Free bytes at the top of glibc's heap kept rather than trimmed.
const KEEP_TOP: usize = 64 << 20;
