//! Data path: tokenizer → token shards (mmap) → batches.
//!
//! - [`tokenizer`]: load any HF `tokenizer.json` (the default one is bundled in the binary).
//! - [`shard`]: the on-disk token shard format, atomic writer, validating mmap reader.
//! - [`build`]: `build_shards`, text files → train/val shards (what `ferrotron data` calls).
//! - [`loader`]: seeded, resumable training batches and a fixed validation set.
//! - [`rng`]: the SplitMix64 generator behind the data order.

pub mod build;
pub mod error;
pub mod loader;
pub mod rng;
pub mod shard;
pub mod tokenizer;

pub use build::{
    build_shards, build_shards_with, chunk_document, find_shards, split_documents, BuildOptions,
    Split, Summary, DOC_SEPARATOR, SUMMARY_FILE,
};
pub use error::{DataError, Result};
pub use loader::{epoch_order, Batch, Loader, LoaderConfig, LoaderState, TokenDataset, ValLoader};
pub use rng::SplitMix64;
pub use shard::{write_shard, Fnv1a64, Shard, ShardInfo, ShardWriter, TokenDtype};
pub use tokenizer::{Tokenizer, BUNDLED_TOKENIZER_JSON};
