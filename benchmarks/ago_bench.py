"""Active gradient offloading ablation (LoHan paper §IV-C, Fig. 10): serial vs naive vs optimized, as users get it.

What it measures. One model's states are laid out and initialized once on the NVMe directories (`--nvme`); then
the three optimizer pipelines of DESIGN.md §4.3 train that *same model on the same store*, the engine being
closed and re-opened with `resume=True` and other settings between runs (the mode and the clipping only change
how a step's optimizer pass runs, so each run continues from the last committed step):

- ``serial``    all optimizer work after the whole backward (ZeRO-Infinity style);
- ``naive``     per block READ(i) -> ADAM(i) -> WRITE(i), overlapped with the backward only;
- ``optimized`` READ(i-1) issued before WRITE(i): SSD reads, SSD writes, CPU Adam and backward at once.

Each mode runs in three gradient-clipping cases (`--cases`), because clipping (on by default in the engine:
``max_grad_norm=1.0``, ``clip_mode="auto"``) decides when a step's update may start. The global gradient norm
is known only at the end of backward; after a step that did not clip the engine speculates (updates at
coefficient 1 during backward and redoes the pass if the step clips after all), after a clipped step it defers
the update until the norm is known (reading records ahead during backward; the next step's forward then runs
beside the update):

- ``noclip``     ``max_grad_norm=0``: clipping off; each update under backward, or after it beside the next
                 forward, as ``clip_mode: auto`` finds cheaper;
- ``clipped``    ``max_grad_norm=--clip-norm`` (0.05), below the norm of every step: every update deferred
                 (what fine-tuning with clipping gets whenever it clips; the headline);
- ``unclipped``  ``max_grad_norm=1e6``: clipping on but no step clips: none redone; each update speculated or
                 deferred as ``clip_mode: auto`` finds cheaper (`lohan/runtime/clip_schedule.py`);
- ``noclip-backward`` (not run by default) ``max_grad_norm=0``, ``clip_mode=speculate``: clipping off and every
                 update under backward, AGO as the paper describes it (``noclip`` is ``auto``'s choice, which may
                 defer where that measures cheaper).

Each case is verified from `engine.last_stats` (``clip_coef``, ``deferred``, ``redone``); a case whose steps did
not behave so gets a note. Every step is given the next batch (``engine.step(batch, next_batch=...)``, as the
CLI does), from one seeded sequence of distinct random-token batches that runs on across openings (on one
repeated batch the model memorizes it and the gradient norm falls).

The (case, mode) pairs are interleaved in rounds (every round runs each pair once, in an order rotated by the
round), because the disk is noisy; every opening of the engine runs `--warmup-steps` discarded steps (its
buffer pools are allocated and touched over its first two steps, and its first step defers: no previous
coefficient) and then `--steps` measured ones. Every opening uses the same ``cpu_mem`` (`--cpu-mem`, the
engine's default 8 GiB). Per case and mode the report gives the median step time, tokens/s, the median seconds
of each lane of `engine.last_stats.lanes` (gpu, ssd, ssd_read, ssd_write, cpu, param_wait,
optimizer_tail), SSD GB/s, the engine's ``overlap_efficiency = max(gpu, m2g, g2m, ssd, cpu) /
T_iter``, the peak RSS, the shares of clipped, deferred, redone and next-forward-overlapped steps, and the
engine's planned pools (`engine.memory_plan`, `engine.host_memory`).

Diagnostics that the engine's lanes cannot show are added, because on this kind of machine the SSD read and
write lanes share one physical disk and compute and CPU Adam share the same cores:

- ``disk_busy``: seconds the block device holding the store was busy with any I/O during the step
  (``io_ticks`` of /proc/diskstats, the union of reads and writes; includes other processes' I/O);
- ``cpu``: this process's CPU seconds (all threads), everything else's, and idle, as fractions of
  cores x T_iter, i.e. how saturated the cores were and whether something else ran;
- the compute thread's time outside the lanes: blocked acquiring a gradient or parameter buffer
  (the pipeline or prefetch is behind), and the commit (fsync + commit record).

Headline keys: ``speedup_vs_serial`` (the ``clipped`` case, optimized vs serial, ratio of median step times),
``speedup_vs_serial_noclip`` and ``speedup_vs_serial_unclipped`` (the other cases; and
``speedup_vs_serial_noclip_in_backward`` where ``noclip-backward`` ran), ``speedup_vs_naive``
(clipped), the ``*_paired`` medians of per-round ratios; for the clipped case's optimized runs
``overlap_efficiency``, ``step_s_optimized``, ``tokens_per_s_optimized``, ``peak_rss_gib`` with the budget it
is checked against: ``cpu_mem`` + the model's activations (an analytic estimate, see `activation_bytes`) + the
process's RSS before the engine was built; ``efficiency_vs_ideal`` = max(serial's compute lane, optimized's
disk_busy, CPU Adam) / optimized T_iter (clipped case): the engine's metric uses the optimized step's *own*
compute lane, which grows when CPU Adam and the I/O threads share the cores with it, so it does not show what
the overlap costs; this one does. A key whose case or mode was not run is None.

Run (from the repository root; nothing else should use the disk or the cores meanwhile):
    .venv/bin/python benchmarks/ago_bench.py --quick  # ~8-10 min
    .venv/bin/python benchmarks/ago_bench.py          # ~15 min
    .venv/bin/python benchmarks/ago_bench.py --quick --cases clipped noclip   # two cases, ~6 min
    .venv/bin/python benchmarks/ago_bench.py --model 1b --rounds 2 --steps 1 --modes naive optimized
(durations for 350m on the 2-core development VM.) A markdown summary is written next to the JSON (same stem,
``.md``). The slab files are deleted at the end unless ``--keep-store``. Keys: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    portable,
    result_fields,
    result_path,
    shared_environment,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

GiB = 1 << 30
STORE_NAME = "agobench"  # slab files: <nvme dir>/agobench.slab (+ .volume.json, .store.json, .commit.json)
LANES = ("gpu", "ssd", "ssd_read", "ssd_write", "cpu", "param_wait", "optimizer_tail")
BOTTLENECK_LANES = ("gpu", "ssd", "cpu")  # the engine's overlap_efficiency (m2g, g2m: a timed simulated device's)
ALL_MODES = ("serial", "naive", "optimized")
ALL_CASES = ("noclip", "clipped", "unclipped", "noclip-backward")
DEFAULT_CASES = ALL_CASES[:3]
HEADLINE_CASE = "clipped"  # what a fine-tuning run with clipping on gets once it clips: the deferred update
UNCLIPPED_NORM = 1e6  # far above any norm here: clipping on (so speculated), no step ever clipped
STEP_FLAGS = ("deferred", "redone", "next_forward_overlapped", "skipped")  # StepStats booleans, per step

# Run sizes, declared as data; the CLI overrides any field. The model and batch were chosen by
# measuring candidates on the 2-core / one-disk development VM (benchmarks/README.md): 350m at batch 1 x
# seq 512 makes a step's compute (~3.5-4 s: forward, recompute, backward) comparable to its SSD traffic
# (~10 GB: 12 B/param read for P32,m,v, 2 x 2 B/param for P16, 14 B/param written; ~3.5 s of disk time).
# Two warm-up steps per opening: a new opening's pools are first touched over its first two steps (the first
# defers for want of a previous coefficient, the second may speculate), so the first measured step is steady.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(model="350m", seq_len=512, batch_size=1, micro_batches=1, rounds=4, steps=2, warmup_steps=2),
    "quick": dict(model="350m", seq_len=512, batch_size=1, micro_batches=1, rounds=3, steps=1, warmup_steps=2),
}


def case_overrides(case: str, clip_norm: float) -> dict[str, Any]:
    """The `EngineConfig` overrides of a clipping case, on top of the base config (clip_mode stays auto, but in
    noclip-backward)."""
    return {"noclip": {"max_grad_norm": 0.0},
            "clipped": {"max_grad_norm": clip_norm},
            "unclipped": {"max_grad_norm": UNCLIPPED_NORM},
            "noclip-backward": {"max_grad_norm": 0.0, "clip_mode": "speculate"}}[case]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps (350m: ~8-10 min with store init)")
    p.add_argument("--model", help="model preset (lohan.config.PRESETS); default from the run preset")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--micro-batches", type=int, help="gradient accumulation factor")
    p.add_argument("--rounds", type=int, help="rounds; each runs every (case, mode) once (order rotated)")
    p.add_argument("--steps", type=int, help="measured steps per (case, mode) per round")
    p.add_argument("--warmup-steps", type=int, help="discarded steps after each (re)opening of the engine")
    p.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(ALL_MODES))
    p.add_argument("--cases", nargs="+", choices=ALL_CASES, default=list(DEFAULT_CASES),
                   help="clipping cases: noclip (max_grad_norm 0), clipped (every step clipped, updates "
                        "deferred), unclipped (max_grad_norm 1e6: clipping on, no step clips); not by default: "
                        "noclip-backward (clipping off, every update under backward: clip_mode speculate)")
    p.add_argument("--clip-norm", type=float, default=0.05,
                   help="max_grad_norm of the clipped case; small enough that every step clips (a random-init "
                        "350m's norm is ~1-5). The engine's work does not depend on the value, only on whether "
                        "the step clips")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the random-token batches")
    p.add_argument("--nvme", nargs="+", default=[str(REPO / "benchmarks" / "scratch" / "ago")],
                   help="store directories (one per SSD)")
    p.add_argument("--cpu-mem", default="8GiB",
                   help="engine main-memory budget, the same for every case and mode (default: the engine's "
                        "8GiB); auto = the largest planned need of the cases and modes run, rounded up to 0.25 GiB")
    p.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--backend", choices=("auto", "aio", "threads"), default="auto")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--max-inflight-blocks", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the process (default: leave torch's choice)")
    p.add_argument("--keep-store", action="store_true", help="do not delete the slab files at the end")
    p.add_argument("--out", help="JSON report path (default benchmarks/results/ago_bench[/quick]/<machine>.json)")
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
    if not (math.isfinite(args.clip_norm) and args.clip_norm > 0):
        p.error("--clip-norm must be a finite number > 0 (the noclip case turns clipping off)")
    # the given order is kept (it is the rotation's starting order); a name given twice runs once
    args.modes, args.cases = list(dict.fromkeys(args.modes)), list(dict.fromkeys(args.cases))
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


# ------------------------------------------------------------------------------------- data and plans
def make_batches(vocab: int, batch: int, seq: int, count: int, seed: int) -> list[tuple[Any, Any]]:
    """`count` distinct random-token batches (ids, targets), the same ones for a given seed. Distinct because on
    one repeated batch the model memorizes it and the gradient norm falls: the clipping cases would drift."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def plan_needs(mcfg: Any, base: Any, pairs: list[tuple[str, str]], clip_norm: float) -> tuple[Any, dict[str, dict]]:
    """The store layout, and each (case, mode)'s pools by `lohan.plan.pools.plan_host_memory` from the model's
    shapes (meta device, nothing allocated) under `base.cpu_mem`; keys 'case/mode'. Raises MemoryPlanError
    (with the least cpu_mem that fits) when a pair does not fit, before minutes of store initialization."""
    from lohan.models.adapter import GPTBlocks
    from lohan.models.gpt import build_model
    from lohan.plan.pools import PoolGeometry, plan_host_memory
    from lohan.store.states import plan_layout

    program = GPTBlocks(build_model(mcfg, device="meta"))
    layout = plan_layout(program.modules, program.names, base.compute_dtype, base.slots)
    n = len(program.modules)
    owners = sorted({o for i in range(n) for o, _ in program.external_params(i)})
    tied = tuple(layout.blocks[o].params[p].numel for i in range(n) for o, p in program.external_params(i))
    geometry = PoolGeometry(layout, tied=tied, owners=len(owners))
    plans = {}
    for case, mode in pairs:
        parts = plan_host_memory(geometry, base.with_overrides(mode=mode, **case_overrides(case, clip_norm))).parts()
        plans[f"{case}/{mode}"] = dict(parts, total=sum(parts.values()))
    return layout, plans


