"""The engine's main-memory pools, priced once (issue 27): what `Engine.__init__` allocates, what the capacity
planner and the dry run price, and what the run header prints all come from :func:`plan_host_memory`.

The engine keeps its host memory in hard-budgeted buffer pools (`io_engine.BufferPool`):

- params: the P16 buffers of the blocks being streamed: the current block, ``prefetch_depth`` read ahead and as
  many kept over the forward/backward turn, plus the blocks a tied weight is borrowed from (kept all step);
  never more than every block at once (small models);
- grads: the host gradient buffers (``grad_dtype``): one block filling while the one before is queued for the
  optimizer (serial mode: every block's until backward ends; optimized mode: every block's too where what cpu_mem
  leaves after the other pools holds them, so backward does not wait for an optimizer that fell behind, else
  ``grads_short`` says what it lacks); data parallel: the whole block being reduced and the rank's shards. Where
  the CPU computes with one micro-batch and one process, and the plan counts every gradient, the optimizer takes
  autograd's own gradients and the pool holds none (:func:`hands_over_grads`, ``grads_handed``: the same bytes,
  alive only from their block's backward to their update, or the step's end where kept). The borrowed gradients of tied weights are autograd's, on the device, never in this pool
  (``planner.gpu_need``'s "borrowed gradients"; a CPU device's: :func:`device_grad_bytes`);
- optimizer: the record pool (``record_pool_bytes``: ``max_inflight_blocks`` records, or chunks, in flight, the
  records bigger than those kept) and the fp32 scratch bf16 gradients are upcast and clipped ones scaled into
  (``upcast_bytes``; the offloader allocates it itself, so the record pool's budget is the plan's ``records``);
- resident: more room in the record pool, for records kept from step to step (``resident_mem``);
- readahead: more room in the record pool, for records read during backward ahead of an update that waits for
  the global norm or ahead of the gradients (``readahead_mem``; optimized mode: :func:`reads_ahead`);
- grad_stash: the step's gradients kept for a clipped (deferred or redone) update, or until an in-place step is
  known to be finite (``keeps_all_grads``), as far as ``cpu_mem`` allows; the rest goes to the SSDs
  (``store.gradstash``). The stash keeps the grads pool's own buffers (no copy), so where every gradient fits
  the pool holds each block's buffer once: ``grad_stash`` is what that adds to ``grads`` (it counted them twice:
  4.88 GB too many for a 175b-shaped layer). Where some spill, the pool also holds the buffer of the spill write
  in flight. In serial mode the grads pool holds them already. Clipping off, an update may still run after
  backward beside the next forward (``may_defer_unclipped``): then too, where they all fit.

When the CPU is the compute device, what it holds beside these pools (autograd's gradients of a block, the tied
weights' borrowed ones: :func:`device_grad_bytes`) comes out of the machine's memory before the ``auto`` rooms
(resident, read-ahead) take half of what is left (``host_device``), as it does out of the capacity planner's.

Torch-free: the geometry is a :class:`~lohan.plan.records.StoreLayout` (records laid out by
``lohan.plan.records``, the store's own geometry) and the settings an ``EngineConfig``. With ``align=1`` the same
arithmetic prices a model's pools without the 4 KiB padding of each section and buffer (the capacity planner's
figures; the engine's are at most a few KiB per buffer above them).

The record pool's units (chunks, scratch, resident records) are in :mod:`lohan.plan.record_pool` and the geometry
in :mod:`lohan.plan.pool_geometry`; this module plans the pools from them and re-exports their public names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from io_engine.align import align_up, size_text
from lohan.config import EngineConfig
from lohan.plan.pool_geometry import PoolGeometry, device_grad_bytes, model_geometry
from lohan.plan.record_pool import (
    FORMAT_ELEMS,
    UPCAST_ELEMS,
    chunk_elem_bytes,
    format_work_bytes,
    optimizer_chunk_elems,
    plan_resident,
    readahead_every,
    record_pool_bytes,
    resident_every,
    resident_extra,
    upcast_bytes,
    zero_copy_blocks,
)
from lohan.plan.records import P16_ITEMSIZE, chunk_record_bytes

__all__ = [
    "OS_RESERVE", "UPCAST_ELEMS", "FORMAT_ELEMS", "OPT_CHUNK_BYTES", "MemoryPlanError", "PoolGeometry", "HostMemoryPlan",
    "ram_budget", "zero_copy_blocks", "grad_dtype", "hands_over_grads", "grad_itemsize", "keeps_all_grads", "may_defer_unclipped", "kept_p16_fraction", "reads_ahead", "optimizer_chunk_elems", "chunk_elem_bytes", "upcast_bytes",
    "record_pool_bytes", "plan_resident", "resident_every", "resident_extra", "readahead_every", "model_geometry",
    "plan_host_memory", "pool_config", "chunk_record_bytes", "device_grad_bytes", "memory_refusal",
]

OS_RESERVE = 0.10
"""Fraction of main memory left to the OS, page cache and the Python process itself (the one definition: the
hardware description, the detected machine and the capacity planner's RAM budget all take it off)."""

OPT_CHUNK_BYTES = 512 * 2**20
"""The engine's default ``opt_chunk_bytes``: bigger optimizer records are updated in chunks."""


class MemoryPlanError(ValueError):
    """The main-memory budget cannot hold the engine's minimum working set."""


def ram_budget(ram: int) -> int:
    """What a machine with ``ram`` bytes of RAM gives a run: all of it less :data:`OS_RESERVE`."""
    return int(ram * (1 - OS_RESERVE))


def grad_dtype(compute_dtype: str, micro_batches: int = 1, world: int = 1) -> str:
    """The dtype of the host gradient buffers, as a compute-dtype name. With one micro-batch and one rank nothing
    is accumulated, and the bf16 gradients of bf16 parameters are kept as they are (half the memory of fp32; the
    optimizer upcasts them exactly, chunk by chunk). Accumulation over micro-batches or ranks, fp32 compute and
    fp16 (whose gradients are unscaled from the loss scale on the host) use fp32."""
    return "bf16" if compute_dtype == "bf16" and micro_batches * world == 1 else "fp32"


def hands_over_grads(cfg: EngineConfig, world: int, host_device: bool) -> bool:
    """Whether backward may hand autograd's own gradients to the optimizer, with no host gradient buffer and no
    copy into one: the CPU computes (its gradients are in main memory already), one process (data parallel sums
    them into a buffer and keeps the rank's shard of it), one micro-batch (nothing to sum) and gradients in the
    buffers' dtype (fp16's are unscaled into fp32 ones). The plan does so only where it counts every block's
    gradient in RAM (`HostMemoryPlan.grads_handed`): nothing then bounds them but the plan."""
    c = cfg.execution.compute_dtype
    return host_device and world == 1 and cfg.execution.micro_batches == 1 and grad_dtype(c) == c


def grad_itemsize(compute_dtype: str, micro_batches: int = 1, world: int = 1) -> int:
    """Bytes per element of the host gradient buffers (:func:`grad_dtype`)."""
    return P16_ITEMSIZE[grad_dtype(compute_dtype, micro_batches, world)]


def keeps_all_grads(cfg: EngineConfig) -> bool:
    """Whether a step holds every block's gradient at once: serial mode updates after backward; clipping needs the
    global norm (a deferred or redone update); slots=1 writes nothing before the step is known to be finite."""
    return cfg.execution.mode == "serial" or cfg.stability.max_grad_norm > 0 or cfg.store.slots == 1


def may_defer_unclipped(cfg: EngineConfig, world: int = 1) -> bool:
    """Clipping off: whether a step may still run its update after backward, in forward order with the next
    step's forward beside it (``clip_mode`` defer, or auto where that measures faster: a CPU device that shares
    its cores with the optimizer fills its forward's idle time so), for which it keeps the step's gradients.
    One process, two slots, not serial mode (the ablation's baseline: ZeRO-Infinity's schedule)."""
    return (cfg.stability.max_grad_norm <= 0 and cfg.store.slots == 2 and cfg.execution.mode != "serial" and world == 1
            and cfg.stability.clip_mode != "speculate")


def kept_p16_fraction(params_bytes: int, p16: tuple[int, ...] | list[int], prefetch_depth: int) -> float:
    """The share of the model's P16 the parameter pool (``params_bytes``) keeps over a forward/backward turn
    (``planner.Profile.kept_p16_params``): all of it where the pool holds every block, else what the blocks in use
    (the current one and those read ahead) leave."""
    total = sum(p16)
    if not total or params_bytes >= total:
        return 1.0
    return max(0, params_bytes - (prefetch_depth + 1) * max(p16)) / total


def reads_ahead(cfg: EngineConfig) -> bool:
    """Whether the optimizer READs records ahead of their update into the read-ahead room (``readahead_mem``):
    optimized mode. Ahead of the gradients when the update runs during backward (a bigger room smooths the SSDs'
    pace: the 350m bench's step went from 5.9 to 5.6 s with clipping off), and, where a step waits for the global
    norm (clipping's deferred steps, slots=1), during the whole backward instead of after it."""
    return cfg.execution.mode == "optimized"


@dataclass(frozen=True)
class HostMemoryPlan:
    """Bytes of each main-memory pool of the engine (module docstring); each is a hard budget.

    `params`, `grads` + `grad_stash` (the grads pool's budget), `records` + `resident` + `readahead` (the record
    pool's budget) and `upcast` add up to `total`, which is at most `budget` (cpu_mem) when
    :func:`plan_host_memory` checks.
    """

    params: int
    grads: int
    records: int
    upcast: int
    """The optimizer's scratch: the fp32 gradient pieces (`upcast_bytes`) and a compressed format's update
    temporaries (`format_work_bytes`)."""
    resident: int
    grad_stash: int
    budget: int
    grad_itemsize: int
    chunk_elems: int
    has_stash: bool = False
    """A step keeps its gradients beyond the grads pool (clipping or slots=1, not serial mode)."""
    stash_ram: int | None = None
    """RAM the gradient stash keeps the step's gradients in (serial mode: the grads pool's own buffers)."""
    resident_all: int = 0
    """What `resident_mem` would add to keep every record that can stay (`resident_mem: all`)."""
    resident_blocks: tuple[int, ...] = ()
    """Blocks whose records the record pool keeps from step to step (:func:`plan_resident`)."""
    readahead: int = 0
    """Room in the record pool for READs issued during backward ahead of a deferred update (``readahead_mem``)."""
    readahead_all: int = 0
    """What reading every record ahead would take (:func:`readahead_every`), where a step may defer."""
    zero_copy: tuple[int, ...] = ()
    """Resident blocks the CPU computes on in place (:func:`zero_copy_blocks`): the params pool has no buffer for
    them."""
    params_saved: int = 0
    """What `zero_copy` takes off the params pool (the P16 the CPU does not copy)."""
    grads_short: int = 0
    """What the grads pool lacks to hold every block's gradient, as serial mode's does (optimized and naive modes,
    where cpu_mem leaves too little: backward may then wait for the optimizer to give a buffer back)."""
    grads_handed: bool = False
    """`grads` and `grad_stash` are autograd's own gradients, handed to the optimizer as they are (:func:`hands_over_grads`):
    the grads pool holds none of them."""

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.records + self.upcast + self.resident
                + self.readahead + self.grad_stash)

    def parts(self) -> dict[str, int]:
        """The pools as the engine budgets them, for messages and `Engine.memory_plan`: `optimizer` the record pool
        with the upcast scratch; `grad_stash` (what the stash adds to the grads pool) when a stash exists."""
        out = {"params": self.params, "grads": self.grads, "optimizer": self.records + self.upcast,
               "resident": self.resident}
        if self.has_stash:
            out["grad_stash"] = self.grad_stash
        if self.readahead:
            out["readahead"] = self.readahead
        return out

    def describe(self) -> str:
        """Every part, finer than :meth:`parts`, for the run header."""
        grads = "grads (autograd's, not copied)" if self.grads_handed else "grads"
        rows = [("params", self.params), (grads, self.grads), ("optimizer records", self.records),
                ("optimizer scratch", self.upcast), ("resident records", self.resident)]
        if self.has_stash:
            rows.append(("gradient stash", self.grad_stash))
        if self.readahead:
            rows.append(("read-ahead records", self.readahead))
        text = ", ".join(f"{k} {size_text(v)}" for k, v in rows)
        if self.grads_short:
            text += (f"; the grads pool is {size_text(self.grads_short)} short of every block's gradient (backward "
                     "may wait for the optimizer; a larger cpu_mem gives it)")
        return text


