#!/usr/bin/env bash
# GPU readiness in one command: the CUDA tests, then the block-TFLOPS benchmark, then (--with-ago) the
# gradient-offloading ablation on the GPU. Everything it prints also goes to
# benchmarks/results/gpu_suite_<date>.log; the benchmark writes benchmarks/results/gpu_block_tflops.{json,md}.
#
#   make install && bash benchmarks/gpu_suite.sh             # ~10 min on one H100
#   bash benchmarks/gpu_suite.sh --with-ago                   # + benchmarks/ago_bench.py --quick (~3 min more)
#   PY=/path/to/python bash benchmarks/gpu_suite.sh           # another interpreter than .venv/bin/python
#
# Exit status: 0 when every step passed, 1 when a step failed (the log says which), 2 when this machine
# cannot run the suite (no nvidia-smi, or a torch without CUDA).
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
WITH_AGO=0
for arg in "$@"; do
  case "$arg" in
    --with-ago) WITH_AGO=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "gpu_suite: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

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

mkdir -p benchmarks/results
LOG="benchmarks/results/gpu_suite_$(date +%Y%m%d-%H%M%S).log"
exec > >(tee "$LOG") 2>&1

failed=()
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

echo "gpu_suite $(date -Iseconds) at commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
  "$(git diff --quiet 2>/dev/null || echo '(uncommitted changes)')"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>&1 || true
"$PY" - <<'EOF'
import platform, torch
p = torch.cuda.get_device_properties(0)
print(f"python {platform.python_version()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
      f"{torch.cuda.get_device_name(0)}, sm {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB | {torch.cuda.device_count()} device(s)")
EOF
step "io_engine backends" "$PY" -m io_engine info

# The CUDA tests, plus the one CPU-suite test with a CUDA branch (a device tensor given to io_engine).
# -m "" also selects tests marked slow or aio; -rsxXfEP prints skip reasons and the output of passed tests
# (the GPU memory plan's predicted vs measured line).
step "CUDA tests" "$PY" -m pytest -q -m "" -rsxXfEP \
  tests/test_cuda_paths.py tests/test_cuda_engine.py tests/test_cuda_cpu_side.py \
  tests/test_io_errors.py::test_gpu_tensor_or_noncontiguous_target_rejected

step "block TFLOPS vs measured peak" "$PY" benchmarks/gpu_block_tflops.py
[ -f benchmarks/results/gpu_block_tflops.md ] && cat benchmarks/results/gpu_block_tflops.md

if [ "$WITH_AGO" = 1 ]; then
  # ago_bench has no device flag: its engines use device 'auto', which is the GPU here.
  step "AGO ablation (quick, on the GPU)" "$PY" benchmarks/ago_bench.py --quick \
    --out benchmarks/results/ago_bench_quick_gpu.json
fi

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_suite: all steps passed; log $LOG"
  exit 0
fi
echo "gpu_suite: FAILED: ${failed[*]}; log $LOG"
exit 1
