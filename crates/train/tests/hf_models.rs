//! Hugging Face model folders: `ferrotron eval` against the logits transformers computed for
//! the committed fixtures, single-file and sharded weights, dtypes, `--init-from`, and the
//! errors of folders that do not describe the model.

mod common;
use common::{tiny_args, tmp};
use ferrotron_train::eval::{eval_dir, EvalResult};
use ferrotron_train::run::run;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    let v = st.tensor(name).unwrap();
    v.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let v = st.tensor(name).unwrap();
    v.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The fixture as an HF folder (config.json + model.safetensors), the token sequences its
/// io.safetensors holds, and the loss over them computed (in f64) from transformers' logits.
fn hf_folder(name: &str, out: &Path) -> (PathBuf, Vec<Vec<u32>>, f64) {
    let src = fixture(name);
    let dir = out.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::copy(
        src.join("params.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let io = std::fs::read(src.join("io.safetensors")).unwrap();
    let io = SafeTensors::deserialize(&io).unwrap();
    let (ids, targets, logits) = (
        i64s(&io, "input_ids"),
        i64s(&io, "targets"),
        f32s(&io, "logits"),
    );
    let (b, t) = (2, 16);
    let v = logits.len() / (b * t);
    // targets[r][i] is the token after input_ids[r][i] (-100 where it was hidden from the loss):
    // every row is its 16 inputs, plus the 17th token when the last target is known.
    let mut seqs = Vec::new();
    let (mut sum, mut count) = (0.0f64, 0usize);
    for r in 0..b {
        let mut s: Vec<u32> = ids[r * t..(r + 1) * t].iter().map(|&x| x as u32).collect();
        if targets[r * t + t - 1] >= 0 {
            s.push(targets[r * t + t - 1] as u32);
        }
        for i in 0..s.len() - 1 {
            let row = &logits[(r * t + i) * v..(r * t + i + 1) * v];
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            sum += lse - row[s[i + 1] as usize] as f64;
            count += 1;
        }
        seqs.push(s);
    }
    (dir, seqs, sum / count as f64)
}

fn write_tokens(path: &Path, seqs: &[Vec<u32>]) {
    std::fs::write(path, serde_json::to_string(seqs).unwrap()).unwrap();
}

fn eval(dir: &Path, tokens: &Path) -> EvalResult {
    eval_dir(dir, tokens).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()))
}

fn eval_err(dir: &Path, tokens: &Path) -> String {
    format!(
        "{:#}",
        eval_dir(dir, tokens).expect_err("should be refused")
    )
}

/// The tensors of a safetensors file: (name, dtype, shape, bytes).
type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn read_all(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write_all(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

/// f32 bytes rounded to bf16 (nearest even), as bf16 bytes or widened back to f32 bytes.
fn to_bf16(bytes: &[u8], widen: bool) -> Vec<u8> {
    bytes
        .chunks_exact(4)
        .flat_map(|c| {
            let x = half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap()));
            if widen {
                x.to_f32().to_le_bytes().to_vec()
            } else {
                x.to_le_bytes().to_vec()
            }
        })
        .collect()
}

#[test]
fn eval_matches_transformers_logits_on_every_fixture() {
    let out = tmp("hf-eval");
    for name in ["tiny-tied", "tiny-gqa", "tiny-qwen2"] {
        let (dir, seqs, want) = hf_folder(name, &out);
        let tokens = out.join(format!("{name}.json"));
        write_tokens(&tokens, &seqs);
        let r = eval(&dir, &tokens);
        assert_eq!(
            r.tokens,
            seqs.iter().map(|s| s.len() as u64 - 1).sum::<u64>()
        );
        let rel = ((r.loss - want) / want).abs();
        eprintln!(
            "{name}: ferrotron {} transformers {want} ({rel:.1e})",
            r.loss
        );
        assert!(
            rel < 1e-5,
            "{name}: {} vs transformers' {want} ({rel:.2e})",
            r.loss
        );
    }
}

