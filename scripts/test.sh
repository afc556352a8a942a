#!/usr/bin/env bash
# The test command of the README: every crate's tests, built in release (the trainer's tests
# train small models). Installs what the tests need: headless Chromium for the web planner's
# end-to-end test (Debian's package; needs root or sudo, skipped with a message otherwise, in
# which case that one test reports that it skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
        echo "== installing chromium (web planner end-to-end test)"
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
    else
        echo "== chromium not installed and no root: the web e2e test will skip"
    fi
fi
cargo test --workspace --release "$@"
