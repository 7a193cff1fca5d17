"""Before anything is written: does the run fit this machine (or a described one), and what would it cost?

`detect_hardware` describes the machine the run is on: the compute device, its throughput (a short
matmul measurement) and, on CUDA, the memory free on it (what the plan must fit), main memory (psutil),
free space of the NVMe directories, and the CPU optimizer's rate (a short measurement of the engine's
own AdamW kernel, `measure_cpu_adam`). SSD bandwidth is
measured by the engine's first step (a write then a read through the volume, saved with the run's
profile as `<nvme>/<name>.profile.json`); when that file exists it is used, otherwise the bandwidth is
`ASSUMED_SSD_GBPS` per directory, labelled as an assumption (measuring here would mean writing).
`fit_report` runs the capacity planner (DESIGN.md §4.4, `planner.capacity`) and adds the predicted step
time, TFLOPS, time per epoch and the cost model's lanes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import time
from dataclasses import dataclass

import psutil
import torch

from lohan.config import ModelConfig
from lohan.plan import durability
from lohan.plan.memory import SLACK_BYTES, SLACK_FACTOR
from lohan.plan.planner import (
    DEFAULT_CPU,
    HARDWARE_PRESETS,
    HOST_SHARED_PARTS,
    Capacity,
    CpuSpec,
    Hardware,
    Profile,
    SsdCost,
    capacity,
    parse_hardware,
    plan_capacity,
    ssd_cost,
)
from lohan.plan.pools import ram_budget
from lohan.plan.run_plan import RunPlan
from lohan.runtime.device import Device, resolve_device
from lohan.runtime.optim import AdamWHyper, adamw_chunk_
from lohan.runtime.profiler import measure_quant_rate
from lohan.store.files import run_files
from lohan.store.integrity import tensor_hash
from lohan.store.states import DTYPES

ASSUMED_SSD_GBPS = 2.0
"""Per-directory read and write GB/s assumed for a dry run on this machine (not measured: no writes)."""


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def nvme_problems(dirs: tuple[str, ...] | list[str]) -> list[str]:
    """What stops the NVMe directories from holding a store, checked without creating or writing anything.

    The engine creates the directories and the volume checks them again, but by then a directory may have
    been made; these are the mistakes found on paths alone: a path that is a file (or lies under one), a
    directory named twice, a place the process cannot write. Each problem says how to fix it.
    """
    problems: list[str] = []
    seen: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(d)
        if real in seen:
            problems.append(f"--nvme names {d} twice" + (f" (also as {seen[real]})" if seen[real] != d else "")
                            + ": list each SSD directory once")
            continue
        seen[real] = d
        if os.path.exists(d) and not os.path.isdir(d):
            problems.append(f"--nvme {d} is a file, not a directory: pass a directory for the states (an "
                            "existing one, or a new path that lohan creates)")
            continue
        parent = _existing_parent(d)
        if not os.path.isdir(parent):
            problems.append(f"--nvme {d} cannot be created: {parent} is a file, not a directory; pass a path "
                            "under a directory")
        elif shutil.disk_usage(parent).total == 0:  # procfs, sysfs: no blocks to hold anything
            problems.append(f"--nvme {d} is on a filesystem without storage ({parent} is like /proc or /sys, a view "
                            "of the kernel): pass a directory on an SSD")
        elif not os.access(parent, os.W_OK | os.X_OK):  # also False on a read-only mount, even for root
            where = "is" if parent == os.path.abspath(d) else f"cannot be created: {parent} is"
            problems.append(f"--nvme {d} {where} not writable by this user; fix the permissions or pass another "
                            "directory")
    return problems


def local_problems(nvme: tuple[str, ...], cpu_mem: int) -> list[str]:
    """Settings this machine cannot honour, found before anything is written: the NVMe paths
    (:func:`nvme_problems`) and a main-memory budget larger than the RAM."""
    problems = nvme_problems(nvme)
    ram = psutil.virtual_memory().total
    if cpu_mem > ram:
        problems.append(f"--cpu-mem {cpu_mem / 2**30:.2f} GiB is more than this machine's RAM "
                        f"({ram / 2**30:.2f} GiB); give a budget below it, leaving room for the OS and the process")
    return problems


PROBE_BYTES = 64 << 20
"""What the first step's SSD speed probe writes beside the store (profiler.measure_ssd_bandwidth's default)."""


def _free_ssd_bytes(dirs: tuple[str, ...], store_name: str | None = None) -> int:
    """Bytes the run may use over the directories: what is free, each filesystem counted once (dirs on one disk
    share its space), plus what the store's own files take there already (a resume reuses them, an overwrite
    replaces them: a store that fills its disk can be resumed), less the speed probe of the first step (none
    when a run saved its profile there: the run resumed measures nothing)."""
    seen: dict[int, int] = {}
    for d in dirs:
        p = _existing_parent(d)
        seen.setdefault(os.stat(p).st_dev, shutil.disk_usage(p).free)
    credit = store_bytes(dirs, store_name) if store_name else 0
    probed = bool(store_name) and os.path.exists(os.path.join(dirs[0], f"{store_name}.profile.json"))
    # at least 1: the capacity planner reads 0 as "unknown, not checked", and a disk without room for the probe
    # must be refused, not waved through
    return max(1, sum(seen.values()) + credit - (0 if probed else PROBE_BYTES))


def store_bytes(dirs: tuple[str, ...], name: str) -> int:
    """Disk space the files of store `name` take in `dirs` (and in their data-parallel rank<r> subdirectories):
    blocks allocated, so a preallocated slab counts in full and a sparse one for what it holds."""
    total, counted = 0, set()
    for d in dirs:
        if not os.path.isdir(d):
            continue
        places = [d] + [os.path.join(d, r) for r in sorted(os.listdir(d)) if r.startswith("rank")
                        and os.path.isdir(os.path.join(d, r))]
        for place in places:
            for filename in run_files(name):
                path = os.path.join(place, filename)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) not in counted:
                    counted.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def _matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


@functools.lru_cache(maxsize=8)
def measure_cpu_adam(numel: int = 1 << 22, compute_dtype: str = "bf16", checksums: bool = True,
                     repeats: int = 3) -> float:
    """Parameters per second this machine's CPU updates the way the engine's optimizer does (runtime/offload.py):
    the compute-dtype gradient upcast to fp32, torch's fused AdamW on P32, m, v, the P16 copy and, with
    ``checksums``, the XXH3 of the record read and of the one written. Best of ``repeats`` on ``numel``
    parameters (about 100 MB at the default, more than a CPU's last-level cache, as a record fresh
    from the SSD is; a few tenths of a second, once per process).

    Measured alone: in a run the optimizer shares the cores with the compute thread and the I/O, so
    this is the rate's upper end.
    """
    p16_dtype = DTYPES.get(compute_dtype, torch.float32)
    p32, m, v = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    grad16, grad = torch.randn(numel).to(p16_dtype), torch.empty(numel)
    p16 = torch.empty(numel, dtype=p16_dtype)
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.1)
    best = float("inf")
    for step in range(1, repeats + 2):  # the first call warms the kernel and the pages up
        t0 = time.perf_counter()
        if checksums:
            tensor_hash(p32, m, v)
        grad.copy_(grad16)
        adamw_chunk_(p32, grad, m, v, p16, step, hyper)
        if checksums:
            tensor_hash(p32, m, v)
            tensor_hash(p16)
        if step > 1:
            best = min(best, time.perf_counter() - t0)
    return numel / best


def _measured_ssd(nvme: tuple[str, ...], store_name: str) -> tuple[float, float, str] | None:
    """(read, write) bytes/s the engine measured on these directories at a run's first step, if saved."""
    if not nvme:
        return None
    path = os.path.join(nvme[0], f"{store_name}.profile.json")
    try:
        hw = Profile.load(path).hardware
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not hw.name.endswith(f"+{len(nvme)}ssd"):  # profiler.hardware_name: measured on another set of SSDs
        return None
    return hw.bw_s2m, hw.bw_m2s, path


