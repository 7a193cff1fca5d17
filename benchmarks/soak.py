"""Memory soak: does a long fine-tune keep its RSS, threads and open files flat, and within its plan?

What one run is. `finetune.py`'s own entry point (`lohan.app.cli.main`) runs as a child process for
`--steps` optimizer steps; the parent samples the child from outside with psutil every `--interval`
seconds (RSS, threads, open fds, the kernel's RSS high-water mark `VmHWM`). Inside the child a thin
wrapper around `Engine.step` (the code path is the CLI's; nothing else changes) appends one JSON line
per step with the step-end RSS, threads and fds, the engine's pools (allocated / peak), the activation
tier, glibc's malloc arenas (`malloc_info`: heap size and free bytes, so allocator retention shows
apart from real growth) and the number of Python objects, so a growth can be attributed.

Configurations (`CONFIGS`, declared as data):

- ``tiny``: `configs/tiny.yaml` as `make run` runs it (1.9M-parameter GPT, batch 8 x 256, corpus);
- ``llama110m``: a ~110M-parameter Llama (hidden 768, 12 layers, 12 heads, MLP 2048, vocab 32000,
  tied embeddings, random weights; `scripts/make_tiny_hf.py --size 110m`) at batch 1 x seq 512 on
  synthetic data (~2.5-5 s per step on the 2-core VM: 300 steps take 15-25 min).

Numbers per run (benchmarks/README.md has the key table):

- warm-up = the first max(20, 10 %) steps; `rss_after_warmup` = median step-end RSS over the `window`
  (max(5, 5 %)) steps after it, `rss_end` = median over the last `window` steps, `drift_pct` =
  (end - after warm-up) / after warm-up. Medians of windows, not single samples, so one noisy sample
  does not decide it; `growth_after_warmup_max` is the largest single step-end RSS above the
  after-warm-up median. The engine's pools fill lazily up to their planned budgets (the optimizer's
  record pool takes one more buffer when its writes back up, at any step), so the same drift is also
  given for the RSS outside the pools (`drift_outside_pools_pct`): growth that no budget bounds.
- `peak_rss` = the child's VmHWM (whole life, store initialization included);
  `overhead` = peak RSS - the engine's planned pools (`memory_plan`, what `cpu_mem` is checked against).
  On this CPU-only machine the "device" is the CPU, so the overhead holds the process (Python, torch,
  libraries, model skeleton), the activations and autograd temporaries of the block being computed,
  the logits, the activation tiers and allocator slack; `breakdown` splits it.
- threads and open fds at the end of the warm-up step vs the last step (step-end values: the first
  step's profiling and SSD probe start threads and open files that are gone by then), and the maximum
  the outside sampler saw.
- checks: |drift| < 2 % (RSS; and RSS minus what glibc holds free, the memory in use), threads and fds
  not growing, VmHWM <= the `peak RSS at most` the run's header states
  (`lohan/runtime/heap.py`), the run completed.

Diagnosis flags: `--legacy-upcast` brings back what made a 110M Llama grow (a new optimizer thread per
step allocating a fresh fp32 gradient per block), `--malloc-trim every|first` calls glibc's malloc_trim(0)
after every step or after the first; benchmarks/README.md has what they showed.

Run (from the repository root):
    .venv/bin/python benchmarks/soak.py                       # both configurations, 300 steps each
    .venv/bin/python benchmarks/soak.py --quick               # 40 steps each (~5 min)
    .venv/bin/python benchmarks/soak.py --configs llama110m --steps 100
Reports: `benchmarks/results/soak/<config>[-quick | -steps<N>][-legacy_upcast][-malloc_trim[_first]]/<machine>.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime as dt
import gc
import json
import math
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    portable,
    result_fields,
    result_path,
    shared_environment,
    variant_name,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

GiB, MiB = 1 << 30, 1 << 20
DIAG_ENV = "LOHAN_SOAK_DIAG"
LEGACY_ENV = "LOHAN_SOAK_LEGACY_UPCAST"
TRIM_ENV = "LOHAN_SOAK_MALLOC_TRIM"

# The two configurations of the issue ("Crash-proof long runs", part 6). `args` are finetune.py flags;
# `--steps`, `--nvme` and `--metrics` are added per run. `hf_size` makes the model first (if missing).
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {"args": [], "hf_size": None},
    "llama110m": {"args": ["--data", "synthetic", "--seq-len", "512", "--batch-size", "1", "--lr", "1e-4"],
                  "hf_size": "110m"},
}
STEPS, QUICK_STEPS = 300, 40


# ------------------------------------------------------------------------------------------ child
def _glibc() -> Any | None:
    """libc through ctypes when it is glibc (malloc_info exists), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_info  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    return libc


