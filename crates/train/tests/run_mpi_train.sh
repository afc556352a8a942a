#!/usr/bin/env bash
# Data parallelism under mpirun: builds ferrotron with `--features mpi`, trains a small model
# with `mpirun -np 2 ferrotron train --dp 2` (one process per rank) and with the threads backend
# (the same binary without mpirun: ranks as threads), without ZeRO and with --zero 1, 2 and 3, and checks
#   - the two backends' losses and gradient norms agree within 1e-6 relative,
#   - every rank's measured peak is within 1% of its own plan, under both,
#   - the per-rank peak falls with ZeRO-1 and 2 (ZeRO-3's windows and unit-sized buffers cost
#     more than its weight shard saves on this small model at dp 2: printed, and planned),
#   - the trace is one file with both processes' kernels and collectives,
#   - a checkpoint both processes write (ZeRO-3) resumes on ZeRO-1 along the same trajectory,
#   - dp 2 × tp 2 (with and without --sp) under mpirun -np 4 agrees with threads and with dp 2
#     alone,
#   - dp 2 × pp 2 under AFAB, 1F1B, interleaved (v 3) and --pp-layers auto (every process
#     choosing the same uneven split) with mpirun -np 4, and dp 2 × tp 2 × sp × pp 2 with
#     mpirun -np 8, agree with threads and with dp 2 alone,
#   - a small Mixtral on dp 2 × ep 2 under mpirun -np 4 agrees with threads and with one rank,
#     and its checkpoint resumes on ep 4,
#   - dp 2 × cp 2 (ring attention between processes) under mpirun -np 4 agrees with threads and
#     with dp 2 alone, and its checkpoint resumes on cp 4; dp 2 × tp 2 × sp × cp 2 × pp 2 under
#     mpirun -np 16 agrees with dp 2 alone,
#   - dp 2 × tp 2 × sp on the emulated device under mpirun -np 4 equals the CPU processes bit
#     for bit,
#   - dp 2 ZeRO-3 on the emulated device (--device emulated) under mpirun -np 2 equals the CPU
#     threads run bit for bit, each rank within 1% of its plan,
#   - mpirun's process count disagreeing with --dp fails at once with one line naming both,
#   - a rank killed with SIGKILL, or stopped with SIGSTOP (the watchdog, --comm-timeout), ends
#     the whole job.
# Needs Open MPI (Debian: openmpi-bin libopenmpi-dev). Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/../../.."
MPIRUN=(mpirun -np 2 --oversubscribe)
if [ "$(id -u)" -eq 0 ]; then MPIRUN+=(--allow-run-as-root); fi

echo "== building ferrotron --features mpi"
cargo build --release -p ferrotron --features mpi 2>&1 | tail -1
BIN=target/release/ferrotron
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
"$BIN" data --input data/corpus/shakespeare.txt --out "$OUT/data" >/dev/null
COMMON=(train --data "$OUT/data" --seq 64 --mbs 2 --grad-acc 2 --eval-interval 0
    --sample-tokens 0 --quiet --peak-gflops 100 --bucket-mb 4 --dp 2)

for z in 0 1 2 3; do
echo "== ferrotron train --dp 2 --zero $z (threads)"
"$BIN" "${COMMON[@]}" --zero $z --steps 4 --out-dir "$OUT/threads$z" 2>"$OUT/threads.log" || { cat "$OUT/threads.log"; exit 1; }
echo "== ${MPIRUN[*]} ferrotron train --dp 2 --zero $z"
timeout 300 "${MPIRUN[@]}" "$BIN" "${COMMON[@]}" --zero $z --steps 4 --out-dir "$OUT/mpi$z" \
    --trace "$OUT/mpi$z/trace.json" 2>"$OUT/mpi.log" || { cat "$OUT/mpi.log"; exit 1; }

