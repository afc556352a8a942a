#!/usr/bin/env bash
# The test command of the README: every crate's tests, built in release (the trainer's tests
# train small models). Needs only cargo; installs nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --release "$@"
