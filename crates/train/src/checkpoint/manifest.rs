//! A checkpoint's `manifest.json`: the size and SHA-256 of every other file, written last into
//! the temporary directory and checked before anything is read back, so a flipped bit, a
//! truncated copy or a hand-edited file is refused with the file's name instead of being
//! trained on. The digests are what `sha256sum FILE` prints, so a user can check a copy by hand.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

pub const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "ferrotron-manifest-1";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    /// File name (inside the checkpoint directory) → size and digest.
    pub files: BTreeMap<String, FileEntry>,
}

/// Size and SHA-256 (lower-case hex) of a file, read in 64 KiB blocks through a buffer on the
/// stack: an asynchronous save digests its files while the next step runs, and must not
/// allocate outside the plan meanwhile.
fn digest(path: &Path) -> Result<FileEntry> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = [0u8; 64 << 10];
    let mut bytes = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bytes += n as u64;
    }
    let sha256 = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(FileEntry { bytes, sha256 })
}

/// Writes `dir/manifest.json` over the named files of `dir`, each synced to disk first so the
/// manifest never describes bytes still in flight.
pub fn write(dir: &Path, names: &[&str]) -> Result<()> {
    let mut files = BTreeMap::new();
    for &name in names {
        let path = dir.join(name);
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("cannot sync {}", path.display()))?;
        files.insert(name.to_string(), digest(&path)?);
    }
    let m = Manifest {
        format: FORMAT.into(),
        files,
    };
    let path = dir.join(MANIFEST);
    std::fs::write(&path, serde_json::to_string_pretty(&m)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::File::open(&path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", path.display()))
}

/// Whether `dir` has a manifest (checkpoints written before manifests existed do not).
pub fn present(dir: &Path) -> bool {
    dir.join(MANIFEST).is_file()
}

/// Checks every file the manifest of `dir` lists: present, of its size, of its digest. The
/// error names the file and what is wrong with it (the caller prefixes the directory).
pub fn verify(dir: &Path) -> Result<()> {
    let text = std::fs::read_to_string(dir.join(MANIFEST))
        .map_err(|e| anyhow::anyhow!("{MANIFEST} cannot be read ({e})"))?;
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{MANIFEST} is invalid ({e}): the checkpoint is damaged"))?;
    if m.format != FORMAT {
        bail!("{MANIFEST}: format `{}` is not `{FORMAT}`", m.format);
    }
    for (name, want) in &m.files {
        // Names come from the file: refuse anything that would leave the directory.
        if name.is_empty() || name.contains(['/', '\\']) || name == "." || name == ".." {
            bail!("{MANIFEST} lists `{name}`, which is not a file name");
        }
        let path = dir.join(name);
        let Ok(meta) = std::fs::metadata(&path) else {
            bail!("{name} is missing (listed in {MANIFEST}): the checkpoint is incomplete");
        };
        if meta.len() != want.bytes {
            bail!(
                "{name} has {} bytes, {MANIFEST} says {}: the file is truncated or was replaced",
                meta.len(),
                want.bytes
            );
        }
        if digest(&path)?.sha256 != want.sha256 {
            bail!(
                "{name} is corrupted: its SHA-256 does not match {MANIFEST} (the bytes changed after the checkpoint was written)"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_sha256() {
        // FIPS 180-2 test vector: SHA-256("abc").
        let dir = std::env::temp_dir().join(format!("ferrotron-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("x"), "abc").unwrap();
        let e = digest(&dir.join("x")).unwrap();
        assert_eq!(e.bytes, 3);
        assert_eq!(
            e.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