@dataclass(frozen=True)
class Machine:
    hardware: Hardware
    notes: tuple[str, ...]
    """What was assumed rather than measured."""
    device_is_host: bool = False
    """The CPU computes: the device working set lives in main memory next to the engine's pools."""

RUNTIME_BYTES = 2**30
"""The process itself (Python, torch, allocator slack), counted in main memory on a CPU-only run."""


def detect_hardware(nvme: tuple[str, ...], device: str = "auto", compute_dtype: str = "bf16",
                    gpu_mem: int | None = None, store_name: str = "lohan", checksums: bool = True,
                    act_compress: str = "none") -> Machine:
    """This machine as a `Hardware` record, without writing anything.

    ``store_name`` finds the profile a previous run on these directories saved (its SSD bandwidths were
    measured); ``checksums`` says whether the optimizer also hashes what it reads and writes; ``act_compress``
    ``int8`` measures how fast the device quantizes activation records (``profiler.measure_quant_rate``).

    On CUDA the device is the current one (a data-parallel rank's: `parallel.init_from_env` selects it) and
    its memory is what is *free* on it now: the CUDA context, other processes and this one's cached blocks
    are not the run's to plan with. ``gpu_mem`` narrows it, never widens it.
    """
    use_cuda = resolve_device(device) == "cuda"
    dev = torch.device("cuda" if use_cuda else "cpu")
    # measured in the dtype the run computes in, also on a CPU: bf16 there is fast with AMX or AVX-512 bf16 and ~10x
    # slower than fp32 without (lohan.plan.compute_dtype), and the plan must price what the run will see
    dtype = DTYPES.get(compute_dtype, torch.float32)
    ram = psutil.virtual_memory().total
    n = len(nvme)
    measured = _measured_ssd(tuple(nvme), store_name)
    if measured:
        bw_s2m, bw_m2s, where = measured
        notes = [f"SSD bandwidth as measured by a run's first step ({where}): read {bw_s2m / 1e9:.3g}, write "
                 f"{bw_m2s / 1e9:.3g} GB/s (a short probe: a consumer drive's write cache can make it optimistic)"]
    else:
        bw_s2m = bw_m2s = n * ASSUMED_SSD_GBPS * 1e9
        notes = [f"SSD bandwidth assumed {ASSUMED_SSD_GBPS} GB/s per directory (read and write; measured at the "
                 "first step of a real run)"]
    adam = measure_cpu_adam(compute_dtype=compute_dtype, checksums=checksums)
    notes.append(f"CPU AdamW measured at {adam / 1e9:.3g} G params/s on this machine's cores, alone (a run shares "
                 "them with compute and I/O)")
    if use_cuda:
        name = torch.cuda.get_device_name().replace(" ", "_")
        dev_mem = _free_gpu_memory(gpu_mem, notes)
        bw_g = 25e9
        notes.append("host link assumed 25 GB/s per direction (PCIe 4.0 x16)")
    else:
        name = f"cpu-{os.cpu_count()}c"
        dev_mem = int(gpu_mem) if gpu_mem else ram  # the CPU stands in for the GPU: its "device memory" is RAM
        bw_g = 20e9
        notes.append("device is the CPU: 'GPU' memory is main memory, host copies assumed 20 GB/s; compute and "
                     "AdamW share the cores, so the gpu and cpu lanes add up more than the overlapped model says")
    quant = (0.0, 0.0)
    if act_compress == "int8":
        quant = measure_quant_rate(Device(dev.type), dtype)
        notes.append(f"int8 activation records: the device quantizes {quant[0] / 1e9:.3g} GB/s of activations and "
                     f"dequantizes {quant[1] / 1e9:.3g} GB/s, measured now")
    hw = Hardware(name=f"{name},{n}xSSD,{ram / 2**30:.0f}GiB", thp_g=_matmul_flops(dev, dtype),
                  bw_g=bw_g, bw_s2m=bw_s2m, bw_m2s=bw_m2s, mem_avail=ram_budget(ram), gpu_mem=int(dev_mem),
                  ram=int(ram), ssd_bytes=_free_ssd_bytes(nvme, store_name), cpu_adam_params_per_s=adam,
                  act_quant_bps=quant[0], act_dequant_bps=quant[1])
    held = store_bytes(tuple(nvme), store_name)
    notes.append("SSD space: what is free on the --nvme filesystems" + (f", plus the {held / 2**30:.2f} GiB the "
                 f"store '{store_name}' takes there already (a resume reuses it, an overwrite replaces it)" if held
                 else "") + f", less the first step's {PROBE_BYTES >> 20} MiB speed probe (none on a resume "
                 "that saved its profile)")
    return Machine(hw, tuple(notes), device_is_host=not use_cuda)


