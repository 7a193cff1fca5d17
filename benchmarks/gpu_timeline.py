"""A lohan step on the GPU as the GPU sees it: kernel time, host<->device copies, idle gaps, from torch.profiler.

    .venv/bin/python benchmarks/gpu_timeline.py                              # 125m preset, bf16, 8 x 1024 tokens
    .venv/bin/python benchmarks/gpu_timeline.py --steps 3 --min-overlap 0.6
    .venv/bin/python benchmarks/gpu_timeline.py --model 350m --batch 4 --keep-trace /tmp/step.json

What one run is. A lohan Engine trains the GPT preset `--model` (default `125m`: 12 layers, 768 wide, the GPT-2
vocabulary) on the GPU in bf16, its store in `--nvme` (a scratch directory, deleted at the end), on random
tokens, each step told the next batch as `finetune.py` does. `--warmup` steps (profiling, buffer pools,
cuBLAS workspaces) run unprofiled; then `--steps` steps run under `torch.profiler` (activities CPU and CUDA),
each inside a `record_function` range that ends with `torch.cuda.synchronize()`, so that all of a step's GPU
work lies inside its range.

From the profiler's trace (Chrome trace format; its categories tell kernels, copies and annotations apart,
which `prof.events()` does not for the GPU-side annotations), per profiled step:

- wall: the step's range on the host clock;
- GPU busy: the union of the kernel intervals (on every stream) within the range; idle fraction = 1 - busy / wall;
- copies: the union of the `Memcpy HtoD` and `Memcpy DtoH` intervals (pinned or pageable), and their bytes;
- overlap: the share of that copy time during which a kernel runs (`|copies ∩ kernels| / |copies|`).

The engine streams every block's bf16 parameters host -> device on a side stream ahead of the block computing
(DESIGN.md "Device abstraction"), so copies should hide under compute: the script exits 1 when the overlap of
the profiled steps together is below `--min-overlap` (default 0.5) *and* the copy time no kernel covered is over
`--max-exposed` (default 0.05) of the steps' wall time, or when it saw no copies at all. The second clause is for
a GPU that waits on the host: on the first H100 run (125m, 8 x 1024) kernels were busy 6% of the step, the engine
waiting on its SSD lanes and the parameters they produce, so a copy issued when its bytes arrived had nothing to
overlap. The report lists the engine's lanes of the profiled steps beside the GPU's view. The
interval arithmetic is in the pure functions below (tested on synthetic intervals in
tests/unit/benchmarks/test_gpu_timeline_math.py).

The profiler costs host time per op, so the profiled steps are slower than the unprofiled ones; the report
gives both (the engine's own `step_s`). Report: benchmarks/results/gpu_timeline/<machine>.{json,md} (`--out`). Without
CUDA the script says so and exits 2 (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lohan, when run from anywhere

STEP_PREFIX = "gpu_timeline_step_"
COPY_DIRECTIONS = ("HtoD", "DtoH")  # host <-> device: what the overlap check is about
LANES = ("gpu", "param_wait", "ssd", "ssd_read", "ssd_write", "checksum", "cpu", "optimizer_tail")

Interval = tuple[float, float]


# ------------------------------------------------------------------------------------------ interval math
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint (start, end) pairs; empty and inverted ones are dropped,
    touching ones merged."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of `intervals` (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The intersection of two unions of intervals, as sorted disjoint pairs."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ua) and j < len(ub):
        s, e = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if e > s:
            out.append((s, e))
        if ua[i][1] < ub[j][1]:  # the one that ends first cannot meet anything further
            i += 1
        else:
            j += 1
    return out


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of `intervals` inside [lo, hi]."""
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


# ------------------------------------------------------------------------------------------ the trace
@dataclass
class GpuTrace:
    """What the timeline needs from a profiler trace (times in microseconds, one clock for host and GPU)."""

    kernels: list[Interval] = field(default_factory=list)
    kernel_names: list[str] = field(default_factory=list)
    copies: dict[str, list[Interval]] = field(default_factory=dict)
    """Memcpy intervals by direction: HtoD, DtoH, DtoD, ..."""
    copy_records: list[tuple[str, Interval, int]] = field(default_factory=list)
    """(full memcpy name, e.g. 'Memcpy HtoD (Pinned -> Device)', interval, bytes) of every copy."""
    windows: dict[str, Interval] = field(default_factory=dict)
    """Host-side `record_function` ranges by name."""


