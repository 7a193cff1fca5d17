#!/usr/bin/env bash
# The GPU suite in one command: what a CPU-only machine cannot check. Everything it prints also goes to
# benchmarks/results/gpu_suite/<machine>.log; a step that fails does not stop the others.
#
#   make install && bash benchmarks/gpu_suite.sh         # every step, ~13 min on one H100
#   bash benchmarks/gpu_suite.sh --quick                  # without make-test and e2e, ~3 min
#   bash benchmarks/gpu_suite.sh --only timeline          # one step; --only a,b,c for several
#   bash benchmarks/gpu_suite.sh --with-ago               # + ago_bench.py --quick on the GPU (not yet timed there)
#   PY=/path/to/python bash benchmarks/gpu_suite.sh       # another interpreter than .venv/bin/python
#
# Steps (NAME: what runs; time on one H100 as measured on 2026-11-26, benchmarks/results/gpu_suite/h100.log,
# make-test, dp-2gpu and ago estimated):
#   io-engine       python -m io_engine info: the NVMe I/O backends (builds the aio op the first time: minutes)  ~10 s
#   make-test       the CPU suite, `make test` (pytest -q; $PY -m pytest -q without make). The three GPU
#                   files with steps of their own below are left out of it (PYTEST_ADDOPTS --ignore)      ~9 min
#   cuda-sanitizer  the CUDA tests (tests/gpu/test_cuda_*.py but those three, test_gpu_memory_plan.py, the io
#                   test with a device tensor) with -m "" under TORCH_CUDA_SANITIZER=1: PyTorch's stream
#                   sanitizer fails a test on a kernel that touches a tensor another stream still uses   ~1 min
#   swap-backends   tests/gpu/test_cuda_swap_backends.py: swapped activations == recompute-all per SDPA backend
#                   (MATH bit-exact; default, EFFICIENT, cuDNN, flash within stated tolerances), fp32
#                   and bf16, CPU and SSD tiers, and a sliding-window HF model                            ~40 s
#   hf-cuda         tests/gpu/test_cuda_hf.py: an HF Llama fine-tuned on CUDA vs a torch loop, its export     ~20 s
#   dp-2gpu         tests/gpu/test_cuda_dp.py: torchrun with 2 ranks, each on its own GPU only (skipped,
#                   not failed, when nvidia-smi -L lists fewer than 2 GPUs)                               ~1 min
#   e2e             finetune.py --overwrite on its defaults (configs/tiny.yaml, device auto = the GPU) into
#                   a temporary directory, with --export; then the metrics (every step, finite, the loss
#                   falls, on the GPU) and the export (loads with transformers, runs on CUDA) are checked  ~40 s
#   timeline        benchmarks/gpu_timeline.py: a 125m-preset step under torch.profiler: GPU idle fraction,
#                   copy time; fails when under half the host<->device copy time overlaps kernels and the
#                   copy time no kernel covers is over 5% of the step                                     ~20 s
#   tflops          benchmarks/gpu_block_tflops.py: one 6b/13b block's TFLOPS against the measured peak  ~15 s
#   ago             (only with --with-ago, or --only ago) ago_bench.py --quick on the GPU                  ~3 min
# One command on a lent machine may run 10 minutes at most: run make-test alone there (--only make-test).
#
# Exit status: 0 when every step passed (or was skipped with its reason), 1 when a step failed (the log and
# the last line say which), 2 when this machine cannot run the suite (no nvidia-smi, or a torch without CUDA)
# or an argument is wrong.
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
ALL_STEPS=(io-engine make-test cuda-sanitizer swap-backends hf-cuda dp-2gpu e2e timeline tflops ago)
QUICK_SKIPS=" make-test e2e "
WITH_AGO=0
QUICK=0
ONLY=""
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --with-ago) WITH_AGO=1 ;;
    --quick) QUICK=1 ;;
    --only) shift; ONLY="${1:-}"; [ -n "$ONLY" ] || { echo "gpu_suite: --only needs a step name" >&2; exit 2; } ;;
    --only=*) ONLY="${1#--only=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_suite: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$ONLY" ]; then
  for name in ${ONLY//,/ }; do
    case " ${ALL_STEPS[*]} " in
      *" $name "*) ;;
      *) echo "gpu_suite: no step '$name'; the steps are: ${ALL_STEPS[*]}" >&2; exit 2 ;;
    esac
  done
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_suite: nvidia-smi not found: this machine has no NVIDIA driver, so there is nothing to test." >&2
  echo "           The CPU suite is 'make test'; the CUDA tests skip there with the reason 'needs CUDA'." >&2
  exit 2