#[test]
fn sharded_and_16_bit_weights_load() {
    let out = tmp("hf-shards");
    let (dir, seqs, _) = hf_folder("tiny-gqa", &out);
    let tokens = out.join("t.json");
    write_tokens(&tokens, &seqs);
    let single = eval(&dir, &tokens);
    let tensors = read_all(&dir.join("model.safetensors"));

    // The same tensors in two shards named by an index, as save_pretrained writes them.
    let sharded = out.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    std::fs::copy(dir.join("config.json"), sharded.join("config.json")).unwrap();
    let half = tensors.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        write_all(&sharded.join(&file), &part.to_vec());
        for t in part {
            map.insert(t.0.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    assert_eq!(
        eval(&sharded, &tokens),
        single,
        "sharded weights give the same loss"
    );

    // bf16 weights: read and widened exactly, so the loss is that of f32 weights holding the
    // same bf16 values, bit for bit.
    let (b16, rounded) = (out.join("bf16"), out.join("rounded"));
    for (d, widen) in [(&b16, false), (&rounded, true)] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::copy(dir.join("config.json"), d.join("config.json")).unwrap();
        let t: Tensors = tensors
            .iter()
            .map(|(n, _, s, b)| {
                let dt = if widen { Dtype::F32 } else { Dtype::BF16 };
                (n.clone(), dt, s.clone(), to_bf16(b, widen))
            })
            .collect();
        write_all(&d.join("model.safetensors"), &t);
    }
    let (a, b) = (eval(&b16, &tokens), eval(&rounded, &tokens));
    assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    assert!((a.loss - single.loss).abs() < 0.05 * single.loss);
}

#[test]
fn folders_that_do_not_describe_the_model_are_refused() {
    let out = tmp("hf-bad");
    let (dir, seqs, _) = hf_folder("tiny-gqa", &out);
    let tokens = out.join("t.json");
    write_tokens(&tokens, &seqs);
    let tensors = read_all(&dir.join("model.safetensors"));
    let variant = |tag: &str, edit: &dyn Fn(&mut Tensors), config: Option<&str>| {
        let d = out.join(tag);
        std::fs::create_dir_all(&d).unwrap();
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        std::fs::write(
            d.join("config.json"),
            config.map_or(text.clone(), |c| text.replace("\"hidden_size\": 96", c)),
        )
        .unwrap();
        let mut t = tensors.clone();
        edit(&mut t);
        write_all(&d.join("model.safetensors"), &t);
        eval_err(&d, &tokens)
    };
    let e = variant(
        "missing",
        &|t| t.retain(|x| x.0 != "model.norm.weight"),
        None,
    );
    assert!(e.contains("the weights lack `model.norm.weight`"), "{e}");
    let e = variant(
        "extra",
        &|t| t.push(("model.extra".into(), Dtype::F32, vec![1], vec![0; 4])),
        None,
    );
    assert!(
        e.contains("model.safetensors has tensor `model.extra`, which this model does not have"),
        "{e}"
    );
    let e = variant("wide", &|_| {}, Some("\"hidden_size\": 48"));
    assert!(e.contains("the model (config.json) expects"), "{e}");
    let e = variant("ints", &|t| t[0].1 = Dtype::I32, None);
    assert!(e.contains("weights must be F32, BF16 or F16"), "{e}");
    // No weights at all, no config, bad tokens.
    std::fs::create_dir_all(out.join("empty")).unwrap();
    std::fs::copy(dir.join("config.json"), out.join("empty/config.json")).unwrap();
    assert!(eval_err(&out.join("empty"), &tokens)
        .contains("neither model.safetensors nor model.safetensors.index.json"));
    assert!(eval_err(&out, &tokens).contains("no config.json (not a model folder)"));
    let t = out.join("bad.json");
    write_tokens(&t, &[vec![1, 2, 500]]);
    assert!(eval_err(&dir, &t)
        .contains("sequence 0, position 2: token 500 is outside the model's vocabulary of 128"));
    std::fs::write(&t, "[[1, 2], [3, -4]]").unwrap();
    assert!(eval_err(&dir, &t).contains("sequence 1, position 1: -4 is not a token id"));
    std::fs::write(&t, "{\"tokens\": []}").unwrap();
    assert!(eval_err(&dir, &t).contains("expected a JSON list of token-id lists"));
    write_tokens(&t, &[vec![7]]);
    assert!(eval_err(&dir, &t).contains("no sequence has 2 or more tokens"));
    write_tokens(&t, &[vec![1; 66]]);
    assert!(eval_err(&dir, &t).contains("sequence 0 has 66 tokens"));
}

#[test]
fn init_from_starts_training_from_a_model_folder() {
    // Train the tiny model, then start a new run from its checkpoint: its first loss is the
    // trained model's, far below a fresh initialisation's ln(8192) ≈ 9.
    let out = tmp("init-from");
    let ck = out.join("ck");
    let mut a = tiny_args(&tmp("init-from-a"), 30);
    a.lr = Some(1e-2);
    a.checkpoint_dir = Some(ck.clone());
    let trained = run(a).unwrap().steps;
    let mut b = tiny_args(&tmp("init-from-b"), 1);
    b.model = None;
    b.init_from = Some(ck.clone());
    let first = run(b).unwrap().steps[0].loss;
    let last = trained.last().unwrap().loss;
    assert!(
        first < trained[0].loss - 1.0 && (first - last).abs() < 0.5,
        "{first} vs trained {last}"
    );
    // The same under bf16 (fp32 master weights from the file).
    let mut b = tiny_args(&tmp("init-from-c"), 1);
    b.model = None;
    b.init_from = Some(ck.clone());
    b.precision = Some("bf16".into());
    let bf = run(b).unwrap().steps[0].loss;
    assert!((bf - first).abs() < 0.05, "bf16 {bf} vs fp32 {first}");
    // A model that does not match the folder, and --init-from with --resume.
    let mut b = tiny_args(&tmp("init-from-d"), 1);
    b.model = Some("ferrotron-12m".into());
    b.init_from = Some(ck.clone());
    let e = format!("{:#}", run(b).expect_err("other model"));
    assert!(e.contains("the model (config.json) expects"), "{e}");
    let mut b = tiny_args(&tmp("init-from-e"), 1);
    b.init_from = Some(ck.clone());
    b.resume = Some(ck.clone());
    let e = format!("{:#}", run(b).expect_err("both"));
    assert!(e.contains("pass --resume or --init-from, not both"), "{e}");
}
