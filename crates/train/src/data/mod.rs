//! Data path: tokenizer → token shards (mmap) → batches.
//!
//! - [`tokenizer`]: load any HF `tokenizer.json` (the default one is bundled in the binary).
//! - [`shard`]: the on-disk token shard format, atomic writer, validating mmap reader.
//! - [`input`]: the documents of `.txt`, `.jsonl(.gz|.zst)` and `.parquet` files, streamed.
//! - [`build`]: `build_shards`, inputs → train/val shards in bounded memory (what `ferrotron
//!   data` and the trainer's first run call), through [`spool`]'s on-disk token stream.
//! - [`loader`]: seeded, resumable training batches and a fixed validation set.
//! - [`rng`]: the SplitMix64 generator behind the data order.

pub mod build;
pub mod error;
pub mod input;
pub mod loader;
mod progress;
pub mod rng;
pub mod shard;
mod spool;
pub mod tokenizer;

pub use build::{
    build_shards, build_shards_from, build_shards_with, chunk_document, find_shards,
    split_documents, BuildOptions, Split, Summary, DOC_SEPARATOR, MEMORY_BOUND_MIB, SUMMARY_FILE,
};
pub use error::{DataError, Result};
pub use input::Source;
pub use loader::{epoch_order, Batch, Loader, LoaderConfig, LoaderState, TokenDataset, ValLoader};
pub use rng::SplitMix64;
pub use shard::{write_shard, Fnv1a64, Shard, ShardInfo, ShardWriter, TokenDtype};
pub use tokenizer::{Tokenizer, BUNDLED_TOKENIZER_JSON};
