//! The PyTorch golden fixtures of `tests/fixtures/<name>/` (written by
//! `tests/reference/llama_reference.py`): loaders shared by the golden tests.

use ferrotron_engine::kernels::IGNORE_INDEX;
use ferrotron_engine::model::{BatchShape, Llama, LlamaConfig};
use ferrotron_plan::ModelSpec;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

pub fn fixture_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    assert!(
        d.join("config.json").exists(),
        "golden fixture {} missing: run tests/reference/llama_reference.py",
        d.display()
    );
    d
}

pub fn read(dir: &Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).unwrap_or_else(|e| panic!("{}/{file}: {e}", dir.display()))
}

pub fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    assert_eq!(t.dtype(), Dtype::F32, "{name} dtype");
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (t.shape().to_vec(), v)
}

pub fn ids(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<u32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name} dtype");
    let v = t
        .data()
        .chunks_exact(8)
        .map(|b| {
            let x = i64::from_le_bytes(b.try_into().unwrap());
            if x < 0 {
                IGNORE_INDEX
            } else {
                x as u32
            }
        })
        .collect();
    (t.shape().to_vec(), v)
}

/// Loads a parameter file into the model's flat layout, checking names and shapes both ways.
pub fn load_params(model: &Llama, bytes: &[u8]) -> Vec<f32> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let mut flat = vec![f32::NAN; model.num_params()];
    for e in &model.params.entries {
        let (shape, v) = f32s(&st, &e.name);
        assert_eq!(shape, e.shape, "{} shape", e.name);
        flat[e.range()].copy_from_slice(&v);
    }
    assert_eq!(
        st.names().len(),
        model.params.entries.len(),
        "extra tensors in fixture"
    );
    flat
}

pub struct Fixture {
    pub model: Llama,
    pub params: Vec<f32>,
    pub batch: BatchShape,
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    pub dir: PathBuf,
}

pub fn load(name: &str) -> Fixture {
    let dir = fixture_dir(name);
    let cfg = LlamaConfig::from_spec(
        &ModelSpec::from_json_str(
            &String::from_utf8(read(&dir, "config.json")).unwrap(),
            "config.json",
        )
        .unwrap(),
    )
    .unwrap();
    // Small chunks so the fused LM head runs several chunks, including a ragged last one.
    let model = Llama::new(cfg).with_ce_chunk_tokens(12);
    let params = load_params(&model, &read(&dir, "params.safetensors"));
    let io_bytes = read(&dir, "io.safetensors");
    let io = SafeTensors::deserialize(&io_bytes).unwrap();
    let (shape, tokens) = ids(&io, "input_ids");
    let (_, targets) = ids(&io, "targets");
    let batch = BatchShape {
        b: shape[0],
        t: shape[1],
    };
    Fixture {
        model,
        params,
        batch,
        tokens,
        targets,
        dir,
    }
}

pub fn num_targets(f: &Fixture) -> usize {
    f.targets
        .iter()
        .filter(|&&t| (t as usize) < f.model.config.vocab)
        .count()
}
