"""The GPU's memory against the plan (scripts/cuda_check.sh's kit, issue #31): for each run
given, its last step's peak as the trainer requested it (mem_peak_measured) within 1% of the
plan, and the device's memory in use by the driver's own count (mem_device_driver,
cuMemGetInfo) no less than what was requested and within 1% of the plan plus a stated
constant. Usage: python3 cuda_memory.py LABEL=METRICS_JSONL ..."""
import json
import sys

MIB = 1 << 20
# What the driver holds beyond the plan's buffers: each allocation rounded up to the driver's
# 2 MiB granularity, the backend's own scratch (the embedding's grouping, reductions' partials,
# a few MiB), and the local memory the driver reserves for the kernels at their first launch.
DRIVER_CONSTANT = 64 * MIB

failed = []
for arg in sys.argv[1:]:
    label, path = arg.split("=", 1)
    last = [json.loads(l) for l in open(path)][-1]
    planned, asked = last["mem_peak_planned"], last["mem_peak_measured"]
    driver = last.get("mem_device_driver")
    line = f"{label}: planned {planned / MIB:.1f} MiB, requested {asked / MIB:.1f} MiB ({100 * (asked / planned - 1):+.2f}%)"
    if abs(asked / planned - 1) >= 0.01:
        failed.append(f"{label}: requested {asked} vs planned {planned}, not within 1%")
    if driver is None:
        failed.append(f"{label}: no mem_device_driver in {path} (not a GPU run?)")
    else:
        line += f", driver {driver / MIB:.1f} MiB ({100 * (driver / planned - 1):+.2f}%, {(driver - planned) / MIB:+.1f} MiB)"
        if driver < 0.99 * asked:
            failed.append(f"{label}: the driver counts {driver} bytes, less than the {asked} requested")
        if driver > 1.01 * planned + DRIVER_CONSTANT:
            failed.append(f"{label}: the driver counts {driver} bytes, over 1% + {DRIVER_CONSTANT >> 20} MiB above the plan's {planned}")
    print(line)
for f in failed:
    print("error:", f)
sys.exit(1 if failed else 0)