fi
if [ ! -x "$PY" ]; then
  echo "gpu_suite: $PY not found; create the environment with 'make install' (or set PY=...)." >&2
  exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_suite: the driver is there but torch sees no GPU:" >&2
  "$PY" -c "import torch; print(f'  torch {torch.__version__}, built for CUDA {torch.version.cuda}')" >&2 || true
  echo "  a CPU-only torch wheel (version '+cpu') needs replacing by the CUDA build of the same version:" >&2
  echo "  $PY -m pip install --force-reinstall torch==<version> from the CUDA wheel index for your CUDA version" >&2
  echo "  (PyTorch's installation page gives the exact command)" >&2
  exit 2
fi

# The async_io op is built for the CPU accelerator, as the tests build it (tests/conftest.py): io_engine moves
# host memory only, and a CUDA-accelerator build would also need the CUDA toolkit (nvcc headers).
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"

# Results are named results/<benchmark>[/<variant>]/<machine>.* (benchmarks/README.md "Result files"); the log's
# first line has the date and the commit.
MACHINE=$("$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); import torch, bench_env; print(bench_env.machine_id())')
LOG="benchmarks/results/gpu_suite/${ONLY:+only-${ONLY//,/-}/}$MACHINE.log"
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

failed=()
skipped=()
step() {  # step NAME COMMAND...: run, time and record one step; go on after a failure
  local name=$1 start rc
  shift
  echo
  echo "=== $name: $* ==="
  start=$(date +%s)
  "$@"
  rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - start )) s ==="
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

selected() {  # selected NAME: whether this run includes the step
  local name=$1
  if [ -n "$ONLY" ]; then
    case ",$ONLY," in *",$name,"*) return 0 ;; *) return 1 ;; esac
  fi
  if [ "$name" = ago ] && [ "$WITH_AGO" = 0 ]; then
    return 1
  fi
  if [ "$QUICK" = 1 ] && [[ "$QUICK_SKIPS" == *" $name "* ]]; then
    skipped+=("$name (--quick)")
    return 1
  fi
  return 0
}

# The three GPU test files that are steps of their own (not run again inside make-test and the sanitizer step)
OWN_STEP_TESTS=(tests/gpu/test_cuda_swap_backends.py tests/gpu/test_cuda_hf.py tests/gpu/test_cuda_dp.py)
IGNORE_OWN=()
for f in "${OWN_STEP_TESTS[@]}"; do IGNORE_OWN+=("--ignore=$f"); done

run_make_test() {
  if command -v make >/dev/null 2>&1 && [ "$PY" = .venv/bin/python ]; then
    PYTEST_ADDOPTS="${IGNORE_OWN[*]}" make test
  else
    "$PY" -m pytest -q "${IGNORE_OWN[@]}"
  fi
}

run_cuda_sanitizer() {
  # -m "" also selects tests marked slow or aio; -rsxXfEP prints skip reasons and the output of passed tests
  # (the GPU memory plan's predicted vs measured line)
  local files=() f
  for f in tests/gpu/test_cuda_*.py tests/unit/plan/test_gpu_memory_plan.py; do
    [ -f "$f" ] && [[ " ${OWN_STEP_TESTS[*]} " != *" $f "* ]] && files+=("$f")
  done
  TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -q -m "" -rsxXfEP "${files[@]}" \
    tests/unit/io_engine/test_io_errors.py::test_gpu_tensor_or_noncontiguous_target_rejected
}

run_swap_backends() {
  # deterministic cuBLAS for the MATH cases (use_deterministic_algorithms asks for it before the first handle)
  CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}" \
    "$PY" -m pytest -q -m "" -rsxXfEP tests/gpu/test_cuda_swap_backends.py
}

run_hf_cuda() {
  "$PY" -m pytest -q -m "" -rsxXfEP tests/gpu/test_cuda_hf.py
}

run_dp_2gpu() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  if [ "$n" -lt 2 ]; then
    echo "skipped: nvidia-smi -L lists $n GPU(s); the 2-GPU data-parallel check needs 2"
    skipped+=("dp-2gpu ($n GPU)")
    return 0
  fi
  "$PY" -m pytest -q -m "" -rsxXfEP tests/gpu/test_cuda_dp.py
}

