//! Step-numbered checkpoints (`--keep-checkpoints K`): a long run saves into
//! `DIR/step-NNNNNNNN`, `DIR/latest` names the newest complete one, and only the K newest are
//! kept, so the disk does not fill up (torchtitan's `keep_latest_k`, Megatron's
//! `latest_checkpointed_iteration.txt`).
//!
//! `latest` is a symbolic link replaced atomically (a new link renamed over it) only after the
//! checkpoint it names is in place, so at every instant it names a complete checkpoint; a save
//! that fails or is killed leaves it naming the previous one. Pruning removes the oldest
//! checkpoints beyond K, never the one `latest` names.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The name of the pointer to the newest complete checkpoint.
pub const LATEST: &str = "latest";
const PREFIX: &str = "step-";

/// Where step `step`'s checkpoint goes under `root`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("{PREFIX}{step:08}"))
}

/// The checkpoint a path names: `root` itself when it is one, else the one its `latest` names
/// (a `--keep-checkpoints` directory), else `root` (whose reader then says what is missing).
pub fn resolve(root: &Path) -> PathBuf {
    if root.join("trainer_state.json").is_file() {
        return root.to_path_buf();
    }
    match std::fs::read_link(root.join(LATEST)) {
        Ok(target) => root.join(target),
        Err(_) => root.to_path_buf(),
    }
}

/// Points `root/latest` at `dir` (a child of `root`) atomically.
pub fn set_latest(root: &Path, dir: &Path) -> Result<()> {
    let name = dir.file_name().context("checkpoint dir has no name")?;
    let tmp = root.join(format!(".{LATEST}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    #[cfg(unix)]
    std::os::unix::fs::symlink(name, &tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    #[cfg(not(unix))]
    anyhow::bail!("keep_checkpoints: the `latest` link needs a Unix filesystem");
    let latest = root.join(LATEST);
    std::fs::rename(&tmp, &latest).with_context(|| format!("cannot replace {}", latest.display()))
}

/// The step-numbered checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    let step = name.strip_prefix(PREFIX)?.parse().ok()?;
                    Some((step, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Removes the oldest checkpoints under `root` beyond the `keep` newest, never the one
/// `latest` names. Returns what it removed.
pub fn prune(root: &Path, keep: u64) -> Result<Vec<PathBuf>> {
    let latest = std::fs::read_link(root.join(LATEST))
        .ok()
        .map(|t| root.join(t));
    let all = list(root);
    let extra = all.len().saturating_sub(keep as usize);
    let mut removed = Vec::new();
    for (_, dir) in all.into_iter().take(extra) {
        if Some(&dir) == latest.as_ref() {
            continue;
        }
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("cannot remove {}", dir.display()))?;
        removed.push(dir);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferrotron-keep-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn latest_names_the_newest_and_prune_keeps_k() {
        let r = root("prune");
        for step in [10, 20, 30, 40] {
            let d = step_dir(&r, step);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("trainer_state.json"), "{}").unwrap();
            set_latest(&r, &d).unwrap();
        }
        assert_eq!(resolve(&r), step_dir(&r, 40));
        let removed = prune(&r, 2).unwrap();
        assert_eq!(removed, vec![step_dir(&r, 10), step_dir(&r, 20)]);
        let left: Vec<u64> = list(&r).into_iter().map(|(s, _)| s).collect();
        assert_eq!(left, vec![30, 40]);
        // A checkpoint directory resolves to itself.
        assert_eq!(resolve(&step_dir(&r, 30)), step_dir(&r, 30));
        let _ = std::fs::remove_dir_all(&r);
    }

    #[test]
    fn prune_never_removes_what_latest_names() {
        let r = root("latest-kept");
        for step in [1, 2, 3] {
            std::fs::create_dir(step_dir(&r, step)).unwrap();
        }
        // A save of step 3 failed before `latest` moved: it still names step 1.
        set_latest(&r, &step_dir(&r, 1)).unwrap();
        prune(&r, 1).unwrap();
        let left: Vec<u64> = list(&r).into_iter().map(|(s, _)| s).collect();
        assert_eq!(left, vec![1, 3]);
        let _ = std::fs::remove_dir_all(&r);
    }
}
