//! Large blocks (≥ [`BIG`]) of the tracking allocator: mapped from the kernel, and on free
//! kept for the next request of the same size — a caching allocator, as PyTorch's CUDA one is,
//! for the host. Its resident memory never exceeds the highest live total of large blocks,
//! which is within the plan.
//!
//! Why not glibc's own: every micro-batch allocates its activation arena (hundreds of MiB) and
//! frees it, and so do the gemm packing and staging buffers per product. Under glibc's defaults
//! each is a fresh `mmap` faulted in page by page (about 27,000 minor faults a step on the
//! default model). Serving them from glibc's heap instead (no mmap, no trim) kept the pages,
//! but left the heap's layout to the order of allocations across threads: one run in four of
//! the default model grew its heap by 200 MiB around a hole the arena no longer fit (peak RSS
//! plan + 262 MiB instead of plan + 60, #34). Here a freed block is reused only by a request
//! of exactly its page-rounded size, so a repeated step reuses its blocks and faults nothing,
//! and nothing fragments, since a block is never split.
//!
//! The bound: `live + cached ≤ high-water of live`. A request that no cached block serves
//! first returns cached blocks to the kernel (oldest first) until a fresh one fits under the
//! high-water mark, so the cache never adds to the peak; it only keeps what the peak already
//! paid for.
//!
//! Nothing here allocates (it is called from inside the global allocator): the cache is a
//! fixed array behind a `std` mutex (a futex, no allocation).

use std::sync::Mutex;

/// Requests of at least this many bytes are large blocks.
pub const BIG: usize = 1 << 20;
/// Mapping granularity (the smallest page size of the platforms we run on; the kernel rounds
/// a length to its own page size, the same for `mmap` and `munmap`).
const PAGE: usize = 4096;
/// How much longer than a request a cached block that serves it may be: the gemm packing
/// buffers of successive products differ by a few MiB; an activation arena must not serve one.
const SLACK: usize = 4 << 20;
/// Freed blocks kept at most; beyond it the oldest goes back to the kernel.
const SLOTS: usize = 64;

struct Cache {
    /// Freed blocks, oldest first: (address, mapped length).
    free: [(usize, usize); SLOTS],
    n: usize,
    /// Mapped bytes of blocks in use.
    live: usize,
    /// Mapped bytes of cached blocks.
    cached: usize,
    /// The highest `live` so far, counting the request being served.
    high: usize,
    /// Blocks in use that are longer than their request's mapped length (a larger cached block
    /// served it): (address, mapped length), so `free` gives back the whole block.
    longer: [(usize, usize); SLOTS],
    n_longer: usize,
}

static CACHE: Mutex<Cache> = Mutex::new(Cache {
    free: [(0, 0); SLOTS],
    n: 0,
    live: 0,
    cached: 0,
    high: 0,
    longer: [(0, 0); SLOTS],
    n_longer: 0,
});

/// Whether a request of `size` bytes aligned to `align` is served here.
#[inline]
pub fn is_big(size: usize, align: usize) -> bool {
    size >= BIG && align <= PAGE
}

fn mapped_len(size: usize) -> usize {
    size.div_ceil(PAGE) * PAGE
}

fn lock() -> std::sync::MutexGuard<'static, Cache> {
    // No code under the lock panics; a poisoned lock still holds consistent counters.
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

impl Cache {
    /// Removes and returns the cached block at `i`, keeping the others oldest first.
    fn take(&mut self, i: usize) -> (usize, usize) {
        let b = self.free[i];
        self.free.copy_within(i + 1..self.n, i);
        self.n -= 1;
        self.cached -= b.1;
        b
    }
}

