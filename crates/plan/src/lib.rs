//! ferrotron-plan: exact memory planning for LLM training.
//!
//! From an HF `config.json`, a recipe and a parallel layout, build the named buffers each rank
//! holds and the order they live in over two optimizer steps (`MemoryPlan`), then read peaks,
//! breakdowns and timelines off it. See docs/FORMULAS.md for every formula and its source.

pub mod activations;
pub mod allocator;
pub mod api;
pub mod arena;
pub mod attention_kernel;
pub mod balance;
pub mod buffers;
pub mod cluster;
pub mod comm;
pub mod convention;
pub mod deepspeed;
pub mod disk_tier;
pub mod dp_layout;
pub mod error;
pub mod flops;
pub mod hardware;
pub mod host_transfer;
pub mod inventory;
pub mod layout;
pub mod layout_flags;
pub mod megatron_lm;
pub mod memory;
pub mod model;
pub mod plan_flags;
pub mod planner;
pub mod presets;
pub mod recipe;
pub mod report;
pub mod resident;
pub mod runtime;
pub mod sac;
pub mod schedule;
pub mod search;
pub mod state_regions;
pub mod states;
pub mod tensors;
pub mod testing;
pub mod time;
pub mod timeline;
pub mod toml_file;
pub mod verdict;
pub mod zero3;

pub use attention_kernel::AttentionKernel;
pub use cluster::Cluster;
pub use convention::Convention;
pub use error::{PlanError, Result};
pub use flops::FlopsConvention;
pub use layout::{Layout, Offload, PpSchedule};
pub use layout_flags::LayoutFlags;
pub use memory::{Breakdown, Category, MemoryPlan};
pub use model::ModelSpec;
pub use plan_flags::{PlanFlags, SearchFlags};
pub use planner::{plan, plan_extremes, ModelSource, PlanInput, PlanResult, RankPlan};
pub use recipe::{DType, Optimizer, Precision, Recipe, Recompute};
pub use runtime::Runtime;

pub const GIB: f64 = (1u64 << 30) as f64;
