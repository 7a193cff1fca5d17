#!/usr/bin/env bash
# The GPU decision run of issues 38 and 39, at most 10.5 min on one H100 (the sum of its phases' timeouts; a fresh GPU box, repo root, no network); adapted from a
# draft written against main at 4f8131c. Phases (benchmarks/gpu_decide.py): copy streams, the FIFO latency,
# serial vs optimized on the disk-bound 350m, GPU idle and copy overlap at 350m 8x2048 and 1b 16x2048 with states
# in RAM (the 1b at persist_every auto and 1, issue 39), and the cost model's lanes for the same runs. Each phase has its own timeout; partial results survive in
# $OUT/results.jsonl, the log in $OUT/run.log.
#
#   OUT=/path/to/out bash benchmarks/gpu_decide.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_decide_out}"; mkdir -p "$OUT"; export OUT; T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
# the first interpreter whose torch sees the GPU (a preinstalled CUDA build); lohan from this checkout
for c in "${PY:-}" .venv/bin/python python3; do
  [ -n "$c" ] && command -v "$c" >/dev/null && "$c" -c 'import torch,sys;sys.exit(not torch.cuda.is_available())' 2>/dev/null && { PY=$c; break; }
done
[ -n "${PY:-}" ] || { log "no python with a CUDA torch"; exit 2; }
"$PY" -c 'import psutil, xxhash, numpy' 2>/dev/null || "$PY" -m pip install -q psutil 'xxhash>=3' numpy >>"$OUT/run.log" 2>&1
export PYTHONPATH="$PWD:$PWD/benchmarks"
{ git rev-parse --short HEAD; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  nproc; free -g | sed -n 2p; df -h . /dev/shm | tail -2; "$PY" -c 'import torch;print(torch.__version__)'; } >>"$OUT/run.log" 2>&1
DISK="$PWD/benchmarks/scratch/gpu_decide"; RAM=/dev/shm/lohan_gpu_decide; mkdir -p "$DISK"; mkdir -p "$RAM" 2>/dev/null
avail=$(df -B1G --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' '); [ "${avail:-0}" -ge 45 ] || RAM=""
ph() { local t=$1; shift; log "phase $*"; timeout "$t" "$PY" benchmarks/gpu_decide.py "$@" >>"$OUT/run.log" 2>&1 || log "phase $1 exit $?"; }
ph 60 copy
ph 60 fifo "$DISK/fifo"; rm -rf "$DISK/fifo"
ph 170 disk "$DISK"; rm -rf "$DISK"
if [ -n "$RAM" ]; then ph 80 ram350 "$RAM"; rm -rf "${RAM:?}"/*; ph 200 ram1b "$RAM"; rm -rf "$RAM"
else log "no 45 GB in /dev/shm: RAM phases skipped"; fi
ph 60 predict
"$PY" - "$OUT/results.jsonl" <<'SUM' | tee -a "$OUT/run.log"
import json, sys
K = ("gpu", "m2g", "g2m", "ssd", "cpu", "param_wait", "optimizer_tail", "checksum")
for r in map(json.loads, open(sys.argv[1])):
    if "steps" not in r:
        print(r); continue
    n = len(r["steps"]); g = r.get("gpu") or {}
    print(r["tag"], r["variant"], "step %.2f" % r["median_step_s"],
          {k: round(sum(s["lanes"].get(k, 0) for s in r["steps"]) / n, 2) for k in K},
          "disk_busy %.2f" % (sum(s["disk_busy_s"] for s in r["steps"]) / n),
          "gpu_idle", g.get("idle_fraction"), "copy_overlap", g.get("copy_overlap_fraction"))
SUM
log "done"