python3 - "$OUT/threads$z/metrics.jsonl" "$OUT/mpi$z/metrics.jsonl" <<'PY'
import json, os, sys
runs = [[json.loads(l) for l in open(p)] for p in sys.argv[1:]]
trace = json.load(open(os.path.join(os.path.dirname(sys.argv[2]), "trace.json")))["traceEvents"]
for rank in (0, 1):
    cats = {e["cat"] for e in trace if e["pid"] == rank}
    assert {"kernel", "comm"} <= cats, f"rank {rank}'s row of the merged trace has {cats}"

assert len(runs[0]) == len(runs[1]) == 4, [len(r) for r in runs]
worst = 0.0
for t, m in zip(*runs):
    for key in ("loss", "grad_norm"):
        rel = abs(t[key] - m[key]) / abs(t[key])
        worst = max(worst, rel)
        assert rel < 1e-6, f"step {t['step']} {key}: threads {t[key]} mpi {m[key]} ({rel:.2e})"
    for name, r in (("threads", t), ("mpi", m)):
        assert len(r["rank_mem"]) == 2, (name, r["rank_mem"])
        for x in r["rank_mem"]:
            dev = abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1)
            assert dev < 0.01, (name, t["step"], x)
print(f"threads vs mpi: 4 steps agree within {worst:.1e}; every rank within 1% of its plan")
PY
done
python3 - "$OUT"/mpi{0,1,2,3}/metrics.jsonl <<'PY'
import json, sys
peak = [max(x["mem_peak_measured"] for l in open(p) for x in json.loads(l)["rank_mem"]) for p in sys.argv[1:]]
assert peak[2] < peak[1] < peak[0], f"per-rank peaks of ZeRO 0, 1, 2: {peak}"
print("per-rank peak: " + ", ".join(f"ZeRO-{z} {p} B" for z, p in enumerate(peak)))
PY

MPIRUN4=("${MPIRUN[@]}")
MPIRUN4[2]=4
for SP in "" "--sp"; do
echo "== tensor parallelism: dp 2 × tp 2 $SP (four processes) = threads"
"$BIN" "${COMMON[@]}" --tp 2 $SP --zero 1 --steps 4 --out-dir "$OUT/tp-threads" 2>"$OUT/tp.log" || { cat "$OUT/tp.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" "${COMMON[@]}" --tp 2 $SP --zero 1 --steps 4 --out-dir "$OUT/tp-mpi" \
    2>"$OUT/tp-mpi.log" || { cat "$OUT/tp-mpi.log"; exit 1; }
python3 - "$OUT/tp-threads/metrics.jsonl" "$OUT/tp-mpi/metrics.jsonl" "$OUT/threads1/metrics.jsonl" <<'PY'
import json, sys
threads, mpi, dp_only = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
for t, m, d in zip(threads, mpi, dp_only):
    for key in ("loss", "grad_norm"):
        assert abs(t[key] - m[key]) / abs(t[key]) < 1e-6, (t["step"], key, t[key], m[key])
        # The same global batch without tensor parallelism.
        assert abs(t[key] - d[key]) / abs(d[key]) < 1e-5, (t["step"], key, t[key], d[key])
    assert len(m["rank_mem"]) == 4, m["rank_mem"]
    for x in m["rank_mem"]:
        assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, x
    assert m["comm"]["tp"]["sent"] == m["comm"]["tp"]["planned"], m
print("dp 2 x tp 2: mpirun -np 4 = threads within 1e-6, = dp 2 alone within 1e-5; 4 ranks within 1% of their plans; bytes as planned")
PY
rm -rf "$OUT/tp-threads"
# The --sp run is the reference of the emulated device's stage below.
if [ -n "$SP" ]; then mv "$OUT/tp-mpi" "$OUT/tp-sp-mpi"; else rm -rf "$OUT/tp-mpi"; fi
done

MPIRUN8=("${MPIRUN[@]}")
MPIRUN8[2]=8
for LAYOUT in "--pp-schedule afab" "--pp-schedule 1f1b" "--pp-schedule interleaved --pp-virtual 3" \
    "--tp 2 --sp --pp-schedule 1f1b" "--pp-layers auto"; do
NP=("${MPIRUN4[@]}")
case "$LAYOUT" in *--tp*) NP=("${MPIRUN8[@]}");; esac
echo "== pipeline parallelism: dp 2 × pp 2 $LAYOUT (${NP[2]} processes) = threads"
"$BIN" "${COMMON[@]}" --pp 2 $LAYOUT --zero 1 --steps 4 --out-dir "$OUT/pp-threads" 2>"$OUT/pp.log" || { cat "$OUT/pp.log"; exit 1; }
timeout 300 "${NP[@]}" "$BIN" "${COMMON[@]}" --pp 2 $LAYOUT --zero 1 --steps 4 --out-dir "$OUT/pp-mpi" \
    2>"$OUT/pp-mpi.log" || { cat "$OUT/pp-mpi.log"; exit 1; }
