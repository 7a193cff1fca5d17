"""End-to-end training throughput vs the number of SSDs (LoHan paper Fig. 10), with the cost model's prediction.

What it does. For every SSD count N of ``--ssds`` (default 1 2 3 4 6) one engine is built whose model states
are striped over the first N directories (store ``ssdscale-n<N>``), and it trains at every batch size of
``--batch-sizes`` (default 1 8 32, seq 256). The (N, batch) points are interleaved in rounds whose order is
rotated every round, so noise from the rest of the machine hits them all alike; after each switch of batch
size the engine re-plans its activations on the first step, which is discarded, and ``--steps`` steps are
measured. Per point: median step time, tokens/s, TFLOPS (model FLOPs: 3 x forward; recomputation not
counted), SSD bytes read/written per step, the engine's lanes, and the planner's predicted step time
beside it (``lohan.plan.planner.estimate`` on the profile the engine measured for that point: its per-op FLOPs
and bytes, the SSD bandwidth it probed on those N directories, and the swap set it ran).

Two inputs of the prediction are measured by the benchmark rather than taken from the engine's profile:

- ``THP_G`` per batch size: the engine measures it once, at its first step, and keeps it for every later
  batch size (``lohan/runtime/activations.py`` caches the ``Hardware``), and a single best-of-4 timing of one block is
  easily 10x off on a shared 2-core machine. The benchmark measures it with the profiler's own function
  (``lohan.runtime.profiler.profile_block``: FLOPs / (forward + backward / 3) of one transformer block of the same
  shape and dtype) once per batch size and round, and uses the median.
- the ``cpu`` lane (CPU AdamW): engine profiles leave it unpriced (rate 0); the benchmark prices it with
  ``lohan.app.fit.measure_cpu_adam`` (the engine's own AdamW kernel and checksums, alone on the cores).

The engine's own estimate (``engine.activations.plan.estimate``) is kept beside it (``engine_plan_s``).

SSDs. Without ``--nvme`` the run is emulated on this machine's one disk: the directories
``benchmarks/scratch/ssd_scaling/ssd0..ssd5`` are each paced to ``--emulate-ssd-gbps`` (default 0.1 GB/s,
reads and writes sharing one clock per directory, as io_bench's scaling part and as an SSD does), so N of
them behave like N independent 0.1 GB/s SSDs while the disk sustains 6 x 0.1 GB/s easily. The default model
(the 13b preset shrunk to 4 layers x d_model 512, vocab 1024: 13.3M parameters, 0.4 GB of SSD traffic per
step) makes one SSD the bottleneck at every batch size, batch 1 SSD-bound up to 6 SSDs and batch 32
compute-bound from 3-4 SSDs on.
Results measured so are labelled emulated.

On your own SSDs (no emulation: ``--nvme`` turns it off unless ``--emulate-ssd-gbps`` is given), one
directory per SSD; N takes the first 1..N of them (default ``--ssds``: 1 .. the number given)::

    .venv/bin/python benchmarks/ssd_scaling.py --nvme /mnt/nvme0/lohan /mnt/nvme1/lohan /mnt/nvme2/lohan \\
        /mnt/nvme3/lohan --model 1b --preset-dims --seq-len 1024 --batch-sizes 1 4 16 --cpu-mem 32GiB

``--preset-dims`` keeps the preset's layers, width, heads and vocabulary (without it they are shrunk to
``--layers``/``--d-model``/``--heads``/``--vocab``). Every SSD count has its own store open at once (two slots
of 16 bytes per parameter each, striped over its N directories: the first directory holds 1 + 1/2 + ... + 1/N
times 32 bytes per parameter, about 2.1 x 32 for four), deleted at the end (``--keep-store`` keeps them).

Headline keys: ``scaling_1_to_4`` (tokens/s at 4 SSDs / at 1, smallest batch: the SSD-bound setting; target
>= 3.0) and ``mean_abs_prediction_error`` (mean over points of |predicted - measured| / measured step time;
target <= 0.15). ZeRO-Infinity is not measured beside it: DeepSpeed's NVMe offload takes one ``nvme_path``,
so N SSDs need a RAID-0 block device under it (mdadm, LVM or device-mapper); the report says what this
machine lacks for that (``zero_infinity``).

Run (from the repository root):
    .venv/bin/python benchmarks/ssd_scaling.py --quick     # ~3 min -> benchmarks/results/ssd_scaling/quick/<machine>.{json,md,png}
    .venv/bin/python benchmarks/ssd_scaling.py             # ~6 min -> benchmarks/results/ssd_scaling/<machine>.{json,md,png}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    cpu_model,
    package_version,
    result_fields,
    result_path,
    save_report,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

STORE_PREFIX = "ssdscale-n"
SCRATCH = REPO / "benchmarks" / "scratch" / "ssd_scaling"
DEFAULT_SSDS = (1, 2, 3, 4, 6)
DEFAULT_EMULATE_GBPS = 0.1
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(rounds=3, steps=2, calib_repeats=2),
    "quick": dict(rounds=1, steps=2, calib_repeats=2),
}
SCALING_TARGET = 3.0
ERROR_TARGET = 0.15


# ------------------------------------------------------------------------------------------- options

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one round (a few minutes)")
    p.add_argument("--nvme", nargs="+", help="SSD directories, one per SSD (default: emulated ones in "
                   "benchmarks/scratch/ssd_scaling); N SSDs use the first N")
    p.add_argument("--ssds", type=int, nargs="+",
                   help=f"SSD counts (default {' '.join(map(str, DEFAULT_SSDS))}; with --nvme: 1 .. the number given)")
    p.add_argument("--emulate-ssd-gbps", type=float, default=None,
                   help=f"pace each directory to this bandwidth (default {DEFAULT_EMULATE_GBPS} without --nvme, "
                        "none with it; 0 = none)")
    p.add_argument("--model", default="13b", help="model preset (shrunk by the next four options)")
    p.add_argument("--preset-dims", action="store_true", help="keep the preset's layers, width, heads, vocab")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--compute-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="0 (default): no clipping, every block's update overlaps the backward (see the report)")
    p.add_argument("--cpu-mem", default="4GiB", help="engine main-memory budget (per SSD count)")
    p.add_argument("--backend", choices=("auto", "aio", "threads"), default="auto")
    p.add_argument("--rounds", type=int, help="rounds; each measures every point (full 3, quick 1)")
    p.add_argument("--steps", type=int, help="measured steps per point and round (2)")
    p.add_argument("--calib-repeats", type=int, help="THP_G measurements per batch size and round (2)")
    p.add_argument("--keep-store", action="store_true", help="leave the stores in the directories")
    p.add_argument("--out", help="JSON report path (default benchmarks/results/ssd_scaling[/quick]/<machine>.json)")
    args = p.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.rounds, args.steps, args.calib_repeats) < 1:
        p.error("--rounds, --steps and --calib-repeats must be >= 1")
    args.emulated_dirs = args.nvme is None
    if args.nvme is None:
        args.ssds = sorted(set(args.ssds or DEFAULT_SSDS))
        args.nvme = [str(SCRATCH / f"ssd{k}") for k in range(max(args.ssds))]
        if args.emulate_ssd_gbps is None:
            args.emulate_ssd_gbps = DEFAULT_EMULATE_GBPS
    else:
        args.ssds = sorted(set(args.ssds or range(1, len(args.nvme) + 1)))
        if len(set(map(os.path.realpath, args.nvme))) != len(args.nvme):
            p.error("--nvme: give each directory once")
    if args.emulate_ssd_gbps is not None and args.emulate_ssd_gbps <= 0:
        args.emulate_ssd_gbps = None
    if min(args.ssds) < 1 or max(args.ssds) > len(args.nvme):
        p.error(f"--ssds must be between 1 and the number of --nvme directories ({len(args.nvme)})")
    if min(args.batch_sizes) < 1 or args.seq_len < 1:
        p.error("--batch-sizes and --seq-len must be >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


# ------------------------------------------------------------------------------------ pure helpers

def rotated(items: Sequence[Any], r: int) -> list[Any]:
    """`items` started at position r (mod len), and reversed on odd rounds: each item meets every place."""
    k = r % len(items)
    out = list(items[k:]) + list(items[:k])
    return out if r % 2 == 0 else out[::-1]


def visit_order(ssds: Sequence[int], batches: Sequence[int], r: int) -> list[tuple[int, int]]:
    """The (N, batch) points of round r: SSD counts rotated, and within each the batch sizes rotated."""
    return [(n, b) for i, n in enumerate(rotated(ssds, r)) for b in rotated(batches, r + i)]


def predict(profile: Any, swap: Sequence[str], thp_g: float | None = None,
            cpu_adam_params_per_s: float | None = None) -> Any:
    """The cost model's estimate (``lohan.plan.planner.estimate``) of `swap` on `profile`, with THP_G and the CPU
    AdamW rate replaced where given (None keeps the profile's)."""
    from lohan.plan.planner import estimate

    hw = profile.hardware
    hw = dataclasses.replace(
        hw, thp_g=hw.thp_g if thp_g is None else thp_g,
        cpu_adam_params_per_s=hw.cpu_adam_params_per_s if cpu_adam_params_per_s is None else cpu_adam_params_per_s)
    return estimate(dataclasses.replace(profile, hardware=hw), swap)


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def scaling(points: Sequence[Mapping[str, Any]], batch: int, n: int, base: int = 1) -> float | None:
    """tokens/s at `n` SSDs over tokens/s at `base` SSDs, at `batch` (None if either is missing)."""
    tps = {p["n_ssds"]: p["tokens_per_s"] for p in points if p["batch"] == batch}
    return tps[n] / tps[base] if n in tps and base in tps else None


def mean_abs_error(points: Sequence[Mapping[str, Any]], key: str = "prediction_error") -> float:
    return statistics.fmean(abs(p[key]) for p in points)


def striped_path_support() -> dict[str, Any]:
    """What this machine offers to put several SSDs under one path (what ZeRO-Infinity's single
    ``nvme_path`` would need): RAID-0 tools and kernel drivers, and root."""
    drivers = set()
    for table in ("/proc/devices", "/proc/misc"):  # a loaded driver registers its name there
        with contextlib.suppress(OSError), open(table) as f:
            drivers.update(line.split()[-1] for line in f if line.strip() and line.split()[0].isdigit())
    return {
        "root": os.geteuid() == 0,
        "mdadm": shutil.which("mdadm") is not None,
        "md_driver": "md" in drivers or os.path.exists("/proc/mdstat"),
        "lvm": shutil.which("lvm") is not None,
        # /dev/mapper/control can exist while the kernel has no driver behind it (open fails with ENODEV)
        "device_mapper": "device-mapper" in drivers,
        "dmsetup": shutil.which("dmsetup") is not None,
        "losetup": shutil.which("losetup") is not None,
        "mkfs_btrfs": shutil.which("mkfs.btrfs") is not None,
    }


def zero_infinity_note(support: Mapping[str, Any], emulated: bool) -> str:
    have = [k for k, v in support.items() if v]
    lacks = [k for k, v in support.items() if not v]
    raid = support["root"] and ((support["mdadm"] and support["md_driver"])
                                or (support["device_mapper"] and (support["lvm"] or support["dmsetup"])))
    why = ("DeepSpeed's NVMe offload (ZeRO-Infinity) takes one nvme_path, so N SSDs must be one RAID-0 block "
           "device under it (mdadm, LVM or device-mapper, as root). ")
    if not raid:
        why += (f"This machine cannot build one: it lacks {', '.join(lacks)} (has {', '.join(have) or 'none'}); "
                + ("the kernel has neither the md nor the device-mapper driver. "
                   if not (support["md_driver"] or support["device_mapper"]) else ""))
    else:
        why += "This machine could build one. "
    if emulated:
        why += ("And the SSDs here are emulated by pacing lohan's io_engine per directory; DeepSpeed's I/O does "
                "not go through it, so a RAID-0 of loop devices over files on the one virtual disk would run at "
                "the disk's own speed, not N x the emulated one: no ZeRO-Infinity point would be comparable. ")
    why += ("With real SSDs: build a RAID-0 of the same N SSDs (mdadm --create --level=0), mount it, and run "
            "benchmarks/vs_deepspeed.py --systems zero-infinity --scratch <the RAID's mount point>.")
    return why


# ------------------------------------------------------------------------------------ measurement

class CpuMeter:
    """Share of all cores busy machine-wide, and of it the part this process did not use (other work)."""

    def __init__(self) -> None:
        self._stat, self._own, self._t0 = self._proc_stat(), self._own_cpu(), time.perf_counter()

    @staticmethod
    def _proc_stat() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    @staticmethod
    def _own_cpu() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        return me.ru_utime + me.ru_stime

    def result(self) -> dict[str, float | None]:
        stat, own, wall = self._proc_stat(), self._own_cpu(), time.perf_counter() - self._t0
        if not (stat and self._stat and stat[1] > self._stat[1] and wall > 0):
            return {"cpu_busy": None, "cpu_other": None}
        busy = (stat[0] - self._stat[0]) / (stat[1] - self._stat[1])
        mine = (own - self._own) / wall / (os.cpu_count() or 1)
        return {"cpu_busy": round(busy, 3), "cpu_other": round(max(0.0, busy - mine), 3)}


def measure_thp(mcfg: Any, batch: int, seq: int, compute_dtype: str, device: str) -> float:
    """FLOP/s of one transformer block of `mcfg` at (batch, seq), the way the engine's profiler measures THP_G
    (``profile_block``: FLOPs / a third of a forward + backward), on a standalone block of the same dtype."""
    import torch

    from lohan.models.gpt import Block
    from lohan.runtime.activation_store import OpTracker
    from lohan.runtime.device import Device
    from lohan.runtime.profiler import profile_block
    from lohan.store.states import DTYPES

    dev = Device(device)
    dtype = DTYPES[compute_dtype]
    block = Block(mcfg).to(device=dev.torch, dtype=dtype)
    for p in block.parameters():
        p.requires_grad_(True)
    x = torch.randn(batch, seq, mcfg.d_model, device=dev.torch, dtype=dtype)
    tracker = OpTracker([block])
    try:
        _, _, flops, seconds = profile_block(block, block, x, tracker, dev, lambda: dev.autocast(dtype))
    finally:
        tracker.remove()
    return flops / seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import lohan
    from lohan.app.fit import measure_cpu_adam
    from lohan.config import EngineConfig, get_model_config

    overrides = {} if args.preset_dims else dict(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                                 vocab_size=args.vocab)
    mcfg = get_model_config(args.model, **overrides, seq_len=max(args.seq_len, 1))
    load_start = os.getloadavg()
    adam_rate = measure_cpu_adam(compute_dtype=args.compute_dtype, checksums=True)
    print(f"model {mcfg.name}: {mcfg.n_layer} layers, d_model {mcfg.d_model}, vocab {mcfg.vocab_size}, "
          f"{mcfg.param_count() / 1e6:.1f}M params; CPU AdamW {adam_rate / 1e9:.3g} G params/s; SSDs "
          + (f"emulated at {args.emulate_ssd_gbps} GB/s each" if args.emulate_ssd_gbps else "not throttled"),
          flush=True)
    batches = {}
    for b in args.batch_sizes:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(0, mcfg.vocab_size, (b, args.seq_len + 1), generator=g)
        batches[b] = (ids[:, :-1], ids[:, 1:])
    engines: dict[int, Any] = {}
    init_s: dict[int, float] = {}
    first_step_s: dict[int, float] = {}
    shape: dict[int, int | None] = {}
    samples: dict[tuple[int, int], list[dict[str, Any]]] = {(n, b): [] for n in args.ssds for b in args.batch_sizes}
    profiles: dict[tuple[int, int], Any] = {}
    plans: dict[tuple[int, int], Any] = {}
    thp: dict[int, list[float]] = {b: [] for b in args.batch_sizes}
    backend = None
    try:
        for n in args.ssds:
            ecfg = EngineConfig(nvme=tuple(args.nvme[:n]), name=f"{STORE_PREFIX}{n}", cpu_mem=args.cpu_mem,
                                compute_dtype=args.compute_dtype, backend=args.backend,
                                emulate_ssd_gbps=args.emulate_ssd_gbps, max_grad_norm=args.max_grad_norm, lr=1e-4,
                                resident_mem=0)  # the states stream through the SSDs, as the planner prices them
            t0 = time.perf_counter()
            engines[n] = lohan.init(mcfg, ecfg, overwrite=True)
            init_s[n] = time.perf_counter() - t0
            shape[n] = None
            backend = engines[n].store.volume.stats()["backend"]
            print(f"store over {n} SSD dir(s) built in {init_s[n]:.1f} s ({backend})", flush=True)
        for r in range(args.rounds):
            for b in rotated(args.batch_sizes, r):
                for _ in range(args.calib_repeats):
                    thp[b].append(measure_thp(mcfg, b, args.seq_len, args.compute_dtype, engines[args.ssds[0]].device.type))
            print(f"round {r + 1}/{args.rounds}: THP_G " + ", ".join(
                f"batch {b} {statistics.median(v) / 1e12:.3f}" for b, v in thp.items()) + " TFLOP/s", flush=True)
            for n, b in visit_order(args.ssds, args.batch_sizes, r):
                eng = engines[n]
                if shape[n] != b:  # new shape: the engine profiles and re-plans on this step; not measured
                    t0 = time.perf_counter()
                    eng.step(batches[b])
                    first_step_s.setdefault(n, time.perf_counter() - t0)
                    shape[n] = b
                    profiles[n, b], plans[n, b] = eng.activations.profile, eng.activations.plan
                for _ in range(args.steps):
                    meter = CpuMeter()
                    eng.step(batches[b])
                    m = eng.last_stats
                    samples[n, b].append({
                        "round": r, "n_ssds": n, "batch": b, "step_s": m.step_s, "tokens": m.tokens,
                        "tokens_per_s": m.tokens_per_s, "tflops": m.tflops,
                        "ssd_read_bytes": m.ssd_read_bytes, "ssd_write_bytes": m.ssd_write_bytes,
                        "lanes": m.lanes, "loss": m.loss, "load_1min": os.getloadavg()[0], **meter.result()})
                last = samples[n, b][-args.steps:]
                print(f"round {r + 1}/{args.rounds} N={n} batch {b:>3}: "
                      + " ".join(f"{s['step_s']:.3f}" for s in last) + " s/step  "
                      f"({statistics.median(s['tokens_per_s'] for s in last):.0f} tokens/s)", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
        if not args.keep_store:
            for d in args.nvme:
                for f in Path(d).glob(f"{STORE_PREFIX}*"):
                    f.unlink()

    thp_med = {b: statistics.median(v) for b, v in thp.items()}
    points = []
    for n in args.ssds:
        for b in args.batch_sizes:
            s = samples[n, b]
            step = statistics.median(x["step_s"] for x in s)
            tokens = s[0]["tokens"]
            flops = s[0]["tflops"] * s[0]["step_s"] if s[0]["tflops"] else None  # TFLOP per step
            prof, plan = profiles[n, b], plans[n, b]
            est = predict(prof, plan.swap, thp_g=thp_med[b], cpu_adam_params_per_s=adam_rate)
            lanes = {k: statistics.median(x["lanes"][k] for x in s) for k in s[0]["lanes"]}
            points.append({
                "n_ssds": n, "batch": b, "tokens_per_step": tokens,
                "measured_s": step, "samples_s": [x["step_s"] for x in s],
                "tokens_per_s": tokens / step, "tflops": flops / step if flops else None,
                "predicted_s": est.t_iter, "predicted_tokens_per_s": tokens / est.t_iter,
                "predicted_tflops": flops / est.t_iter if flops else None,
                "prediction_error": relative_error(est.t_iter, step),
                "predicted_bottleneck": f"{est.bottleneck_f}/{est.bottleneck_b}",
                "predicted_lanes_f": est.lanes_f, "predicted_lanes_b": est.lanes_b,
                "predicted_fill": [est.fill_f, est.fill_b],
                "engine_plan_s": plan.estimate.t_iter,
                "engine_plan_error": relative_error(plan.estimate.t_iter, step),
                "swap": list(plan.swap),
                "profile_ssd_gbps": [prof.hardware.bw_s2m / 1e9, prof.hardware.bw_m2s / 1e9],
                "engine_thp_tflops": prof.hardware.thp_g / 1e12,
                "ssd_read_bytes": statistics.median(x["ssd_read_bytes"] for x in s),
                "ssd_write_bytes": statistics.median(x["ssd_write_bytes"] for x in s),
                "predicted_ssd_bytes": [est.traffic["ssd_read"], est.traffic["ssd_write"]],
                "measured_lanes": lanes,
                "cpu_other_median": statistics.median(x["cpu_other"] or 0.0 for x in s),
            })
    for p in points:
        p["speedup_vs_1"] = scaling(points, p["batch"], p["n_ssds"], args.ssds[0])
    b0 = args.batch_sizes[0]
    scale14 = scaling(points, b0, 4, 1)
    mae = mean_abs_error(points)
    support = striped_path_support()
    load_end = os.getloadavg()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "lohan", "io_engine",
                            "benchmarks/ssd_scaling.py"], capture_output=True, text=True)
    noisy = [p for p in points if p["cpu_other_median"] > 0.25]
    return {
        "benchmark": "ssd_scaling",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "scaling_1_to_4": scale14,
        "mean_abs_prediction_error": mae,
        "targets": {"scaling_1_to_4": SCALING_TARGET, "mean_abs_prediction_error": ERROR_TARGET},
        "targets_met": {"scaling_1_to_4": scale14 is not None and scale14 >= SCALING_TARGET,
                        "mean_abs_prediction_error": mae <= ERROR_TARGET},
        "engine_plan_mean_abs_error": mean_abs_error(points, "engine_plan_error"),
        "scaling_batch": b0,
        "scaling_by_batch": {b: {n: scaling(points, b, n, args.ssds[0]) for n in args.ssds} for b in args.batch_sizes},
        "points": points,
        "records": [x for n in args.ssds for b in args.batch_sizes for x in samples[n, b]],
        "calibration": {"thp_tflops": {b: [t / 1e12 for t in v] for b, v in thp.items()},
                        "thp_tflops_median": {b: t / 1e12 for b, t in thp_med.items()},
                        "cpu_adam_params_per_s": adam_rate},
        "model": {"preset": args.model, "n_layer": mcfg.n_layer, "d_model": mcfg.d_model, "n_head": mcfg.n_head,
                  "vocab_size": mcfg.vocab_size, "seq_len": args.seq_len, "params": mcfg.param_count(),
                  "flops_per_token": mcfg.flops_per_token(args.seq_len)},
        "settings": {"ssds": args.ssds, "batch_sizes": args.batch_sizes, "seq_len": args.seq_len,
                     "emulated": bool(args.emulate_ssd_gbps), "emulate_ssd_gbps": args.emulate_ssd_gbps,
                     "emulated_dirs": args.emulated_dirs, "nvme": args.nvme,
                     "compute_dtype": args.compute_dtype, "max_grad_norm": args.max_grad_norm,
                     "cpu_mem": args.cpu_mem, "backend": backend, "rounds": args.rounds, "steps": args.steps,
                     "calib_repeats": args.calib_repeats, "act_policy": "plan", "mode": "optimized",
                     "store_init_s": init_s, "first_step_s": first_step_s},
        "zero_infinity": {"measured": False, "striped_path_support": support,
                          "why": zero_infinity_note(support, bool(args.emulate_ssd_gbps))},
        "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "kernel": platform.release(), "machine": platform.machine(),
                     "disk_free_bytes": shutil.disk_usage(args.nvme[0]).free},
        "versions": {"python": platform.python_version(), "torch": package_version("torch"),
                     "deepspeed": package_version("deepspeed"), "numpy": package_version("numpy"),
                     "git_commit": commit.stdout.strip() or None,
                     "git_dirty": [ln[3:] for ln in dirty.stdout.splitlines()]},
        "load_average": {"start": list(load_start), "end": list(load_end)},
        "notes": ([f"{len(noisy)} point(s) ran with over 25 % of the cores busy with other work (median per "
                   "step): " + ", ".join(f"N={p['n_ssds']} b={p['batch']}" for p in noisy)] if noisy else []),
    }