def round_order(pairs: list[tuple[str, str]], rnd: int, rounds: int) -> list[tuple[str, str]]:
    """Every (case, mode) pair once, rotated so that the rounds start at evenly spaced pairs: no pair is always
    first or last, where the disk's state between openings differs most."""
    shift = (rnd * max(1, len(pairs) // rounds)) % len(pairs)
    return pairs[shift:] + pairs[:shift]


# ------------------------------------------------------------------------------------- run
@dataclasses.dataclass
class Bench:
    """What every opening of the engine shares: the package, model, base config, data stream and probes."""

    lohan: Any
    mcfg: Any
    base: Any  # EngineConfig: the settings every case and mode share (cpu_mem included)
    args: argparse.Namespace
    batches: list[tuple[Any, Any]]
    device: str | None  # block device of the store, for /proc/diskstats
    sampler: RssSampler
    log: Callable[[str], None]
    cursor: int = 0  # the next batch: the stream runs on across openings, as one long run's data would

    def take(self) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """This step's batch and the next one (`step`'s next_batch: the CLI always knows it)."""
        self.cursor += 1
        return self.batches[self.cursor - 1], self.batches[self.cursor]


def _metrics_record(engine: Any, m: Any, where: dict[str, Any], counters: tuple[dict, dict],
                    waits: tuple[dict, dict], rss_peak: int, wall_s: float) -> dict:
    ago = engine.offloader
    lanes = {name: float(m.lanes[name]) for name in LANES}
    step_s = float(m.step_s)
    cores = os.cpu_count() or 1
    c0, c1 = counters
    d = {k: (None if c0[k] is None or c1[k] is None else c1[k] - c0[k]) for k in c0}
    proc = d["proc_user"] + d["proc_sys"]
    waited = {k: waits[1][k] - waits[0][k] for k in waits[0]}
    accounted = lanes["gpu"] + lanes["param_wait"] + lanes["optimizer_tail"] + sum(waited.values())
    return {
        **where, "step": m.step, "loss": m.loss,
        # what clipping did (StepStats): the case is verified from these
        "grad_norm": m.grad_norm, "clip_coef": m.clip_coef, **{f: bool(getattr(m, f)) for f in STEP_FLAGS},
        "step_s": step_s, "wall_s": wall_s, "tokens_per_s": m.tokens_per_s, "tflops": m.tflops,
        "ssd_read_gbps": m.ssd_read_gbps, "ssd_write_gbps": m.ssd_write_gbps,
        "ssd_read_bytes": m.ssd_read_bytes, "ssd_write_bytes": m.ssd_write_bytes,
        "lanes": lanes, "overlap_efficiency": m.overlap_efficiency,
        # Where the compute thread's step time went besides the engine's lanes (WaitMeter), and the
        # rest: forward/backward Python overhead, releasing/acquiring resident blocks, metrics.
        "compute_thread": {**{f"{k}_s": v for k, v in waited.items()}, "unaccounted_s": step_s - accounted},
        # The optimizer thread's own accounting (lohan.runtime.offload.GradOffloader): idle waiting for
        # gradients, waiting for its READs, and its wall time from first to last block.
        "ago": {"grad_wait_s": ago.grad_wait_s, "read_wait_s": ago.read_wait_s, "busy_s": ago.busy_s},
        "disk_busy_s": d["disk_busy"],
        "disk_bytes": d["disk_bytes"],
        # bytes the disk moved that this step's engine did not count: other processes (another benchmark), or the
        # engine's own writes counted in a neighbouring step (write-behind: the last step's tail completes in this
        # one); the summary's `other_disk_bytes` sums over the measured steps, where those cancel out
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
        # every opening profiles a block and plans the activations anew (act_policy plan): a plan that differs
        # between openings changes the work, so it is kept per step and compared (check_activation_plans)
        "activation_plan": ({k: m.activations.get(k) for k in ("policy", "swap", "tiers")}
                            if m.activations else None),
    }


def _step_line(rec: dict) -> str:
    """One console line per step; flags D(eferred) R(edone) N(ext forward overlapped) S(kipped), '-' if not."""
    ln, ct = rec["lanes"], rec["compute_thread"]
    flags = "".join(c if rec[f] else "-" for c, f in zip("DRNS", STEP_FLAGS))
    other_io = None if rec["other_disk_bytes"] is None else rec["other_disk_bytes"] / 1e9
    return (f"  round {rec['round']} {rec['case']:9s} {rec['mode']:9s} {'warm-up' if rec['warmup'] else 'step   '}"
            f" {rec['step']:3d}: {rec['step_s']:6.2f} s  loss {rec['loss']:6.3f} norm {_fmt(rec['grad_norm'], '.3f')}"
            f" coef {_fmt(rec['clip_coef'], '.3f')} {flags} | gpu {ln['gpu']:5.2f} read {ln['ssd_read']:5.2f}"
            f" write {ln['ssd_write']:5.2f} cpu {ln['cpu']:5.2f} p-wait {ln['param_wait']:5.2f}"
            f" tail {ln['optimizer_tail']:5.2f} | gbuf {ct['grad_buffer_wait_s']:5.2f}"
            f" commit {ct['commit_s']:5.2f} rest {ct['unaccounted_s']:5.2f} | disk {_fmt(rec['disk_busy_s'])}"
            f" cpu {rec['cpu']['proc_busy']:.2f}/{rec['cpu']['other_busy']:.2f}/{rec['cpu']['idle']:.2f}"
            f" other-io {_fmt(other_io, '.2f')} GB | eff {rec['overlap_efficiency']:.2f}"
            f" rss {rec['rss_peak_bytes'] / GiB:.2f} GiB")


def timed_step(bench: Bench, engine: Any, meter: WaitMeter, where: dict[str, Any]) -> dict:
    """One `engine.step` told the next batch, with the probes read around it; its record."""
    batch, next_batch = bench.take()
    bench.sampler.take_peak()
    c0, w0, t0 = _counters(bench.device), meter.snapshot(), time.perf_counter()
    engine.step(batch, next_batch=next_batch)
    wall = time.perf_counter() - t0
    c1, w1 = _counters(bench.device), meter.snapshot()
    rec = _metrics_record(engine, engine.last_stats, where, (c0, c1), (w0, w1), bench.sampler.take_peak(), wall)
    rec["batch_index"] = bench.cursor - 1
    bench.log(_step_line(rec))
    return rec


def run_opening(bench: Bench, case: str, mode: str, rnd: int) -> tuple[list[dict], dict]:
    """Open the store in (case, mode), run warm-up + measured steps, close: the step records, and the opening's
    planned pools (`engine.memory_plan` parts, the full `engine.host_memory`) and pool peaks."""
    args = bench.args
    t0 = time.perf_counter()
    engine = bench.lohan.init(bench.mcfg, bench.base.with_overrides(mode=mode, **case_overrides(case, args.clip_norm)),
                              resume=True)
    plan = engine.host_memory
    opening = {"case": case, "mode": mode, "round": rnd, "open_s": time.perf_counter() - t0,
               "memory_plan": dict(engine.memory_plan, total=sum(engine.memory_plan.values())),
               "host_memory": {**dataclasses.asdict(plan), "total": plan.total}}
    meter = WaitMeter(engine)
    records = []
    try:
        for k in range(args.warmup_steps + args.steps):
            where = {"case": case, "mode": mode, "round": rnd, "index": k, "warmup": k < args.warmup_steps}
            records.append(timed_step(bench, engine, meter, where))
        opening["pools"] = {name: getattr(engine, f"{name}_pool").stats() for name in ("params", "grads", "records")}
    finally:
        engine.close()
        # The engine keeps freed memory in glibc's heap for reuse (engine.heap_reuse): its pools would stay
        # resident after it closed, and the next opening in this process would carry them in its peak RSS.
        from lohan.runtime.heap import release_free_memory
        release_free_memory()
    return records, opening


def run_rounds(bench: Bench, pairs: list[tuple[str, str]]) -> tuple[list[dict], list[dict]]:
    """Every round runs every (case, mode) once, in a rotated order; all step records and openings."""
    records: list[dict] = []
    openings: list[dict] = []
    for rnd in range(bench.args.rounds):
        for case, mode in round_order(pairs, rnd, bench.args.rounds):
            recs, opening = run_opening(bench, case, mode, rnd)
            records.extend(recs)
            openings.append(opening)
    return records, openings


# ------------------------------------------------------------------------------------- summary
def _share(rs: list[dict], pred: Callable[[dict], bool]) -> float | None:
    return sum(1 for r in rs if pred(r)) / len(rs) if rs else None


def clip_fractions(rs: list[dict]) -> dict[str, float | None]:
    """Shares of the steps `rs` that clipped (coefficient < 1), were deferred, redone, had the next step's forward
    beside their optimizer pass, or were skipped; None for no steps. Plus the median gradient norm."""
    out = {"clipped_fraction": _share(rs, lambda r: r["clip_coef"] is not None and r["clip_coef"] < 1.0)}
    out.update({f"{flag}_fraction": _share(rs, lambda r, f=flag: bool(r[f])) for flag in STEP_FLAGS})
    norms = [r["grad_norm"] for r in rs if r["grad_norm"] is not None]
    out["grad_norm_median"] = statistics.median(norms) if norms else None
    return out


def summarize_mode(rs: list[dict], everything: list[dict]) -> dict:
    """Medians over one (case, mode)'s measured steps `rs`; the peak RSS over `everything` it ran (warm-up too)."""
    med = statistics.median
    step = med([r["step_s"] for r in rs])
    lanes = {name: med([r["lanes"][name] for r in rs]) for name in LANES}
    disks = [r["disk_busy_s"] for r in rs if r["disk_busy_s"] is not None]
    bottleneck = max(BOTTLENECK_LANES, key=lambda n: lanes[n])
    disk = med(disks) if disks else None
    return {
        "steps": len(rs), "step_s": step, "step_s_all": [r["step_s"] for r in rs],
        "step_s_min": min(r["step_s"] for r in rs), "step_s_max": max(r["step_s"] for r in rs),
        "tokens_per_s": med([r["tokens_per_s"] for r in rs]),
        "tflops": med(tf) if (tf := [r["tflops"] for r in rs if r["tflops"] is not None]) else None,
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
        "other_disk_bytes": _other_disk_bytes(rs),
        "compute_thread": {k: med([r["compute_thread"][k] for r in rs]) for k in rs[0]["compute_thread"]},
        "ago": {k: med([r["ago"][k] for r in rs]) for k in ("grad_wait_s", "read_wait_s", "busy_s")},
        "peak_rss_bytes": max(r["rss_peak_bytes"] for r in everything),
        "clip": clip_fractions(rs),
    }


def summarize(records: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode of one case's `records`, the summary of its measured steps; a mode with none is left out."""
    out = {}
    for mode in modes:
        mine = [r for r in records if r["mode"] == mode]
        rs = [r for r in mine if not r["warmup"]]
        if rs:
            out[mode] = summarize_mode(rs, mine)
    return out


def speedups(records: list[dict], summary: dict, base: str, target: str = "optimized") -> dict | None:
    """`base`'s step time over `target`'s within one case: ratio of the medians, and the median over rounds of
    the per-round ratios (pairs measured minutes apart, robust to the disk's drift); None if either is missing."""
    if base not in summary or target not in summary:
        return None
    paired = []
    for rnd in sorted({r["round"] for r in records}):
        a, b = ([r["step_s"] for r in records if r["mode"] == mode and r["round"] == rnd and not r["warmup"]]
                for mode in (base, target))
        if a and b:
            paired.append(statistics.median(a) / statistics.median(b))
    return {"ratio_of_medians": summary[base]["step_s"] / summary[target]["step_s"],
            "paired_median": statistics.median(paired) if paired else None, "paired_all": paired}


def case_summary(records: list[dict], case: str, modes: list[str], overrides: dict[str, Any]) -> dict:
    """One clipping case: its overrides, per-mode summaries, speedups, and the clipping shares over the
    measured steps of all its modes."""
    rs = [r for r in records if r["case"] == case]
    per_mode = summarize(rs, modes)
    return {"overrides": overrides, "modes": per_mode,
            "speedups": {"optimized_vs_serial": speedups(rs, per_mode, "serial"),
                         "optimized_vs_naive": speedups(rs, per_mode, "naive"),
                         "naive_vs_serial": speedups(rs, per_mode, "serial", "naive")},
            **clip_fractions([r for r in rs if not r["warmup"]])}


# What each case is meant to measure, as shares of its measured steps; with why a share can differ.
EXPECTED: dict[str, dict[str, tuple[float, str]]] = {
    # (clipping off, clip_mode auto updates under backward or after it beside the next forward, as it measures
    # cheaper: not checked)
    "noclip": {"redone_fraction": (0.0, "clipping off should never redo")},
    "noclip-backward": {"deferred_fraction": (0.0, "clip_mode speculate with clipping off should never defer"),
                        "redone_fraction": (0.0, "clipping off should never redo")},
    "clipped": {"clipped_fraction": (1.0, "a step's norm fell below --clip-norm: lower it"),
                "deferred_fraction": (1.0, "after a clipped step clip_mode auto should defer")},
    # (deferred or speculated there is the engine's choice, clip_mode auto's, by what each costs: not checked)
    "unclipped": {"clipped_fraction": (0.0, "a norm above max_grad_norm 1e6"),
                  "redone_fraction": (0.0, "a speculated update was redone although no step clipped")},
}


def check_case(case: str, summary: dict) -> list[str]:
    """Notes where a case's measured steps did not do what the case is meant to measure."""
    notes = []
    for key, (want, why) in EXPECTED[case].items():
        got = summary[key]
        if got is not None and got != want:
            notes.append(f"{case}: {key} = {got:.2f}, expected {want:.0f} ({why}); its speedups do not measure "
                         f"the case alone")
    if summary["skipped_fraction"]:
        notes.append(f"{case}: {summary['skipped_fraction']:.0%} of the measured steps were skipped (non-finite)")
    return notes


def _other_disk_bytes(rs: list[dict]) -> dict[str, int] | None:
    """What the disk moved over the measured steps beyond what the engine counted in them, and the engine's
    count (None where the disk's counters were not readable). A sum, not per step: write-behind completes a
    step's last writes in the next one, so the engine's bytes and the disk's fall in different steps."""
    if any(r.get("disk_bytes") is None for r in rs):
        return None
    own = sum(r["ssd_read_bytes"] + r["ssd_write_bytes"] for r in rs)
    return {"other": max(0, sum(r["disk_bytes"] for r in rs) - own), "own": own}


def check_machine(case: str, mode: str, sm: dict) -> list[str]:
    """Notes on what this benchmark cannot control on a shared box; the raw records show which steps."""
    notes = []
    other = sm.get("other_disk_bytes")
    if other and other["other"] > 0.05 * other["own"]:
        notes.append(f"{case}/{mode}: the measured steps saw {other['other'] / 1e9:.1f} GB of other disk traffic "
                     f"(> 5% of the engine's {other['own'] / 1e9:.1f} GB): another process used the disk")
    if sm["other_busy_max"] > 0.25:
        notes.append(f"{case}/{mode}: a measured step had {sm['other_busy_max']:.0%} of the cores busy outside "
                     "this process (other processes, interrupts, kernel I/O workers)")
    return notes


def check_activation_plans(records: list[dict]) -> list[str]:
    """A note when the measured steps ran under more than one activation plan, with the (case, mode) pairs of
    each: the plan comes from a profile measured at every opening, so timing noise can change it."""
    pairs: dict[str, set[str]] = {}
    for r in records:
        if not r["warmup"] and r.get("activation_plan"):
            pairs.setdefault(json.dumps(r["activation_plan"], sort_keys=True), set()).add(f"{r['case']}/{r['mode']}")
    if len(pairs) < 2:
        return []
    return [f"the measured steps ran under {len(pairs)} activation plans: "
            + "; ".join(f"{plan} in {', '.join(sorted(where))}" for plan, where in pairs.items())]


def _dig(d: Any, *keys: str) -> Any:
    """d[k0][k1]...; None as soon as a level is missing or None (a case or mode that was not run)."""
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def headline_keys(cases: dict[str, dict], peak_rss: int, limit: int) -> dict[str, Any]:
    """The report's headline: speedups per case, the clipped case's optimized figures, memory; None for a key
    whose case or mode was not run."""
    hc = HEADLINE_CASE
    opt, serial = _dig(cases, hc, "modes", "optimized"), _dig(cases, hc, "modes", "serial")
    # What perfect overlap would give without the costs overlap brings on this box: the larger of the
    # compute lane measured *alone* (serial mode: nothing else runs during its backward) and the disk
    # time of the optimized step. overlap_efficiency uses the optimized step's own compute lane, which
    # is inflated by sharing the cores with CPU Adam and the I/O threads, so it flatters the overlap.
    ideal = (max(serial["lanes"]["gpu"], opt["disk_busy_s"] or 0.0, opt["lanes"]["cpu"])
             if opt and serial else None)
    out = {
        "speedup_vs_serial": _dig(cases, hc, "speedups", "optimized_vs_serial", "ratio_of_medians"),
        "speedup_vs_serial_noclip": _dig(cases, "noclip", "speedups", "optimized_vs_serial", "ratio_of_medians"),
        "speedup_vs_serial_unclipped": _dig(cases, "unclipped", "speedups", "optimized_vs_serial",
                                            "ratio_of_medians"),
        "speedup_vs_serial_noclip_in_backward": _dig(cases, "noclip-backward", "speedups", "optimized_vs_serial",
                                                     "ratio_of_medians"),
        "speedup_vs_naive": _dig(cases, hc, "speedups", "optimized_vs_naive", "ratio_of_medians"),
        "speedup_naive_vs_serial": _dig(cases, hc, "speedups", "naive_vs_serial", "ratio_of_medians"),
        # the same ratios as the median over rounds of ratios measured minutes apart (robust to drift)
        "speedup_vs_serial_paired": _dig(cases, hc, "speedups", "optimized_vs_serial", "paired_median"),
        "speedup_vs_serial_noclip_paired": _dig(cases, "noclip", "speedups", "optimized_vs_serial", "paired_median"),
        "speedup_vs_serial_unclipped_paired": _dig(cases, "unclipped", "speedups", "optimized_vs_serial",
                                                   "paired_median"),
        "speedup_vs_naive_paired": _dig(cases, hc, "speedups", "optimized_vs_naive", "paired_median"),
        "overlap_efficiency": _dig(opt, "overlap_efficiency"),
        "bottleneck_lane": _dig(opt, "bottleneck_lane"),
        "clipped_fraction": _dig(cases, hc, "clipped_fraction"),
        "peak_rss_gib": (opt["peak_rss_bytes"] if opt else peak_rss) / GiB,
        "peak_rss_all_modes_gib": peak_rss / GiB,
        "rss_limit_gib": limit / GiB,
        "within_memory_budget": peak_rss <= limit,
        "ideal_step_s": ideal,
        "efficiency_vs_ideal": ideal / opt["step_s"] if opt and ideal else None,
        "step_s_optimized": _dig(opt, "step_s"),
        "tokens_per_s_optimized": _dig(opt, "tokens_per_s"),
    }
    return out


def targets_met(h: dict[str, Any]) -> dict[str, bool | None]:
    """The project's targets for this benchmark; None where the key could not be computed."""
    def at_least(key: str, bound: float) -> bool | None:
        return None if h[key] is None else h[key] >= bound

    return {"speedup_vs_serial>=1.25": at_least("speedup_vs_serial", 1.25),
            "speedup_vs_serial_noclip>=1.3": at_least("speedup_vs_serial_noclip", 1.3),
            "peak_rss<=cpu_mem+activations+baseline": h["within_memory_budget"]}


def attach_plans(cases: dict[str, dict], openings: list[dict], baseline_rss: int, activations: int) -> list[str]:
    """Each (case, mode)'s pools as its engine planned them (first opening), the per-mode memory check against
    them, and notes where the plan changed between openings (auto sizes follow the machine's free memory)."""
    notes = []
    for case, cs in cases.items():
        for mode, sm in cs["modes"].items():
            mine = [o for o in openings if o["case"] == case and o["mode"] == mode]
            if not mine:
                continue
            sm["memory_plan"], sm["host_memory"] = mine[0]["memory_plan"], mine[0]["host_memory"]
            sm["memory_plan_totals"] = [o["memory_plan"]["total"] for o in mine]
            # the tighter, per-mode form of the memory check: the engine's planned pools instead of cpu_mem
            sm["rss_limit_plan_bytes"] = baseline_rss + max(sm["memory_plan_totals"]) + activations
            sm["within_plan"] = sm["peak_rss_bytes"] <= sm["rss_limit_plan_bytes"]
            if len(set(sm["memory_plan_totals"])) > 1:
                notes.append(f"{case}/{mode}: the planned pools changed between openings "
                             f"({', '.join(f'{t / GiB:.2f}' for t in sm['memory_plan_totals'])} GiB)")
    return notes


def environment(nvme: list[str]) -> dict:
    usage = shutil.disk_usage(nvme[0])
    return shared_environment(("torch", "deepspeed", "psutil"), hardware={
        "disk_devices": sorted({d for d in (_block_device(p) for p in nvme) if d}),
        "disk_total_bytes": usage.total, "disk_free_bytes": usage.free})


def _fmt(x: float | None, spec: str = "5.2f") -> str:
    return "  n/a" if x is None else format(x, spec)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(c.strip() for c in r) + " |" for r in rows)])