def copy_direction(name: str) -> str:
    """'Memcpy HtoD (Pinned -> Device)' -> 'HtoD' (CUPTI's memcpy kinds: HtoD, DtoH, DtoD, HtoH, PtoP, ...)."""
    parts = name.split()
    return parts[1] if len(parts) > 1 else "other"


def classify(events: Iterable[dict[str, Any]], window_prefix: str = STEP_PREFIX) -> GpuTrace:
    """Sort Chrome-trace events (`prof.export_chrome_trace`) into kernels, memcpys and the host ranges whose
    name starts with `window_prefix`. Complete events only (`"ph": "X"`); categories as Kineto writes them:
    `kernel`, `gpu_memcpy`, `gpu_memset` (ignored), `user_annotation` (host ranges; their GPU-side twins,
    `gpu_user_annotation`, span the range's kernels and are not kernels)."""
    trace = GpuTrace()
    for ev in events:
        if ev.get("ph") != "X" or "ts" not in ev:
            continue
        start = float(ev["ts"])
        iv = (start, start + float(ev.get("dur", 0.0)))
        cat, name = ev.get("cat", ""), str(ev.get("name", ""))
        if cat == "kernel":
            trace.kernels.append(iv)
            trace.kernel_names.append(name)
        elif cat == "gpu_memcpy":
            trace.copies.setdefault(copy_direction(name), []).append(iv)
            trace.copy_records.append((name, iv, int((ev.get("args") or {}).get("bytes", 0))))
        elif cat == "user_annotation" and name.startswith(window_prefix):
            trace.windows[name] = iv
    return trace


def window_stats(trace: GpuTrace, window: Interval) -> dict[str, Any]:
    """Busy, idle, copy and overlap times (microseconds and fractions) of the GPU within one host range."""
    lo, hi = window
    wall = hi - lo
    kernels = union(clip(trace.kernels, lo, hi))
    busy = length(kernels)
    per_dir = {d: union(clip(ivs, lo, hi)) for d, ivs in trace.copies.items()}
    copies = union(iv for d in COPY_DIRECTIONS for iv in per_dir.get(d, []))
    copy_us = length(copies)
    overlap_us = length(intersect(copies, kernels))
    copy_bytes: dict[str, int] = {}
    for name, (s, e), nbytes in trace.copy_records:
        if s >= lo and e <= hi:
            d = copy_direction(name)
            copy_bytes[d] = copy_bytes.get(d, 0) + nbytes
    return {
        "wall_us": wall, "kernel_busy_us": busy, "idle_fraction": 1.0 - busy / wall if wall > 0 else None,
        "kernel_count": sum(1 for s, _ in trace.kernels if lo <= s < hi),
        "copy_us": {d: length(ivs) for d, ivs in sorted(per_dir.items())},
        "copy_bytes": dict(sorted(copy_bytes.items())),
        "host_device_copy_us": copy_us, "copy_overlap_us": overlap_us,
        "copy_overlap_fraction": overlap_us / copy_us if copy_us > 0 else None,
        "busy_incl_copies_us": length(kernels + copies),
    }


