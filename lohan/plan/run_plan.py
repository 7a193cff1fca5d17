"""One plan of a run's host memory, made once (issue 40): what the engine allocates, what the pre-flight, the dry
run and the capacity planner price, from the same inputs.

:func:`plan_run` takes the *whole* engine config (never a subset of its fields rebuilt from keyword arguments: the
dry run that did so dropped ``max_inflight_blocks``, ``opt_chunk_bytes``, ``mode`` and priced 125m's pools at
4.3 GB where the engine refused them at 5.1 GiB), the geometry of the store (`pools.PoolGeometry`: the engine's own,
the same blocks, padding and shards) and what the machine gives (the ranks, the memory available, whether the CPU
computes). The :class:`RunPlan` it returns holds every figure the engine used to work out inline: the pools' sizes,
the optimizer's chunk, the records kept resident, the gradient stash and the unclipped deferral, the share of the
P16 kept over a turn, the durability interval's eligibility, and, where the pools exceed ``cpu_mem``, the refusal
the engine raises (the dry run reports the same words).

Pure and torch-free: arithmetic on the layout, no I/O, no allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from io_engine.align import ALIGN
from lohan.config import EngineConfig
from lohan.plan import durability
from lohan.plan.formats import state_format
from lohan.plan.pools import (
    HostMemoryPlan,
    MemoryPlanError,
    PoolGeometry,
    keeps_all_grads,
    kept_p16_fraction,
    memory_refusal,
    plan_host_memory,
)
from lohan.plan.records import chunk_refusal

__all__ = ["RunPlan", "plan_run"]


@dataclass(frozen=True)
class RunPlan:
    """A run's host-memory plan (module docstring). Two plans are equal when every figure is: the config they
    were made from is kept (`engine`) but not compared, since fields no figure reads (the directories, the step
    count) differ between the pre-flight's copy and the engine's."""

    engine: EngineConfig = field(compare=False, repr=False)
    """The config the plan was made from, whole."""
    geometry: PoolGeometry = field(compare=False, repr=False)
    """The store's geometry the pools are sized from."""
    world: int
    free: int | None
    """The main memory the plan assumed available to this process (None: cpu_mem alone bounds the auto rooms)."""
    host_device: bool
    host: HostMemoryPlan
    """Every pool's bytes (`pools.plan_host_memory`, unchecked: see `refusal`)."""
    stash: bool
    """The engine keeps a step's gradients in a gradient stash (serial mode's pool, clipping, slots=1, or a
    deferred unclipped update)."""
    defer_unclipped: bool
    """Clipping off, the plan kept room for every gradient: an update may run after backward (`ClipSchedule`)."""
    write_behind: bool
    """A deferred update's last writes may complete during the next step (two slots, ``write_behind`` on, one
    process: `step.StepPlan`'s lazy commit), which the cost model prices (`Profile.write_behind`)."""
    kept_p16: float
    """The share of the P16 the parameter pool keeps over a forward/backward turn (0 in place: slots=1)."""
    resident_params: int
    """Parameters of the whole model whose records stay in memory (a rank's share scaled to the whole model)."""
    readahead_params: int
    """Parameters of the whole model whose records the read-ahead room holds, scaled as ``resident_params``."""
    persist_refusal: str | None
    """Why the durability interval cannot exceed 1 (`durability.eligible`); None: it can."""
    refusal: str | None
    """The engine's refusal (`MemoryPlanError`'s message): the pools exceed cpu_mem, or its optimizer chunks would
    split an 8-bit quantization block (`records.chunk_refusal`); None: the plan runs."""
    over_cpu_mem: bool = False
    """The pools exceed cpu_mem (the fit report's cpu row says so, whatever the machine's RAM)."""

    @property
    def chunk_elems(self) -> int:
        """Elements per optimizer chunk (the store's checksum unit too)."""
        return self.host.chunk_elems

    @property
    def zero_copy(self) -> tuple[int, ...]:
        """Resident blocks the CPU computes on in place, with no P16 buffer (`pools.zero_copy_blocks`)."""
        return self.host.zero_copy

    @property
    def resident_blocks(self) -> tuple[int, ...]:
        """Blocks whose records the record pool keeps from step to step."""
        return self.host.resident_blocks

    def pools(self) -> dict[str, int]:
        """The capacity of each buffer pool the engine creates (`Engine._build`): the P16 buffers, the host
        gradients with the stash's, and the optimizer records with the resident and read-ahead rooms. (The fp32
        upcast scratch, `host.upcast`, is the offloader's own allocation, not a pool.)"""
        h = self.host
        # (a pool's budget is a page at least: where the CPU computes on every record in place, one never used)
        # (the grads pool holds nothing where the optimizer takes autograd's own gradients: `host.grads_handed`)
        return {"params": max(h.params, ALIGN), "grads": ALIGN if h.grads_handed else h.grads + h.grad_stash,
                "records": h.records + h.resident + h.readahead}

    def check(self) -> None:
        """Raise the engine's refusal, if any: the pools do not fit cpu_mem, or the chunks split 8-bit blocks."""
        if self.refusal is not None:
            raise MemoryPlanError(self.refusal)