def pool_config(compute_dtype: str = "bf16", micro_batches: int = 1, prefetch_depth: int = 2, max_inflight: int = 3,
                slots: int = 2, clip: bool = False, resident: bool = True, resident_mem: int | str = 0,
                cpu_mem: int = 0, opt_chunk_bytes: int = OPT_CHUNK_BYTES, mode: str = "optimized",
                readahead_mem: int | str = "auto", clip_mode: str = "auto") -> EngineConfig:
    """The engine settings the pools depend on, for planners that know them as flat arguments; `clip`: gradients
    are clipped (any `max_grad_norm` > 0 prices the same). `readahead_mem` sizes the read-ahead room (optimized
    mode: :func:`reads_ahead`)."""
    return EngineConfig(compute_dtype=compute_dtype, micro_batches=micro_batches, prefetch_depth=prefetch_depth,
                        max_inflight_blocks=max_inflight, slots=slots, max_grad_norm=1.0 if clip else 0.0,
                        resident_records=resident, resident_mem=resident_mem if resident else 0, cpu_mem=cpu_mem,
                        opt_chunk_bytes=opt_chunk_bytes, mode=mode, readahead_mem=readahead_mem,
                        clip_mode=clip_mode)


def plan_host_memory(geometry: PoolGeometry, cfg: EngineConfig, world: int = 1, free: int | None = None,
                     grad_size: int | None = None, check: bool = True, host_device: bool = False) -> HostMemoryPlan:
    """Bytes of every pool of the engine's main memory (module docstring); raises MemoryPlanError (with the
    least cpu_mem that fits) when they exceed `cfg.cpu_mem`, unless `check` is off (the capacity planner judges).

    `resident_mem: auto` takes half of what cpu_mem leaves after the other pools and the gradient stash, and
    of what `free` (this process's share of the machine's available memory) leaves after them: the other
    half stays for swapped activations (runtime.activations.ActivationManager) and the rest of the process.
    `host_device`: the CPU computes, and its gradients (:func:`device_grad_bytes`) come out of `free` first.

    Data parallel (`world` > 1): `geometry.local` is the rank's store (its shards), `geometry.p16_bytes` each
    block's gathered P16 buffer; whole-block gradients are reduced, then the rank's shard of each is kept for
    its optimizer. `grad_size`: the gradient buffers' itemsize when the engine overrides :func:`grad_dtype`.

    Where the CPU computes on resident records in place (`host_device`, one process: :func:`zero_copy_blocks`), the
    params pool holds the P16 of the other blocks only, and the rooms after it are sized with that pool: the plan
    starts from none and grows it to what the blocks left streaming need until the two agree (fewer records stay
    where it grows, so it only grows, and stops).
    """
    zero, saved = (), 0
    if cfg.memory.resident_records and host_device and world == 1:
        params = 0
        for _ in range(len(geometry.layout.blocks) + 1):
            plan = _sized(geometry, cfg, world, free, grad_size, host_device, params)
            zero = zero_copy_blocks(geometry.store, plan.resident_blocks, plan.chunk_elems)
            need = _streamed_params(geometry, cfg, zero)
            if need <= params:
                break
            params = need
        else:  # (never: it stops within as many rounds as there are blocks) every block streams
            plan, zero = _sized(geometry, cfg, world, free, grad_size, host_device), ()
        saved = _streamed_params(geometry, cfg) - plan.params
    else:
        plan = _sized(geometry, cfg, world, free, grad_size, host_device)
    plan = replace(plan, zero_copy=zero, params_saved=saved)
    if check:
        _check(plan, cfg)
    return plan


