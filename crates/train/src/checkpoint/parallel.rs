//! Checkpoint files written by every rank at once. A safetensors file is a JSON header (names,
//! dtypes, shapes, byte offsets) and the tensors back to back; the header follows from the model
//! alone, so rank 0 writes it and sizes the file, and every rank then writes the bytes of the
//! blocks it holds at their offsets. No rank gathers states it does not own (ZeRO's shards stay
//! where they are), and the file is byte for byte the one a single rank writes: loadable by
//! transformers, and re-sharded on resume by each rank reading its own blocks back
//! (`read_blocks`).
//!
//! As with torch.distributed.checkpoint, the directory must be on a filesystem every rank sees;
//! a rank that cannot see the file rank 0 created says so.

use crate::weights::Flat;
use anyhow::{bail, Context, Result};
use ferrotron_plan::DType;
use half::{bf16, f16};
use safetensors::tensor::SafeTensors;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// A safetensors file whose tensors lie back to back in the order given, so together they are
/// one flat vector: element `i` of the concatenation is at byte `data + i × size`.
pub struct FlatFile {
    header: Vec<u8>,
    elem: usize,
    numel: usize,
    /// Each tensor's name and its range in the flat vector.
    tensors: Vec<(String, Range<usize>)>,
}

fn st_dtype(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "BF16",
        DType::F16 => "F16",
        _ => "F32",
    }
}

impl FlatFile {
    /// The layout of `tensors` (name, shape) stored as `dtype`.
    pub fn new(dtype: DType, tensors: &[(String, Vec<usize>)]) -> Self {
        let elem = dtype.bytes() as usize;
        let (mut json, mut at, mut ranges) = (String::from("{"), 0usize, Vec::new());
        for (i, (name, shape)) in tensors.iter().enumerate() {
            let n: usize = shape.iter().product();
            let key = serde_json::to_string(name).expect("a string serialises");
            let (a, b) = (at * elem, (at + n) * elem);
            json += &format!(
                "{}{key}:{{\"dtype\":\"{}\",\"shape\":{shape:?},\"data_offsets\":[{a},{b}]}}",
                if i > 0 { "," } else { "" },
                st_dtype(dtype)
            );
            ranges.push((name.clone(), at..at + n));
            at += n;
        }
        json.push('}');
        // The header is padded with spaces to 8 bytes, as the reference writer does, so the
        // tensors start aligned.
        while json.len() % 8 != 0 {
            json.push(' ');
        }
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(json.as_bytes());
        Self {
            header,
            elem,
            numel: at,
            tensors: ranges,
        }
    }

    /// Elements of the flat vector.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The range of tensor `name` in the flat vector.
    pub fn range(&self, name: &str) -> Option<Range<usize>> {
        self.tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
    }