# ------------------------------------------------------------------------------------------ report

def write_markdown(report: dict[str, Any], path: Path) -> None:
    s, m, hw, v = report["settings"], report["model"], report["hardware"], report["versions"]
    ssd = (f"SSDs emulated: each directory paced to {s['emulate_ssd_gbps']} GB/s (reads and writes share it), "
           "all on one disk" if s["emulated"] else "SSDs: the given directories at their own speed")
    sc, mae = report["scaling_1_to_4"], report["mean_abs_prediction_error"]
    ok = report["targets_met"]
    lines = [
        "# ssd_scaling: training throughput vs number of SSDs (LoHan Fig. 10)", "",
        f"`{report['command']}` — {report['date']}, commit {str(v['git_commit'])[:10]}", "",
        f"{hw['cpu']} ({hw['cores']} cores, {hw['ram_bytes'] / 2**30:.0f} GiB), GPU: {hw['gpu'] or 'none (the CPU computes)'}; "
        f"python {v['python']}, torch {v['torch']}, deepspeed {v['deepspeed']}; io backend {s['backend']}. "
        f"Load average at start {report['load_average']['start'][0]:.2f}, at end {report['load_average']['end'][0]:.2f}.", "",
        f"Model: {m['preset']} shape, {m['n_layer']} layers, d_model {m['d_model']}, vocab {m['vocab_size']}, "
        f"{m['params'] / 1e6:.1f}M params; seq {m['seq_len']}; {s['compute_dtype']}; max_grad_norm "
        f"{s['max_grad_norm']}; {ssd}. {s['rounds']} round(s) x {s['steps']} measured step(s) per point, interleaved.", "",
        f"**scaling_1_to_4 = {sc:.2f}**" if sc is not None else "**scaling_1_to_4 = n/a** (needs 1 and 4 SSDs)",
        f"(tokens/s at 4 SSDs / at 1, batch {report['scaling_batch']}; target >= {report['targets']['scaling_1_to_4']}: "
        f"{'met' if ok['scaling_1_to_4'] else 'not met'}), "
        f"**mean_abs_prediction_error = {mae:.3f}** (target <= {report['targets']['mean_abs_prediction_error']}: "
        f"{'met' if ok['mean_abs_prediction_error'] else 'not met'}; the engine's own plan estimate: "
        f"{report['engine_plan_mean_abs_error']:.3f})", "",
        "| SSDs | batch | measured s/step | tokens/s | TFLOPS | x vs 1 SSD | predicted s | predicted tokens/s | "
        "error | predicted bottleneck f/b | SSD read / write MB per step (predicted) | compute s | other CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(report["points"], key=lambda p: (p["batch"], p["n_ssds"])):
        lines.append(
            f"| {p['n_ssds']} | {p['batch']} | {p['measured_s']:.3f} | {p['tokens_per_s']:.0f} | "
            f"{p['tflops'] or 0:.4f} | {p['speedup_vs_1']:.2f} | {p['predicted_s']:.3f} | "
            f"{p['predicted_tokens_per_s']:.0f} | {p['prediction_error']:+.1%} | {p['predicted_bottleneck']} | "
            f"{p['ssd_read_bytes'] / 1e6:.0f} / {p['ssd_write_bytes'] / 1e6:.0f} "
            f"({p['predicted_ssd_bytes'][0] / 1e6:.0f} / {p['predicted_ssd_bytes'][1] / 1e6:.0f}) | "
            f"{p['measured_lanes']['compute']:.3f} | {p['cpu_other_median']:.2f} |")
    cal = report["calibration"]
    lines += [
        "", "Prediction: `lohan.plan.planner.estimate` on the profile the engine measured at each point (per-op FLOPs "
        "and bytes, SSD bandwidth probed on those N directories, the swap set it ran), with THP_G measured per "
        "batch size by `profiler.profile_block` (median TFLOP/s: " + ", ".join(
            f"batch {b} {t:.3f}" for b, t in cal["thp_tflops_median"].items())
        + f") and the CPU AdamW lane priced at {cal['cpu_adam_params_per_s'] / 1e9:.3g} G params/s "
        "(`fit.measure_cpu_adam`). Error = (predicted - measured) / measured step time. `other CPU` = median share "
        "of all cores busy with other processes during the point's steps.", "",
        f"max_grad_norm {s['max_grad_norm']}: " + (
            "no clipping, so every block's AdamW runs during the backward as its gradients arrive (active "
            "gradient offloading, the paper's schedule; LoHan drops clipping too). With clipping (the engine's "
            "default 1.0) a randomly initialized model is clipped every step and its update is deferred until the "
            "norm is known, which moves the optimizer's SSD traffic after the backward."
            if not s["max_grad_norm"] else "clipping on: clipped steps defer their update after the backward."), "",
        "ZeRO-Infinity at the same SSD counts: not measured. " + report["zero_infinity"]["why"], "",
    ]
    lines += [f"Note: {n}" for n in report["notes"]]
    path.write_text("\n".join(lines) + "\n")


def write_plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib unavailable: no plot", file=sys.stderr)
        return False
    pts = report["points"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, b in enumerate(report["settings"]["batch_sizes"]):
        row = sorted((p for p in pts if p["batch"] == b), key=lambda p: p["n_ssds"])
        x = [p["n_ssds"] for p in row]
        c = colors[i % len(colors)]
        ax1.plot(x, [p["tokens_per_s"] for p in row], "o-", color=c, label=f"batch {b} measured")
        ax1.plot(x, [p["predicted_tokens_per_s"] for p in row], "s--", color=c, mfc="none", label=f"batch {b} predicted")
        ax2.plot(x, [p["tflops"] for p in row], "o-", color=c, label=f"batch {b}")
        ax2.plot(x, [p["predicted_tflops"] for p in row], "s--", color=c, mfc="none")
        ax3.plot(x, [p["speedup_vs_1"] for p in row], "o-", color=c, label=f"batch {b}")
        ax3.plot(x, [p["predicted_tokens_per_s"] / row[0]["tokens_per_s"] for p in row], "s--", color=c, mfc="none")
    ssds = report["settings"]["ssds"]
    ax3.plot(ssds, [n / ssds[0] for n in ssds], ":", color="gray", label="linear")
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("SSDs" + (" (emulated)" if report["settings"]["emulated"] else ""))
        ax.set_xticks(report["settings"]["ssds"])
        ax.grid(alpha=0.3)
    ax1.set_ylabel("tokens/s")
    ax2.set_ylabel("TFLOPS (model FLOPs)")
    ax3.set_ylabel(f"tokens/s / measured tokens/s at {ssds[0]} SSD(s)")
    ax3.set_title("speedup (dashed: predicted)")
    ax3.legend(fontsize=7)
    sc = report["scaling_1_to_4"]
    ax1.set_title(f"throughput; 1->4 SSDs x{sc:.2f}" if sc else "throughput")
    ax2.set_title(f"TFLOPS; mean |pred err| {report['mean_abs_prediction_error']:.3f} (dashed: predicted)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for d in args.nvme:
        os.makedirs(d, exist_ok=True)
    out = result_path("ssd_scaling", {"quick": args.quick}, args.out)
    t0 = time.perf_counter()
    report = {**run(args), **result_fields("ssd_scaling", {"quick": args.quick})}
    report["wall_s"] = time.perf_counter() - t0
    report = save_report(report, out, write_markdown, write_plot)
    sc = report["scaling_1_to_4"]
    print(f"scaling_1_to_4 {sc if sc is None else round(sc, 3)}  mean_abs_prediction_error "
          f"{report['mean_abs_prediction_error']:.3f}  ({report['wall_s']:.0f} s) -> {out}")
    if args.emulated_dirs and not args.keep_store:  # the scratch directories this run made: left empty
        for d in map(Path, args.nvme):
            (d / ".lohan.lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            SCRATCH.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
