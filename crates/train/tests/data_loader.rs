//! Loader: window layout, determinism from the seed, exact save/restore, ranks, validation.

mod common;
use common::TempDir;
use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use ferrotron_train::data::{
    epoch_order, write_shard, Batch, Loader, LoaderConfig, LoaderState, SplitMix64, TokenDataset,
    ValLoader,
};

/// Shards whose token at global position p is p (vocab 1<<20, so u32 tokens), with the given
/// lengths; returns their paths.
fn position_shards(dir: &Path, lens: &[u32]) -> Vec<PathBuf> {
    let mut start = 0u32;
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = dir.join(format!("train_{i:04}.tok"));
            let toks: Vec<u32> = (start..start + n).collect();
            write_shard(&p, 1 << 20, &toks).unwrap();
            start += n;
            p
        })
        .collect()
}

fn open(paths: &[PathBuf]) -> TokenDataset {
    TokenDataset::open(paths).unwrap()
}

fn take(l: &mut Loader, n: usize) -> Vec<Batch> {
    (0..n).map(|_| l.next_batch()).collect()
}

#[test]
fn splitmix_reference_values() {
    // First outputs of Vigna's splitmix64.c seeded with 1234567.
    let mut r = SplitMix64::new(1234567);
    assert_eq!(r.next_u64(), 6457827717110365317);
    assert_eq!(r.next_u64(), 3203168211198807973);
    let mut r = SplitMix64::new(7);
    for n in [1u64, 2, 3, 10, 1 << 40] {
        for _ in 0..100 {
            assert!(r.below(n) < n);
        }
    }
    let p = epoch_order(42, 3, 1000);
    let mut s = p.clone();
    s.sort();
    assert_eq!(s, (0..1000).collect::<Vec<u64>>());
    assert_ne!(p, epoch_order(42, 4, 1000));
    assert_eq!(p, epoch_order(42, 3, 1000));
}

#[test]
fn windows_inputs_and_targets() {
    let dir = TempDir::new("loader-win");
    // 101 tokens, T = 10 -> 10 windows starting at 0, 10, ..., 90; 25 tokens -> 2 windows;
    // 5 tokens -> none (too short for T + 1).
    let paths = position_shards(dir.path(), &[101, 25, 5]);
    let data = open(&paths);
    assert_eq!(data.windows(10), 12);
    assert_eq!(data.tokens(), 131);
    let mut l = Loader::new(data, LoaderConfig::new(3, 10, 1)).unwrap();
    assert_eq!(l.windows_per_epoch(), 12);
    assert_eq!(l.batches_per_epoch(), 4);
    let mut starts = Vec::new();
    for _ in 0..4 {
        let b = l.next_batch();
        assert_eq!((b.batch_size, b.seq_len), (3, 10));
        for r in 0..3 {
            let inp = &b.inputs[r * 10..(r + 1) * 10];
            let tgt = &b.targets[r * 10..(r + 1) * 10];
            for i in 0..10 {
                assert_eq!(inp[i] + 1, tgt[i], "targets are inputs shifted by one");
            }
            starts.push(inp[0]);
        }
    }
    starts.sort();
    // Every window exactly once per epoch; none crosses a shard boundary (101 | 126).
    assert_eq!(
        starts,
        vec![0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 101, 111]
    );
    assert_eq!(l.epoch(), 1);
}

#[test]
fn same_seed_same_batches_different_seed_different() {
    let dir = TempDir::new("loader-det");
    let paths = position_shards(dir.path(), &[5000, 3000]);
    let cfg = LoaderConfig::new(4, 16, 1234);
    let a = take(&mut Loader::new(open(&paths), cfg.clone()).unwrap(), 300);
    let b = take(&mut Loader::new(open(&paths), cfg.clone()).unwrap(), 300);
    assert_eq!(a, b);
    let mut other = cfg.clone();
    other.seed = 1235;
    let c = take(&mut Loader::new(open(&paths), other).unwrap(), 300);
    assert_ne!(a, c);
    // 300 batches of 4 over 499 windows: crosses two epoch boundaries, and epochs differ.
    let l = Loader::new(open(&paths), cfg).unwrap();
    assert_eq!(l.windows_per_epoch(), 312 + 187);
    assert_ne!(a[..10], a[124..134]);
}