def _kept_p16(host: HostMemoryPlan, geometry: PoolGeometry, cfg: EngineConfig) -> float:
    """The share of the P16 read in neither pass of a turn (`pools.kept_p16_fraction`): what the params pool keeps of
    the blocks it streams, and all of the blocks the CPU computes on in their records (none is read)."""
    if cfg.store.slots == 1 and not host.zero_copy:
        return 0.0
    p16 = geometry.p16
    streamed = [n for i, n in enumerate(p16) if i not in host.zero_copy]
    kept = kept_p16_fraction(host.params, streamed, cfg.memory.prefetch_depth) if cfg.store.slots > 1 else 0.0
    return (sum(p16) - sum(streamed) + kept * sum(streamed)) / max(1, sum(p16))


def plan_run(cfg: EngineConfig, geometry: PoolGeometry, world: int = 1, free: int | None = None,
             host_device: bool = False, grad_size: int | None = None) -> RunPlan:
    """The run's plan (module docstring) for the whole config `cfg` (its compute dtype resolved), the store's
    `geometry` (data parallel: the rank's shards in ``geometry.local``), `world` ranks, `free` bytes of main memory
    available to this process and `host_device` (the CPU computes); `grad_size`: the host gradient buffers'
    itemsize where the engine's differs from `pools.grad_dtype`'s rule. Never raises for a plan over cpu_mem: the
    refusal is in the plan (:meth:`RunPlan.check`)."""
    host = plan_host_memory(geometry, cfg, world, free, grad_size, check=False, host_device=host_device)
    over = memory_refusal(host, cfg)
    stash = keeps_all_grads(cfg) or host.has_stash
    local, whole = geometry.store, geometry.layout.param_count
    mine = max(1, local.param_count)
    resident = sum(local.blocks[i].numel for i in host.resident_blocks)
    at_rest = state_format(cfg.store.state_format).at_rest(local.blocks[0].p16_itemsize)
    return RunPlan(
        engine=cfg, geometry=geometry, world=world, free=free, host_device=host_device, host=host, stash=stash,
        defer_unclipped=host.has_stash and cfg.stability.max_grad_norm <= 0,
        write_behind=cfg.store.slots == 2 and cfg.execution.write_behind and world == 1,
        kept_p16=_kept_p16(host, geometry, cfg),
        resident_params=whole * resident // mine, readahead_params=whole * int(host.readahead // at_rest) // mine,
        persist_refusal=durability.eligible(len(host.resident_blocks) == len(local.blocks), cfg.store.slots, world == 1,
                                            stash, in_place=cfg.stability.max_grad_norm <= 0 and cfg.execution.compute_dtype != "fp16"),
        refusal=chunk_refusal(local.blocks, host.chunk_elems) or over, over_cpu_mem=over is not None)