def _free_gpu_memory(gpu_mem: int | None, notes: list[str]) -> int:
    """Bytes free on the current CUDA device, or the smaller ``gpu_mem`` a user gives; says which in ``notes``."""
    index = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    notes.append(f"GPU memory: {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB on cuda:{index} (the CUDA "
                 "context and other processes hold the rest); the plan must fit what is free")
    if gpu_mem and int(gpu_mem) < free:
        notes.append(f"GPU memory limited to engine.gpu_mem = {int(gpu_mem) / 2**30:.2f} GiB")
        return int(gpu_mem)
    if gpu_mem:
        notes.append(f"engine.gpu_mem = {int(gpu_mem) / 2**30:.2f} GiB is more than is free: planning with the "
                     "free memory")
    return int(free)


def described_hardware(desc: str) -> Machine:
    """A machine from a description such as ``rtx4090,12xP5510,256GB`` (see `planner.parse_hardware`)."""
    hw = parse_hardware(desc)
    notes = ["GPU FLOP/s and PCIe bandwidth are datasheet peaks (a real block runs below them); SSD bandwidths are "
             "effective ones (datasheet x a per-model derating, sources in planner.HARDWARE_PRESETS)"]
    cpus = [k for k, v in HARDWARE_PRESETS.items() if isinstance(v, CpuSpec)]
    if not any(c in hw.name.lower() for c in cpus) and "adam=" not in hw.name:
        sockets, model = DEFAULT_CPU
        notes.append(f"no CPU given: AdamW priced at {hw.cpu_adam_params_per_s / 1e9:.3g} G params/s, the paper "
                     f"testbed's {sockets}x{model.capitalize()} (add e.g. '2xGold5320' or 'adam=1.4e9' to the description)")
    return Machine(hw, tuple(notes))