def malloc_arenas(libc: Any, scratch: str) -> dict[str, int] | None:
    """glibc's arenas from malloc_info(3): count, bytes taken from the system, bytes free inside them
    (retained by the allocator: counted in RSS but holding nothing), and mmapped chunks."""
    f = libc.fopen(scratch.encode(), b"w")
    if not f:
        return None
    libc.malloc_info(0, f)
    libc.fclose(f)
    xml = Path(scratch).read_text()
    heaps = re.findall(r'<heap nr="\d+">(.*?)</heap>', xml, re.S)
    per_arena = []
    for body in heaps:
        per_arena.append([int(re.search(r'<system type="current" size="(\d+)"/>', body).group(1)),
                          sum(int(x) for x in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"/>', body))])
    system, free = sum(size for size, _ in per_arena), sum(fr for _, fr in per_arena)
    tail = xml[xml.rfind("</heap>"):]
    mmap = re.search(r'<total type="mmap" count="(\d+)" size="(\d+)"/>', tail)
    return {"arenas": len(heaps), "arena_bytes": system, "arena_free_bytes": free, "per_arena": per_arena,
            "mmap_chunks": int(mmap.group(1)) if mmap else 0, "mmap_bytes": int(mmap.group(2)) if mmap else 0}


def _vm_hwm() -> int:
    """The kernel's RSS high-water mark of this process (bytes)."""
    return _status()["VmHWM"]


def _status() -> dict[str, int]:
    """The byte counts of /proc/self/status: VmHWM, VmRSS and its parts RssAnon, RssFile, RssShmem."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f)
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")}


def child(argv: list[str]) -> int:
    """Run `lohan.app.cli.main(argv)` (what finetune.py runs) with a per-step probe around Engine.step."""
    import psutil
    import torch

    import lohan.runtime.engine as engine_mod
    from lohan.app.cli import main

    proc = psutil.Process()
    out = open(os.environ[DIAG_ENV], "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    libc = _glibc()
    scratch = os.environ[DIAG_ENV] + ".malloc.xml"
    t0 = time.monotonic()

    def emit(record: dict[str, Any]) -> None:
        out.write(json.dumps({"t": time.monotonic() - t0, **record}) + "\n")

    emit({"event": "start", "rss": proc.memory_info().rss})
    Engine = engine_mod.Engine
    orig_init, orig_step = Engine.__init__, Engine.step

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        emit({"event": "engine_init", "rss": proc.memory_info().rss})
        orig_init(self, *args, **kwargs)
        emit({"event": "engine_ready", "rss": proc.memory_info().rss, "vm_hwm": _vm_hwm(),
              "plan": dict(self.memory_plan), "cpu_mem": int(self.cfg.cpu_mem), "device": self.device.type,
              "threads": proc.num_threads(), "fds": proc.num_fds()})

    trim_mode = os.environ.get(TRIM_ENV, "") if libc is not None else ""  # "", "every" or "first"
    last_faults = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt]

    def step(self: Any, batch: Any, *args: Any, **kwargs: Any) -> float:  # next_batch passes through
        loss = orig_step(self, batch, *args, **kwargs)
        t_trim = time.perf_counter()
        trim = trim_mode == "every" or (trim_mode == "first" and self.step_count == 1)
        if trim:  # diagnosis: give the allocator's free pages back, so retention shows apart from growth
            libc.malloc_trim(0)
        t_trim = time.perf_counter() - t_trim
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # what re-touching freed pages costs
        pools = {name: {"allocated": p.allocated, "peak": p.peak_allocated}
                 for name, p in (("params", getattr(self, "params_pool", None)),
                                 ("grads", getattr(self, "grads_pool", None)),
                                 ("optimizer", getattr(self, "records_pool", None))) if p is not None}
        upcast = getattr(self.offloader, "_upcast", None)
        acts = self.activations.store
        rec = {"event": "step", "step": self.step_count, "loss": loss,
               "step_s": self.last_stats.step_s if self.last_stats else None, "rss": proc.memory_info().rss, "vm_hwm": _vm_hwm(),
               "rss_anon": _status()["RssAnon"], "rss_file": _status()["RssFile"],
               "threads": proc.num_threads(), "fds": proc.num_fds(), "pools": pools,
               "upcast_bytes": 0 if upcast is None else upcast.numel() * upcast.element_size(),
               "act_cpu_peak_bytes": acts.peak_cpu_bytes if acts is not None else 0,
               "act_keep_bytes": acts.bytes.get("keep", 0) if acts is not None else 0,
               "act_cpu_pool_bytes": acts.cpu_pool.allocated if acts is not None and acts.cpu_pool else 0,
               "act_policy": self.activations.plan.policy if self.activations.plan else None,
               "act_tiers": list(self.activations.plan.block_tiers) if self.activations.plan else None,
               "gc_objects": len(gc.get_objects()), "minor_faults": faults - last_faults[0],
               "malloc_trim_s": t_trim if trim else None}
        last_faults[0] = faults
        if self.step_count % 10 == 1:  # a walk over every object: not every step
            with warnings.catch_warnings():  # isinstance() on torch's deprecated module aliases warns
                warnings.simplefilter("ignore")
                rec["tensors"] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
        if libc is not None:
            rec["malloc"] = malloc_arenas(libc, scratch)
        emit(rec)
        return loss

    Engine.__init__, Engine.step = init, step
    if os.environ.get(LEGACY_ENV) == "1":
        from concurrent.futures import ThreadPoolExecutor

        from lohan.runtime.offload import GradOffloader

        def legacy_fp32(self: Any, g: Any, coef: Any = None) -> Any:
            # the behaviour before the upcast scratch: a fresh fp32 tensor per block...
            out = g.float()
            return out if coef is None or float(coef) == 1.0 else out.mul_(coef)

        orig_begin = GradOffloader.begin_step

        def legacy_begin(self: Any, *args: Any, **kwargs: Any) -> None:
            # ... on a thread of its own for every step (before the persistent worker)
            self._executor.shutdown(wait=True)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lohan-ago")
            orig_begin(self, *args, **kwargs)

        GradOffloader._fp32, GradOffloader.begin_step = legacy_fp32, legacy_begin
    try:
        return main(argv)
    finally:
        emit({"event": "end", "rss": proc.memory_info().rss, "vm_hwm": _vm_hwm()})
        out.close()


# ----------------------------------------------------------------------------------------- parent
def ensure_hf_model(size: str, scratch: Path) -> Path:
    """The HF model of `size` in the scratch directory, made by scripts/make_tiny_hf.py if missing."""
    path = scratch / f"llama-{size}"
    if not (path / "config.json").exists():
        if path.exists():
            shutil.rmtree(path)
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_hf.py"), str(path), "--size", size],
                       check=True, cwd=REPO)
    return path


def _read_new_lines(path: Path, pos: int) -> tuple[list[dict], int]:
    """Complete JSON lines appended to `path` since byte `pos`, and the new position."""
    if not path.exists():
        return [], pos
    with open(path, "rb") as f:
        f.seek(pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], pos + end


def run_child(finetune_args: list[str], workdir: Path, interval: float, log: Any,
              legacy_upcast: bool = False, malloc_trim: str | None = None) -> dict[str, Any]:
    """Run the fine-tune as a child, sample it from outside; returns the raw records."""
    import psutil

    diag = workdir / "diag.jsonl"
    diag.unlink(missing_ok=True)
    stdout = workdir / "stdout.log"
    env = {**os.environ, DIAG_ENV: str(diag), LEGACY_ENV: "1" if legacy_upcast else "0",
           TRIM_ENV: malloc_trim or ""}
    env.setdefault("DS_ACCELERATOR", "cpu")  # as the Makefile sets it on machines without an NVIDIA driver
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *finetune_args]
    t0 = time.monotonic()
    with open(stdout, "w") as out:
        child_proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        ps = psutil.Process(child_proc.pid)
        samples: list[dict[str, Any]] = []
        records: list[dict] = []
        pos, last_report = 0, 0.0
        while child_proc.poll() is None:
            try:
                with ps.oneshot():
                    s = {"t": time.monotonic() - t0, "rss": ps.memory_info().rss, "threads": ps.num_threads(),
                         "fds": ps.num_fds()}
                with open(f"/proc/{child_proc.pid}/status") as f:
                    s["vm_hwm"] = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
            except (psutil.Error, OSError, StopIteration):
                break  # it just exited
            new, pos = _read_new_lines(diag, pos)
            records += new
            s["steps_done"] = sum(1 for r in records if r["event"] == "step")
            samples.append(s)
            if s["t"] - last_report > 30:
                last_report = s["t"]
                log(f"  {s['t']:7.0f} s  step {s['steps_done']:4d}  RSS {s['rss'] / GiB:.3f} GiB  threads "
                    f"{s['threads']}  fds {s['fds']}")
            time.sleep(interval)
        rc = child_proc.wait()
    new, pos = _read_new_lines(diag, pos)
    records += new
    return {"command": cmd, "returncode": rc, "wall_s": time.monotonic() - t0, "samples": samples,
            "records": records, "stdout": stdout.read_text(errors="replace")}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def analyze(raw: dict[str, Any], steps: int) -> dict[str, Any]:
    """The report's numbers from the child's per-step records and the outside samples."""
    recs = raw["records"]
    per_step = [r for r in recs if r["event"] == "step"]
    ready = next((r for r in recs if r["event"] == "engine_ready"), None)
    init = next((r for r in recs if r["event"] == "engine_init"), None)
    end = next((r for r in recs if r["event"] == "end"), None)
    n = len(per_step)
    warmup = min(max(20, math.ceil(0.1 * steps)), max(1, n // 2))
    window = max(5, round(0.05 * steps))
    rss = [r["rss"] for r in per_step]
    after = rss[warmup:warmup + window]
    last = rss[-window:]
    rss_after, rss_end = _median(after), _median(last)
    # the engine's pools fill lazily up to their planned budgets (e.g. one more record buffer when the
    # optimizer's writes back up): RSS outside them shows growth that no budget bounds
    outside = [r["rss"] - sum(p["allocated"] for p in r["pools"].values()) - r.get("upcast_bytes", 0)
               for r in per_step]
    out_after, out_end = _median(outside[warmup:warmup + window]), _median(outside[-window:])
    # what glibc holds free inside its arenas stays resident (with engine.heap_reuse, all that a step frees,
    # and a heap grown once by fragmentation keeps its size): RSS minus those free bytes is what is in use,
    # and its drift is what a leak shows
    in_use = ([r["rss"] - r["malloc"]["arena_free_bytes"] for r in per_step]
              if per_step and all(r.get("malloc") for r in per_step) else [])
    use_after, use_end = (_median(in_use[warmup:warmup + window]), _median(in_use[-window:])) if in_use else (0, 0)
    post = per_step[warmup:]
    samples = raw["samples"]
    peak = max([r["vm_hwm"] for r in recs if "vm_hwm" in r] + [s.get("vm_hwm", 0) for s in samples] + [0])
    sampled_post = [s["rss"] for s in samples if s["steps_done"] >= warmup]
    plan = ready["plan"] if ready else {}
    pools_planned = sum(plan.values())
    last_rec = per_step[-1] if per_step else {}
    pools_peak = sum(p["peak"] for p in last_rec.get("pools", {}).values()) + last_rec.get("upcast_bytes", 0)
    act_cpu = max((r.get("act_cpu_pool_bytes", 0) for r in per_step), default=0)
    engine_ready = ready["rss"] if ready else 0
    half = len(post) // 2
    xs = [r["step"] for r in post]
    out = {
        "steps_run": n, "warmup_steps": warmup, "window_steps": window,
        "rss": {
            "after_warmup_bytes": rss_after, "end_bytes": rss_end,
            "drift_pct": 100 * (rss_end - rss_after) / rss_after if after else None,
            "outside_pools_after_warmup_bytes": out_after, "outside_pools_end_bytes": out_end,
            "drift_outside_pools_pct": 100 * (out_end - out_after) / out_after if after else None,
            "in_use_after_warmup_bytes": use_after or None, "in_use_end_bytes": use_end or None,
            "drift_in_use_pct": 100 * (use_end - use_after) / use_after if use_after else None,
            "growth_after_warmup_max_bytes": (max(r["rss"] for r in post) - rss_after) if post else None,
            "slope_bytes_per_step": {"post_warmup": _slope(xs, [r["rss"] for r in post]),
                                     "first_half": _slope(xs[:half], [r["rss"] for r in post[:half]]),
                                     "second_half": _slope(xs[half:], [r["rss"] for r in post[half:]])},
            "peak_bytes": peak, "peak_sampled_after_warmup_bytes": max(sampled_post, default=None),
            "first_step_bytes": rss[0] if rss else None, "min_bytes": min(rss, default=None),
            "max_step_end_bytes": max(rss, default=None),
        },
        "threads": _counts(per_step, samples, warmup, "threads"),
        "fds": _counts(per_step, samples, warmup, "fds"),
        "plan": {"cpu_mem_bytes": ready["cpu_mem"] if ready else None, "pools_bytes": plan,
                 "pools_total_bytes": pools_planned, "device": ready["device"] if ready else None},
        "overhead_bytes": peak - pools_planned,
        "breakdown": {
            "process_before_engine_bytes": init["rss"] if init else None,
            "after_engine_init_bytes": engine_ready,
            "pools_peak_allocated_bytes": pools_peak,
            "activation_cpu_tier_bytes": act_cpu,
            # what a step adds beyond the process, the pools and the activation tier: the device working
            # set (on a CPU: the block's activations, autograd temporaries, logits) and allocator slack
            "step_working_set_bytes": peak - engine_ready - pools_peak - act_cpu if ready else None,
        },
        "gc_objects": {"after_warmup": post[0]["gc_objects"] if post else None,
                       "end": last_rec.get("gc_objects")},
        "tensors": [(r["step"], r["tensors"]) for r in per_step if "tensors" in r],
        "malloc": {"after_warmup": post[0].get("malloc") if post else None, "end": last_rec.get("malloc")},
        "step_s_median": _median([r["step_s"] for r in per_step[warmup:] if r.get("step_s")]),
        "end_event_rss_bytes": end["rss"] if end else None,
    }
    expected = re.search(r"peak RSS at most ([\d.]+) GiB", raw["stdout"])
    out["expected_peak_bytes"] = float(expected.group(1)) * GiB if expected else None
    out["checks"] = {
        "drift_below_2pct": out["rss"]["drift_pct"] is not None and abs(out["rss"]["drift_pct"]) < 2.0,
        "drift_outside_pools_below_2pct": (out["rss"]["drift_outside_pools_pct"] is not None
                                           and abs(out["rss"]["drift_outside_pools_pct"]) < 2.0),
        "drift_in_use_below_2pct": (None if out["rss"]["drift_in_use_pct"] is None
                                    else abs(out["rss"]["drift_in_use_pct"]) < 2.0),
        # not growing: a step can end with write-behind's tail writes (their files open) still in flight
        "threads_flat": out["threads"]["end"] <= out["threads"]["after_warmup"],
        "fds_flat": out["fds"]["end"] <= out["fds"]["after_warmup"],
        "peak_within_expected": (None if out["expected_peak_bytes"] is None
                                 else peak <= out["expected_peak_bytes"]),
        "completed": raw["returncode"] == 0 and n == steps,
    }
    return out


def _counts(per_step: list[dict], samples: list[dict], warmup: int, key: str) -> dict[str, Any]:
    post = per_step[warmup - 1:] if per_step else []
    return {"after_warmup": post[0][key] if post else None, "end": per_step[-1][key] if per_step else None,
            "min_after_warmup": min((r[key] for r in post), default=None),
            "max_after_warmup": max((r[key] for r in post), default=None),
            "max_sampled": max((s[key] for s in samples), default=None)}


def environment() -> dict[str, Any]:
    return shared_environment(("torch", "transformers", "deepspeed", "psutil"))


def _header_lines(stdout: str) -> list[str]:
    """The run's plan lines (`train._header`): from the `lohan ...` line up to the first step."""
    lines = stdout.splitlines()
    start = next((k for k, ln in enumerate(lines) if ln.startswith("lohan ")), len(lines))
    return [ln for ln in lines[start:start + 8] if ln.startswith(("lohan ", "  "))]


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GiB:.3f}"


def markdown(report: dict[str, Any]) -> str:
    a = report["result"]
    r, th, fd, b = a["rss"], a["threads"], a["fds"], a["breakdown"]
    plan = a["plan"]
    pools = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in plan["pools_bytes"].items())
    drift = "n/a" if r["drift_pct"] is None else f"{r['drift_pct']:+.2f} %"
    slope = r["slope_bytes_per_step"]
    rows = [
        ("RSS after warm-up (median of steps {}-{})".format(a["warmup_steps"] + 1, a["warmup_steps"] + a["window_steps"]),
         f"{_g(r['after_warmup_bytes'])} GiB"),
        (f"RSS at the end (median of the last {a['window_steps']} steps)", f"{_g(r['end_bytes'])} GiB"),
        ("drift", drift),
        ("RSS outside the engine pools after warm-up / end / drift (pools fill lazily up to their plan)",
         f"{_g(r['outside_pools_after_warmup_bytes'])} / {_g(r['outside_pools_end_bytes'])} GiB / "
         + ("n/a" if r["drift_outside_pools_pct"] is None else f"{r['drift_outside_pools_pct']:+.2f} %")),
        ("RSS minus glibc's free bytes (in use) after warm-up / end / drift",
         "n/a" if r.get("drift_in_use_pct") is None else
         f"{_g(r['in_use_after_warmup_bytes'])} / {_g(r['in_use_end_bytes'])} GiB / {r['drift_in_use_pct']:+.2f} %"),
        ("largest step-end RSS above the after-warm-up median", f"{(r['growth_after_warmup_max_bytes'] or 0) / MiB:.1f} MiB"),
        ("RSS slope after warm-up (first half / second half)",
         f"{slope['first_half'] / 1024:+.1f} / {slope['second_half'] / 1024:+.1f} KiB/step"),
        ("peak RSS (VmHWM, whole run)", f"{_g(r['peak_bytes'])} GiB"),
        ("first step-end RSS", f"{_g(r['first_step_bytes'])} GiB"),
        ("threads after warm-up / end / max sampled", f"{th['after_warmup']} / {th['end']} / {th['max_sampled']}"),
        ("open fds after warm-up / end / max sampled", f"{fd['after_warmup']} / {fd['end']} / {fd['max_sampled']}"),
        ("cpu_mem budget", f"{_g(plan['cpu_mem_bytes'])} GiB"),
        ("planned engine pools", f"{_g(plan['pools_total_bytes'])} GiB ({pools})"),
        ("overhead = peak RSS - planned pools", f"{_g(a['overhead_bytes'])} GiB"),
        ("  process before the engine (Python, torch, libraries, skeleton)", f"{_g(b['process_before_engine_bytes'])} GiB"),
        ("  after engine init (store created, pools still empty)", f"{_g(b['after_engine_init_bytes'])} GiB"),
        ("  pools peak allocated (incl. the optimizer's upcast scratch)", f"{_g(b['pools_peak_allocated_bytes'])} GiB"),
        ("  activation CPU tier", f"{_g(b['activation_cpu_tier_bytes'])} GiB"),
        ("  step working set + allocator slack (peak - init - pools - tier)", f"{_g(b['step_working_set_bytes'])} GiB"),
        ("expected peak stated by the run's header", f"{_g(a['expected_peak_bytes'])} GiB"),
        ("Python objects after warm-up / end", f"{a['gc_objects']['after_warmup']} / {a['gc_objects']['end']}"),
        ("median step time after warm-up", f"{a['step_s_median']:.3f} s"),
    ]
    m = a["malloc"]
    if m["end"]:
        rows.append(("glibc arenas after warm-up / end (count, heap MiB, free inside MiB)",
                     " / ".join(f"{x['arenas']}, {x['arena_bytes'] / MiB:.0f}, {x['arena_free_bytes'] / MiB:.0f}"
                                for x in (m["after_warmup"], m["end"]) if x)))
    lines = [f"# soak {report['config']} — {report['timestamp']}", "",
             f"`{report['soak_command']}`", "",
             f"Child (what ran, sampled every {report['settings']['interval_s']} s): `{shlex.join(report['child_command'])}`",
             "", f"{a['steps_run']} steps in {report['wall_seconds']:.0f} s; warm-up = first {a['warmup_steps']} "
             f"steps. Checks: " + ", ".join(f"{k} {'yes' if v else 'NO' if v is not None else 'n/a'}"
                                             for k, v in a["checks"].items()), "",
             "| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += ["", f"Hardware: {report['hardware']['cpu_count']} CPUs, "
              f"{report['hardware']['ram_bytes'] / GiB:.1f} GiB RAM, {report['hardware']['libc']}; torch "
              f"{report['versions']['torch']}, transformers {report['versions']['transformers']}, commit "
              f"{report['versions']['git_commit']} (dirty: {len(report['versions']['git_dirty_paths'] or [])} paths)."]
    if report.get("notes"):
        lines += ["", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = report["per_step"]
    xs = [r["step"] for r in steps]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, [r["rss"] / GiB for r in steps], label="RSS at step end")
    ax.plot(xs, [r["vm_hwm"] / GiB for r in steps], label="peak RSS so far (VmHWM)", linestyle="--")
    ax.plot(xs, [sum(p["allocated"] for p in r["pools"].values()) / GiB for r in steps], label="engine pools allocated")
    if steps and steps[0].get("malloc"):
        ax.plot(xs, [r["malloc"]["arena_free_bytes"] / GiB for r in steps], label="free inside malloc arenas")
    planned = report["result"]["plan"]["pools_total_bytes"]
    ax.axhline(planned / GiB, color="grey", linestyle=":", label="planned pools")
    ax.axvline(report["result"]["warmup_steps"], color="black", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_title(path.stem)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def variant(args: argparse.Namespace, config: str, steps: int) -> dict[str, Any]:
    """What sets this run apart (the report's ``variant``, its folder under results/soak/)."""
    return {"config": config, "quick": args.quick and not args.steps,
            "steps": steps if steps != STEPS and not (args.quick and not args.steps) else None,
            "legacy_upcast": args.legacy_upcast, "malloc_trim": args.malloc_trim == "every",
            "malloc_trim_first": args.malloc_trim == "first"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["tiny", "llama110m"])
    p.add_argument("--steps", type=int, help=f"optimizer steps per run (default {STEPS}, --quick {QUICK_STEPS})")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per configuration")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between outside samples")
    p.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "scratch" / "soak",
                   help="store directories, logs and the generated HF model")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results",
                   help="the results folder: each configuration's report goes to soak/<variant>/<machine>.json in it")
    p.add_argument("--legacy-upcast", action="store_true",
                   help="diagnosis: bring back a new optimizer thread per step and its per-block g.float() (before "
                        "the upcast scratch and the persistent worker) to show the malloc-arena growth they caused; "
                        "reports record it in their variant")
    p.add_argument("--malloc-trim", choices=["every", "first"],
                   help="diagnosis: call glibc's malloc_trim(0) after every step, or after the first one only "
                        "(tells allocator retention from growth); reports record it in their variant")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more finetune.py flags for every run (last option)")
    args = p.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)

    def log(msg: str) -> None:
        print(msg, flush=True)

    env = environment()
    for name in args.configs:
        spec = CONFIGS[name]
        work = args.scratch / variant_name(variant(args, name, steps))
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        model = ["--model", str(ensure_hf_model(spec["hf_size"], args.scratch))] if spec["hf_size"] else []
        ft_args = [*model, *spec["args"], "--steps", str(steps), "--nvme", str(work / "nvme"),
                   "--metrics", str(work / "metrics.jsonl"), *args.extra]
        log(f"soak {name}: {steps} steps: finetune.py {shlex.join(ft_args)}")
        t0 = time.time()
        raw = run_child(ft_args, work, args.interval, log, legacy_upcast=args.legacy_upcast,
                        malloc_trim=args.malloc_trim)
        result = analyze(raw, steps)
        report = {
            "config": name, "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "soak_command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(),
            "child_command": raw["command"], "finetune_args": ft_args,
            "returncode": raw["returncode"],
            "wall_seconds": time.time() - t0,
            "settings": {"steps": steps, "interval_s": args.interval, "legacy_upcast": args.legacy_upcast,
                         "malloc_trim": args.malloc_trim},
            **env, **result_fields("soak", variant(args, name, steps)), "result": result,
            "header": _header_lines(raw["stdout"]),
            "per_step": [r for r in raw["records"] if r["event"] == "step"],
            "events": [r for r in raw["records"] if r["event"] != "step"],
            "samples": raw["samples"], "notes": [],
        }
        if raw["returncode"] != 0:
            report["notes"].append(f"the fine-tune exited with {raw['returncode']}; see stdout_tail")
            report["stdout_tail"] = raw["stdout"][-4000:]
        stem = result_path("soak", variant(args, name, steps), root=args.out_dir).with_suffix("")
        stem.parent.mkdir(parents=True, exist_ok=True)
        report = portable(report)  # no paths of this machine in a report that goes into the repository
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        png = plot(report, stem.with_suffix(".png"))
        stem.with_suffix(".md").write_text(markdown(report) + (f"\n![RSS over steps]({png.name})\n" if png else ""))
        r = result["rss"]
        drift = "n/a" if r["drift_pct"] is None else f"{r['drift_pct']:+.2f} %"
        log(f"soak {name}: RSS after warm-up {_g(r['after_warmup_bytes'])} GiB, end {_g(r['end_bytes'])} GiB, drift "
            f"{drift}, peak {_g(r['peak_bytes'])} GiB, overhead {_g(result['overhead_bytes'])} GiB; "
            f"threads {result['threads']['after_warmup']}->{result['threads']['end']}, fds "
            f"{result['fds']['after_warmup']}->{result['fds']['end']} | {stem}.json")
        shutil.rmtree(work / "nvme", ignore_errors=True)  # the states (the model and logs stay for reruns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