    /// Writes the header and sizes the file (its data still zero): rank 0, before the others
    /// write their blocks.
    pub fn create(&self, path: &Path) -> Result<()> {
        let f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        f.write_all_at(&self.header, 0)
            .and_then(|_| f.set_len((self.header.len() + self.numel * self.elem) as u64))
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Writes `values` at element `at` of the flat vector into `file` (opened for writing), in
    /// chunks through `buf` so no copy of the block is made.
    pub fn write<T: LeBytes>(
        &self,
        file: &File,
        at: usize,
        values: &[T],
        buf: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        self.emit(at, values, buf, &mut |offset, bytes| {
            file.write_all_at(bytes, offset)
        })
    }

    /// Encodes `values` at element `at` of the flat vector in chunks through `buf`, handing
    /// each chunk and its byte offset in the file to `out` (a file write, or a copy into an
    /// asynchronous save's staging buffer).
    pub fn emit<T: LeBytes>(
        &self,
        at: usize,
        values: &[T],
        buf: &mut Vec<u8>,
        out: &mut dyn FnMut(u64, &[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        const CHUNK: usize = 1 << 16;
        debug_assert_eq!(T::SIZE, self.elem);
        debug_assert!(at + values.len() <= self.numel);
        for (i, chunk) in values.chunks(CHUNK).enumerate() {
            buf.clear();
            for v in chunk {
                v.put(buf);
            }
            let offset = self.header.len() + (at + i * CHUNK) * self.elem;
            out(offset as u64, buf)?;
        }
        Ok(())
    }
}

/// A value stored little-endian (the safetensors byte order).
pub trait LeBytes: Copy {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
}

impl LeBytes for f32 {
    const SIZE: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl LeBytes for bf16 {
    const SIZE: usize = 2;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl LeBytes for f16 {
    const SIZE: usize = 2;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

/// Emits elements `from` of `src` at element `at` of `layout`'s flat vector (`FlatFile::emit`).
pub fn emit_flat(
    layout: &FlatFile,
    at: usize,
    src: &Flat,
    from: Range<usize>,
    buf: &mut Vec<u8>,
    out: &mut dyn FnMut(u64, &[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    match src {
        Flat::F32(v) => layout.emit(at, &v[from], buf, out),
        Flat::Bf16(v) => layout.emit(at, &v[from], buf, out),
        Flat::F16(v) => layout.emit(at, &v[from], buf, out),
    }
}

/// Opens a file rank 0 created for this rank to write its blocks into; the error says what to
/// do when the rank does not see it (another machine's disk).
pub fn open_for_blocks(path: &Path, rank: usize) -> Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| {
            anyhow::anyhow!(
                "rank {rank} cannot open {} that rank 0 created ({e}): every rank writes its part of the checkpoint, so --checkpoint-dir must be on a filesystem all ranks share",
                path.display()
            )
        })
}

/// The f32 tensor `name` of length `n` in the safetensors file `path`, read only where
/// `blocks` say (each a range of the tensor and the offset in `out` it goes to): a rank reads
/// its own shard of a checkpoint's optimizer states, whatever layout wrote them. The file is
/// mapped, not read, so pages outside the blocks are never touched.
pub fn read_blocks(
    path: &Path,
    name: &str,
    n: usize,
    blocks: &[(Range<usize>, usize)],
    out: &mut [f32],
) -> Result<()> {
    let f = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    // SAFETY: checkpoint files are written once, into a temporary directory renamed into
    // place, and never modified after; the map is read only while this function runs.
    let map = unsafe { memmap2::Mmap::map(&f) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    let file = path.file_name().unwrap_or_default().to_string_lossy();
    let st = SafeTensors::deserialize(&map)
        .map_err(|e| anyhow::anyhow!("{file} is not valid safetensors ({e})"))?;
    let t = st
        .tensor(name)
        .map_err(|_| anyhow::anyhow!("{file} lacks `{name}`"))?;
    if t.dtype() != safetensors::Dtype::F32 || t.shape() != [n] {
        bail!(
            "{file}: `{name}` is {:?} {:?}, expected F32 [{n}]",
            t.dtype(),
            t.shape()
        );
    }
    let data = t.data();
    for (r, at) in blocks {
        crate::weights::widen_le_bytes(
            DType::F32,
            &data[r.start * 4..r.end * 4],
            &mut out[*at..*at + r.len()],
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ferrotron-flat-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn blocks_written_in_any_order_make_the_file_one_writer_makes() {
        // Two tensors, written as four blocks by "ranks" in reverse order, some crossing the
        // boundary between the tensors: the file reads back as the reference writer's does.
        let tensors = vec![
            ("b.weight".to_string(), vec![3, 5]),
            ("a.weight".to_string(), vec![7]),
        ];
        let values: Vec<f32> = (0..22).map(|i| i as f32 * 0.5 - 3.0).collect();
        let dir = tmp("order");
        let layout = FlatFile::new(DType::F32, &tensors);
        assert_eq!(layout.numel(), 22);
        assert_eq!(layout.range("a.weight"), Some(15..22));
        let path = dir.join("x.safetensors");
        layout.create(&path).unwrap();
        let mut buf = Vec::new();
        for block in [17..22, 9..17, 4..9, 0..4] {
            let f = open_for_blocks(&path, 1).unwrap();
            layout
                .write(&f, block.start, &values[block], &mut buf)
                .unwrap();
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let b = st.tensor("b.weight").unwrap();
        assert_eq!(b.shape(), [3, 5]);
        let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(b.data(), le(&values[..15]));
        assert_eq!(st.tensor("a.weight").unwrap().data(), le(&values[15..]));
        // The reference writer's bytes for the same tensors: the same data after the header.
        let (b_bytes, a_bytes) = (le(&values[..15]), le(&values[15..]));
        let views = vec![
            (
                "b.weight",
                TensorView::new(safetensors::Dtype::F32, vec![3, 5], &b_bytes).unwrap(),
            ),
            (
                "a.weight",
                TensorView::new(safetensors::Dtype::F32, vec![7], &a_bytes).unwrap(),
            ),
        ];
        let reference = safetensors::serialize(views, &None).unwrap();
        assert_eq!(reference.len(), bytes.len(), "same header padding and size");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn half_precision_blocks_and_reading_own_blocks_back() {
        let dir = tmp("half");
        let tensors = vec![("w".to_string(), vec![6])];
        let layout = FlatFile::new(DType::Bf16, &tensors);
        let path = dir.join("w.safetensors");
        layout.create(&path).unwrap();
        let src = Flat::from_f32(DType::Bf16, &[1.0, -2.0, 0.5, 4.0, 8.0, -0.25]);
        let f = open_for_blocks(&path, 0).unwrap();
        let mut buf = Vec::new();
        let mut to_file = |offset, bytes: &[u8]| f.write_all_at(bytes, offset);
        emit_flat(&layout, 2, &src, 2..6, &mut buf, &mut to_file).unwrap();
        emit_flat(&layout, 0, &src, 0..2, &mut buf, &mut to_file).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("w").unwrap().data(), src.le_bytes(0..6));

        // f32 states: a rank reads two blocks of the tensor into its own shard.
        let opt = FlatFile::new(DType::F32, &[("m".to_string(), vec![5])]);
        let p = dir.join("m.safetensors");
        opt.create(&p).unwrap();
        let f = open_for_blocks(&p, 0).unwrap();
        opt.write(&f, 0, &[1.0f32, 2.0, 3.0, 4.0, 5.0], &mut buf)
            .unwrap();
        let mut out = [0.0; 3];
        read_blocks(&p, "m", 5, &[(3..5, 0), (0..1, 2)], &mut out).unwrap();
        assert_eq!(out, [4.0, 5.0, 1.0]);
        let e = read_blocks(&p, "m", 6, &[], &mut out)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "m.safetensors: `m` is F32 [5], expected F32 [6]");
        let e = read_blocks(&p, "v", 5, &[], &mut out)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "m.safetensors lacks `v`");
        let e = open_for_blocks(&dir.join("gone"), 3)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("rank 3 cannot open")
                && e.ends_with("--checkpoint-dir must be on a filesystem all ranks share"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