python3 - "$OUT/pp-threads/metrics.jsonl" "$OUT/pp-mpi/metrics.jsonl" "$OUT/threads1/metrics.jsonl" "${NP[2]}" <<'PY'
import json, sys
threads, mpi, dp_only = ([json.loads(l) for l in open(p)] for p in sys.argv[1:4])
ranks = int(sys.argv[4])
for t, m, d in zip(threads, mpi, dp_only):
    for key in ("loss", "grad_norm"):
        assert abs(t[key] - m[key]) / abs(t[key]) < 1e-6, (t["step"], key, t[key], m[key])
        # The same global batch on one pipeline stage.
        assert abs(t[key] - d[key]) / abs(d[key]) < 1e-5, (t["step"], key, t[key], d[key])
    for run, r in (("threads", t), ("mpirun", m)):
        assert len(r["rank_mem"]) == ranks, r["rank_mem"]
        for x in r["rank_mem"]:
            # Which run and step, and every rank's excess over its plan and its measured
            # kernel workspace (bytes), so that a rank over its plan can be told from a
            # run-wide effect, and a plan that is off from a measurement that is.
            assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, (
                run, r["step"], x,
                [(y["mem_peak_measured"] - y["mem_peak_planned"], y["kernel_workspace"])
                 for y in r["rank_mem"]])
        assert len(r["pp_bubble"]) == 2, r
print(f"pipeline: mpirun -np {ranks} = threads within 1e-6, = dp 2 alone within 1e-5; {ranks} ranks within 1% of their plans; bubble {m['pp_bubble']} (planned {m['pp_bubble_planned']})")
PY
rm -rf "$OUT/pp-threads" "$OUT/pp-mpi"
done

echo "== expert parallelism: a small Mixtral on dp 2 × ep 2 (4 processes) = threads = one rank"
# The one-rank reference runs the 4 replicas' micro-batches in turn (the load-balancing loss is
# per micro-batch); the MPI run under ZeRO-1 (dense states sharded over the 4 replicas, each
# expert's over its 2) writes a checkpoint at step 2, which resumes on ep 4 along the same
# trajectory.
MOE=(train --model ferrotron-moe-16m --data "$OUT/data" --seq 64 --mbs 2 --eval-interval 0
    --sample-tokens 0 --quiet --peak-gflops 100 --steps 4)
