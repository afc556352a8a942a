//! Hugging Face model folders: `config.json` with `model.safetensors`, or with the shards that
//! `model.safetensors.index.json` names (what `save_pretrained` writes above its shard size).
//! A ferrotron checkpoint is such a folder too, with its manifest checked first.
//!
//! Weights may be stored as F32, BF16 or F16 and are converted to the precision asked for.
//! Tensors a model of the family does not have are refused, except two that transformers writes
//! without them being parameters: a tied `lm_head.weight` (a copy of the embedding) and older
//! checkpoints' `rotary_emb.inv_freq` buffers (recomputed from `rope_theta`).

use super::{bad, manifest, safetensors_dtype};
use crate::setup;
use crate::weights::{widen_le_bytes, Flat};
use anyhow::{bail, Context, Result};
use ferrotron_engine::model::{Llama, ParamTable};
use ferrotron_plan::{DType, ModelSpec};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// A model read from a folder: its spec, the engine's model and the weights.
pub struct HfModel {
    pub spec: ModelSpec,
    pub model: Llama,
    /// The weights, widened to f32.
    pub params: Vec<f32>,
}

/// The safetensors files of `dir`: the single file, or every shard of the index.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.join(SINGLE).is_file() {
        return Ok(vec![dir.join(SINGLE)]);
    }
    let index = dir.join(INDEX);
    if !index.is_file() {
        bail!(bad(
            dir,
            format!("neither {SINGLE} nor {INDEX}: not a model folder with safetensors weights")
        ));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|e| bad(dir, format!("{INDEX} cannot be read ({e})")))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| bad(dir, format!("{INDEX} is not valid JSON ({e})")))?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        bail!(bad(dir, format!("{INDEX} has no `weight_map` object")));
    };
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let Some(f) = file.as_str() else {
            bail!(bad(
                dir,
                format!("{INDEX}: `{tensor}` maps to {file}, not a file name")
            ));
        };
        if f.is_empty() || f.contains(['/', '\\']) || f == ".." {
            bail!(bad(
                dir,
                format!("{INDEX}: `{tensor}` maps to `{f}`, not a file in the folder")
            ));
        }
        shards.insert(f.to_string());
    }
    Ok(shards.into_iter().map(|f| dir.join(f)).collect())
}

/// The shard files mapped into memory and parsed.
struct Shards {
    maps: Vec<(String, Mmap)>,
}

impl Shards {
    fn open(dir: &Path) -> Result<Self> {
        let mut maps = Vec::new();
        for p in weight_files(dir)? {
            let name = p
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into());
            let f = std::fs::File::open(&p)
                .map_err(|e| bad(dir, format!("{name} cannot be read ({e})")))?;
            // SAFETY: the file is only read; a concurrent writer could change what we read,
            // which at worst gives wrong weights, as reading it with `read` would.
            let m = unsafe { Mmap::map(&f) }
                .map_err(|e| bad(dir, format!("{name} cannot be mapped ({e})")))?;
            maps.push((name, m));
        }
        Ok(Shards { maps })
    }

    fn parsed(&self, dir: &Path) -> Result<Vec<(&str, SafeTensors<'_>)>> {
        self.maps
            .iter()
            .map(|(n, m)| {
                SafeTensors::deserialize(m)
                    .map(|st| (n.as_str(), st))
                    .map_err(|e| bad(dir, format!("{n} is not valid safetensors ({e})")))
            })
            .collect()
    }
}

/// How the weights' dtype is treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtypes {
    /// Every tensor must already be this dtype, kept as stored (a resumed run keeps its
    /// precision).
    Exactly(DType),
    /// Any of F32, BF16, F16, widened to f32 (evaluation, sampling, `--init-from`).
    Widened,
}

fn storage_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::Bf16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

/// Names transformers stores that are not parameters of the model (see the module comment).
fn ignorable(name: &str, tied: bool) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || (tied && name == ferrotron_plan::inventory::names::LM_HEAD)
}