@dataclass(frozen=True)
class FitReport:
    capacity: Capacity
    machine: Machine
    step_s: float
    tflops: float
    tokens_per_s: float
    epoch_s: float | None
    clips: bool = False
    """The run clips its gradients (max_grad_norm > 0): the plan says what a clipped step costs."""
    waits: bool = False
    """Every update waits for the step's global norm (slots=1, or clip_mode defer): ``step_s`` is the estimate's
    ``t_deferred``, not ``t_iter``."""
    defers: bool = False
    """Clipping off, an update may still run after backward beside the next forward (the plan kept room for the
    gradients: `pools.may_defer_unclipped`): the plan says what that costs."""
    ssd: SsdCost | None = None
    """Where the SSD lane binds: what a smaller state format, or more tokens per step, would do (`planner.ssd_cost`)."""
    model: ModelConfig | None = None
    batch: int = 0
    seq: int = 0
    plan_args: dict = dataclasses.field(default_factory=dict)
    """What `fit_report` planned with (`planner.capacity`'s keywords), for `measured_ssd` to price the same run."""

    def measured_ssd(self, lanes: dict[str, float], step_s: float, mode: str = "optimized") -> SsdCost | None:
        """`planner.ssd_cost` from a step's measured lanes (the first step's): None unless its ssd lane binds."""
        if self.model is None:
            return None
        return ssd_cost(self.model, self.machine.hardware, self.batch, self.seq, mode, (lanes, step_s),
                        **self.plan_args)

    @property
    def fits(self) -> bool:
        return self.capacity.fits

    def durability(self) -> str:
        """The durability interval the plan prices, and what a kill can lose (`durability.loss_text`)."""
        asked, n = self.plan_args.get("persist_every", 1), self.capacity.persist_every
        note = self.capacity.persist_note
        why = f" ({note})" if note else ""
        return (f"durability: persist_every {asked}: the records written every {n} step{'s' if n > 1 else ''}{why}; "
                f"{durability.loss_text(n, self.step_s)}")

    def format(self) -> str:
        c = self.capacity
        lines = [c.format(), "", c.plan.format_table(clip=self.clips, defer=self.defers), "",
                 f"rates: {self.machine.hardware.describe()}",
                 f"predicted step {self.step_s:.4g} s"
                 + ((" (every update after backward)" if self.defers else " (every update waits for the global norm)")
                    if self.waits else "")
                 + f" | {self.tokens_per_s:,.3g} tokens/s | {self.tflops:.3g} TFLOPS (model FLOPs)"
                 + (f" | epoch {_duration(self.epoch_s)}" if self.epoch_s else "")]
        if self.ssd is not None:
            lines.append(self.ssd.format())
        if self.plan_args.get("persist_every", 1) != 1:
            lines.append(self.durability())
        lines += [f"  note: {n}" for n in self.machine.notes]
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return (f"{d}d " if d else "") + f"{h}:{m:02d}:{s:02d}"


