//! A tracking global allocator: live and peak heap bytes of the whole process, so every run can
//! compare the memory it actually used with the plan's prediction, and of each rank when
//! several ranks run as threads of one process.
//!
//! Per-rank accounting: a thread tagged with [`set_rank`] (a rank's own thread, and the worker
//! threads of that rank's thread pool, tagged by the pool's start handler) charges what it
//! allocates and frees to that rank. The rule that makes this exact is that a rank's memory is
//! allocated and freed by the rank's own threads, as it is when every rank owns its buffers and
//! its pool; untagged threads (the main thread before ranks exist, I/O threads) charge only
//! the process-wide counters.
//!
//! The binary (and each test that measures) installs it:
//! `#[global_allocator] static A: ferrotron_train::alloc::Tracking = ferrotron_train::alloc::Tracking;`

use crate::memory::big_blocks;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::Relaxed};

pub struct Tracking;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Ranks a process can account for separately (threads backend: one process, many ranks).
pub const MAX_RANKS: usize = 256;
const NO_RANK: usize = usize::MAX;
// Signed, so a buffer freed by another rank's thread skews two counters instead of wrapping one.
static RANK_LIVE: [AtomicI64; MAX_RANKS] = [const { AtomicI64::new(0) }; MAX_RANKS];
static RANK_PEAK: [AtomicI64; MAX_RANKS] = [const { AtomicI64::new(0) }; MAX_RANKS];

thread_local! {
    // Const-initialised and without a destructor: reading it never allocates, so the allocator
    // may read it.
    static RANK: Cell<usize> = const { Cell::new(NO_RANK) };
}

fn rank_slot() -> Option<usize> {
    RANK.try_with(Cell::get).ok().filter(|&r| r < MAX_RANKS)
}

#[inline]
fn grew(n: usize) {
    if !INSTALLED.load(Relaxed) {
        INSTALLED.store(true, Relaxed);
    }
    let now = LIVE.fetch_add(n, Relaxed) + n;
    PEAK.fetch_max(now, Relaxed);
    if let Some(r) = rank_slot() {
        let now = RANK_LIVE[r].fetch_add(n as i64, Relaxed) + n as i64;
        RANK_PEAK[r].fetch_max(now, Relaxed);
    }
}

#[inline]
fn shrank(n: usize) {
    LIVE.fetch_sub(n, Relaxed);
    if let Some(r) = rank_slot() {
        RANK_LIVE[r].fetch_sub(n as i64, Relaxed);
    }
}

/// Charges what this thread allocates from now on to `rank` (`None`: to no rank).
pub fn set_rank(rank: Option<usize>) {
    let r = rank.filter(|&r| r < MAX_RANKS).unwrap_or(NO_RANK);
    RANK.with(|c| c.set(r));
}

/// The rank this thread charges, if any.
pub fn current_rank() -> Option<usize> {
    rank_slot()
}

/// Live heap bytes of `rank` (allocated minus freed by its threads).
pub fn rank_live(rank: usize) -> u64 {
    RANK_LIVE
        .get(rank)
        .map_or(0, |c| c.load(Relaxed).max(0) as u64)
}

/// Highest live bytes of `rank` since its last `reset_rank_peak`.
pub fn rank_peak(rank: usize) -> u64 {
    RANK_PEAK
        .get(rank)
        .map_or(0, |c| c.load(Relaxed).max(0) as u64)
}

/// Starts a new peak window of `rank` at its current live bytes.
pub fn reset_rank_peak(rank: usize) {
    if let (Some(p), Some(l)) = (RANK_PEAK.get(rank), RANK_LIVE.get(rank)) {
        p.store(l.load(Relaxed), Relaxed);
    }
}

