//! Checkpoints: one directory holding the weights (safetensors, HF tensor names, loadable by
//! transformers), the optimizer state, the trainer state (step, data position, config), the
//! model's config.json, the tokenizer and a manifest of checksums (`manifest`), written
//! atomically (temp directory + rename, with recovery of a save interrupted between renames)
//! and by every rank in parallel, each its own blocks (`parallel`).

pub mod background;
pub mod hf;
pub mod keep;
pub mod manifest;
pub mod parallel;

use crate::config::TrainConfig;
use crate::data::LoaderState;
use crate::loss_scale::DynamicLossScaler;
use crate::trainer::{AdamState, Trainer};
use crate::weights::Flat;
use anyhow::{bail, Context, Result};
use ferrotron_engine::model::ParamTable;
use ferrotron_plan::{DType, ModelSpec};
use parallel::FlatFile;
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "ferrotron-checkpoint-1";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: String,
    /// Optimizer steps completed.
    pub step: u64,
    pub config: TrainConfig,
    pub loader: LoaderState,
    pub params: u64,
    pub tokenizer: String,
    /// fp16's loss scaler (scale and its run of good steps), so a resumed run continues it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<DynamicLossScaler>,
}

/// The model's HF config.json (what transformers and `--model DIR` read back), for weights
/// stored as `dtype`.
pub fn hf_config(spec: &ModelSpec, dtype: DType) -> serde_json::Value {
    let arch = match spec.model_type.as_str() {
        "qwen2" => "Qwen2ForCausalLM",
        "mixtral" => "MixtralForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut config = serde_json::json!({
        "architectures": [arch],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.layers,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_embeddings,
        // Qwen2's q/k/v biases are implied by its model type; Llama states them.
        "attention_bias": spec.qkv_bias && spec.model_type != "qwen2",
        "hidden_act": "silu",
        // transformers 4 reads `torch_dtype`, 5 `dtype`.
        "torch_dtype": torch_dtype(dtype),
        "dtype": torch_dtype(dtype),
    });
    if let Some(moe) = spec.moe {
        // MixtralConfig's: the experts are as wide as intermediate_size; the load-balancing
        // loss is trained (output_router_logits, as ferrotron trains it).
        let fields = serde_json::json!({
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "output_router_logits": true,
        });
        if let (Some(c), Some(f)) = (config.as_object_mut(), fields.as_object()) {
            c.extend(f.clone());
        }
    }
    config
}

