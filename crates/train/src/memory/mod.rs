//! A rank's memory: the tracking allocator and its large-block cache, the plan's arena and
//! pool of activation buffers, the heap's reuse, the kernels' workspace, and the measured
//! timeline against the plan.

pub mod alloc;
pub mod arena;
pub mod big_blocks;
pub mod heap;
pub mod pool;
pub mod resident;
pub mod timeline;
pub mod workspace;