// SAFETY: large blocks come from `big_blocks` (mapped, page-aligned, released there with the
// same size), everything else from the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = if big_blocks::is_big(layout.size(), layout.align()) {
            big_blocks::alloc(layout.size(), false)
        } else {
            System.alloc(layout)
        };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        grew(layout.size());
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = if big_blocks::is_big(layout.size(), layout.align()) {
            big_blocks::alloc(layout.size(), true)
        } else {
            System.alloc_zeroed(layout)
        };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        grew(layout.size());
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if big_blocks::is_big(layout.size(), layout.align()) {
            big_blocks::free(ptr, layout.size());
        } else {
            System.dealloc(ptr, layout);
        }
        shrank(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let big = |size| big_blocks::is_big(size, layout.align());
        if !big(layout.size()) && !big(new_size) {
            let p = System.realloc(ptr, layout, new_size);
            if p.is_null() {
                out_of_memory(new_size);
            }
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
            return p;
        }
        // A large block on either side: a new block, the bytes copied, the old one freed.
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        let p = self.alloc(new_layout);
        std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
        self.dealloc(ptr, layout);
        p
    }
}

/// An allocation the system refused: one line and exit status 1, instead of Rust's abort
/// (SIGABRT after `memory allocation of N bytes failed`). A trainer refuses a plan that does
/// not fit before it allocates (`fit`); this is what is left when memory runs out anyway
/// (another process took it meanwhile). Nothing in ferrotron asks for memory fallibly
/// (`try_reserve`), so a null from the system is always the end. The line is formatted on the
/// stack: nothing may be allocated here.
#[cold]
fn out_of_memory(size: usize) -> ! {
    use std::io::Write;
    struct Line {
        buf: [u8; 400],
        len: usize,
    }
    impl std::fmt::Write for Line {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut line = Line {
        buf: [0; 400],
        len: 0,
    };
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    let _ = std::fmt::Write::write_fmt(
        &mut line,
        format_args!(
            "error: out of memory: the system refused {size} bytes ({:.1} MiB) with {:.1} MiB in use; free memory on this machine, or lower the plan's peak (--recompute full, a smaller --mbs with --grad-acc, --precision bf16)\n",
            mib(size),
            mib(LIVE.load(Relaxed))
        ),
    );
    let _ = std::io::stderr().write_all(&line.buf[..line.len]);
    std::process::exit(1)
}

/// Live heap bytes now, of the calling thread's rank when it has one (see [`set_rank`]), else
/// of the process (0 if the tracking allocator is not installed). A trainer calls this from
/// its own thread, so a rank measures itself and a single-rank run the process.
pub fn live() -> u64 {
    match rank_slot() {
        Some(r) => rank_live(r),
        None => process_live(),
    }
}

/// Highest live bytes since the last `reset_peak`, of the calling thread's rank or the process.
pub fn peak() -> u64 {
    match rank_slot() {
        Some(r) => rank_peak(r),
        None => PEAK.load(Relaxed) as u64,
    }
}

/// Starts a new peak window at the current live bytes (the calling thread's rank's, or the
/// process's).
pub fn reset_peak() {
    match rank_slot() {
        Some(r) => reset_rank_peak(r),
        None => PEAK.store(LIVE.load(Relaxed), Relaxed),
    }
}

/// Live heap bytes of the whole process, whatever thread asks.
pub fn process_live() -> u64 {
    LIVE.load(Relaxed) as u64
}

/// Whether the tracking allocator is the global allocator of this process: it marks itself
/// on every allocation it serves, so one allocation here tells. (Watching the live counter
/// move by the probe's size instead raced with other threads: a rank thread freeing memory
/// meanwhile hid the probe, so a rank of the threads backend once measured no kernel
/// workspace and planned 2 MiB low.)
pub fn installed() -> bool {
    drop(std::hint::black_box(Box::new(0u64)));
    INSTALLED.load(Relaxed)
}

#[cfg(test)]
mod tests {
    /// This test binary runs on the system allocator: the probe must say so, however much the
    /// counters' neighbours allocate.
    #[test]
    fn not_installed_here() {
        assert!(!super::installed());
    }
}