run_e2e() {
  local dir rc
  dir=$(mktemp -d "${TMPDIR:-/tmp}/lohan_gpu_e2e.XXXXXX") || return 1
  # the defaults (configs/tiny.yaml), device auto: LOHAN_DEVICE unset so that auto means the GPU
  env -u LOHAN_DEVICE "$PY" finetune.py --overwrite --nvme "$dir/nvme" --metrics "$dir/metrics.jsonl" \
    --export "$dir/export"
  rc=$?
  if [ "$rc" -eq 0 ]; then
    "$PY" - "$dir" <<'EOF'
import json, math, sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM

d = Path(sys.argv[1])
want = yaml.safe_load(open("configs/tiny.yaml"))["steps"]
recs = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in r and "step" in r]
losses = [r["loss"] for r in recs]
problems = []
if [r["step"] for r in recs] != list(range(1, want + 1)):
    problems.append(f"metrics have steps {[r['step'] for r in recs][:5]}... ({len(recs)} records), want 1..{want}")
if not all(math.isfinite(v) for v in losses) or any(r.get("skipped") for r in recs):
    problems.append(f"non-finite or skipped steps: {[r['step'] for r in recs if r.get('skipped')]}")
if any(r.get("gpu_mem_gib") is None for r in recs):
    problems.append("records without gpu_mem_gib: the run was not on the GPU")
first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
if not last < first - 1.0:
    problems.append(f"the loss did not fall by 1.0: first 5 steps {first:.3f}, last 5 {last:.3f}")
model = AutoModelForCausalLM.from_pretrained(d / "export").to("cuda").eval()
with torch.no_grad():
    logits = model(input_ids=torch.randint(0, 256, (2, 64), device="cuda")).logits
if not torch.isfinite(logits).all():
    problems.append("the exported model gives non-finite logits on CUDA")
print(f"e2e: {len(recs)} steps, loss {first:.3f} -> {last:.3f} (means of 5), median step "
      f"{sorted(r['step_s'] for r in recs)[len(recs) // 2]:.3f} s, peak GPU {max(r['gpu_mem_gib'] or 0 for r in recs):.2f} GiB; "
      f"export loads and runs on CUDA")
for p in problems:
    print(f"e2e: FAIL: {p}")
sys.exit(1 if problems else 0)
EOF
    rc=$?
  fi
  rm -rf "$dir"
  return "$rc"
}

run_timeline() {
  "$PY" benchmarks/gpu_timeline.py
  local rc=$?
  [ -f "benchmarks/results/gpu_timeline/$MACHINE.md" ] && cat "benchmarks/results/gpu_timeline/$MACHINE.md"
  return "$rc"
}

run_tflops() {
  "$PY" benchmarks/gpu_block_tflops.py
  local rc=$?
  [ -f "benchmarks/results/gpu_block_tflops/$MACHINE.md" ] && cat "benchmarks/results/gpu_block_tflops/$MACHINE.md"
  return "$rc"
}

run_ago() {
  # ago_bench has no device flag: its engines use device 'auto', which is the GPU here
  "$PY" benchmarks/ago_bench.py --quick  # -> results/ago_bench/quick/$MACHINE.*
}

echo "gpu_suite $(date -Iseconds) at commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
  "$(git diff --quiet 2>/dev/null || echo '(uncommitted changes)')" \
  "${ONLY:+(only: $ONLY)}$([ "$QUICK" = 1 ] && echo '(--quick)')"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>&1 || true
"$PY" - <<'EOF'
import platform, torch
p = torch.cuda.get_device_properties(0)
print(f"python {platform.python_version()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
      f"{torch.cuda.get_device_name(0)}, sm {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB | {torch.cuda.device_count()} device(s)")
EOF

selected io-engine && step io-engine "$PY" -m io_engine info
selected make-test && step make-test run_make_test
selected cuda-sanitizer && step cuda-sanitizer run_cuda_sanitizer
selected swap-backends && step swap-backends run_swap_backends
selected hf-cuda && step hf-cuda run_hf_cuda
selected dp-2gpu && step dp-2gpu run_dp_2gpu
selected e2e && step e2e run_e2e
selected timeline && step timeline run_timeline
selected tflops && step tflops run_tflops
selected ago && step ago run_ago

echo
[ ${#skipped[@]} -eq 0 ] || echo "gpu_suite: skipped: ${skipped[*]}"
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_suite: all steps passed; log $LOG"
  exit 0
fi
echo "gpu_suite: FAILED: ${failed[*]}; log $LOG"
exit 1