def mode_tables(modes: dict[str, dict]) -> str:
    """Two markdown tables for one case: the engine's lanes per mode, then the diagnostics that explain them."""
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


def case_table(cases: dict[str, dict]) -> str:
    """One row per clipping case: median step per mode, optimized's speedups and overlap, clipping shares."""
    def step(cs: dict, mode: str) -> str:
        return _fmt(_dig(cs, "modes", mode, "step_s"), ".2f")

    return _md_table(
        ["case", "max_grad_norm", "serial s", "naive s", "optimized s", "opt vs serial", "opt vs naive",
         "overlap_eff", "clipped", "deferred", "redone", "next fwd overlapped"],
        [[case, f"{cs['overrides']['max_grad_norm']:g}", step(cs, "serial"), step(cs, "naive"),
          step(cs, "optimized"),
          _fmt(_dig(cs, "speedups", "optimized_vs_serial", "ratio_of_medians"), ".2f"),
          _fmt(_dig(cs, "speedups", "optimized_vs_naive", "ratio_of_medians"), ".2f"),
          _fmt(_dig(cs, "modes", "optimized", "overlap_efficiency"), ".2f"),
          *(_fmt(cs[f"{k}_fraction"], ".2f") for k in ("clipped", "deferred", "redone", "next_forward_overlapped"))]
         for case, cs in cases.items()])