def data_parallel_machine(machine: Machine, world: int, local_world: int) -> Machine:
    """One rank's view of its machine, in whole-model terms, so that `fit_report` of the whole model prices
    one rank (its batch slice, passed separately): a rank moves and updates 1/N of the optimizer states and
    reads 1/N of the P16 from the SSDs, over the SSDs, CPU cores and RAM it shares with the other
    `local_world` ranks of its machine. So its SSD bandwidths, SSD space and CPU AdamW rate count N /
    local_world times (1/N of the work at 1/local_world of the rate), its main memory 1/local_world (its
    host pools hold whole blocks' P16), and a CPU that computes is shared too. Network time is not priced:
    `parallel.network_bytes_per_step` gives the bytes."""
    if world <= 1:
        return machine
    hw, k = machine.hardware, world / local_world
    shared = dataclasses.replace(
        hw, name=f"{hw.name}, 1 of {world} ranks", bw_s2m=hw.bw_s2m * k, bw_m2s=hw.bw_m2s * k,
        ssd_bytes=int(hw.ssd_bytes * k), cpu_adam_params_per_s=hw.cpu_adam_params_per_s * k,
        ram=hw.ram // local_world, mem_avail=hw.mem_avail // local_world,
        thp_g=hw.thp_g / local_world if machine.device_is_host else hw.thp_g)
    return dataclasses.replace(machine, hardware=shared,
                               notes=machine.notes + (f"data parallel: one rank of {world}, {local_world} per machine",))


def fit_report(mcfg: ModelConfig, machine: Machine, batch: int, seq: int, compute_dtype: str = "bf16",
               micro_batches: int = 1, prefetch_depth: int = 2, steps_per_epoch: int | None = None,
               slots: int = 2, keep_grads: bool = False, resident_mem: int | str = 0,
               cpu_mem: int | None = None, readahead_mem: int | str = "auto", clip_mode: str = "auto",
               clips: bool | None = None, state_format: str = "exact", act_compress: str = "none",
               heap_reuse: bool = True, persist_every: int | str = 1) -> FitReport:
    """The capacity plan of a design given as keywords and its predicted speed. ``keep_grads``: the step keeps
    its gradients (clipping or slots=1); ``clips``: the run clips (max_grad_norm > 0; None: as ``keep_grads``
    says); ``act_compress``: the engine's setting (int8 records priced compressed, `planner.capacity`).
    ``heap_reuse``: the engine's setting, which on a CPU device keeps the freed device working set in the heap
    (the allocator slack `plan.memory` bounds the peak RSS with). ``persist_every``: the engine's durability
    interval (`planner.capacity` prices the record writes at 1/N per step where it applies). A run prices its
    own plan, its whole EngineConfig: :func:`plan_report`."""
    plan_args = dict(compute_dtype=compute_dtype, micro_batches=micro_batches, prefetch_depth=prefetch_depth,
                     slots=slots, keep_grads=keep_grads, resident_mem=resident_mem, cpu_mem=cpu_mem,
                     readahead_mem=readahead_mem, clip_mode=clip_mode, state_format=state_format,
                     act_compress=act_compress, host_device=machine.device_is_host, persist_every=persist_every)
    cap = capacity(mcfg, machine.hardware, batch, seq, **plan_args)
    return _report(mcfg, machine, batch, seq, cap, steps_per_epoch, keep_grads if clips is None else clips,
                   clip_mode, heap_reuse, plan_args)