"$BIN" "${MOE[@]}" --grad-acc 4 --out-dir "$OUT/moe-one" 2>"$OUT/moe.log" || { cat "$OUT/moe.log"; exit 1; }
"$BIN" "${MOE[@]}" --dp 2 --ep 2 --out-dir "$OUT/moe-threads" 2>"$OUT/moe.log" || { cat "$OUT/moe.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" "${MOE[@]}" --dp 2 --ep 2 --out-dir "$OUT/moe-mpi" \
    2>"$OUT/moe-mpi.log" || { cat "$OUT/moe-mpi.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" "${MOE[@]}" --dp 2 --ep 2 --zero 1 --stop-after 2 --out-dir "$OUT/moe-ck" \
    --checkpoint-dir "$OUT/moe-ck/checkpoint" 2>"$OUT/moe-ck.log" || { cat "$OUT/moe-ck.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" train --resume "$OUT/moe-ck/checkpoint" --data "$OUT/data" --dp 1 \
    --ep 4 --quiet --peak-gflops 100 --out-dir "$OUT/moe-resumed" 2>"$OUT/moe-res.log" || { cat "$OUT/moe-res.log"; exit 1; }
python3 - "$OUT/moe-one/metrics.jsonl" "$OUT/moe-threads/metrics.jsonl" "$OUT/moe-mpi/metrics.jsonl" "$OUT/moe-resumed/metrics.jsonl" <<'PY'
import json, sys
one, threads, mpi, resumed = ([json.loads(l) for l in open(p)] for p in sys.argv[1:5])
for o, t, m in zip(one, threads, mpi):
    for key in ("loss", "grad_norm"):
        assert abs(t[key] - m[key]) / abs(t[key]) < 1e-6, (t["step"], key, t[key], m[key])
        assert abs(o[key] - m[key]) / abs(o[key]) < 1e-5, (o["step"], key, o[key], m[key])
    for r in (t, m):
        assert len(r["rank_mem"]) == 4, r["rank_mem"]
        for x in r["rank_mem"]:
            assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, x
assert [r["step"] for r in resumed] == [3, 4], [r["step"] for r in resumed]
for o, r in zip(one[2:], resumed):
    assert abs(o["loss"] - r["loss"]) / abs(o["loss"]) < 1e-5, (o["loss"], r["loss"])
print("expert parallelism: mpirun -np 4 (dp 2 × ep 2) = threads within 1e-6, = one rank within 1e-5; 4 ranks within 1% of their plans; its checkpoint resumes on ep 4 along the same trajectory")
PY

echo "== context parallelism: dp 2 × cp 2 (4 processes) = threads = dp 2 alone"
# Ring attention between processes; a checkpoint written at step 2 resumes on cp 4 (one
# replica of 4 sequences a micro-batch: the same sequences per step) along the same trajectory.
"$BIN" "${COMMON[@]}" --cp 2 --zero 1 --steps 4 --out-dir "$OUT/cp-threads" 2>"$OUT/cp.log" || { cat "$OUT/cp.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" "${COMMON[@]}" --cp 2 --zero 1 --steps 4 --out-dir "$OUT/cp-mpi" \
    2>"$OUT/cp-mpi.log" || { cat "$OUT/cp-mpi.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" "${COMMON[@]}" --cp 2 --zero 1 --steps 4 --stop-after 2 \
    --out-dir "$OUT/cp-ck" --checkpoint-dir "$OUT/cp-ck/checkpoint" 2>"$OUT/cp-ck.log" || { cat "$OUT/cp-ck.log"; exit 1; }
timeout 300 "${MPIRUN4[@]}" "$BIN" train --resume "$OUT/cp-ck/checkpoint" --data "$OUT/data" --dp 1 \
    --cp 4 --zero 0 --mbs 4 --quiet --peak-gflops 100 --out-dir "$OUT/cp-resumed" 2>"$OUT/cp-res.log" || { cat "$OUT/cp-res.log"; exit 1; }
# 4D: dp 2 × tp 2 × sp × cp 2 × pp 2 on 16 processes, against dp 2 alone.
MPIRUN16=("${MPIRUN[@]}")
MPIRUN16[2]=16
timeout 300 "${MPIRUN16[@]}" "$BIN" "${COMMON[@]}" --cp 2 --tp 2 --sp --pp 2 --zero 1 --steps 4 \
    --out-dir "$OUT/cp-4d" 2>"$OUT/cp-4d.log" || { cat "$OUT/cp-4d.log"; exit 1; }
python3 - "$OUT/cp-4d/metrics.jsonl" "$OUT/threads1/metrics.jsonl" <<'PY'
import json, sys
four_d, dp_only = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert len(four_d) == 4, len(four_d)
for m, d in zip(four_d, dp_only):
    for key in ("loss", "grad_norm"):
        assert abs(d[key] - m[key]) / abs(d[key]) < 1e-5, (d["step"], key, d[key], m[key])
    assert len(m["rank_mem"]) == 16, m["rank_mem"]
    for x in m["rank_mem"]:
        assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, x
    assert m["comm"]["cp"]["sent"] == m["comm"]["cp"]["planned"], m
print("4D: mpirun -np 16 (dp 2 × tp 2 × sp × cp 2 × pp 2) = dp 2 alone within 1e-5; 16 ranks within 1% of their plans; ring bytes as planned")
PY
python3 - "$OUT/cp-threads/metrics.jsonl" "$OUT/cp-mpi/metrics.jsonl" "$OUT/threads1/metrics.jsonl" "$OUT/cp-resumed/metrics.jsonl" <<'PY'
import json, sys
threads, mpi, dp_only, resumed = ([json.loads(l) for l in open(p)] for p in sys.argv[1:5])
assert len(mpi) == 4, len(mpi)
for t, m, d in zip(threads, mpi, dp_only):
    for key in ("loss", "grad_norm"):
        assert abs(t[key] - m[key]) / abs(t[key]) < 1e-6, (t["step"], key, t[key], m[key])
        assert abs(d[key] - m[key]) / abs(d[key]) < 1e-5, (d["step"], key, d[key], m[key])
    assert len(m["rank_mem"]) == 4, m["rank_mem"]
    for x in m["rank_mem"]:
        assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, x
assert [r["step"] for r in resumed] == [3, 4], [r["step"] for r in resumed]
for d, r in zip(dp_only[2:], resumed):
    assert abs(d["loss"] - r["loss"]) / abs(d["loss"]) < 1e-5, (d["loss"], r["loss"])
print("context parallelism: mpirun -np 4 (dp 2 × cp 2) = threads within 1e-6, = dp 2 alone within 1e-5; 4 ranks within 1% of their plans; its checkpoint resumes on cp 4 along the same trajectory")
PY

echo "== several ranks on the emulated device under mpirun (--device emulated --dp 2 --zero 3) = threads on the CPU"
# Each process's state in device memory, data parallelism staged through its host buckets
# (crates/train/src/device/ranks.rs): the CPU threads run's losses and norms, bit for bit.
timeout 300 "${MPIRUN[@]}" "$BIN" "${COMMON[@]}" --zero 3 --steps 4 --device emulated \
    --out-dir "$OUT/emulated3" 2>"$OUT/emulated.log" || { cat "$OUT/emulated.log"; exit 1; }
python3 - "$OUT/threads3/metrics.jsonl" "$OUT/emulated3/metrics.jsonl" <<'PY'
import json, sys
cpu, dev = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert len(cpu) == len(dev) == 4, (len(cpu), len(dev))
for c, d in zip(cpu, dev):
    for key in ("loss", "grad_norm"):
        assert c[key] == d[key], f"step {c['step']} {key}: cpu threads {c[key]} emulated mpi {d[key]}"
    assert len(d["rank_mem"]) == 2, d["rank_mem"]
    for x in d["rank_mem"]:
        assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, (d["step"], x)
print("emulated device under mpirun -np 2 (ZeRO-3) = CPU threads bit for bit; 2 ranks within 1% of their plans")
PY

echo "== tensor parallelism on the emulated device under mpirun (--device emulated --tp 2 --sp, four processes) = the CPU processes"
# The tensor-parallel group's buffer filled from each process's device and written back
# (device/ranks.rs): the same layout's CPU run under mpirun (tp-sp-mpi), bit for bit.
timeout 300 "${MPIRUN4[@]}" "$BIN" "${COMMON[@]}" --tp 2 --sp --zero 1 --steps 4 --device emulated \
    --out-dir "$OUT/emulated-tp" 2>"$OUT/emulated-tp.log" || { cat "$OUT/emulated-tp.log"; exit 1; }
python3 - "$OUT/tp-sp-mpi/metrics.jsonl" "$OUT/emulated-tp/metrics.jsonl" <<'PY'
import json, sys
cpu, dev = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert len(cpu) == len(dev) == 4, (len(cpu), len(dev))
for c, d in zip(cpu, dev):
    for key in ("loss", "grad_norm"):
        assert c[key] == d[key], f"step {c['step']} {key}: cpu mpi {c[key]} emulated mpi {d[key]}"
    assert len(d["rank_mem"]) == 4, d["rank_mem"]
    for x in d["rank_mem"]:
        assert abs(x["mem_peak_measured"] / x["mem_peak_planned"] - 1) < 0.01, (d["step"], x)
print("emulated device under mpirun -np 4 (dp 2 x tp 2 x sp) = the CPU processes bit for bit; 4 ranks within 1% of their plans")
PY

echo "== a checkpoint written by both processes in parallel (ZeRO-3), resumed re-sharded (ZeRO-1)"
# Stopped after step 2 of 4, each rank writing its own blocks of one checkpoint; resumed on the
# other ZeRO stage, steps 3 and 4 follow the uninterrupted threads run.
timeout 300 "${MPIRUN[@]}" "$BIN" "${COMMON[@]}" --zero 3 --steps 4 --stop-after 2 \
    --out-dir "$OUT/ck" --checkpoint-dir "$OUT/ck/checkpoint" 2>"$OUT/ck.log" || { cat "$OUT/ck.log"; exit 1; }
timeout 300 "${MPIRUN[@]}" "$BIN" train --resume "$OUT/ck/checkpoint" --data "$OUT/data" --zero 1 \
    --quiet --peak-gflops 100 --out-dir "$OUT/resumed" 2>"$OUT/resumed.log" || { cat "$OUT/resumed.log"; exit 1; }
python3 - "$OUT/threads3/metrics.jsonl" "$OUT/resumed/metrics.jsonl" <<'PY'
import json, sys
straight, resumed = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert [r["step"] for r in resumed] == [3, 4], [r["step"] for r in resumed]
for s, r in zip(straight[2:], resumed):
    rel = abs(s["loss"] - r["loss"]) / abs(s["loss"])
    assert rel < 1e-5, f"step {r['step']}: straight {s['loss']} resumed {r['loss']} ({rel:.1e})"
print("resumed under mpirun on ZeRO-1 from a ZeRO-3 checkpoint: steps 3-4 follow the straight run")
PY

echo "== asynchronous checkpoints under mpirun: each process's writer thread, rank 0's rename"
# Two saves (steps 2 and 4) of two processes, each staged and written in the background, rank 0
# waiting for the other's marker file: byte for byte the threads backend's synchronous ones.
timeout 300 "${MPIRUN[@]}" "$BIN" "${COMMON[@]}" --zero 1 --steps 4 --checkpoint-interval 2 \
    --async-checkpoint --out-dir "$OUT/async" --checkpoint-dir "$OUT/async/checkpoint" \
    2>"$OUT/async.log" || { cat "$OUT/async.log"; exit 1; }
timeout 300 "$BIN" "${COMMON[@]}" --zero 1 --steps 4 --checkpoint-interval 2 \
    --out-dir "$OUT/sync" --checkpoint-dir "$OUT/sync/checkpoint" \
    2>"$OUT/sync.log" || { cat "$OUT/sync.log"; exit 1; }
for f in model.safetensors optimizer.safetensors; do
    cmp "$OUT/async/checkpoint/$f" "$OUT/sync/checkpoint/$f"
done
if ls -a "$OUT/async" | grep -q '\.tmp-'; then echo "a temp directory was left"; exit 1; fi
echo "asynchronous checkpoints under mpirun -np 2 = the threads backend's synchronous ones, byte for byte"

echo "== mpirun -np 2 with --dp 4 is refused"
set +e
out="$(timeout 60 "${MPIRUN[@]}" "$BIN" train --steps 1 --dp 4 --quiet --out-dir "$OUT/bad" 2>&1)"
rc=$?
set -e
if [ "$rc" -eq 0 ] || ! grep -q "dp = 4: mpirun started 2 processes; pass --dp 2" <<<"$out"; then
    echo "expected a refusal naming both counts (rc $rc):"; echo "$out"; exit 1
fi
echo "refused: $(grep -m1 'dp = 4' <<<"$out")"

# Sets `pids` to the ferrotron processes of the job writing to $MARK, once both run and one
# step is written (at most 60 s).
wait_for_ranks() {
    pids=""
    for _ in $(seq 1 120); do
        pids="$(pgrep -f -- "--out-dir $MARK" | while read -r p; do
            [ "$(cat /proc/"$p"/comm 2>/dev/null)" = ferrotron ] && echo "$p"; done)"
        [ "$(wc -w <<<"$pids")" -ge 2 ] && [ -s "$MARK/metrics.jsonl" ] && break
        sleep 0.5
    done
}

echo "== a rank killed with SIGKILL takes the whole job down"
# A long run whose ranks carry a marker in their command line; once it has written a step,
# kill one rank's process.
MARK="$OUT/killed"
start=$(date +%s)
set +e
timeout 120 "${MPIRUN[@]}" "$BIN" "${COMMON[@]}" --steps 100000 --out-dir "$MARK" >"$OUT/kill.log" 2>&1 &
job=$!
wait_for_ranks
victim="$(tail -1 <<<"$pids")"
killed_at=$(date +%s)
kill -9 "$victim"
wait "$job"
rc=$?
set -e
took=$(($(date +%s) - killed_at))
if [ -z "$victim" ] || [ "$rc" -eq 0 ] || [ "$took" -gt 30 ]; then
    echo "expected the job to fail within 30 s of the kill (victim '$victim', rc $rc, ${took}s):"
    cat "$OUT/kill.log"; exit 1
fi
echo "killed pid $victim after $((killed_at - start))s: mpirun exited $rc ${took}s later"

echo "== a rank stopped with SIGSTOP is caught by the watchdog (--comm-timeout 5)"
# A stopped rank is alive: MPI alone would wait for it forever. The other rank's watchdog must
# name itself, the operation, the group and the step, and MPI_Abort the job; mpirun then ends
# every process, the stopped one included, within the timeout + 30 s.
MARK="$OUT/stopped"
set +e
timeout 120 "${MPIRUN[@]}" "$BIN" "${COMMON[@]}" --steps 100000 --comm-timeout 5 \
    --out-dir "$MARK" >"$OUT/stop.log" 2>&1 &
job=$!
wait_for_ranks
victim="$(tail -1 <<<"$pids")"
stopped_at=$(date +%s)
kill -STOP "$victim"
wait "$job"
rc=$?
set -e
took=$(($(date +%s) - stopped_at))
# mpirun has returned; its processes may take a moment more to be reaped.
for _ in $(seq 1 20); do
    left="$(for p in $pids; do [ -d /proc/"$p" ] && echo "$p"; done; true)"
    [ -z "$left" ] && break
    sleep 0.5
done
if [ -n "$left" ]; then kill -9 $left 2>/dev/null || true; fi
if [ -z "$victim" ] || [ "$rc" -eq 0 ] || [ "$took" -gt 35 ] || [ -n "$left" ] ||
    ! grep -q "comm timeout: .* on group world at step [0-9]* got no answer within 5 s (comm_timeout)" "$OUT/stop.log"; then
    echo "expected the watchdog to end the job within 35 s of the stop (victim '$victim', rc $rc, ${took}s, left '$left'):"
    cat "$OUT/stop.log"; exit 1
fi
echo "stopped pid $victim: $(grep -m1 -o 'rank [0-9]*: comm timeout: .*step [0-9]*' "$OUT/stop.log"); mpirun exited $rc ${took}s later, no process left"