def plan_table(cases: dict[str, dict]) -> str:
    """The engine's planned pools (GiB) per case and mode, from `engine.memory_plan` at the first opening."""
    parts = ("params", "grads", "optimizer", "resident", "grad_stash", "readahead", "total")
    rows = [[f"{case}/{mode}", *(_fmt(sm["memory_plan"].get(p, 0) / GiB, ".2f") for p in parts)]
            for case, cs in cases.items() for mode, sm in cs["modes"].items() if "memory_plan" in sm]
    return _md_table(["case/mode", *parts], rows)


def _header(report: dict) -> str:
    st, m, hw = report["settings"], report["model"], report["hardware"]
    return (f"Model {m['name']} ({m['param_count'] / 1e6:.0f}M params, {m['n_layer']} layers, d={m['d_model']}), "
            f"batch {st['batch_size']} x seq {st['seq_len']}, micro-batches {st['micro_batches']}, "
            f"{st['compute_dtype']}, backend {st['backend']}, cpu_mem {st['cpu_mem_bytes'] / GiB:.2f} GiB (every case "
            f"and mode), {st['rounds']} rounds x {st['steps']} measured steps per case and mode "
            f"({st['warmup_steps']} warm-up per opening), every step told the next batch. "
            f"Store: {report['store']['total_bytes'] / 1e9:.2f} GB, initialized in {report['store']['init_s']:.1f} s. "
            f"Hardware: {hw['cpu_count']} CPUs, {hw['ram_bytes'] / GiB:.1f} GiB RAM, "
            f"disk {', '.join(hw['disk_devices'])}. Wall time {report['wall_seconds']:.0f} s.")