def plan_report(mcfg: ModelConfig, machine: Machine, batch: int, seq: int, plan: RunPlan,
                steps_per_epoch: int | None = None) -> FitReport:
    """The capacity plan and predicted speed of a run's own plan (`run_plan.plan_run` on the engine's geometry
    and the whole EngineConfig, `plan.engine`): the pools the engine will allocate, and its refusal where they
    exceed cpu_mem (`planner.plan_capacity`). ``batch``: this process's."""
    ex, mem, store, clip = plan.engine.execution, plan.engine.memory, plan.engine.store, plan.engine.stability
    # the other state formats (`planner.ssd_cost`) are priced as designs of the same settings
    plan_args = dict(compute_dtype=ex.compute_dtype, micro_batches=ex.micro_batches, prefetch_depth=mem.prefetch_depth,
                     max_inflight=mem.max_inflight_blocks, slots=store.slots,
                     keep_grads=clip.max_grad_norm > 0 or store.slots == 1,
                     resident_mem=mem.resident_mem if mem.resident_records else 0, cpu_mem=plan.host.budget,
                     readahead_mem=mem.readahead_mem, clip_mode=clip.clip_mode, state_format=store.state_format,
                     act_compress=plan.engine.activations.act_compress, host_device=machine.device_is_host,
                     persist_every=ex.persist_every if plan.world == 1 else 1, opt_chunk_bytes=int(mem.opt_chunk_bytes))
    cap = plan_capacity(mcfg, machine.hardware, batch, seq, plan)
    return _report(mcfg, machine, batch, seq, cap, steps_per_epoch, clip.max_grad_norm > 0, clip.clip_mode,
                   mem.heap_reuse, plan_args, ex.mode)


def _report(mcfg: ModelConfig, machine: Machine, batch: int, seq: int, cap: Capacity, steps_per_epoch: int | None,
            clips: bool, clip_mode: str, heap_reuse: bool, plan_args: dict, mode: str = "optimized") -> FitReport:
    """The report of a capacity plan: its predicted step is the estimate's ``t_iter`` (updates under backward),
    or ``t_deferred`` where every update waits for the global norm (slots=1, or ``clip_mode`` defer: with
    clipping off too, where the plan keeps room for the gradients)."""
    slots = plan_args["slots"]
    if machine.device_is_host:
        cap = _with_device_in_ram(cap, machine.hardware, heap_reuse)
    defers = not clips and slots == 2 and "grad_stash" in cap.cpu_parts  # the plan kept room for the gradients
    # (steps between durable ones update after the gradient norm is known: their states have no copy on the SSDs)
    waits = slots == 1 or (clip_mode == "defer" and (clips or defers)) or cap.persist_every > 1
    est = cap.plan.estimate
    step_s = est.t_deferred if waits and est.t_deferred else est.t_iter
    tokens = batch * seq
    flops = 3 * mcfg.flops_per_token(seq) * tokens
    return FitReport(cap, machine, step_s, flops / step_s / 1e12, tokens / step_s,
                     steps_per_epoch * step_s if steps_per_epoch else None, clips, waits, defers,
                     ssd_cost(mcfg, machine.hardware, batch, seq, mode, **plan_args), mcfg, batch, seq, plan_args)


def _with_device_in_ram(cap: Capacity, hw: Hardware, heap_reuse: bool = True) -> Capacity:
    """On a CPU-only run the device's working set is in main memory too: its parameters are the host
    pool's buffers (no copy), but a block's activations and gradients, the logits and the process add up
    (`planner.HOST_SHARED_PARTS`: the parts that do not), and so does the allocator's slack as `plan.memory`
    bounds the peak RSS: with heap reuse, the heap keeps the working set it freed, fragmented (a 13b-shaped
    layer here: 1.2-2.8 GB above its live bytes, none with heap reuse off)."""
    extra = {k: v for k, v in cap.gpu_parts.items() if k not in HOST_SHARED_PARTS}
    extra["allocator slack"] = int(SLACK_BYTES + (SLACK_FACTOR * sum(extra.values()) if heap_reuse else 0))
    extra["runtime"] = RUNTIME_BYTES
    cpu_parts = {**cap.cpu_parts, **{f"device {k}": v for k, v in extra.items()}}
    need = sum(cpu_parts.values())
    limit = cap.limits["cpu"]
    reasons = [r for r in cap.reasons if not r.startswith(("main memory", "GPU memory"))]
    if limit and need > limit:
        parts = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in cpu_parts.items())
        reasons.insert(0, f"main memory: needs {need / 1e9:.2f} GB ({parts}) but {limit / 1e9:.2f} GB is usable "
                          f"({hw.ram / 1e9:.2f} GB RAM minus the OS reserve); the device is the CPU, so its "
                          "working set shares main memory with the engine's pools")
    return dataclasses.replace(cap, cpu_bytes=need, cpu_parts=cpu_parts, gpu_bytes=0, gpu_parts={},
                               limits={**cap.limits, "gpu": 0}, reasons=tuple(reasons), fits=not reasons)
