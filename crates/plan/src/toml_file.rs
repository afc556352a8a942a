//! TOML settings files (`ferrotron plan --config`, `--cluster`, `ferrotron train --config`):
//! read, parsed, and their errors turned into one line with the file's position.

use crate::error::{one_line, PlanError, Result};
use serde::de::DeserializeOwned;
use std::path::Path;

/// A TOML file's parse error as one line: `FILE:LINE:COLUMN: message`. The `toml` crate's
/// message alone has no position and spans several lines ("invalid string\nexpected ...").
pub fn toml_error(path: &Path, text: &str, e: &toml::de::Error) -> String {
    let message = toml_message(e.message());
    match e.span() {
        Some(span) => {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            let line_start = before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            let column = String::from_utf8_lossy(&before[line_start..])
                .chars()
                .count()
                + 1;
            format!("{}:{line}:{column}: {message}", path.display())
        }
        None => format!("{}: {message}", path.display()),
    }
}

/// The `toml` crate's several lines of message as one.
pub fn toml_message(message: &str) -> String {
    let message = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    one_line(&message).into_owned()
}

/// Reads the TOML file that `--{flag}` names into `T`.
pub fn read_toml<T: DeserializeOwned>(flag: &str, path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        PlanError::File(format!(
            "cannot read --{flag} {}: {}",
            one_line(&path.display().to_string()),
            one_line(&e.to_string())
        ))
    })?;
    toml::from_str(&text).map_err(|e| PlanError::File(toml_error(path, &text, &e)))
}
