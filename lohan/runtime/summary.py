"""What an engine says of itself (`Engine.describe`, `LoraEngine.describe`): the run header's facts, read once from
the engine's parts, so that the header (`lohan.app.header`) prints a plain record and reaches into nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lohan.config import EngineConfig
from lohan.plan.pools import HostMemoryPlan


@dataclass(frozen=True)
class LoraSummary:
    """A LoRA engine's adapters and the pool its frozen base streams through."""

    r: int
    alpha: float
    scaling: float
    targets: tuple[str, ...]
    """The adapted projections' names (`LoraSet.target_names`)."""
    n_targets: int
    """How many projections carry an adapter (every block's)."""
    numel: int
    """Trainable parameters."""
    params_pool_bytes: int
    """The pool the base streams through."""


@dataclass(frozen=True)
class EngineSummary:
    """An engine as the run header describes it: its store, its memory, its device, its durability."""

    cfg: EngineConfig
    """The engine's own settings (a rank's: its share of cpu_mem; the compute dtype resolved)."""
    param_count: int
    """The whole model's parameters (a data-parallel rank's store holds its shards of them)."""
    rank: int | None
    """This process's data-parallel rank; None: one process."""
    state_bytes: int
    """The store's bytes on NVMe (every slot)."""
    n_blocks: int
    slots: int
    state_format: str
    p16_itemsize: int
    p16_dtype: str
    store_param_count: int
    """The parameters this process's store holds."""
    dirs: tuple[str, ...]
    """The store's directories (a rank's own)."""
    backend: str
    """The I/O backend the volume chose."""
    device: str
    """The device, in words (`Device.describe`)."""
    device_is_cuda: bool
    host_memory: HostMemoryPlan | None = None
    """The main-memory pools (None: a LoRA engine, which streams its base through one pool)."""
    resident_blocks: int = 0
    """Blocks whose optimizer records stay in main memory across steps."""
    persist_every: int = 1
    """The durability interval in force (`Engine.persist_every`)."""
    persist_refusal: str | None = None
    """Why every step is durable where more was asked (`Engine.persist_refusal`)."""
    lora: LoraSummary | None = None


def engine_summary(engine: Any) -> EngineSummary:
    """The summary of an `Engine` or a `LoraEngine`, as it stands now (before the first step, for the header)."""
    layout, volume = engine.store.layout, engine.store.volume
    lora = getattr(engine, "lora", None)
    base = dict(cfg=engine.cfg, param_count=engine.layout.param_count, rank=engine.dp.store_rank,
                state_bytes=layout.total_bytes, n_blocks=len(layout.blocks), slots=layout.slots,
                state_format=layout.state_format, p16_itemsize=engine.store.p16_dtype.itemsize,
                p16_dtype=str(layout.p16_dtype), store_param_count=layout.param_count, dirs=tuple(volume.dirs),
                backend=volume.backend.name, device=engine.device.describe(), device_is_cuda=engine.device.is_cuda,
                persist_every=engine.persist_every, persist_refusal=engine.persist_refusal)
    if lora is not None:
        return EngineSummary(**base, lora=LoraSummary(lora.r, lora.alpha, lora.scaling, tuple(lora.target_names()),
                                                      len(lora.targets), lora.numel, engine.params_pool.budget_bytes))
    return EngineSummary(**base, host_memory=engine.host_memory, resident_blocks=len(engine.offloader.resident))