fn torch_dtype(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

pub(super) fn safetensors_dtype(d: DType) -> Dtype {
    match d {
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// Saves the trainer's checkpoint as `c` says, every rank taking part: into `c.dir` itself
/// (replacing the previous one), or with `--keep-checkpoints K` into `c.dir/step-NNNNNNNN`,
/// then `c.dir/latest` moved to it and the oldest beyond K removed. A save that fails (a full
/// disk, a file-size limit, a read-only directory) leaves the previous checkpoint as it was,
/// still the one a resume finds, and returns one line naming the file and the error.
pub fn save_as_configured(
    c: &crate::config::CheckpointConfig,
    t: &Trainer,
    tokenizer_json: &str,
    tokenizer_name: &str,
) -> Result<()> {
    let Some(root) = &c.dir else {
        return Ok(());
    };
    let (dir, kept) = target(root, c.keep, t)?;
    save(&dir, t, tokenizer_json, tokenizer_name)?;
    if t.world_rank() == 0 {
        keep_after(kept.as_ref(), &dir)?;
    }
    Ok(())
}

/// With `--keep-checkpoints K`: the root and K.
type Kept = Option<(PathBuf, u64)>;

/// Where a save of `t` under `root` goes: `root` itself, or with `keep` its step directory
/// (rank 0 creates `root` then).
fn target(root: &Path, keep: Option<u64>, t: &Trainer) -> Result<(PathBuf, Kept)> {
    let Some(k) = keep else {
        return Ok((root.to_path_buf(), None));
    };
    if t.world_rank() == 0 {
        std::fs::create_dir_all(root)
            .with_context(|| format!("cannot create {}", root.display()))?;
    }
    Ok((keep::step_dir(root, t.step), Some((root.to_path_buf(), k))))
}

/// Rank 0, once the save into `dir` is in place: `latest` moved to it, the oldest beyond K
/// removed.
fn keep_after(kept: Option<&(PathBuf, u64)>, dir: &Path) -> Result<()> {
    if let Some((root, k)) = kept {
        keep::set_latest(root, dir)?;
        keep::prune(root, *k)?;
    }
    Ok(())
}

/// Writes `DIR` atomically, every rank taking part (each must call it): rank 0 makes a temp
/// directory beside it and the weight and optimizer files with their headers; every rank writes
/// the blocks it holds into them (`parallel`: ZeRO's shards are never gathered); rank 0 adds the
/// trainer state, config, tokenizer and manifest and renames the directory into place. Whatever
/// the layout that wrote it, the checkpoint holds every parameter's weights and states, in the
/// files one rank would write.
pub fn save(dir: &Path, t: &Trainer, tokenizer_json: &str, tokenizer_name: &str) -> Result<()> {
    let tmp = tmp_dir(dir, t.step)?;
    let rank = t.world_rank();
    let written = write_all(dir, &tmp, t, tokenizer_json, tokenizer_name);
    if written.is_err() && rank == 0 {
        // Nothing half-written stays behind; the previous checkpoint was never touched (it is
        // moved aside only once the new one is complete).
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// The temp directory a save of `step` into `dir` writes: named by the step, not a process
/// id, so ranks in other processes find it.
fn tmp_dir(dir: &Path, step: u64) -> Result<PathBuf> {
    let (parent, name) = parent_and_name(dir)?;
    Ok(parent.join(format!(".{name}.tmp-step{step}")))
}

/// The directory a checkpoint `dir` sits in (`.` for a bare name) and its own name.
fn parent_and_name(dir: &Path) -> Result<(&Path, String)> {
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dir
        .file_name()
        .context("checkpoint dir has no name")?
        .to_string_lossy()
        .to_string();
    Ok((parent, name))
}

/// [`save`]'s work into `tmp`, every rank's part.
fn write_all(
    dir: &Path,
    tmp: &Path,
    t: &Trainer,
    tokenizer_json: &str,
    tokenizer_name: &str,
) -> Result<()> {
    prepare(dir, tmp, t)?;
    let (weights, states) = layouts(t);
    write_blocks(t, &weights, &states, tmp)?;
    t.barrier()?;
    if t.world_rank() == 0 {
        finish(dir, tmp, &SmallFiles::of(t, tokenizer_json, tokenizer_name))?;
    }
    // No rank goes on (to train, or to the next save) before the checkpoint is in place.
    t.barrier()
}

/// Every rank, before writing blocks: rank 0 clears what an interrupted save left, makes the
/// temp directory and the two block files with their headers (sized, data still zero); then
/// every rank waits for them.
fn prepare(dir: &Path, tmp: &Path, t: &Trainer) -> Result<()> {
    let (parent, _) = parent_and_name(dir)?;
    if t.world_rank() == 0 {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
        recover(dir, true)?;
        let _ = std::fs::remove_dir_all(tmp);
        std::fs::create_dir(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let (weights, states) = layouts(t);
        // The weights in their storage type (a bf16 model is a bf16 checkpoint, as on the
        // Hub); the fp32 master copy, when there is one, goes with the optimizer state.
        weights.create(&tmp.join("model.safetensors"))?;
        if t.opt.is_some() {
            states.create(&tmp.join(OPTIMIZER))?;
        }
    }
    t.barrier()
}

const OPTIMIZER: &str = "optimizer.safetensors";

/// The two files every rank writes blocks into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFile {
    Model,
    Optimizer,
}

/// Where encoded blocks go: a file write, or a copy into an asynchronous save's staging buffer.
type BlockSink<'a> = dyn FnMut(BlockFile, u64, &[u8]) -> std::io::Result<()> + 'a;

/// The layouts of the two block files of `t`'s checkpoint: the weights in their storage type,
/// and the AdamW moments (with mixed precision also the fp32 master weights) of every parameter.
fn layouts(t: &Trainer) -> (FlatFile, FlatFile) {
    // The whole model's tensors, whatever slice of them this rank holds.
    let table = t.whole_params();
    let weights = FlatFile::new(
        t.params.dtype(),
        &table
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.shape.clone()))
            .collect::<Vec<_>>(),
    );
    let n = table.total;
    let states = FlatFile::new(
        DType::F32,
        &state_names(t)
            .iter()
            .map(|s| (s.to_string(), vec![n]))
            .collect::<Vec<_>>(),
    );
    (weights, states)
}

fn state_names(t: &Trainer) -> Vec<&'static str> {
    let mut names = vec!["exp_avg", "exp_avg_sq"];
    if t.master.is_some() {
        names.push("master");
    }
    names
}

/// Bytes of this rank's blocks in both files: what [`emit_blocks`] hands out, and what an
/// asynchronous save stages (`background`).
pub fn block_bytes(t: &Trainer) -> u64 {
    let elems: usize = t.written_blocks().iter().map(|(r, ..)| r.len()).sum();
    // The optimizer's states exist from the first step on (AdamW creates them lazily), before
    // any save.
    let states = 4 * state_names(t).len() as u64;
    elems as u64 * (t.params.dtype().bytes() + states)
}

/// This rank's blocks of the weights and optimizer states, each handed to `out` with its file
/// and byte offset (encoded in chunks through one small buffer).
fn emit_blocks(
    t: &Trainer,
    weights: &FlatFile,
    states: &FlatFile,
    out: &mut BlockSink,
) -> std::io::Result<()> {
    let blocks = t.written_blocks();
    let mut buf = Vec::new();
    for (r, _, from) in &blocks {
        let from = *from;
        let mut to = |offset, bytes: &[u8]| out(BlockFile::Model, offset, bytes);
        parallel::emit_flat(
            weights,
            r.start,
            &t.params,
            from..from + r.len(),
            &mut buf,
            &mut to,
        )?;
    }
    let Some(opt) = &t.opt else {
        return Ok(());
    };
    let mut tensors: Vec<(&str, &[f32])> = vec![("exp_avg", &opt.m), ("exp_avg_sq", &opt.v)];
    if let Some(m) = &t.master {
        tensors.push(("master", m));
    }
    for (name, values) in tensors {
        let base = states.range(name).expect("the layout names it").start;
        for (r, at, _) in &blocks {
            let mut to = |offset, bytes: &[u8]| out(BlockFile::Optimizer, offset, bytes);
            states.emit(
                base + r.start,
                &values[*at..*at + r.len()],
                &mut buf,
                &mut to,
            )?;
        }
    }
    Ok(())
}

/// This rank's blocks written at their offsets in the files rank 0 created, synced to disk
/// before the rank reports done.
fn write_blocks(t: &Trainer, weights: &FlatFile, states: &FlatFile, tmp: &Path) -> Result<()> {
    if t.written_blocks().is_empty() {
        return Ok(());
    }
    let files = BlockFiles::open(tmp, t.world_rank(), t.opt.is_some())?;
    let mut failed = None;
    emit_blocks(t, weights, states, &mut |which, offset, bytes| {
        files
            .write(which, offset, bytes)
            .inspect_err(|_| failed = Some(which))
    })
    .map_err(|e| files.error(failed.unwrap_or(BlockFile::Model), e))?;
    files.sync()
}

/// A rank's handles on the two block files of a save in progress.
pub struct BlockFiles {
    model: (PathBuf, std::fs::File),
    opt: Option<(PathBuf, std::fs::File)>,
}

impl BlockFiles {
    /// Opens the files rank 0 created in `tmp` (the optimizer's when the run has one).
    pub fn open(tmp: &Path, rank: usize, with_opt: bool) -> Result<Self> {
        let at = |name: &str| -> Result<(PathBuf, std::fs::File)> {
            let p = tmp.join(name);
            let f = parallel::open_for_blocks(&p, rank)?;
            Ok((p, f))
        };
        Ok(Self {
            model: at("model.safetensors")?,
            opt: with_opt.then(|| at(OPTIMIZER)).transpose()?,
        })
    }

    fn file(&self, which: BlockFile) -> &(PathBuf, std::fs::File) {
        match (which, &self.opt) {
            (BlockFile::Optimizer, Some(o)) => o,
            _ => &self.model,
        }
    }

    pub fn write(&self, which: BlockFile, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file(which).1.write_all_at(bytes, offset)
    }

    /// One line naming the file a write failed on.
    pub fn error(&self, which: BlockFile, e: std::io::Error) -> anyhow::Error {
        anyhow::anyhow!("cannot write {}: {e}", self.file(which).0.display())
    }

    /// Both files synced to disk.
    pub fn sync(&self) -> Result<()> {
        for (p, f) in std::iter::once(&self.model).chain(&self.opt) {
            f.sync_data()
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
        }
        Ok(())
    }
}

/// The small files of a checkpoint, rendered at the step it saves (an asynchronous save
/// renders them before training goes on, and writes them later).
pub struct SmallFiles {
    trainer_state: String,
    config: String,
    tokenizer: String,
    with_opt: bool,
}

impl SmallFiles {
    pub fn of(t: &Trainer, tokenizer_json: &str, tokenizer_name: &str) -> Self {
        let state = TrainerState {
            format: FORMAT.into(),
            step: t.step,
            config: t.cfg.clone(),
            loader: t.loader.state(),
            params: t.whole_params().total as u64,
            tokenizer: tokenizer_name.into(),
            loss_scaler: t.scaler.clone(),
        };
        Self {
            trainer_state: pretty(&state),
            config: pretty(&hf_config(&t.spec, t.params.dtype())),
            tokenizer: tokenizer_json.to_string(),
            with_opt: t.opt.is_some(),
        }
    }
}

/// Pretty JSON of checkpoint metadata (plain structs and strings: serialising cannot fail).
fn pretty(v: &impl Serialize) -> String {
    serde_json::to_string_pretty(v).expect("checkpoint metadata serialises")
}

impl SmallFiles {
    /// Writes them into `tmp` (rank 0).
    fn write(&self, tmp: &Path) -> Result<()> {
        for (name, text) in [
            ("trainer_state.json", &self.trainer_state),
            ("config.json", &self.config),
            ("tokenizer.json", &self.tokenizer),
        ] {
            let p = tmp.join(name);
            std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
        }
        Ok(())
    }
}

/// Rank 0, once every rank's blocks are on disk: the small files, the manifest, the rename.
fn finish(dir: &Path, tmp: &Path, small: &SmallFiles) -> Result<()> {
    small.write(tmp)?;
    seal(dir, tmp, small.with_opt)
}

/// Rank 0, once every file of `tmp` is written: the manifest, then the rename into `dir`.
fn seal(dir: &Path, tmp: &Path, with_opt: bool) -> Result<()> {
    let (parent, name) = parent_and_name(dir)?;
    let mut files = vec![
        "model.safetensors",
        "trainer_state.json",
        "config.json",
        "tokenizer.json",
    ];
    if with_opt {
        files.push(OPTIMIZER);
    }
    manifest::write(tmp, &files)?;
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    if dir.exists() {
        std::fs::rename(dir, &old).with_context(|| format!("cannot move old {}", dir.display()))?;
    }
    std::fs::rename(tmp, dir).with_context(|| format!("cannot rename into {}", dir.display()))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// Siblings of `dir` left by saves (`.NAME.tmp-PID`, `.NAME.old-PID`).
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Vec::new();
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let name = name.to_string_lossy();
    let (tmp, old) = (format!(".{name}.tmp-"), format!(".{name}.old-"));
    std::fs::read_dir(parent)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| {
                    let f = e.file_name().to_string_lossy().to_string();
                    f.starts_with(&tmp) || f.starts_with(&old)
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Finishes a save that was killed: a save renames the current checkpoint aside
/// (`.NAME.old-PID`) before renaming the new one in, so a kill between the two renames leaves
/// no `dir` but a complete previous checkpoint beside it. That one is moved back (after its
/// manifest verifies). With `clean` (the writer, about to save) every other leftover
/// (half-written temp directories, an old copy whose replacement is in place) is removed;
/// readers leave them, as they may belong to a save in progress.
fn recover(dir: &Path, clean: bool) -> Result<()> {
    let found = leftovers(dir);
    if !dir.exists() {
        let old = found.iter().find(|p| {
            p.file_name()
                .is_some_and(|f| f.to_string_lossy().contains(".old-"))
                && manifest::present(p)
                && manifest::verify(p).is_ok()
        });
        if let Some(old) = old {
            std::fs::rename(old, dir)
                .with_context(|| format!("cannot restore {}", old.display()))?;
            eprintln!(
                "checkpoint {}: restored the previous checkpoint of a save that was interrupted",
                dir.display()
            );
        }
    }
    if clean {
        for p in found.iter().filter(|p| p.exists()) {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    Ok(())
}

/// A checkpoint read back and checked.
#[derive(Clone)]
pub struct Loaded {
    pub dir: PathBuf,
    pub state: TrainerState,
    pub spec: ModelSpec,
}

fn bad(dir: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("checkpoint {}: {what}", dir.display())
}

/// Reads the trainer state and model config of `dir`, after checking every file against the
/// manifest (and finishing a save that was interrupted).
pub fn open(dir: &Path) -> Result<Loaded> {
    // A `--keep-checkpoints` directory opens as its newest complete checkpoint.
    let resolved = keep::resolve(dir);
    let dir = resolved.as_path();
    recover(dir, false)?;
    if manifest::present(dir) {
        manifest::verify(dir).map_err(|e| bad(dir, e))?;
    } else if dir.join("trainer_state.json").is_file() {
        eprintln!(
            "checkpoint {}: no {} (written before checksums existed): its files are not verified",
            dir.display(),
            manifest::MANIFEST
        );
    }
    let state_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|_| {
        bad(
            dir,
            "no trainer_state.json (not a ferrotron checkpoint directory)",
        )
    })?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| bad(dir, format!("trainer_state.json is invalid: {e}")))?;
    if state.format != FORMAT {
        bail!(bad(
            dir,
            format!("format `{}` is not `{FORMAT}`", state.format)
        ));
    }
    let spec = ferrotron_plan::presets::resolve(&dir.join("config.json").to_string_lossy())
        .map_err(|e| bad(dir, e))?;
    Ok(Loaded {
        dir: dir.to_path_buf(),
        state,
        spec,
    })
}

/// The weights of checkpoint `dir` (opened, so verified, already), checking every name and
/// shape against `table`, in `rule`'s dtype: a resumed run keeps its precision exactly; sampling
/// widens to f32.
pub fn load_weights(dir: &Path, table: &ParamTable, rule: hf::Dtypes) -> Result<Flat> {
    // The checkpoint's own config decides whether lm_head is tied (a tied table has none).
    let tied = table
        .get(ferrotron_plan::inventory::names::LM_HEAD)
        .is_none();
    hf::load_params(dir, table, tied, rule)
}

/// This rank's part of the AdamW moments of `dir`, if it has them, and of the fp32 master
/// weights when `master`: every rank reads only the blocks it holds (`blocks`: ranges of every
/// parameter's states and their offsets in this rank's `len`), so a checkpoint of any layout
/// re-shards onto this one.
pub fn load_optimizer(
    dir: &Path,
    n: usize,
    blocks: &[(std::ops::Range<usize>, usize)],
    len: usize,
    master: bool,
) -> Result<Option<(AdamState, Option<Vec<f32>>)>> {
    let path = dir.join(OPTIMIZER);
    if !path.exists() {
        return Ok(None);
    }
    let take = |name: &str| -> Result<Vec<f32>> {
        let mut out = vec![0.0; len];
        parallel::read_blocks(&path, name, n, blocks, &mut out).map_err(|e| bad(dir, e))?;
        Ok(out)
    };
    let state = AdamState {
        m: take("exp_avg")?.into(),
        v: take("exp_avg_sq")?.into(),
    };
    let master = if master { Some(take("master")?) } else { None };
    Ok(Some((state, master)))
}