#[test]
fn state_save_restore_continues_identically() {
    let dir = TempDir::new("loader-state");
    let paths = position_shards(dir.path(), &[4000, 777]);
    let cfg = LoaderConfig::new(3, 32, 99);
    let mut reference = Loader::new(open(&paths), cfg.clone()).unwrap();
    let all = take(&mut reference, 200); // ~4 epochs of 49 batches
    assert!(reference.epoch() >= 4);

    for split in [0usize, 1, 48, 49, 50, 137, 199] {
        let mut l = Loader::new(open(&paths), cfg.clone()).unwrap();
        let first = take(&mut l, split);
        assert_eq!(first[..], all[..split]);
        let state = l.state();
        assert_eq!(state.batches, split as u64);
        // Through JSON, as a checkpoint would store it.
        let json = serde_json::to_string(&state).unwrap();
        let back: LoaderState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, state);

        // A fresh loader from the state...
        let mut resumed = Loader::from_state(open(&paths), &back).unwrap();
        assert_eq!(
            take(&mut resumed, 200 - split)[..],
            all[split..],
            "split {split}"
        );
        // ...and restoring an existing loader that had moved elsewhere.
        let mut moved = Loader::new(open(&paths), cfg.clone()).unwrap();
        take(&mut moved, 77);
        moved.restore(&back).unwrap();
        assert_eq!(moved.state(), state);
        assert_eq!(take(&mut moved, 200 - split)[..], all[split..]);
    }
}

#[test]
fn restore_rejects_other_data_or_config() {
    let dir = TempDir::new("loader-mismatch");
    fs::create_dir_all(dir.path().join("a")).unwrap();
    fs::create_dir_all(dir.path().join("b")).unwrap();
    let pa = position_shards(&dir.path().join("a"), &[3000]);
    let pb = position_shards(&dir.path().join("b"), &[3001]);
    let cfg = LoaderConfig::new(2, 8, 5);
    let mut l = Loader::new(open(&pa), cfg.clone()).unwrap();
    take(&mut l, 3);
    let st = l.state();

    let e = Loader::from_state(open(&pb), &st).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("loader state does not match: saved for a different dataset"),
        "{e}"
    );
    let mut other = Loader::new(open(&pa), LoaderConfig::new(4, 8, 5)).unwrap();
    let e = other.restore(&st).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("loader state does not match: saved with"),
        "{e}"
    );
    let mut bad = st.clone();
    bad.cursor = 10_000;
    let e = Loader::from_state(open(&pa), &bad).unwrap_err();
    assert_eq!(
        e.to_string(),
        "loader state does not match: cursor 10000 is past the last full batch of an epoch of 374 windows"
    );
}

#[test]
fn ranks_partition_each_global_batch() {
    let dir = TempDir::new("loader-ranks");
    let paths = position_shards(dir.path(), &[2000]);
    let world = 3;
    let mut loaders: Vec<Loader> = (0..world)
        .map(|r| Loader::new(open(&paths), LoaderConfig::new(2, 8, 7).with_rank(r, world)).unwrap())
        .collect();
    // 249 windows / 6 per global batch = 41 steps per epoch.
    for _step in 0..41 {
        let mut seen = HashSet::new();
        for l in &mut loaders {
            let b = l.next_batch();
            for r in 0..2 {
                assert!(seen.insert(b.inputs[r * 8]), "window served to two ranks");
            }
        }
        assert_eq!(seen.len(), 6);
    }
    assert!(loaders.iter().all(|l| l.epoch() == 1));
    // Rank r's batch equals the r-th slice of the single-rank loader with B × world.
    let mut single = Loader::new(open(&paths), LoaderConfig::new(6, 8, 7)).unwrap();
    let mut r1 = Loader::new(open(&paths), LoaderConfig::new(2, 8, 7).with_rank(1, 3)).unwrap();
    for _ in 0..5 {
        let g = single.next_batch();
        let b = r1.next_batch();
        assert_eq!(b.inputs[..], g.inputs[16..32]);
        assert_eq!(b.targets[..], g.targets[16..32]);
    }
}

