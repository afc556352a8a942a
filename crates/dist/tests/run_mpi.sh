#!/usr/bin/env bash
# The MPI backend's tests: builds ferrotron-dist with `--features mpi` and runs
# tests/mpi_collectives.rs under `mpirun -np 4 --oversubscribe` (it prints `N passed, M failed`),
# then checks that a rank that fails (MPI_Abort), panics, or exits without finalising takes the
# job down: mpirun exits non-zero within 30 s, naming the rank. Needs Open MPI (Debian: openmpi-bin libopenmpi-dev).
# Extra arguments go to cargo (default profile: release, as the CI's tests).
set -euo pipefail
cd "$(dirname "$0")/../../.."
NP="${NP:-4}"
MPIRUN=(mpirun -np "$NP" --oversubscribe)
if [ "$(id -u)" -eq 0 ]; then MPIRUN+=(--allow-run-as-root); fi
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--release)

echo "== building the MPI tests (cargo ${ARGS[*]} --features mpi)"
BUILD_LOG="$(mktemp)"
trap 'rm -f "$BUILD_LOG"' EXIT
if ! cargo test -p ferrotron-dist --features mpi --test mpi_collectives --no-run "${ARGS[@]}" \
    >"$BUILD_LOG" 2>&1; then
    cat "$BUILD_LOG"
    exit 1
fi
BIN="$(sed -n 's/.*Executable tests\/mpi_collectives.rs (\(.*\))$/\1/p' "$BUILD_LOG" | tail -1)"
if [ -z "$BIN" ]; then
    cat "$BUILD_LOG"
    echo "run_mpi.sh: no test executable in cargo's output" >&2
    exit 1
fi

echo "== ${MPIRUN[*]} mpi_collectives"
timeout 300 "${MPIRUN[@]}" "$BIN"

for mode in fail panic exit; do
    echo "== a rank that ${mode}s takes the job down (mpi_collectives $mode)"
    start=$(date +%s)
    set +e
    out="$(timeout 30 "${MPIRUN[@]}" "$BIN" "$mode" 2>&1)"
    rc=$?
    set -e
    took=$(($(date +%s) - start))
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then
        echo "$out"
        echo "FAIL: mpirun exited $rc after ${took} s (want non-zero, within 30 s)" >&2
        exit 1
    fi
    want="rank 1 failed: data shard unreadable"
    [ "$mode" = panic ] && want="rank 1 failed: panicked"
    [ "$mode" = exit ] && want="rank 1 failed: exited without ferrotron_dist::mpi::finalize"
    if grep -q "survived a failed rank" <<<"$out"; then
        echo "$out"
        echo "FAIL: ranks went on after rank 1 failed" >&2
        exit 1
    fi
    if ! grep -qF "$want" <<<"$out"; then
        echo "$out"
        echo "FAIL: the output does not name the failed rank ('$want')" >&2
        exit 1
    fi
    echo "ok: mpirun exited $rc after ${took} s: $want"
done
echo "== MPI tests done"