def _streamed_params(geometry: PoolGeometry, cfg: EngineConfig, zero: tuple[int, ...] = ()) -> int:
    """The params pool: the current block, ``prefetch_depth`` read ahead and as many kept over the forward/backward
    turn, and the borrowed-from blocks, but never more than every block at once (small models); of the blocks not
    in `zero` (those the CPU computes on in their records)."""
    p16 = [n for i, n in enumerate(geometry.p16) if i not in zero]
    return min((2 * cfg.memory.prefetch_depth + 1 + geometry.owners) * max(p16), sum(p16)) if p16 else 0


def _sized(geometry: PoolGeometry, cfg: EngineConfig, world: int, free: int | None, grad_size: int | None,
           host_device: bool, params: int | None = None) -> HostMemoryPlan:
    """`plan_host_memory` with a params pool of `params` bytes (None: :func:`_streamed_params` of every block)."""
    local, a = geometry.store, geometry.align
    chunk = optimizer_chunk_elems(local, cfg)
    inflight = cfg.memory.max_inflight_blocks
    records = record_pool_bytes(local, inflight, chunk, cfg.memory.resident_records, a)
    g = grad_size or grad_itemsize(cfg.execution.compute_dtype, cfg.execution.micro_batches, world)
    whole = [align_up(g * b.numel, a) for b in geometry.layout.blocks]
    shards = [align_up(g * b.numel, a) for b in local.blocks]
    # one filling, one queued (serial mode: every block's gradient until backward ends); data parallel: one
    # filling, one being reduced, and the shards of them as above
    kept = sum(shards) if cfg.execution.mode == "serial" else min(2 * max(shards), sum(shards))
    plan = HostMemoryPlan(
        params=_streamed_params(geometry, cfg) if params is None else params,
        grads=kept if world == 1 else min(2 * max(whole), sum(whole)) + kept,
        records=records,
        upcast=upcast_bytes(local, chunk, g, clip=cfg.stability.max_grad_norm > 0) + format_work_bytes(local, chunk),
        # more records kept from step to step (no more than all of them); auto: below
        resident=0 if cfg.memory.resident_mem == "auto" else resident_extra(local, cfg, chunk, records, align=a),
        grad_stash=0, budget=int(cfg.memory.cpu_mem), grad_itemsize=g, chunk_elems=chunk,
        resident_all=resident_every(local, inflight, chunk, records, a) if cfg.memory.resident_records else 0)
    if keeps_all_grads(cfg) and cfg.execution.mode != "serial":
        # Clipping (a deferred or redone update) and in-place updates (slots=1: nothing is written before the
        # step is known to be finite) keep the step's gradients: in main memory as far as cpu_mem allows,
        # the rest on the SSDs (store.gradstash)
        plan = _with_stash(plan, shards, kept, host_device)
    elif cfg.execution.mode == "serial":  # the grads pool holds every gradient: the stash keeps those very buffers
        plan = replace(plan, stash_ram=sum(shards))
    elif may_defer_unclipped(cfg, world) and cfg.stability.clip_mode == "defer":  # clipping off, every update deferred
        plan = _with_stash(plan, shards, kept, host_device)
    if free is not None and host_device:
        free = max(0, free - device_grad_bytes(geometry, cfg.execution.micro_batches, g))
    # half of what cpu_mem (and the machine) leave goes to records: resident ones first (auto), read-ahead room
    # with the rest of that half (auto); the other half stays for swapped activations and the process
    share = max(0, (plan.budget if free is None else min(plan.budget, free)) - plan.total) // 2
    if cfg.memory.resident_mem == "auto":
        plan = replace(plan, resident=resident_extra(local, cfg, chunk, records, room=share, align=a))
        share -= plan.resident
    if cfg.memory.resident_records:
        plan = replace(plan, resident_blocks=tuple(plan_resident(local, records + plan.resident, inflight, chunk, a)))
    if cfg.execution.mode == "optimized" and world == 1 and not host_device:
        # the hand-over room: every streamed block's P16 kept over the step, where that half allows (P16 is an
        # eighth of a record). The next forward then follows a durable in-backward pass's tail (the blocks updated
        # before it must reach it from memory: `runtime.step.StepPlan.tail_follows`), and backward reads back
        # none of the P16 the forward used
        streamed = sum(n for i, n in enumerate(geometry.p16) if i not in plan.resident_blocks)
        extra = min(share, max(0, streamed - plan.params))
        plan = replace(plan, params=plan.params + extra)
        share -= extra
    if reads_ahead(cfg):
        every = readahead_every(local, chunk, records + plan.resident, a)
        want = share if cfg.memory.readahead_mem == "auto" else int(cfg.memory.readahead_mem)
        plan = replace(plan, readahead=min(want, every), readahead_all=every)
    if cfg.execution.mode == "optimized" and not plan.has_stash:  # (a stash keeps every gradient, in RAM or spilled)
        plan, kept = _every_gradient(plan, shards, kept)
    if may_defer_unclipped(cfg, world) and cfg.stability.clip_mode == "auto" and sum(shards) - kept <= plan.budget - plan.total:
        # clipping off, an update that may run after backward (auto): from what the pools leave, only where every
        # gradient fits (spilling them to the SSDs for a schedule that pays where the CPU binds is a poor bet; and
        # the resident and read-ahead rooms stay what they were without it)
        plan = _with_stash(plan, shards, kept, host_device)
    # autograd's own gradients go to the optimizer where the plan holds every one (nothing else bounds them)
    if hands_over_grads(cfg, world, host_device) and plan.grads + plan.grad_stash >= sum(shards):
        plan = replace(plan, grads_handed=True)
    return plan