#[test]
fn next_into_and_config_errors() {
    let dir = TempDir::new("loader-errs");
    let paths = position_shards(dir.path(), &[100]);
    let mut l = Loader::new(open(&paths), LoaderConfig::new(2, 4, 0)).unwrap();
    let (mut i, mut t) = (vec![0u32; 8], vec![0u32; 8]);
    l.next_into(&mut i, &mut t).unwrap();
    let mut l2 = Loader::new(open(&paths), LoaderConfig::new(2, 4, 0)).unwrap();
    let b = l2.next_batch();
    assert_eq!((i, t), (b.inputs, b.targets));
    let e = l.next_into(&mut [0; 7], &mut [0; 8]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "batch buffers have 7 and 8 elements, expected batch_size × seq_len = 8"
    );

    let e = Loader::new(open(&paths), LoaderConfig::new(8, 20, 0)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "training data: 100 tokens give only 4 windows of seq_len + 1 = 21 tokens, fewer than \
         one batch of batch_size × world_size = 8; use more data or a smaller batch_size/seq_len"
    );
    let e = Loader::new(open(&paths), LoaderConfig::new(1, 4, 0).with_rank(2, 2)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "rank = 2 is out of range for world_size = 2: use 0..2"
    );
    let e = Loader::new(open(&paths), LoaderConfig::new(0, 4, 0)).unwrap_err();
    assert_eq!(e.to_string(), "batch_size = 0: use at least 1");
    let none: [PathBuf; 0] = [];
    let e = TokenDataset::open(&none).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no token shards given (run `ferrotron data` first)"
    );
}

#[test]
fn dataset_vocab_check() {
    let dir = TempDir::new("loader-vocab");
    let paths = position_shards(dir.path(), &[10]);
    let e = TokenDataset::open_for_model(&paths, 8192).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: shard vocab size 1048576 is larger than the model's vocab size 8192 \
             (re-tokenize with the model's tokenizer, or set vocab_size >= 1048576)",
            paths[0].display()
        )
    );
}

#[test]
fn validation_set_is_fixed_spread_and_rank_disjoint() {
    let dir = TempDir::new("loader-val");
    let paths = position_shards(dir.path(), &[1001]); // 100 windows of T = 10
    let v = ValLoader::new(open(&paths), LoaderConfig::new(4, 10, 0), Some(5)).unwrap();
    assert_eq!(v.num_batches(), 5);
    assert_eq!(v.tokens_per_pass(), 200);
    let a: Vec<Batch> = v.iter().collect();
    let b: Vec<Batch> = v.iter().collect();
    assert_eq!(a, b, "every pass sees the same batches");
    // The seed does not matter.
    let v2 = ValLoader::new(open(&paths), LoaderConfig::new(4, 10, 777), Some(5)).unwrap();
    assert_eq!(v2.iter().collect::<Vec<_>>(), a);
    // 20 windows spread evenly over 100: starts 0, 50, 100, ... 950.
    let starts: Vec<u32> = a
        .iter()
        .flat_map(|b| (0..4).map(move |r| b.inputs[r * 10]))
        .collect();
    assert_eq!(starts, (0..20).map(|j| j * 50).collect::<Vec<u32>>());
    for b in &a {
        for i in 0..40 {
            assert_eq!(b.inputs[i] + 1, b.targets[i]);
        }
    }
    // Uncapped: all full batches.
    let all = ValLoader::new(open(&paths), LoaderConfig::new(4, 10, 0), None).unwrap();
    assert_eq!(all.num_batches(), 25);
    // Two ranks split each global batch.
    let r0 = ValLoader::new(
        open(&paths),
        LoaderConfig::new(2, 10, 0).with_rank(0, 2),
        Some(5),
    )
    .unwrap();
    let r1 = ValLoader::new(
        open(&paths),
        LoaderConfig::new(2, 10, 0).with_rank(1, 2),
        Some(5),
    )
    .unwrap();
    for (i, whole) in a.iter().enumerate() {
        let (x, y) = (r0.batch(i), r1.batch(i));
        let mut joined = x.inputs.clone();
        joined.extend(&y.inputs);
        assert_eq!(joined, whole.inputs);
    }
    let e = ValLoader::new(open(&paths), LoaderConfig::new(200, 10, 0), None).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("validation data: 1001 tokens give only 100 windows"));
}