def combine(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The profiled steps together: times summed, fractions recomputed from the sums (not averaged)."""
    wall = sum(s["wall_us"] for s in steps)
    busy = sum(s["kernel_busy_us"] for s in steps)
    copy_us = sum(s["host_device_copy_us"] for s in steps)
    overlap = sum(s["copy_overlap_us"] for s in steps)
    dirs = sorted({d for s in steps for d in s["copy_us"]})
    return {
        "steps": len(steps), "wall_us": wall, "kernel_busy_us": busy,
        "idle_fraction": 1.0 - busy / wall if wall > 0 else None,
        "copy_us": {d: sum(s["copy_us"].get(d, 0.0) for s in steps) for d in dirs},
        "copy_bytes": {d: sum(s["copy_bytes"].get(d, 0) for s in steps) for d in dirs},
        "host_device_copy_us": copy_us, "copy_overlap_us": overlap,
        "copy_overlap_fraction": overlap / copy_us if copy_us > 0 else None,
    }


def top_kernels(trace: GpuTrace, windows: Sequence[Interval], n: int = 10) -> list[dict[str, Any]]:
    """The `n` kernels with the most time inside the windows (by name; summed over calls)."""
    total: dict[str, list[float]] = {}
    for name, (s, e) in zip(trace.kernel_names, trace.kernels):
        if any(lo <= s < hi for lo, hi in windows):
            t = total.setdefault(name, [0.0, 0])
            t[0] += e - s
            t[1] += 1
    rows = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k[:120], "us": v[0], "calls": int(v[1])} for k, v in rows]


def copy_kinds(trace: GpuTrace, windows: Sequence[Interval]) -> list[dict[str, Any]]:
    """Copies inside the windows by full name (pinned vs pageable matters: a pageable HtoD blocks the host)."""
    kinds: dict[str, list[float]] = {}
    for name, (s, e), nbytes in trace.copy_records:
        if any(lo <= s < hi for lo, hi in windows):
            k = kinds.setdefault(name, [0, 0, 0.0])
            k[0] += 1
            k[1] += nbytes
            k[2] += e - s
    return [{"name": k, "count": int(v[0]), "bytes": int(v[1]), "us": v[2]} for k, v in sorted(kinds.items())]


def verdict(total: dict[str, Any], min_overlap: float, max_exposed: float = 0.05) -> tuple[bool, str]:
    """Whether the copies were hidden well enough, and the sentence that says so.

    Hidden: at least ``min_overlap`` of the copy time ran under kernels, or the copy time no kernel covered is at
    most ``max_exposed`` of the steps' wall time. The second clause is for a GPU that mostly waits on the host
    (the SSDs, the CPU optimizer): with nothing queued to hide under, a copy issued the moment its data is ready
    runs alone, and what it can add to the step is its own exposed time."""
    frac = total["copy_overlap_fraction"]
    if frac is None:
        return False, ("no host<->device copy was seen in the profiled steps: the parameters were not streamed to "
                       "the GPU, or the profiler did not record CUDA activity")
    exposed = (total["host_device_copy_us"] - total["copy_overlap_us"]) / total["wall_us"]
    ok = frac >= min_overlap or exposed <= max_exposed
    return ok, (f"{100 * frac:.1f}% of the {total['host_device_copy_us'] / 1e3:.2f} ms of host<->device copies ran "
                f"while a kernel ran (required: {100 * min_overlap:.0f}%), and the copy time no kernel covered is "
                f"{100 * exposed:.1f}% of the steps' wall time (allowed: {100 * max_exposed:.0f}%)")


# ------------------------------------------------------------------------------------------ the run
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="125m", help="GPT preset (lohan.config.PRESETS)")
    p.add_argument("--layers", type=int, help="override the preset's n_layer")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="engine compute dtype")
    p.add_argument("--act-policy", default="plan", help="engine act_policy (plan, interblock, swap-all, ...)")
    p.add_argument("--cpu-mem", default="16GiB", help="engine cpu_mem")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps first")
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--min-overlap", type=float, default=0.5,
                   help="exit 1 when less than this share of the copy time overlaps kernels")
    p.add_argument("--max-exposed", type=float, default=0.05,
                   help="...or when the copy time no kernel covers is over this share of the step (a GPU that waits "
                        "on the host has no kernels to hide copies under; then this bounds what copies cost)")
    p.add_argument("--nvme", help="directory for the store (default: a fresh one in benchmarks/scratch, deleted)")
    p.add_argument("--out", help="JSON report path (a .md summary is written next to it); default "
                                 "benchmarks/results/gpu_timeline/<machine>.json")
    p.add_argument("--keep-trace", help="also keep the profiler's Chrome trace at this path")
    args = p.parse_args(argv)
    for name in ("batch", "seq", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step profiles the model and allocates the pools)")
    if not 0 <= args.min_overlap <= 1 or not 0 <= args.max_exposed <= 1:
        p.error("--min-overlap and --max-exposed are fractions in [0, 1]")
    return args


def environment() -> dict[str, Any]:
    """This machine and its first GPU (`bench_env.device_environment`)."""
    import torch
    from bench_env import device_environment

    return device_environment(torch.device("cuda", 0))


def run(args: argparse.Namespace, nvme: Path, trace_path: Path) -> dict[str, Any]:
    """Train, profile, classify: the report's measurements."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import lohan
    from lohan.config import EngineConfig, get_model_config

    over: dict[str, Any] = {"seq_len": max(args.seq, get_model_config(args.model).seq_len)}
    if args.layers:
        over["n_layer"] = args.layers
    mcfg = get_model_config(args.model, **over)
    ecfg = EngineConfig(nvme=(str(nvme),), device="cuda", compute_dtype=args.dtype, cpu_mem=args.cpu_mem,
                        act_policy=args.act_policy, lr=1e-4, name="gpu_timeline")
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.warmup + args.steps + 1):
        x = torch.randint(0, mcfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        data.append((x[:, :-1], x[:, 1:]))
    metrics = []
    with lohan.init(mcfg, ecfg, overwrite=True) as engine:
        n = args.warmup + args.steps
        for k in range(args.warmup):
            engine.step(data[k], next_batch=data[k + 1])
            metrics.append(engine.last_stats.to_dict())
            print(f"warm-up step {k + 1}: {engine.last_stats.step_s:.3f} s")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(args.warmup, n):
                with record_function(f"{STEP_PREFIX}{k - args.warmup}"):
                    engine.step(data[k], next_batch=data[k + 1])
                    torch.cuda.synchronize()
                metrics.append(engine.last_stats.to_dict())
        plan = engine.last_stats.activations
    prof.export_chrome_trace(str(trace_path))
    with open(trace_path) as f:
        events = json.load(f)
    trace = classify(events["traceEvents"] if isinstance(events, dict) else events)
    names = [f"{STEP_PREFIX}{k}" for k in range(args.steps)]
    missing = [nm for nm in names if nm not in trace.windows]
    if missing:
        raise RuntimeError(f"the trace has no host range for {missing}: the profiler did not record them")
    windows = [trace.windows[nm] for nm in names]
    steps = [window_stats(trace, w) for w in windows]
    keep = ("step", "loss", "step_s", "tokens_per_s", "tflops", "gpu_mem_gib", "overlap_efficiency", "lanes")
    return {
        "model": {"preset": args.model, "n_layer": mcfg.n_layer, "d_model": mcfg.d_model,
                  "params": mcfg.param_count()},
        "settings": {"batch": args.batch, "seq": args.seq, "dtype": args.dtype, "act_policy": args.act_policy,
                     "cpu_mem": args.cpu_mem, "warmup": args.warmup, "steps": args.steps,
                     "min_overlap": args.min_overlap, "max_exposed": args.max_exposed},
        "activations": {k: plan.get(k) for k in ("policy", "swap", "tiers")},
        "engine_steps": [{k: m.get(k) for k in keep} for m in metrics],
        "unprofiled_step_s_median": statistics.median(m["step_s"] for m in metrics[1:args.warmup])
        if args.warmup > 1 else metrics[0]["step_s"],
        "profiled_step_s": [m["step_s"] for m in metrics[args.warmup:]],
        "per_step": steps, "total": combine(steps),
        "top_kernels": top_kernels(trace, windows), "copy_kinds": copy_kinds(trace, windows),
    }


def write_report(report: dict[str, Any], out: Path) -> None:
    from bench_env import portable

    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=1) + "\n")
    env, tot, s = report["environment"], report["total"], report["settings"]
    ms = 1e-3
    lines = ["# A lohan step on the GPU: kernels, copies, idle time (torch.profiler)", "",
             f"`{env['command']}` on {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}", "",
             f"Model {report['model']['preset']} ({report['model']['n_layer']} layers, d_model "
             f"{report['model']['d_model']}, {report['model']['params'] / 1e6:.0f}M params), {s['dtype']}, "
             f"{s['batch']} x {s['seq']} tokens, act_policy {s['act_policy']} (swap "
             f"{report['activations'].get('swap') or 'block inputs'}, tiers {report['activations'].get('tiers')}); "
             f"{s['warmup']} warm-up steps, then {s['steps']} profiled.", "",
             "| step | wall (ms) | kernel busy (ms) | GPU idle | HtoD (ms, MB) | DtoH (ms, MB) | copies under kernels |",
             "|---|---|---|---|---|---|---|"]
    for k, st in enumerate(report["per_step"] + [tot]):
        label = "all" if k == len(report["per_step"]) else str(k + 1)
        cells = []
        for d in COPY_DIRECTIONS:
            cells.append(f"{st['copy_us'].get(d, 0.0) * ms:.2f}, {st['copy_bytes'].get(d, 0) / 1e6:.1f}")
        frac = st["copy_overlap_fraction"]
        lines.append(f"| {label} | {st['wall_us'] * ms:.1f} | {st['kernel_busy_us'] * ms:.1f} | "
                     f"{100 * st['idle_fraction']:.1f}% | {cells[0]} | {cells[1]} | "
                     f"{'-' if frac is None else f'{100 * frac:.1f}%'} |")
    lines += ["", f"**{'PASS' if report['passed'] else 'FAIL'}**: {report['verdict']}.", "",
              f"Engine step time: {report['unprofiled_step_s_median']:.3f} s unprofiled (median of warm-up steps "
              f"after the first), {', '.join(f'{t:.3f}' for t in report['profiled_step_s'])} s profiled.", "",
              "GPU idle = 1 - (union of kernel intervals) / (the step's host range, which ends with "
              "`torch.cuda.synchronize()`); copies = union of Memcpy HtoD and DtoH intervals; "
              "\"under kernels\" = the share of that copy time during which some kernel ran.", "",
              "What the engine's host side waited on (its lanes, seconds per step, the profiled steps):", "",
              "| step | " + " | ".join(LANES) + " |", "|---" * (len(LANES) + 1) + "|"]
    for rec in report["engine_steps"][-s["steps"]:]:
        from lohan.plan.planner import upgrade_lanes  # a report made before the lanes were the cost model's

        lanes = upgrade_lanes(rec.get("lanes") or {})
        lines.append(f"| {rec['step']} | " + " | ".join(f"{lanes.get(k, 0.0):.3f}" for k in LANES) + " |")
    lines += ["", "| copy | count | MB | ms |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['count']} | {c['bytes'] / 1e6:.1f} | {c['us'] * ms:.2f} |"
              for c in report["copy_kinds"]]
    lines += ["", "| top kernels | calls | ms |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['calls']} | {k['us'] * ms:.2f} |" for k in report["top_kernels"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_timeline: no CUDA device here (torch.cuda.is_available() is False); nothing measured, nothing "
              "written. Run it on a GPU machine (bash benchmarks/gpu_suite.sh --only timeline).")
        return 2
    from bench_env import result_fields, result_path

    out = result_path("gpu_timeline", out=args.out)
    scratch = HERE / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_timeline.", dir=scratch))  # the store (unless --nvme) and the trace
    try:
        report = {"environment": environment(), **result_fields("gpu_timeline"),
                  **run(args, Path(args.nvme) if args.nvme else work / "nvme", work / "trace.json")}
        if args.keep_trace:
            shutil.copyfile(work / "trace.json", args.keep_trace)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed, why = verdict(report["total"], args.min_overlap, args.max_exposed)
    report.update(passed=passed, verdict=why)
    write_report(report, out)
    tot = report["total"]
    print(f"GPU idle {100 * tot['idle_fraction']:.1f}% of {tot['wall_us'] / 1e3:.1f} ms over {tot['steps']} profiled "
          f"step(s); {why}")
    print(f"results: {out} and {out.with_suffix('.md')}")
    if not passed:
        print("gpu_timeline: FAIL: host<->device copies do not overlap compute enough (see the report)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