def markdown(report: dict) -> str:
    h, mem, cases = report["headline"], report["memory"], report["cases"]
    lines = [
        f"# ago_bench — {report['timestamp']}", "", f"`{report['command']}`", "", _header(report), "",
        "| key | value |", "|---|---|",
        *(f"| {k} | {_fmt(v, '.3f') if isinstance(v, float) or v is None else v} |" for k, v in h.items()), "",
        f"Targets: {', '.join(f'{k}: {v}' for k, v in report['targets_met'].items())}", "",
        "Per clipping case: median step time per mode (s), optimized's speedups and overlap_efficiency, and the "
        "shares of measured steps (every mode) that clipped, deferred their update until the norm was known, "
        "redid a speculated update, and ran the next step's forward beside the optimizer pass.", "",
        case_table(cases), "",
        "Per case, seconds per step, medians over the measured steps. Lanes are `engine.last_stats.lanes`; "
        "`overlap_eff` = max(gpu, ssd, cpu) / step (median of the per-step values). "
        "Second table: `disk_busy` = seconds the disk had any I/O in flight (/proc/diskstats), `disk GB/s` = "
        "(read + written bytes) / disk_busy; compute-thread time outside the lanes (blocked acquiring a "
        "gradient buffer, commit = fsync + commit record, unaccounted rest); the optimizer thread idle "
        "waiting for gradients and for its READs; CPU as fractions of all cores (this process / anything "
        "else / idle).", "",
    ]
    for case, cs in cases.items():
        lines += [f"## {case} (max_grad_norm {cs['overrides']['max_grad_norm']:g})", "", mode_tables(cs["modes"]), ""]
    lines += [
        f"Memory: peak RSS {mem['peak_rss_bytes'] / GiB:.2f} GiB vs limit {mem['limit_bytes'] / GiB:.2f} GiB = "
        f"baseline {mem['baseline_rss_bytes'] / GiB:.2f} + cpu_mem {mem['cpu_mem_bytes'] / GiB:.2f} + activations "
        f"(estimate) {mem['activations_estimate']['total'] / GiB:.2f}; pools allocated at peak "
        f"{mem['pools_peak_allocated_bytes'] / GiB:.2f} GiB. The engine's planned pools (GiB):", "",
        plan_table(cases), "", "Raw step times (s):", "",
        *(f"- {case}/{mode}: " + ", ".join(f"{x:.2f}" for x in s["step_s_all"])
          for case, cs in cases.items() for mode, s in cs["modes"].items()), "",
    ]
    if report.get("notes"):
        lines += ["Notes:", "", *(f"- {n}" for n in report["notes"]), ""]
    return "\n".join(lines)


