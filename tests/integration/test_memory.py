"""Memory over a run: RSS, threads and open files stay flat after warm-up, the optimizer's bf16 upcast
reuses one buffer that the plan counts, and peak RSS stays within the bound the run's plan states
(cpu_mem + overhead, lohan/plan/memory.py). The long version is benchmarks/soak.py (300 steps)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import lohan
from lohan.config import get_model_config
from lohan.data import synthetic_batches

REPO = Path(__file__).resolve().parents[2]
MiB, GiB = 1 << 20, 1 << 30


def small_engine(tmp_path: Path):
    mcfg = get_model_config("tiny", vocab_size=256, n_layer=2, d_model=128, n_head=4, seq_len=32)
    return lohan.init(mcfg, {"nvme": [str(tmp_path / "nvme")], "cpu_mem": "256MiB", "compute_dtype": "bf16"})


def test_rss_threads_and_open_files_stay_flat_after_warm_up(tmp_path: Path) -> None:
    engine = small_engine(tmp_path)
    proc = psutil.Process()
    batches = synthetic_batches(256, 2, 32, seed=0)
    seen: dict[int, tuple[int, int, int]] = {}
    try:
        for step in range(1, 31):
            engine.step(next(batches))
            if step in (5, 30):  # step 1 profiles and measures the disk; by 5 the pools are in use
                gc.collect()
                seen[step] = (proc.num_threads(), proc.num_fds(), proc.memory_info().rss)
    finally:
        engine.close()
    (threads5, fds5, rss5), (threads30, fds30, rss30) = seen[5], seen[30]
    # Fewer is fine (another test's objects may be collected meanwhile); more would be a leak.
    assert threads30 <= threads5, f"threads grew from {threads5} to {threads30} between steps 5 and 30"
    assert fds30 <= fds5, f"open files grew from {fds5} to {fds30} between steps 5 and 30"
    # Step-end RSS moves by < 1 MiB from step to step here (a step's working set is a few MiB): 16 MiB
    # over 25 steps is far above the noise and far below a leak of one activation or gradient per step.
    assert rss30 - rss5 < 16 * MiB, f"RSS grew by {(rss30 - rss5) / MiB:.1f} MiB between steps 5 and 30"


def test_bf16_gradients_are_upcast_into_one_buffer_that_the_plan_counts(tmp_path: Path) -> None:
    engine = small_engine(tmp_path)
    batches = synthetic_batches(256, 2, 32, seed=0)
    try:
        engine.step(next(batches))
        scratch = engine.offloader._upcast
        assert scratch is not None and scratch.dtype.is_floating_point and scratch.element_size() == 4
        engine.step(next(batches))
        assert engine.offloader._upcast.data_ptr() == scratch.data_ptr()  # allocated once, reused
        # the optimizer's share of the plan = the record pool's budget + the scratch
        scratch_bytes = scratch.numel() * 4
        assert engine.records_pool.budget_bytes + scratch_bytes == engine.memory_plan["optimizer"] + engine.memory_plan["resident"]
        assert engine.records_pool.peak_allocated <= engine.records_pool.budget_bytes
    finally:
        engine.close()


_PEAK_WRAPPER = """
import atexit, runpy, sys
def _peak():  # VmHWM: the most this process's own memory held, since its exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            print("VMHWM_BYTES", int(line.split()[1]) * 1024, flush=True)
atexit.register(_peak)
sys.argv = ["finetune.py", *sys.argv[1:]]
runpy.run_path("finetune.py", run_name="__main__")
"""


def run_measuring_peak(args: list[str]) -> tuple[str, int]:
    """finetune.py with `args` in a child process; its output and the peak RSS of that process alone.

    Not `ru_maxrss` from wait4: Python starts children with vfork, and at exec the kernel records the
    high-water mark of the memory the child was still sharing (the parent's: a test suite's process, over a
    GiB once torch has run a few hundred tests) as the child's own maximum. VmHWM, read by the child as it
    exits, counts only what it held after its exec."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    out = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    found = re.search(r"^VMHWM_BYTES (\d+)$", out.stdout, re.M)
    assert found, text
    return text, int(found.group(1))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM of the child (Linux /proc)")
def test_peak_rss_stays_within_the_bound_the_plan_states(tmp_path: Path) -> None:
    """finetune.py in a child process (so the peak is this run's alone): its peak RSS is at most the `peak RSS
    at most X GiB` its header states."""
    out, peak = run_measuring_peak(["--model", "tiny", "--layers", "2", "--data", "synthetic", "--batch-size", "2",
                                    "--seq-len", "32", "--steps", "2", "--cpu-mem", "256MiB",
                                    "--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "metrics.jsonl")])
    stated = re.search(r"peak RSS at most ([\d.]+) GiB = cpu_mem ([\d.]+) \+ overhead ([\d.]+)", out)
    assert stated, f"the header states no RSS bound:\n{out}"
    bound, cpu_mem, overhead = (float(x) * GiB for x in stated.groups())
    assert peak <= bound, f"peak RSS {peak / GiB:.3f} GiB above the stated {bound / GiB:.3f} GiB:\n{out}"
    # and the bound is not vacuous: the overhead it adds to cpu_mem is of the order of the process itself
    assert overhead < 2 * peak


_FAULTS_SCRIPT = """
import resource, sys, torch
import lohan.runtime.engine  # as a run sets it: in Engine.__init__, with everything imported
from lohan.runtime.heap import reuse_heap
if sys.argv[1] == "on" and not reuse_heap():
    print("unsupported"); raise SystemExit
faults = []
for _ in range(8):  # a step's big temporary, made and freed every step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(64 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[4:]))  # small allocations may split the first free region: the heap settles by then
"""


def test_reuse_heap_serves_a_repeated_big_tensor_from_resident_pages() -> None:
    """glibc maps a 64 MiB tensor afresh each time (16k page faults for its pages); after reuse_heap, once
    the heap has settled, later ones reuse its resident pages. In child processes: the setting is
    process-wide."""
    def faults(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
    reused = faults("on")
    if reused == "unsupported":
        pytest.skip("the C library is not glibc")
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert int(reused) < pages // 16, f"{reused} page faults for a reused 64 MiB tensor ({pages} pages)"
    assert int(faults("off")) > pages // 2  # what it avoids: without it, every page faults again


@pytest.mark.parametrize("on", [True, False])
def test_the_engine_sets_heap_reuse_only_when_asked(tmp_path: Path, monkeypatch, on: bool) -> None:
    import lohan.runtime.engine as engine_mod
    calls: list[int] = []
    monkeypatch.setattr(engine_mod, "reuse_heap", lambda: calls.append(1) or True)  # process-wide: not for real
    mcfg = get_model_config("tiny", vocab_size=256, n_layer=2, d_model=128, n_head=4, seq_len=32)
    with lohan.init(mcfg, {"nvme": [str(tmp_path / "nvme")], "cpu_mem": "256MiB", "heap_reuse": on}):
        pass
    assert calls == ([1] if on else [])


def test_config_refuses_a_non_boolean_heap_reuse() -> None:
    from lohan.config import EngineConfig
    with pytest.raises(ValueError, match="heap_reuse"):
        EngineConfig(heap_reuse="yes")
