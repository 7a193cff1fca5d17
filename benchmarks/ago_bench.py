"""Active gradient offloading ablation (LoHan paper §IV-C, Fig. 10): serial vs naive vs optimized.

What it measures. One model's states are laid out and initialized once on the NVMe directories
(`--nvme`); then the three optimizer pipelines of DESIGN.md §4.3 train that *same model on the same
store*, the engine being closed and re-opened with `resume=True` and another `mode` between them
(the mode only changes the optimizer pipeline, so each run continues from the last committed step):

- ``serial``   all optimizer work after the whole backward (ZeRO-Infinity style);
- ``naive``    per block READ(i) -> ADAM(i) -> WRITE(i), overlapped with the backward only;
- ``optimized`` READ(i-1) issued before WRITE(i): SSD reads, SSD writes, CPU Adam and backward at once.

The modes are interleaved in rounds (round r runs every mode, in an order rotated by r), because the
disk is noisy; every opening of the engine runs `--warmup-steps` discarded steps (its buffer pools are
allocated and page-locked on first use) and then `--steps` measured ones. Per mode the report gives the
median step time, tokens/s, the median seconds of each lane of `engine.last_stats.lanes`
(compute, ssd_read, ssd_write, cpu_adam, param_wait, optimizer_tail), SSD GB/s, the engine's
``overlap_efficiency = max(compute, ssd_read, ssd_write, cpu_adam) / T_iter`` and the peak RSS.

Diagnostics that the engine's lanes cannot show are added, because on this kind of machine the
SSD read and write lanes share one physical disk and compute and CPU Adam share the same cores:

- ``disk_busy``: seconds the block device holding the store was busy with any I/O during the step
  (``io_ticks`` of /proc/diskstats, the union of reads and writes; includes other processes' I/O);
- ``cpu``: this process's CPU seconds (all threads), everything else's, and idle, as fractions of
  cores x T_iter, i.e. how saturated the cores were and whether something else ran;
- the compute thread's time outside the lanes: blocked acquiring a gradient or parameter buffer
  (the pipeline or prefetch is behind), and the commit (fsync + commit record).

Headline keys (for ``optimized``): ``speedup_vs_serial`` and ``speedup_vs_naive`` (ratio of median step
times; the medians of the per-round paired ratios are reported too), ``overlap_efficiency`` and
``peak_rss_gib`` with the budget it is checked against: ``cpu_mem`` + the model's activations (an
analytic estimate, see `activation_bytes`) + the process's RSS before the engine was built. Also
``efficiency_vs_ideal`` = max(serial's compute lane, optimized's disk_busy, CPU Adam) / optimized T_iter:
the engine's metric uses the optimized step's *own* compute lane, which grows when CPU Adam and the
I/O threads share the cores with it, so it does not show what the overlap costs; this one does.

Run (from the repository root; nothing else should use the disk meanwhile):
    .venv/bin/python benchmarks/ago_bench.py --quick --out benchmarks/results/ago_bench_quick.json  # ~2.5 min
    .venv/bin/python benchmarks/ago_bench.py --out benchmarks/results/ago_bench.json                # ~6 min
    .venv/bin/python benchmarks/ago_bench.py --quick --seq-len 256     # SSD-bound: naive's pipeline exposed
    .venv/bin/python benchmarks/ago_bench.py --model 1b --rounds 2 --steps 1 --modes naive optimized
A markdown summary is written next to the JSON (same stem, ``.md``). The slab files are deleted at the
end unless ``--keep-store``. Keys of the report: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench_env import cpu_model, package_version, portable  # sibling module (the script's own directory)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

GiB = 1 << 30
STORE_NAME = "agobench"  # slab files: <nvme dir>/agobench.slab (+ .volume.json, .store.json, .commit.json)
LANES = ("compute", "ssd_read", "ssd_write", "cpu_adam", "param_wait", "optimizer_tail")
BOTTLENECK_LANES = ("compute", "ssd_read", "ssd_write", "cpu_adam")  # the engine's overlap_efficiency
ALL_MODES = ("serial", "naive", "optimized")

# Run sizes, declared as data; the CLI overrides any field. The model and batch were chosen by
# measuring candidates on the 2-core / one-disk development VM (benchmarks/README.md): 350m at batch 1 x
# seq 512 makes a step's compute (~3.5-4 s: forward, recompute, backward) comparable to its SSD traffic
# (~10 GB: 12 B/param read for P32,m,v, 2 x 2 B/param for P16, 14 B/param written; ~3.5 s of disk time).
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(model="350m", seq_len=512, batch_size=1, micro_batches=1, rounds=5, steps=2, warmup_steps=1),
    "quick": dict(model="350m", seq_len=512, batch_size=1, micro_batches=1, rounds=3, steps=1, warmup_steps=1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (< 5 min including store init)")
    p.add_argument("--model", help="model preset (lohan.config.PRESETS); default from the run preset")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--micro-batches", type=int, help="gradient accumulation factor")
    p.add_argument("--rounds", type=int, help="rounds; each runs every mode once (order rotated)")
    p.add_argument("--steps", type=int, help="measured steps per mode per round")
    p.add_argument("--warmup-steps", type=int, help="discarded steps after each (re)opening of the engine")
    p.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(ALL_MODES))
    p.add_argument("--nvme", nargs="+", default=[str(REPO / "benchmarks" / "scratch" / "ago")],
                   help="store directories (one per SSD)")
    p.add_argument("--cpu-mem", default="auto",
                   help="engine main-memory budget, e.g. 6GiB; auto = the largest need of the modes run, "
                        "rounded up to 0.25 GiB")
    p.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--backend", choices=("auto", "aio", "threads"), default="auto")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--max-inflight-blocks", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the process (default: leave torch's choice)")
    p.add_argument("--keep-store", action="store_true", help="do not delete the slab files at the end")
    p.add_argument("--out", help="JSON report path (default benchmarks/results/ago_bench_<timestamp>.json)")
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("seq_len", "batch_size", "micro_batches", "rounds", "steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.batch_size % args.micro_batches:
        p.error("--batch-size must be divisible by --micro-batches")
    return args


# ------------------------------------------------------------------------------------- probes
class RssSampler:
    """Peak resident set size of this process, sampled every `interval` s in a background thread.

    `ru_maxrss` covers the process's whole life (store init included), so per-phase peaks need sampling.
    """

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._lock = threading.Lock()
        self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> int:
        rss = self._proc.memory_info().rss
        with self._lock:
            self._peak = max(self._peak, rss)
        return rss

    def take_peak(self) -> int:
        """The peak since the previous call (or since start), then start a new window."""
        current = self.sample()
        with self._lock:
            peak, self._peak = self._peak, current
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _block_device(path: str) -> str | None:
    """Name in /proc/diskstats of the block device holding `path` (a partition maps to itself)."""
    try:
        st = os.stat(path)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if int(parts[0]) == major and int(parts[1]) == minor:
                    return parts[2]
    except (OSError, ValueError, IndexError):
        pass
    return None


def _disk(device: str | None) -> tuple[float, int] | tuple[None, None]:
    """Cumulative (seconds `device` had I/O in flight, bytes read + written) from /proc/diskstats.

    Fields (Documentation/admin-guide/iostats.rst): sectors read = 6, sectors written = 10 (512 B
    each), io_ticks = 13 (ms).
    """
    if device is not None:
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if parts[2] == device:
                    return int(parts[12]) / 1000.0, (int(parts[5]) + int(parts[9])) * 512
    return None, None


def _counters(device: str | None) -> dict[str, float | None]:
    """Cumulative CPU and disk counters; the difference over a step is attributed to that step."""
    import psutil

    t, m = os.times(), psutil.cpu_times()
    return {"proc_user": t.user, "proc_sys": t.system,
            # the whole machine: busy includes interrupts and kernel workers (direct-I/O completions
            # run in kworkers) and steal, which no process is charged for
            "machine_busy": m.user + m.nice + m.system + m.irq + m.softirq + getattr(m, "steal", 0.0),
            "machine_idle": m.idle + getattr(m, "iowait", 0.0),
            **dict(zip(("disk_busy", "disk_bytes"), _disk(device)))}


class WaitMeter:
    """Times the calls the engine's compute thread makes that can block outside the engine's lanes.

    Wraps, on this engine instance only, the gradient and parameter buffer pools' `acquire` (the
    compute thread blocks there when the optimizer pipeline or the prefetch is behind) and the
    store's `commit` (fsync + atomic commit record at the end of the step). Engine code is unchanged.
    """

    def __init__(self, engine: Any) -> None:
        self.seconds = {"grad_buffer_wait": 0.0, "param_buffer_wait": 0.0, "commit": 0.0}
        compute_thread = threading.get_ident()
        for key, owner, name in (("grad_buffer_wait", engine.grads_pool, "acquire"),
                                 ("param_buffer_wait", engine.params_pool, "acquire"),
                                 ("commit", engine.store, "commit")):
            setattr(owner, name, self._timed(key, getattr(owner, name), compute_thread))

    def _timed(self, key: str, fn: Any, thread: int) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if threading.get_ident() == thread:
                    self.seconds[key] += time.perf_counter() - t0
        return call

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


# ------------------------------------------------------------------------------------- model
def activation_bytes(mcfg: Any, batch: int, seq: int, micro_batches: int, compute_dtype: str) -> dict[str, int]:
    """Analytic estimate of the activation memory one step holds (the part of RSS outside `cpu_mem`).

    Forward keeps only block inputs (n_layer + 1 tensors of [b, s, d] in the compute dtype, every
    micro-batch); backward recomputes one block at a time, whose peak is dominated by the MLP
    ([b, s, 4d] input, GELU output and their gradients) or, for the head, the fp32 logits over the
    vocabulary, their softmax and gradient. The block's device parameters are counted in `cpu_mem`
    (they are views of the engine's buffers on a CPU device).
    """
    item = 2 if compute_dtype == "bf16" else 4
    b = batch // micro_batches
    d, h, v = mcfg.d_model, mcfg.mlp_hidden, mcfg.vocab_size
    kept = (mcfg.n_layer + 1) * batch * seq * d * item
    attn = b * mcfg.n_head * seq * seq * 4 * 2  # scores + softmax (fp32 worst case) of one micro-batch
    block = b * seq * (8 * d + 4 * h) * item + attn
    head = 3 * b * seq * v * 4  # logits (fp32 for the loss), softmax, grad of logits
    recompute = max(block, head)
    return {"kept_inputs": kept, "recompute_peak": recompute, "total": kept + recompute}


# ------------------------------------------------------------------------------------- run
def _metrics_record(engine: Any, m: Any, mode: str, rnd: int, k: int, warmup: bool, c0: dict, c1: dict,
                    w0: dict, w1: dict, rss_peak: int, wall_s: float) -> dict:
    ago = engine.offloader
    lanes = {name: float(m.lanes[name]) for name in LANES}
    step_s = float(m.step_s)
    cores = os.cpu_count() or 1
    d = {k: (None if c0[k] is None or c1[k] is None else c1[k] - c0[k]) for k in c0}
    proc = d["proc_user"] + d["proc_sys"]
    waits = {k: w1[k] - w0[k] for k in w0}
    accounted = lanes["compute"] + lanes["param_wait"] + lanes["optimizer_tail"] + sum(waits.values())
    return {
        "mode": mode, "round": rnd, "index": k, "warmup": warmup, "step": m.step, "loss": m.loss,
        "step_s": step_s, "wall_s": wall_s, "tokens_per_s": m.tokens_per_s, "tflops": m.tflops,
        "ssd_read_gbps": m.ssd_read_gbps, "ssd_write_gbps": m.ssd_write_gbps,
        "ssd_read_bytes": m.ssd_read_bytes, "ssd_write_bytes": m.ssd_write_bytes,
        "lanes": lanes, "overlap_efficiency": m.overlap_efficiency,
        # Where the compute thread's step time went besides the engine's lanes (WaitMeter), and the
        # rest: forward/backward Python overhead, releasing/acquiring resident blocks, metrics.
        "compute_thread": {**{f"{k}_s": v for k, v in waits.items()}, "unaccounted_s": step_s - accounted},
        # The optimizer thread's own accounting (lohan.runtime.offload.GradOffloader): idle waiting for
        # gradients, waiting for its READs, and its wall time from first to last block.
        "ago": {"grad_wait_s": ago.grad_wait_s, "read_wait_s": ago.read_wait_s, "busy_s": ago.busy_s},
        "disk_busy_s": d["disk_busy"],
        # bytes the disk moved that this step's engine did not: other processes (another benchmark)
        "other_disk_bytes": (None if d["disk_bytes"] is None
                             else max(0, d["disk_bytes"] - m.ssd_read_bytes - m.ssd_write_bytes)),
        "cpu": {"proc_user_s": d["proc_user"], "proc_sys_s": d["proc_sys"],
                # fraction of all cores: used by this process; by anything else (other processes,
                # interrupts, kernel workers, steal); idle. A step with a large `other` had fewer cores.
                "proc_busy": proc / (cores * step_s),
                "other_busy": max(0.0, d["machine_busy"] - proc) / (cores * step_s),
                "idle": d["machine_idle"] / (cores * step_s)},
        "rss_peak_bytes": rss_peak, "cpu_mem_gib_end": m.cpu_mem_gib,
        "max_resident_blocks": m.max_resident_blocks,
    }


def run_mode(lohan: Any, mcfg: Any, ecfg: Any, mode: str, rnd: int, args: argparse.Namespace,
             batch: tuple, device: str | None, sampler: RssSampler, log: Any) -> tuple[list[dict], dict]:
    """Open the store in `mode`, run warm-up + measured steps, close; returns the step records."""
    engine = lohan.init(mcfg, ecfg.with_overrides(mode=mode), resume=True)
    meter = WaitMeter(engine)
    records = []
    try:
        for k in range(args.warmup_steps + args.steps):
            warmup = k < args.warmup_steps
            sampler.take_peak()
            c0, w0, t0 = _counters(device), meter.snapshot(), time.perf_counter()
            loss = engine.step(batch)
            wall = time.perf_counter() - t0
            c1, w1 = _counters(device), meter.snapshot()
            rec = _metrics_record(engine, engine.last_stats, mode, rnd, k, warmup, c0, c1, w0, w1,
                                  sampler.take_peak(), wall)
            records.append(rec)
            ln, ct = rec["lanes"], rec["compute_thread"]
            log(f"  round {rnd} {mode:9s} {'warm-up' if warmup else 'step   '} {rec['step']:3d}: "
                f"{rec['step_s']:6.2f} s  loss {loss:6.3f} | compute {ln['compute']:5.2f} read {ln['ssd_read']:5.2f}"
                f" write {ln['ssd_write']:5.2f} adam {ln['cpu_adam']:5.2f} p-wait {ln['param_wait']:5.2f}"
                f" tail {ln['optimizer_tail']:5.2f} | gbuf {ct['grad_buffer_wait_s']:5.2f}"
                f" commit {ct['commit_s']:5.2f} rest {ct['unaccounted_s']:5.2f} | disk {_fmt(rec['disk_busy_s'])}"
                f" cpu {rec['cpu']['proc_busy']:.2f}/{rec['cpu']['other_busy']:.2f}/{rec['cpu']['idle']:.2f}"
                f" other-io {_fmt(None if rec['other_disk_bytes'] is None else rec['other_disk_bytes'] / 1e9, '.2f')} GB"
                f" | eff {rec['overlap_efficiency']:.2f} rss {rec['rss_peak_bytes'] / GiB:.2f} GiB")
        pools = {name: getattr(engine, f"{name}_pool").stats() for name in ("params", "grads", "records")}
    finally:
        engine.close()
    return records, pools


def summarize(records: list[dict], modes: list[str]) -> dict[str, dict]:
    out = {}
    for mode in modes:
        rs = [r for r in records if r["mode"] == mode and not r["warmup"]]
        if not rs:
            continue
        med = statistics.median
        step = med([r["step_s"] for r in rs])
        lanes = {name: med([r["lanes"][name] for r in rs]) for name in LANES}
        disks = [r["disk_busy_s"] for r in rs if r["disk_busy_s"] is not None]
        bottleneck = max(BOTTLENECK_LANES, key=lambda n: lanes[n])
        disk = med(disks) if disks else None
        out[mode] = {
            "steps": len(rs), "step_s": step, "step_s_all": [r["step_s"] for r in rs],
            "step_s_min": min(r["step_s"] for r in rs), "step_s_max": max(r["step_s"] for r in rs),
            "tokens_per_s": med([r["tokens_per_s"] for r in rs]), "tflops": med([r["tflops"] for r in rs]),
            "lanes": lanes,
            # the engine's metric, per step then the median; and the same formula on the median lanes
            "overlap_efficiency": med([r["overlap_efficiency"] for r in rs]),
            "overlap_efficiency_of_medians": lanes[bottleneck] / step,
            "bottleneck_lane": bottleneck,
            "ssd_read_gbps": med([r["ssd_read_gbps"] for r in rs]),
            "ssd_write_gbps": med([r["ssd_write_gbps"] for r in rs]),
            "ssd_read_bytes": med([r["ssd_read_bytes"] for r in rs]),
            "ssd_write_bytes": med([r["ssd_write_bytes"] for r in rs]),
            "disk_busy_s": disk,
            "disk_gbps": ((med([r["ssd_read_bytes"] + r["ssd_write_bytes"] for r in rs]) / disk / 1e9)
                          if disk else None),
            "cpu": {k: med([r["cpu"][k] for r in rs]) for k in rs[0]["cpu"]},
            "other_busy_max": max(r["cpu"]["other_busy"] for r in rs),
            "other_disk_bytes_max": max((r["other_disk_bytes"] or 0) for r in rs),
            "compute_thread": {k: med([r["compute_thread"][k] for r in rs]) for k in rs[0]["compute_thread"]},
            "ago": {k: med([r["ago"][k] for r in rs]) for k in ("grad_wait_s", "read_wait_s", "busy_s")},
            "peak_rss_bytes": max(r["rss_peak_bytes"] for r in records if r["mode"] == mode),
        }
    return out


def speedups(records: list[dict], summary: dict, base: str, target: str = "optimized") -> dict | None:
    if base not in summary or target not in summary:
        return None
    rounds = sorted({r["round"] for r in records})
    paired = []
    for rnd in rounds:
        a, b = ([r["step_s"] for r in records if r["mode"] == mode and r["round"] == rnd and not r["warmup"]]
                for mode in (base, target))
        if a and b:
            paired.append(statistics.median(a) / statistics.median(b))
    return {"ratio_of_medians": summary[base]["step_s"] / summary[target]["step_s"],
            "paired_median": statistics.median(paired) if paired else None, "paired_all": paired}


# ------------------------------------------------------------------------------------- report
def environment(nvme: list[str]) -> dict:
    import torch

    usage = shutil.disk_usage(nvme[0])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "lohan", "io_engine", "benchmarks"],
                           capture_output=True, text=True)
    return {
        "hardware": {
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "disk_devices": sorted({d for d in (_block_device(p) for p in nvme) if d}),
            "disk_total_bytes": usage.total, "disk_free_bytes": usage.free,
            "kernel": platform.release(), "platform": platform.platform(), "machine": platform.machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(), "torch": package_version("torch"), "deepspeed": package_version("deepspeed"),
            "psutil": package_version("psutil"), "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "git_commit": commit.stdout.strip() or None,
            "git_dirty_paths": dirty.stdout.split("\n")[:-1] if dirty.returncode == 0 else None,
        },
    }


def _fmt(x: float | None, spec: str = "5.2f") -> str:
    return "  n/a" if x is None else format(x, spec)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def table(report: dict) -> str:
    """Two markdown tables: the engine's lanes per mode, then the diagnostics that explain them."""
    modes = report["modes"]
    lanes = _md_table(
        ["mode", "step s", "tokens/s", *LANES, "overlap_eff", "bottleneck", "read GB/s", "write GB/s"],
        [[mode, f"{s['step_s']:.2f}", f"{s['tokens_per_s']:.1f}", *(f"{s['lanes'][n]:.2f}" for n in LANES),
          f"{s['overlap_efficiency']:.2f}", s["bottleneck_lane"], f"{s['ssd_read_gbps']:.2f}",
          f"{s['ssd_write_gbps']:.2f}"] for mode, s in modes.items()])
    diag = _md_table(
        ["mode", "disk_busy s", "disk GB/s", "grad_buffer_wait", "commit", "unaccounted", "ago grad_wait",
         "ago read_wait", "cpu proc/other/idle", "peak RSS GiB"],
        [[mode, _fmt(s["disk_busy_s"], ".2f"), _fmt(s["disk_gbps"], ".2f"),
          f"{s['compute_thread']['grad_buffer_wait_s']:.2f}", f"{s['compute_thread']['commit_s']:.2f}",
          f"{s['compute_thread']['unaccounted_s']:.2f}", f"{s['ago']['grad_wait_s']:.2f}",
          f"{s['ago']['read_wait_s']:.2f}",
          f"{s['cpu']['proc_busy']:.2f}/{s['cpu']['other_busy']:.2f}/{s['cpu']['idle']:.2f}",
          f"{s['peak_rss_bytes'] / GiB:.2f}"] for mode, s in modes.items()])
    return f"{lanes}\n\n{diag}"


def markdown(report: dict) -> str:
    h, st, mem = report["headline"], report["settings"], report["memory"]
    m = report["model"]
    raw = "\n".join(f"- {mode}: " + ", ".join(f"{x:.2f}" for x in s["step_s_all"]) for mode, s in report["modes"].items())
    lines = [
        f"# ago_bench — {report['timestamp']}",
        "",
        f"`{report['command']}`",
        "",
        f"Model {m['name']} ({m['param_count'] / 1e6:.0f}M params, {m['n_layer']} layers, d={m['d_model']}), "
        f"batch {st['batch_size']} x seq {st['seq_len']}, micro-batches {st['micro_batches']}, "
        f"{st['compute_dtype']}, backend {st['backend']}, cpu_mem {st['cpu_mem_bytes'] / GiB:.2f} GiB, "
        f"{st['rounds']} rounds x {st['steps']} measured steps per mode ({st['warmup_steps']} warm-up per opening). "
        f"Store: {report['store']['total_bytes'] / 1e9:.2f} GB, initialized in {report['store']['init_s']:.1f} s. "
        f"Hardware: {report['hardware']['cpu_count']} CPUs, {report['hardware']['ram_bytes'] / GiB:.1f} GiB RAM, "
        f"disk {', '.join(report['hardware']['disk_devices'])}. Wall time {report['wall_seconds']:.0f} s.",
        "",
        "| key | value |",
        "|---|---|",
        *(f"| {k} | {_fmt(v, '.3f') if isinstance(v, float) or v is None else v} |" for k, v in h.items()),
        "",
        "Seconds per step, medians over the measured steps. Lanes are `engine.last_stats.lanes`; "
        "`overlap_eff` = max(compute, ssd_read, ssd_write, cpu_adam) / step (median of the per-step values). "
        "Second table: `disk_busy` = seconds the disk had any I/O in flight (/proc/diskstats), `disk GB/s` = "
        "(read + written bytes) / disk_busy; compute-thread time outside the lanes (blocked acquiring a "
        "gradient buffer, commit = fsync + commit record, unaccounted rest); the optimizer thread idle "
        "waiting for gradients and for its READs; CPU as fractions of all cores (this process / anything "
        "else / idle).",
        "",
        table(report),
        "",
        f"Memory: peak RSS {mem['peak_rss_bytes'] / GiB:.2f} GiB vs limit {mem['limit_bytes'] / GiB:.2f} GiB = "
        f"baseline {mem['baseline_rss_bytes'] / GiB:.2f} + cpu_mem {mem['cpu_mem_bytes'] / GiB:.2f} + activations "
        f"(estimate) {mem['activations_estimate']['total'] / GiB:.2f}; engine pools planned "
        f"{mem['engine_plan_bytes_max'] / GiB:.2f} GiB, allocated at peak {mem['pools_peak_allocated_bytes'] / GiB:.2f} GiB.",
        "",
        "Raw step times (s):",
        "",
        raw,
        "",
    ]
    if report.get("notes"):
        lines += ["Notes:", "", *(f"- {n}" for n in report["notes"]), ""]
    return "\n".join(lines)


def _remove_store(dirs: list[str]) -> None:
    for d in dirs:
        for suffix in (".slab", ".volume.json", ".store.json", ".commit.json", ".commit.json.tmp"):
            path = os.path.join(d, f"{STORE_NAME}{suffix}")
            if os.path.exists(path):
                os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    import psutil
    import torch

    import lohan
    from lohan.config import EngineConfig, get_model_config
    from lohan.models.adapter import GPTBlocks
    from lohan.models.gpt import build_model
    from lohan.plan.pools import PoolGeometry, plan_host_memory
    from lohan.store.states import plan_layout

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sampler = RssSampler()
    baseline_rss = psutil.Process().memory_info().rss
    mcfg = get_model_config(args.model, seq_len=args.seq_len)
    for d in args.nvme:
        os.makedirs(d, exist_ok=True)
    device = _block_device(args.nvme[0])
    env = environment(args.nvme)  # at the start: the commit and the tree the run actually imported

    base = EngineConfig(nvme=tuple(args.nvme), cpu_mem=64 * GiB, compute_dtype=args.compute_dtype,
                        micro_batches=args.micro_batches, backend=args.backend, prefetch_depth=args.prefetch_depth,
                        max_inflight_blocks=args.max_inflight_blocks, name=STORE_NAME,
                        resident_mem=0)  # the modes are compared on the records they stream, not on RAM
    # What each mode's buffer pools need (lohan.plan.pools.plan_host_memory), for cpu_mem=auto and the report.
    program = GPTBlocks(build_model(mcfg, device="meta"))
    layout = plan_layout(program.modules, program.names, args.compute_dtype, base.slots)
    owners = sorted({o for i in range(len(program.modules)) for o, _ in program.external_params(i)})
    tied = tuple(layout.blocks[o].params[p].numel for i in range(len(program.modules))
                 for o, p in program.external_params(i))
    geometry = PoolGeometry(layout, tied=tied, owners=len(owners))
    plans = {mode: plan_host_memory(geometry, base.with_overrides(mode=mode)).parts() for mode in args.modes}
    need = max(sum(p.values()) for p in plans.values())
    cpu_mem = (math.ceil(need / (GiB // 4)) * (GiB // 4)) if args.cpu_mem == "auto" else args.cpu_mem
    ecfg = base.with_overrides(cpu_mem=cpu_mem, mode=args.modes[0])
    acts = activation_bytes(mcfg, args.batch_size, args.seq_len, args.micro_batches, args.compute_dtype)
    log(f"model {mcfg.name}: {mcfg.param_count() / 1e6:.1f}M params, batch {args.batch_size} x seq {args.seq_len}; "
        f"store {layout.total_bytes / 1e9:.2f} GB in {args.nvme}; cpu_mem {ecfg.cpu_mem / GiB:.2f} GiB "
        f"(largest need {need / GiB:.2f} GiB); activations ~{acts['total'] / GiB:.2f} GiB; "
        f"torch threads {torch.get_num_threads()}; disk {device}")

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mcfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())

    records: list[dict] = []
    pools_peak = 0
    notes: list[str] = []
    try:
        t0 = time.perf_counter()
        engine = lohan.init(mcfg, ecfg, overwrite=True)
        total_bytes = engine.store.layout.total_bytes
        engine.close()
        init_s = time.perf_counter() - t0
        log(f"store initialized in {init_s:.1f} s ({total_bytes / 1e9:.2f} GB laid out, "
            f"{layout.slot_bytes / 1e9:.2f} GB written)")
        for rnd in range(args.rounds):
            order = args.modes[rnd % len(args.modes):] + args.modes[:rnd % len(args.modes)]
            for mode in order:
                recs, pools = run_mode(lohan, mcfg, ecfg, mode, rnd, args, batch, device, sampler, log)
                records.extend(recs)
                pools_peak = max(pools_peak, sum(p["peak_allocated"] for p in pools.values()))
    finally:
        sampler.stop()
        if not args.keep_store:
            _remove_store(args.nvme)

    summary = summarize(records, args.modes)
    for mode, sm in summary.items():
        # The tighter, per-mode form of the memory check: this mode's planned pools instead of cpu_mem.
        sm["rss_limit_plan_bytes"] = baseline_rss + sum(plans[mode].values()) + acts["total"]
        sm["within_plan"] = sm["peak_rss_bytes"] <= sm["rss_limit_plan_bytes"]
    for mode, sm in summary.items():
        # Flag what this benchmark cannot control on a shared box; the raw records show which steps.
        own = sm["ssd_read_bytes"] + sm["ssd_write_bytes"]
        if sm["other_disk_bytes_max"] > 0.05 * own:
            notes.append(f"{mode}: a measured step saw {sm['other_disk_bytes_max'] / 1e9:.1f} GB of other disk "
                         f"traffic (> 5% of the engine's {own / 1e9:.1f} GB): another process used the disk")
        if sm["other_busy_max"] > 0.25:
            notes.append(f"{mode}: a measured step had {sm['other_busy_max']:.0%} of the cores busy outside this "
                         "process (other processes, interrupts, kernel I/O workers)")
    opt = summary.get("optimized")
    vs_serial = speedups(records, summary, "serial")
    vs_naive = speedups(records, summary, "naive")
    naive_vs_serial = speedups(records, summary, "serial", "naive")
    peak_rss = max(r["rss_peak_bytes"] for r in records)
    ideal = (max(summary["serial"]["lanes"]["compute"], opt["disk_busy_s"] or 0.0, opt["lanes"]["cpu_adam"])
             if opt and "serial" in summary else None)
    limit = baseline_rss + ecfg.cpu_mem + acts["total"]
    headline = {
        "speedup_vs_serial": vs_serial["ratio_of_medians"] if vs_serial else None,
        "speedup_vs_naive": vs_naive["ratio_of_medians"] if vs_naive else None,
        "speedup_naive_vs_serial": naive_vs_serial["ratio_of_medians"] if naive_vs_serial else None,
        # the same ratios as the median over rounds of ratios measured minutes apart (robust to drift)
        "speedup_vs_serial_paired": vs_serial["paired_median"] if vs_serial else None,
        "speedup_vs_naive_paired": vs_naive["paired_median"] if vs_naive else None,
        "overlap_efficiency": opt["overlap_efficiency"] if opt else None,
        "bottleneck_lane": opt["bottleneck_lane"] if opt else None,
        "peak_rss_gib": (opt["peak_rss_bytes"] if opt else peak_rss) / GiB,
        "peak_rss_all_modes_gib": peak_rss / GiB,
        "rss_limit_gib": limit / GiB,
        "within_memory_budget": peak_rss <= limit,
        # What perfect overlap would give without the costs overlap brings on this box: the larger of the
        # compute lane measured *alone* (serial mode: nothing else runs during its backward) and the disk
        # time of the optimized step. overlap_efficiency uses the optimized step's own compute lane, which
        # is inflated by sharing the cores with CPU Adam and the I/O threads, so it flatters the overlap.
        "ideal_step_s": ideal,
        "efficiency_vs_ideal": ideal / opt["step_s"] if opt and ideal else None,
        "step_s_optimized": opt["step_s"] if opt else None,
        "tokens_per_s_optimized": opt["tokens_per_s"] if opt else None,
    }
    targets = {"speedup_vs_serial>=1.2": None if vs_serial is None else vs_serial["ratio_of_medians"] >= 1.2,
               "overlap_efficiency>=0.85": None if opt is None else opt["overlap_efficiency"] >= 0.85,
               "peak_rss<=cpu_mem+activations+baseline": peak_rss <= limit}
    stamp = dt.datetime.now().astimezone()
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"ago_bench_{stamp:%Y%m%d_%H%M%S}.json"
    report = {
        **headline,
        "headline": headline,
        "targets_met": targets,
        "speedups": {"optimized_vs_serial": vs_serial, "optimized_vs_naive": vs_naive,
                     "naive_vs_serial": naive_vs_serial},
        "modes": summary,
        "model": {"name": mcfg.name, "param_count": mcfg.param_count(), "n_layer": mcfg.n_layer,
                  "n_head": mcfg.n_head, "d_model": mcfg.d_model, "vocab_size": mcfg.vocab_size,
                  "seq_len": mcfg.seq_len, "flops_per_token_fwd": mcfg.flops_per_token(args.seq_len)},
        "settings": {"batch_size": args.batch_size, "seq_len": args.seq_len, "micro_batches": args.micro_batches,
                     "tokens_per_step": args.batch_size * args.seq_len, "modes": args.modes,
                     "rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup_steps,
                     "compute_dtype": args.compute_dtype, "backend": args.backend, "nvme": args.nvme,
                     "cpu_mem_bytes": ecfg.cpu_mem, "cpu_mem_arg": args.cpu_mem,
                     "prefetch_depth": args.prefetch_depth, "max_inflight_blocks": args.max_inflight_blocks,
                     "threads": args.threads, "quick": args.quick},
        "store": {"total_bytes": total_bytes, "slot_bytes": layout.slot_bytes, "init_s": init_s,
                  "blocks": len(layout.blocks), "largest_record_bytes": max(b.record_bytes for b in layout.blocks),
                  "bytes_per_step_expected": {
                      "read": 12 * layout.param_count + 2 * (2 if args.compute_dtype == "bf16" else 4)
                      * layout.param_count, "write": (14 if args.compute_dtype == "bf16" else 16) * layout.param_count}},
        "memory": {"peak_rss_bytes": peak_rss, "baseline_rss_bytes": baseline_rss, "cpu_mem_bytes": ecfg.cpu_mem,
                   "activations_estimate": acts, "limit_bytes": limit,
                   "engine_plan_bytes": {m: dict(p, total=sum(p.values())) for m, p in plans.items()},
                   "engine_plan_bytes_max": need, "pools_peak_allocated_bytes": pools_peak,
                   "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        "records": records,
        **env,
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "timestamp": stamp.isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - t_start,
        "notes": notes,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print()
    print(table(report))
    print()
    for k, v in headline.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    print(f"targets: {targets}")
    print(f"wrote {out} and {out.with_suffix('.md')} ({report['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