def _every_gradient(plan: HostMemoryPlan, shards: list[int], kept: int) -> tuple[HostMemoryPlan, int]:
    """`plan` with a grads pool of every block's gradient, as serial mode's, where what cpu_mem leaves after the
    other pools (the resident and read-ahead rooms included, which stay as they were) holds it; else as it was, with
    what it lacks in `grads_short`. Returns the plan and the gradients the pool now keeps (a stash that may follow
    keeps those very buffers).

    Why: backward hands each block's gradient to the optimizer, and a buffer comes back only once that block is
    updated; a pool of two stalled backward whenever the optimizer (a slow disk, AdamW) fell behind (0.6-0.8 s of
    `grad_buffer_wait` a step at 350m on an H100 box, where serial's pool held them all)."""
    need = sum(shards) - kept
    if need <= 0:
        return plan, kept
    if need > plan.budget - plan.total:
        return replace(plan, grads_short=need), kept
    return replace(plan, grads=plan.grads + need), sum(shards)


def _with_stash(plan: HostMemoryPlan, shards: list[int], kept: int, host_device: bool) -> HostMemoryPlan:
    """`plan` with a gradient stash in what cpu_mem leaves. The stash keeps the grads pool's own buffers (`kept`
    of them: one filling, one queued), so where every gradient fits the pool holds each block's buffer once and
    `grad_stash` is what the others add. Where they do not, it keeps what is left and the rest spills; the pool
    then also holds the buffer of a spill write in flight (`store.gradstash.GradStash.put`) beside the two, when a
    device's copy can keep the queued one waiting (not on the CPU, which hands it over at once)."""
    room = max(0, plan.budget - plan.total)
    if sum(shards) - kept <= room:
        return replace(plan, grad_stash=sum(shards) - kept, has_stash=True, stash_ram=sum(shards))
    spill = 0 if host_device else min(max(shards), sum(shards) - kept)
    stash = max(0, room - spill)
    return replace(plan, grads=plan.grads + spill, grad_stash=stash, has_stash=True, stash_ram=stash)


def _check(plan: HostMemoryPlan, cfg: EngineConfig) -> None:
    """Refuse a plan over cpu_mem (:func:`memory_refusal`)."""
    refusal = memory_refusal(plan, cfg)
    if refusal is not None:
        raise MemoryPlanError(refusal)


def memory_refusal(plan: HostMemoryPlan, cfg: EngineConfig) -> str | None:
    """Why a plan over cpu_mem is refused, saying what each pool takes and what to change; None: it fits."""
    if plan.total <= plan.budget:
        return None
    total = plan.total
    parts = ", ".join(f"{k} {size_text(v)}" for k, v in plan.parts().items())
    return (
        f"cpu_mem={size_text(plan.budget)} is too small for this model: the engine needs "
        f"{size_text(total)} ({parts}). Raise cpu_mem to at least {size_text(total)}"
        + (", or use mode='optimized' (serial keeps all gradients)" if cfg.execution.mode == "serial" else "")
        + ", or lower prefetch_depth / max_inflight_blocks" + (" / resident_mem" if plan.resident else "")
        + (" / readahead_mem" if plan.readahead else ""))