/// The weights of the folder `dir` for `table`: every parameter present with its shape, no
/// tensor the model lacks, dtypes by `rule`.
pub fn load_params(dir: &Path, table: &ParamTable, tied: bool, rule: Dtypes) -> Result<Flat> {
    let shards = Shards::open(dir)?;
    let parsed = shards.parsed(dir)?;
    let mut at: HashMap<String, usize> = HashMap::new();
    for (i, (file, st)) in parsed.iter().enumerate() {
        for name in st.names() {
            if table.get(name).is_none() && !ignorable(name, tied) {
                bail!(bad(
                    dir,
                    format!(
                        "{file} has tensor `{name}`, which this model does not have (a checkpoint of another model or config.json?)"
                    )
                ));
            }
            at.insert(name.to_string(), i);
        }
    }
    let mut out = match rule {
        Dtypes::Exactly(d) => Flat::zeros(d, table.total),
        Dtypes::Widened => Flat::zeros(DType::F32, table.total),
    };
    for e in &table.entries {
        let Some(&i) = at.get(&e.name) else {
            bail!(bad(
                dir,
                format!(
                    "the weights lack `{}` (a checkpoint of another model?)",
                    e.name
                )
            ));
        };
        let (file, st) = &parsed[i];
        let v = st
            .tensor(&e.name)
            .map_err(|err| bad(dir, format!("{file}: {err}")))?;
        let Some(dtype) = storage_dtype(v.dtype()) else {
            bail!(bad(
                dir,
                format!(
                    "`{}` is {:?}; weights must be F32, BF16 or F16",
                    e.name,
                    v.dtype()
                )
            ));
        };
        if v.shape() != e.shape.as_slice() {
            bail!(bad(
                dir,
                format!(
                    "`{}` has shape {:?}, the model (config.json) expects {:?}",
                    e.name,
                    v.shape(),
                    e.shape
                )
            ));
        }
        match (rule, &mut out) {
            (Dtypes::Widened, Flat::F32(w)) => widen_le_bytes(dtype, v.data(), &mut w[e.range()]),
            (Dtypes::Exactly(want), out) => {
                if dtype != want {
                    bail!(bad(
                        dir,
                        format!(
                            "`{}` is {:?} {:?}, the model expects {:?} {:?}",
                            e.name,
                            v.dtype(),
                            v.shape(),
                            safetensors_dtype(want),
                            e.shape
                        )
                    ));
                }
                out.read_le_bytes(e.offset, v.data());
            }
            (Dtypes::Widened, _) => unreachable!("widened weights are f32"),
        }
    }
    Ok(out)
}

/// The weights of a model folder for `table`, widened to f32, after checking a ferrotron
/// checkpoint's manifest (evaluation and `--init-from`).
pub fn load_widened(dir: &Path, table: &ParamTable, tied: bool) -> Result<Vec<f32>> {
    verify_if_checkpoint(dir)?;
    Ok(load_params(dir, table, tied, Dtypes::Widened)?.into_f32())
}

/// Checks a ferrotron checkpoint's manifest (a Hugging Face folder has none).
pub fn verify_if_checkpoint(dir: &Path) -> Result<()> {
    if manifest::present(dir) {
        manifest::verify(dir).map_err(|e| bad(dir, e))?;
    }
    Ok(())
}

/// A model folder: a ferrotron checkpoint (manifest verified) or a Hugging Face folder of a
/// supported family, weights widened to f32.
pub fn load_model(dir: &Path) -> Result<HfModel> {
    // A `--keep-checkpoints` directory: its newest checkpoint.
    let resolved = super::keep::resolve(dir);
    let dir = resolved.as_path();
    if !dir.is_dir() {
        bail!(
            "{}: not a directory (pass a model folder with config.json)",
            dir.display()
        );
    }
    let config = dir.join("config.json");
    if !config.is_file() {
        bail!(bad(dir, "no config.json (not a model folder)"));
    }
    let spec = ferrotron_plan::presets::resolve(&config.to_string_lossy())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = Llama::new(setup::llama_config(&spec).with_context(|| {
        format!(
            "{}: config.json describes a model ferrotron cannot run",
            dir.display()
        )
    })?);
    let params = load_widened(dir, &model.params, spec.tie_embeddings)?;
    Ok(HfModel {
        spec,
        model,
        params,
    })
}
