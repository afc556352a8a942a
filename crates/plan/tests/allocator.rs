//! The caching-allocator model (`allocator.rs`): segments, best fit, splitting and merging as
//! PyTorch's `CUDACachingAllocator` does them, replayed over hand-made programs and plans.

mod common;
use common::input;
use ferrotron_plan::allocator::reserved_peak;
use ferrotron_plan::*;

const MIB: u64 = 1 << 20;

/// A program of allocations and frees of byte buffers: `+name size` or `-name`.
fn program(ops: &[(&str, u64)]) -> MemoryPlan {
    let mut p = MemoryPlan::default();
    let mut ids = std::collections::HashMap::new();
    for &(name, size) in ops {
        if let Some(name) = name.strip_prefix('-') {
            p.free(&[ids[name]]);
        } else {
            let id = p.add(name, DType::U8, size, Category::Workspace);
            ids.insert(name.to_string(), id);
            p.alloc(&[id]);
        }
    }
    p
}

#[test]
fn a_freed_block_too_small_for_the_next_request_stays_reserved() {
    // 30 + 30 MiB, free the first, ask for 40: no cached block fits, a third segment is
    // reserved while 70 MiB are allocated.
    let p = program(&[("a", 30 * MIB), ("b", 30 * MIB), ("-a", 0), ("c", 40 * MIB)]);
    assert_eq!(reserved_peak(&p), 100 * MIB);
    assert_eq!(p.sweep().peak, 70 * MIB);
}

#[test]
fn a_large_cached_block_is_split_and_merged_back() {
    // 40 MiB freed, then 30 + 10 MiB: best fit splits the cached block (the rest, 10 MiB, is
    // over 1 MiB) and the second request takes the rest. Freed, both merge back into 40 MiB,
    // which then serves a 40 MiB request without a new segment.
    let p = program(&[
        ("a", 40 * MIB),
        ("-a", 0),
        ("b", 30 * MIB),
        ("c", 10 * MIB),
        ("-b", 0),
        ("-c", 0),
        ("d", 40 * MIB),
    ]);
    assert_eq!(reserved_peak(&p), 40 * MIB);
}

#[test]
fn small_and_medium_requests_get_pytorchs_segments() {
    // Up to 1 MiB: a 2 MiB segment shared by small blocks; under 10 MiB: a 20 MiB one; else
    // the request rounded up to 2 MiB.
    assert_eq!(reserved_peak(&program(&[("a", 100), ("b", 100)])), 2 * MIB);
    assert_eq!(reserved_peak(&program(&[("a", 3 * MIB)])), 20 * MIB);
    assert_eq!(reserved_peak(&program(&[("a", 11 * MIB + 1)])), 12 * MIB);
    // The 12 MiB left of an 8 MiB request's 20 MiB segment serves a second medium request;
    // an 18 MiB request's own segment (18 MiB) has nothing left for it.
    assert_eq!(
        reserved_peak(&program(&[("a", 8 * MIB), ("b", 3 * MIB / 2)])),
        20 * MIB
    );
    assert_eq!(
        reserved_peak(&program(&[("a", 18 * MIB), ("b", 3 * MIB / 2)])),
        38 * MIB
    );
}

#[test]
fn reserved_is_never_below_allocated() {
    for conv in [
        Convention::Ferrotron,
        Convention::Megatron,
        Convention::Torchtitan,
    ] {
        for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let x = input(
                "llama-3.2-1b",
                Recipe {
                    seq: 1024,
                    mbs: 2,
                    grad_acc: 2,
                    recompute: rc,
                    ..Recipe::default()
                },
                Layout {
                    dp: 4,
                    zero: 3,
                    ..Layout::default()
                },
                conv,
            );
            let r = plan(&x).unwrap();
            let w = r.worst();
            assert!(w.reserved() >= w.sweep.peak, "{conv} {rc:?}");
        }
    }
}