def _remove_store(dirs: list[str]) -> None:
    """Every file of the run (slabs, records, the activation profile an opening saves; lohan's own list), not the
    directory's lock file, which any run in it shares."""
    from lohan.store.files import remove_files, run_files

    remove_files(dirs, run_files(STORE_NAME))


# ------------------------------------------------------------------------------------- main
@dataclasses.dataclass
class Run:
    """What the report is built from: the setup's figures, then what the rounds measured."""

    t_start: float
    pairs: list[tuple[str, str]]
    layout: Any  # the store's StoreLayout
    needs: dict[str, dict]  # per 'case/mode': planned pools with memory to spare (what --cpu-mem auto sizes from)
    baseline_rss: int  # this process's RSS before any engine was built
    activations: dict[str, int]
    env: dict
    init_s: float = 0.0
    store_bytes: int = 0
    records: list[dict] = dataclasses.field(default_factory=list)
    openings: list[dict] = dataclasses.field(default_factory=list)


def prepare(args: argparse.Namespace, t_start: float) -> tuple[Bench, Run]:
    """Imports, the base config with its cpu_mem (auto: the largest planned need), the data stream, probes."""
    import psutil
    import torch

    import lohan
    from lohan.config import EngineConfig, get_model_config

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    baseline_rss = psutil.Process().memory_info().rss
    mcfg = get_model_config(args.model, seq_len=args.seq_len)
    for d in args.nvme:
        os.makedirs(d, exist_ok=True)
    env = environment(args.nvme)  # at the start: the commit and the tree the run actually imported
    base = EngineConfig(nvme=tuple(args.nvme), cpu_mem=64 * GiB, compute_dtype=args.compute_dtype,
                        micro_batches=args.micro_batches, backend=args.backend, prefetch_depth=args.prefetch_depth,
                        max_inflight_blocks=args.max_inflight_blocks, name=STORE_NAME,
                        resident_mem=0)  # the modes are compared on the records they stream, not on RAM
    pairs = [(case, mode) for case in args.cases for mode in args.modes]
    layout, needs = plan_needs(mcfg, base, pairs, args.clip_norm)  # with memory to spare: what each would take
    need = max(p["total"] for p in needs.values())
    base = base.with_overrides(cpu_mem=(math.ceil(need / (GiB // 4)) * (GiB // 4)) if args.cpu_mem == "auto"
                               else args.cpu_mem)
    plan_needs(mcfg, base, pairs, args.clip_norm)  # every pair fits that budget (MemoryPlanError otherwise)
    acts = activation_bytes(mcfg, args.batch_size, args.seq_len, args.micro_batches, args.compute_dtype)
    n_steps = args.rounds * len(pairs) * (args.warmup_steps + args.steps)
    batches = make_batches(mcfg.vocab_size, args.batch_size, args.seq_len, n_steps + 1, args.data_seed)
    device = _block_device(args.nvme[0])
    log(f"model {mcfg.name}: {mcfg.param_count() / 1e6:.1f}M params, batch {args.batch_size} x seq {args.seq_len}; "
        f"store {layout.total_bytes / 1e9:.2f} GB in {args.nvme}; cpu_mem {base.cpu_mem / GiB:.2f} GiB "
        f"(largest need {need / GiB:.2f} GiB); activations ~{acts['total'] / GiB:.2f} GiB; "
        f"torch threads {torch.get_num_threads()}; disk {device}; {len(pairs)} (case, mode) pairs x "
        f"{args.rounds} rounds, {n_steps} steps")
    bench = Bench(lohan, mcfg, base, args, batches, device, RssSampler(), log)
    return bench, Run(t_start, pairs, layout, needs, baseline_rss, acts, env)


def init_store(bench: Bench, run: Run) -> None:
    """Lay out and initialize the store once; every opening then resumes it."""
    case, mode = run.pairs[0]
    t0 = time.perf_counter()
    engine = bench.lohan.init(bench.mcfg, bench.base.with_overrides(
        mode=mode, **case_overrides(case, bench.args.clip_norm)), overwrite=True)
    run.store_bytes = engine.store.layout.total_bytes
    engine.close()
    run.init_s = time.perf_counter() - t0
    bench.log(f"store initialized in {run.init_s:.1f} s ({run.store_bytes / 1e9:.2f} GB laid out, "
              f"{run.layout.slot_bytes / 1e9:.2f} GB written)")


def build_report(args: argparse.Namespace, bench: Bench, run: Run) -> dict:
    """The JSON report: headline keys at the top level and under `headline`, then everything measured."""
    cases = {case: case_summary(run.records, case, args.modes, case_overrides(case, args.clip_norm))
             for case in args.cases}
    notes = [n for case, cs in cases.items() for n in check_case(case, cs)]
    notes += [n for case, cs in cases.items() for mode, sm in cs["modes"].items() for n in check_machine(case, mode, sm)]
    notes += attach_plans(cases, run.openings, run.baseline_rss, run.activations["total"])
    notes += check_activation_plans(run.records)
    peak_rss = max(r["rss_peak_bytes"] for r in run.records)
    limit = run.baseline_rss + bench.base.cpu_mem + run.activations["total"]
    headline = headline_keys(cases, peak_rss, limit)
    mcfg, layout, base = bench.mcfg, run.layout, bench.base
    p16 = 2 if args.compute_dtype == "bf16" else 4
    return {
        **headline, "headline": headline, "targets_met": targets_met(headline), "cases": cases,
        "model": {"name": mcfg.name, "param_count": mcfg.param_count(), "n_layer": mcfg.n_layer,
                  "n_head": mcfg.n_head, "d_model": mcfg.d_model, "vocab_size": mcfg.vocab_size,
                  "seq_len": mcfg.seq_len, "flops_per_token_fwd": mcfg.flops_per_token(args.seq_len)},
        "settings": {"batch_size": args.batch_size, "seq_len": args.seq_len, "micro_batches": args.micro_batches,
                     "tokens_per_step": args.batch_size * args.seq_len, "modes": args.modes, "cases": args.cases,
                     "case_overrides": {c: case_overrides(c, args.clip_norm) for c in args.cases},
                     "clip_norm": args.clip_norm, "clip_mode": base.clip_mode, "data_seed": args.data_seed,
                     "next_batch": True, "rounds": args.rounds, "steps": args.steps,
                     "warmup_steps": args.warmup_steps, "compute_dtype": args.compute_dtype,
                     "backend": args.backend, "nvme": args.nvme, "cpu_mem_bytes": base.cpu_mem,
                     "cpu_mem_arg": args.cpu_mem, "resident_mem": base.resident_mem,
                     "readahead_mem": base.readahead_mem, "prefetch_depth": args.prefetch_depth,
                     "max_inflight_blocks": args.max_inflight_blocks, "threads": args.threads, "quick": args.quick},
        "store": {"total_bytes": run.store_bytes, "slot_bytes": layout.slot_bytes, "init_s": run.init_s,
                  "blocks": len(layout.blocks), "largest_record_bytes": max(b.record_bytes for b in layout.blocks),
                  "bytes_per_step_expected": {"read": (12 + 2 * p16) * layout.param_count,
                                              "write": (12 + p16) * layout.param_count}},
        "memory": {"peak_rss_bytes": peak_rss, "baseline_rss_bytes": run.baseline_rss, "cpu_mem_bytes": base.cpu_mem,
                   "activations_estimate": run.activations, "limit_bytes": limit,
                   "need_bytes": run.needs, "need_bytes_max": max(p["total"] for p in run.needs.values()),
                   "pools_peak_allocated_bytes": max(sum(p["peak_allocated"] for p in o["pools"].values())
                                                     for o in run.openings),
                   "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        "openings": run.openings,
        "records": run.records,
        **run.env,
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "timestamp": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - run.t_start,
        "notes": notes,
    }


def write_report(report: dict, out: str | None) -> tuple[dict, Path]:
    """Write the JSON (made portable: no path of this machine) and its markdown summary; the portable report."""
    variant = {"quick": report["settings"]["quick"]} if "settings" in report else {}
    report.update(result_fields("ago_bench", variant))
    path = result_path("ago_bench", variant, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)
    path.write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(report))
    return report, path


def print_summary(report: dict, path: Path) -> None:
    print()
    print(case_table(report["cases"]))
    for case, cs in report["cases"].items():
        print(f"\n{case} (max_grad_norm {cs['overrides']['max_grad_norm']:g}):\n")
        print(mode_tables(cs["modes"]))
    print()
    for k, v in report["headline"].items():
        print(f"{k:36s} {v:.3f}" if isinstance(v, float) else f"{k:36s} {v}")
    print(f"targets: {report['targets_met']}")
    for note in report["notes"]:
        print(f"note: {note}")
    print(f"wrote {path} and {path.with_suffix('.md')} ({report['wall_seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench, run = prepare(args, time.perf_counter())
    try:
        init_store(bench, run)
        run.records, run.openings = run_rounds(bench, run.pairs)
    finally:
        bench.sampler.stop()
        if not args.keep_store:
            _remove_store(args.nvme)
    report, path = write_report(build_report(args, bench, run), args.out)
    print_summary(report, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
