//! PyTorch's CUDA caching allocator replayed over a rank's program: the memory it *reserves*
//! (what `torch.cuda.max_memory_reserved` and nvidia-smi see, and what torchtitan logs as its
//! memory) against what the program has allocated. A stated model of the allocator, not a
//! margin: its rules are PyTorch's (`c10/cuda/CUDACachingAllocator.cpp`, default settings,
//! one stream):
//!
//! - every request is rounded up to a multiple of 512 bytes (`kMinBlockSize`);
//! - requests of at most 1 MiB (`kSmallSize`) use the small pool, the rest the large pool;
//! - a request takes the smallest cached free block of its pool that fits (best fit, lowest
//!   address on ties), split when the rest is worth keeping: more than 1 MiB in the large pool,
//!   at least 512 bytes in the small one (`should_split`);
//! - with no fitting block it reserves a new segment (`get_allocation_size`): 2 MiB
//!   (`kSmallBuffer`) for a small request, 20 MiB (`kLargeBuffer`) for one under 10 MiB
//!   (`kMinLargeAlloc`), else the request rounded up to 2 MiB (`kRoundLarge`);
//! - a freed block merges with free neighbours of its segment; segments are never returned
//!   (no `empty_cache`, no out-of-memory retry: the capacity is the verdict's business).
//!
//! Not modelled: kernel temporaries the program does not name, several streams, and the
//! expandable-segments mode (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), which
//! removes most of this gap.

use crate::memory::{MemoryPlan, Op};
use std::collections::BTreeSet;

const MIN_BLOCK: u64 = 512;
const SMALL_SIZE: u64 = 1 << 20;
const SMALL_BUFFER: u64 = 2 << 20;
const LARGE_BUFFER: u64 = 20 << 20;
const MIN_LARGE_ALLOC: u64 = 10 << 20;
const ROUND_LARGE: u64 = 2 << 20;

fn round_size(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK
}

fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// One block: a range of a segment, free or in use.
#[derive(Debug, Clone, Copy)]
struct Block {
    segment: usize,
    offset: u64,
    size: u64,
    free: bool,
}

/// The allocator's state: blocks by id, each segment's blocks in address order, and the free
/// blocks of each pool ordered by (size, segment, offset) for best fit.
#[derive(Default)]
struct Caching {
    blocks: Vec<Block>,
    /// Per segment, block ids in address order.
    segments: Vec<Vec<usize>>,
    small_segment: Vec<bool>,
    free: [BTreeSet<(u64, usize, u64, usize)>; 2],
    reserved: u64,
}

impl Caching {
    fn pool(&self, block: usize) -> usize {
        self.small_segment[self.blocks[block].segment] as usize
    }

    fn key(&self, id: usize) -> (u64, usize, u64, usize) {
        let b = self.blocks[id];
        (b.size, b.segment, b.offset, id)
    }

    fn malloc(&mut self, bytes: u64) -> usize {
        let size = round_size(bytes);
        let small = size <= SMALL_SIZE;
        let pool = small as usize;
        let found = self.free[pool]
            .range((size, 0, 0, 0)..)
            .next()
            .map(|&(_, _, _, id)| id);
        let id = match found {
            Some(id) => {
                let k = self.key(id);
                self.free[pool].remove(&k);
                id
            }
            None => {
                let seg = self.segments.len();
                let seg_size = segment_size(size);
                self.reserved += seg_size;
                self.blocks.push(Block {
                    segment: seg,
                    offset: 0,
                    size: seg_size,
                    free: true,
                });
                let id = self.blocks.len() - 1;
                self.segments.push(vec![id]);
                self.small_segment.push(small);
                id
            }
        };
        let rest = self.blocks[id].size - size;
        let split = if small {
            rest >= MIN_BLOCK
        } else {
            rest > SMALL_SIZE
        };
        if split {
            let b = self.blocks[id];
            self.blocks[id].size = size;
            self.blocks.push(Block {
                segment: b.segment,
                offset: b.offset + size,
                size: rest,
                free: true,
            });
            let tail = self.blocks.len() - 1;
            let seg = &mut self.segments[b.segment];
            let at = seg
                .iter()
                .position(|&x| x == id)
                .expect("block in its segment");
            seg.insert(at + 1, tail);
            let k = self.key(tail);
            self.free[pool].insert(k);
        }
        self.blocks[id].free = false;
        id
    }

    fn release(&mut self, id: usize) {
        let pool = self.pool(id);
        self.blocks[id].free = true;
        let seg = self.blocks[id].segment;
        // Merge with the free neighbours in address order.
        let mut at = self.segments[seg]
            .iter()
            .position(|&x| x == id)
            .expect("block in its segment");
        if at + 1 < self.segments[seg].len() {
            let next = self.segments[seg][at + 1];
            if self.blocks[next].free {
                let k = self.key(next);
                self.free[pool].remove(&k);
                self.blocks[id].size += self.blocks[next].size;
                self.segments[seg].remove(at + 1);
            }
        }
        if at > 0 {
            let prev = self.segments[seg][at - 1];
            if self.blocks[prev].free {
                let k = self.key(prev);
                self.free[pool].remove(&k);
                self.blocks[prev].size += self.blocks[id].size;
                self.segments[seg].remove(at);
                at -= 1;
            }
        }
        let merged = self.segments[seg][at];
        let k = self.key(merged);
        self.free[pool].insert(k);
    }
}

/// The caching allocator's reserved bytes at their peak over `plan`'s program (at least the
/// allocated peak).
pub fn reserved_peak(plan: &MemoryPlan) -> u64 {
    let mut a = Caching::default();
    // Live block ids per buffer (a buffer can be live several times: pipelined micro-batches);
    // a free releases the most recent instance.
    let mut live: Vec<Vec<usize>> = vec![Vec::new(); plan.buffers.len()];
    let mut peak = 0;
    for op in &plan.program {
        match *op {
            Op::Alloc(i) => {
                let bytes = plan.buffers[i].bytes();
                if bytes > 0 {
                    live[i].push(a.malloc(bytes));
                    peak = peak.max(a.reserved);
                }
            }
            Op::Free(i) => {
                if let Some(id) = live[i].pop() {
                    a.release(id);
                }
            }
            Op::Mark { .. } => {}
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_sizes_follow_pytorch() {
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(segment_size(1 << 20), 2 << 20);
        assert_eq!(segment_size((1 << 20) + 512), 20 << 20);
        assert_eq!(segment_size(10 << 20), 10 << 20);
        assert_eq!(segment_size((10 << 20) + 1), 12 << 20);
    }
}