/// A large block of `size` bytes: the shortest cached one at least as long and at most
/// [`SLACK`] longer (its old contents,
/// or zeroed with `zeroed`), or a fresh mapping (zero pages). Null when the kernel refuses.
///
/// A longer cached block serves a shorter request only while its length is remembered (at
/// most [`SLOTS`] such blocks in use); it counts as in use at its whole length, so the bound
/// holds in mapped bytes.
///
/// # Safety
/// `size` must satisfy [`is_big`]; the block must be released with [`free`] and the same size.
pub unsafe fn alloc(size: usize, zeroed: bool) -> *mut u8 {
    let len = mapped_len(size);
    let mut evict = [(0usize, 0usize); SLOTS];
    let mut n_evict = 0;
    {
        let mut c = lock();
        let fit = (0..c.n)
            .filter(|&i| {
                let l = c.free[i].1;
                l == len || (l > len && l - len <= SLACK && c.n_longer < SLOTS)
            })
            .min_by_key(|&i| c.free[i].1);
        if let Some(i) = fit {
            let (p, l) = c.take(i);
            if l != len {
                let k = c.n_longer;
                c.longer[k] = (p, l);
                c.n_longer += 1;
            }
            c.live += l;
            c.high = c.high.max(c.live);
            drop(c);
            let p = p as *mut u8;
            if zeroed {
                std::ptr::write_bytes(p, 0, size);
            }
            return p;
        }
        c.high = c.high.max(c.live + len);
        while c.n > 0 && c.live + c.cached + len > c.high {
            evict[n_evict] = c.take(0);
            n_evict += 1;
        }
        c.live += len;
    }
    for &(p, l) in &evict[..n_evict] {
        libc::munmap(p as *mut libc::c_void, l);
    }
    let p = libc::mmap(
        std::ptr::null_mut(),
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    if p == libc::MAP_FAILED {
        lock().live -= len;
        return std::ptr::null_mut();
    }
    p as *mut u8
}

/// Gives a large block back to the cache (the oldest cached one goes back to the kernel when
/// the cache is full).
///
/// # Safety
/// `p` must come from [`alloc`] with the same `size`, and not be used afterwards.
pub unsafe fn free(p: *mut u8, size: usize) {
    let oldest = {
        let mut c = lock();
        let len = match (0..c.n_longer).find(|&i| c.longer[i].0 == p as usize) {
            Some(i) => {
                let l = c.longer[i].1;
                c.n_longer -= 1;
                c.longer[i] = c.longer[c.n_longer];
                l
            }
            None => mapped_len(size),
        };
        c.live -= len;
        let oldest = (c.n == SLOTS).then(|| c.take(0));
        let n = c.n;
        c.free[n] = (p as usize, len);
        c.n += 1;
        c.cached += len;
        oldest
    };
    if let Some((q, l)) = oldest {
        libc::munmap(q as *mut libc::c_void, l);
    }
}

/// (mapped bytes in use, mapped bytes cached, high-water of in use) of large blocks.
pub fn stats() -> (usize, usize, usize) {
    let c = lock();
    (c.live, c.cached, c.high)
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the cache is process-wide, and tests run on parallel threads.
    #[test]
    fn blocks_are_reused_by_size_and_the_cache_stays_under_the_high_water_mark() {
        unsafe {
            let a = alloc(3 * BIG, false);
            assert!(!a.is_null());
            a.write_bytes(7, 3 * BIG);
            free(a, 3 * BIG);
            // Same mapped length: the same block, zeroed when asked.
            let b = alloc(3 * BIG - 100, true);
            assert_eq!(a, b);
            assert!(std::slice::from_raw_parts(b, 3 * BIG - 100)
                .iter()
                .all(|&x| x == 0));
            // A shorter request takes the shortest longer block, and gives all of it back.
            free(b, 3 * BIG - 100);
            let short = alloc(BIG + 5, false);
            assert_eq!(short, a);
            assert_eq!(stats(), (3 * BIG, 0, 3 * BIG));
            free(short, BIG + 5);
            let b = alloc(3 * BIG, false);
            assert_eq!(b, a);
            let c = alloc(2 * BIG, false);
            free(b, 3 * BIG);
            free(c, 2 * BIG);
            let (live, cached, high) = stats();
            assert_eq!((live, cached, high), (0, 5 * BIG, 5 * BIG));
            // A size nothing cached serves: the oldest cached blocks go back to the kernel
            // until live + cached + request fits under the high-water mark.
            let d = alloc(4 * BIG, false);
            let (live, cached, high) = stats();
            assert_eq!((live, cached, high), (4 * BIG, 0, 5 * BIG));
            free(d, 4 * BIG);
            let e = alloc(BIG, false);
            let (live, cached, high) = stats();
            assert!(live + cached <= high, "{live} + {cached} > {high}");
            free(e, BIG);
        }
    }
}
