//! Per-rank accounting of the tracking allocator: ranks running as threads of one process each
//! see their own live and peak bytes (the only test in this binary: the counters are global).

use ferrotron_train::alloc::{
    installed, live, rank_live, rank_peak, reset_rank_peak, set_rank, Tracking,
};
use std::sync::{Arc, Barrier};

#[global_allocator]
static A: Tracking = Tracking;

#[test]
fn ranks_as_threads_are_measured_apart() {
    assert!(installed());
    const MIB: usize = 1 << 20;
    let ranks = 4;
    // Every rank holds (rank + 1) MiB, then a (rank + 1) MiB transient on top, at the same
    // time as the others (a barrier keeps all of them live together).
    let barrier = Arc::new(Barrier::new(ranks + 1));
    let before = live();
    let handles: Vec<_> = (0..ranks)
        .map(|r| {
            let b = barrier.clone();
            std::thread::spawn(move || {
                set_rank(Some(r));
                reset_rank_peak(r);
                let base = rank_live(r);
                let held = std::hint::black_box(vec![1u8; (r + 1) * MIB]);
                let t = std::hint::black_box(vec![2u8; (r + 1) * MIB]);
                drop(t);
                b.wait(); // all ranks hold their buffers here
                b.wait(); // the main thread has read the process total
                let now = rank_live(r) - base;
                let peak = rank_peak(r) - base;
                drop(held);
                let after = rank_live(r) - base;
                (now, peak, after)
            })
        })
        .collect();
    barrier.wait();
    let together = live() - before;
    barrier.wait();
    let want: usize = (1..=ranks).map(|r| r * MIB).sum();
    assert!(
        together as usize >= want,
        "the process holds every rank's bytes: {together}"
    );
    for (r, h) in handles.into_iter().enumerate() {
        let (now, peak, after) = h.join().unwrap();
        let own = ((r + 1) * MIB) as u64;
        // A thread's own small allocations (its name, the barrier wait) are within 64 KiB.
        let close = |x: u64, y: u64| x.abs_diff(y) < 64 << 10;
        assert!(close(now, own), "rank {r} live {now}, expected {own}");
        assert!(
            close(peak, 2 * own),
            "rank {r} peak {peak}, expected {}",
            2 * own
        );
        assert!(close(after, 0), "rank {r} after free {after}");
    }
    // An untagged thread charges no rank.
    let r0 = rank_live(0);
    std::thread::spawn(|| drop(std::hint::black_box(vec![0u8; 8 * MIB])))
        .join()
        .unwrap();
    assert_eq!(rank_live(0), r0);
}
