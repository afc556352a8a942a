//! Per-rank accounting of the tracking allocator: ranks running as threads of one process each
//! see their own live and peak bytes, down to the trainer's measured peak (one test in this
//! binary: the counters are global).

mod common;
use ferrotron_train::alloc::{
    installed, process_live, rank_live, rank_peak, reset_rank_peak, set_rank, Tracking,
};
use ferrotron_train::run::run;
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
    let before = process_live();
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
    let together = process_live() - before;
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

    // Two trainers at once, each a rank with its own tagged thread pool: each measures its own
    // peak, within 1% of its own plan (process-wide counters would see both, about twice it).
    // The shared token shards are built first, untagged: the streaming build hands buffers
    // between its threads, which would skew a rank's counters had a rank's thread built them.
    common::shards();
    let trainers: Vec<_> = [10usize, 11]
        .into_iter()
        .map(|r| {
            std::thread::spawn(move || {
                set_rank(Some(r));
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .start_handler(move |_| set_rank(Some(r)))
                    .build()
                    .unwrap();
                let mut a = common::tiny_args(&common::tmp(&format!("rank-{r}")), 3);
                a.mbs = Some(8);
                pool.install(|| run(a)).unwrap()
            })
        })
        .collect();
    for (r, t) in trainers.into_iter().enumerate() {
        let s = t.join().unwrap();
        let dev = s.measured_peak as f64 / s.planned_peak as f64 - 1.0;
        assert!(
            dev.abs() < 0.01,
            "rank {r}: measured {} vs planned {} ({:+.2}%)",
            s.measured_peak,
            s.planned_peak,
            dev * 100.0
        );
    }
}
