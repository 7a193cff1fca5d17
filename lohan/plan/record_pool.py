"""The record pool's units, which `lohan.plan.pools` sizes the host pools from (and re-exports): the chunks a
block's optimizer record is updated in, the scratch an update takes beside its record (the fp32 upcast of bf16
gradients, a compressed state format's temporaries), and which records stay resident in the pool from one step to
the next (and which of those a CPU compute device computes on in place). Pure and torch-free."""

from __future__ import annotations

import math

from io_engine.align import ALIGN
from lohan.config import EngineConfig
from lohan.plan.formats import state_format
from lohan.plan.records import P16_ITEMSIZE, StoreLayout

__all__ = [
    "UPCAST_ELEMS", "FORMAT_ELEMS", "FORMAT_SCRATCH", "optimizer_chunk_elems", "chunk_elem_bytes", "upcast_bytes",
    "format_work_bytes", "record_pool_bytes", "plan_resident", "resident_every", "resident_extra", "readahead_every",
    "zero_copy_blocks",
]

UPCAST_ELEMS = 1 << 22
"""Most elements of gradient the optimizer upcasts (bf16) or scales (clipping) at once: 16 MiB of fp32."""

FORMAT_ELEMS = 1 << 20
"""Elements a compressed state format's update decodes, updates and encodes at once (`format_adamw.adamw_unit_`):
its temporaries (fp32 master, m and v, the 8-bit codes' search) are :data:`FORMAT_SCRATCH` bytes per element."""

FORMAT_SCRATCH = 64
"""Bytes per element of a compressed format's update temporaries, a bound on what `adamw_unit_` allocates."""


def optimizer_chunk_elems(layout: StoreLayout, cfg: EngineConfig) -> int:
    """Elements per optimizer chunk: `opt_chunk_bytes` of record, a multiple of 4096 (aligned I/O)."""
    return max(4096, cfg.memory.opt_chunk_bytes // chunk_elem_bytes(layout) // 4096 * 4096)


def chunk_elem_bytes(layout: StoreLayout) -> int:
    """Bytes a parameter of `opt_chunk_bytes` counts: its record's with a P16 of the compute dtype beside the
    master where the format keeps one at all, also where a record computed in fp32 shares it with the master
    (`records.BlockLayout.shared_p16`): the chunks, and the checksum units of a store, stay what they were."""
    f = state_format(layout.state_format)
    return math.ceil(f.record() + (layout.blocks[0].p16_itemsize if f.separate_p16 else 0))


def _itemsize(dtype: object) -> int:
    """Bytes per element of a dtype given as an itemsize, a compute-dtype name or a torch dtype (`.itemsize`)."""
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, str):
        return P16_ITEMSIZE[dtype]
    return int(dtype.itemsize)  # type: ignore[attr-defined]


def upcast_bytes(layout: StoreLayout, chunk_elems: int | None, grad_dtype: object, clip: bool = False,
                 limit: int | None = None) -> int:
    """Bytes of the fp32 scratch the optimizer upcasts bf16 gradients (and scales clipped ones) into
    (`GradOffloader._fp32`): `limit` (:data:`UPCAST_ELEMS`) elements, or the largest pipeline unit (a whole
    block, or a chunk) if smaller; 0 when the gradients are fp32 already and never scaled. `grad_dtype`: an
    itemsize, a dtype name or a torch dtype."""
    if _itemsize(grad_dtype) == 4 and not clip:
        return 0
    limit = UPCAST_ELEMS if limit is None else limit
    return 4 * min(limit, _largest_unit(layout, chunk_elems))


def _largest_unit(layout: StoreLayout, chunk_elems: int | None) -> int:
    return max(b.numel if chunk_elems is None else min(b.numel, chunk_elems) for b in layout.blocks)


def format_work_bytes(layout: StoreLayout, chunk_elems: int | None) -> int:
    """Bytes of the temporaries a compressed state format's update allocates (`format_adamw.adamw_unit_` decodes,
    updates and encodes FORMAT_ELEMS elements at a time); 0 for ``exact``, updated in its buffer."""
    if layout.state_format == "exact":
        return 0
    return FORMAT_SCRATCH * min(FORMAT_ELEMS, _largest_unit(layout, chunk_elems))


def _caps(layout: StoreLayout, chunk_elems: int, align: int) -> tuple[list[int], list[int]]:
    """Per block: the buffer one of its pipeline units takes while it streams (its record, or a chunk), and the
    buffers it keeps while resident (its record, or one per chunk: `runtime.record_buffers.ResidentRecords`)."""
    stream = [b.max_unit_bytes(chunk_elems, align) for b in layout.blocks]
    keep = [b.units_bytes(chunk_elems, align) for b in layout.blocks]
    return stream, keep


def record_pool_bytes(layout: StoreLayout, inflight: int, chunk_elems: int, resident: bool, align: int = ALIGN) -> int:
    """The record pool's size before `resident_mem`: `inflight` buffers of the largest record (or chunk). With
    resident records, no more than the least pool that streams the rest through `inflight` buffers while every
    record whose unit is bigger than them stays: min over t of (records above t) + inflight x t. A tied embedding's
    record, 3.5x a layer's, then takes one buffer instead of three (the 110M Llama's pool: 0.64 instead of 1.03 GB),
    and plan_resident keeps it; a record updated in chunks counts whole (all its chunks) when it stays. Pure."""
    stream, keep = _caps(layout, chunk_elems, align)
    top = inflight * max(stream)
    if not resident:
        return top
    return min([top] + [sum(k for s, k in zip(stream, keep) if s > t) + inflight * t for t in sorted({0, *stream})])


def plan_resident(layout: StoreLayout, budget: int, inflight: int, chunk_elems: int, align: int = ALIGN) -> list[int]:
    """Blocks whose records stay resident in a record pool of `budget` bytes (`runtime.offload`'s docstring): the
    most bytes that fit beside `inflight` buffers of the largest unit still streamed, lowest blocks first (the
    deferred pass and the next forward start there). A block updated in chunks stays whole (one buffer per chunk)
    or streams chunk by chunk. Pure."""
    stream, keep = _caps(layout, chunk_elems, align)
    best: list[int] = []
    # t: the largest unit still streamed (0: none); every block whose unit is larger than t must be resident
    for t in sorted({0, *stream}):
        chosen = [i for i, s in enumerate(stream) if s > t]
        room = budget - sum(keep[i] for i in chosen) - (inflight * t if t else 0)
        if room < 0:
            continue
        for i, s in enumerate(stream):
            if s <= t and keep[i] <= room:
                chosen.append(i)
                room -= keep[i]
        if sum(keep[i] for i in chosen) > sum(keep[i] for i in best):
            best = sorted(chosen)
    return best


def resident_every(layout: StoreLayout, inflight: int, chunk_elems: int, pool: int, align: int = ALIGN) -> int:
    """Bytes a record pool of `pool` bytes lacks to keep every record (those updated in chunks too, one buffer
    per chunk): what `resident_mem: all` adds. (`inflight`: none streams then, so no buffer is kept for it.)"""
    _, keep = _caps(layout, chunk_elems, align)
    return max(0, sum(keep) - pool)


def resident_extra(local: StoreLayout, cfg: EngineConfig, chunk: int, pool: int, room: int = 0,
                   align: int = ALIGN) -> int:
    """Bytes `resident_mem` adds to a record pool of `pool` bytes: at most what keeps every record resident that
    can be (:func:`resident_every`); `auto` takes up to `room`."""
    if not cfg.memory.resident_records:
        return 0
    every = resident_every(local, cfg.memory.max_inflight_blocks, chunk, pool, align)
    if cfg.memory.resident_mem == "all":
        return every
    return min(max(0, room) if cfg.memory.resident_mem == "auto" else int(cfg.memory.resident_mem), every)


def readahead_every(layout: StoreLayout, chunk_elems: int, pool: int, align: int = ALIGN) -> int:
    """Bytes a record pool of `pool` bytes lacks to hold every record at once: the most read-ahead room
    (``readahead_mem``) can use, every READ of a deferred update then issued during backward."""
    total = sum(b.units_bytes(chunk_elems, align) for b in layout.blocks)
    return max(0, total - pool)


def zero_copy_blocks(layout: StoreLayout, resident: tuple[int, ...] | list[int], chunk_elems: int) -> tuple[int, ...]:
    """The resident blocks whose parameters a CPU compute device takes as views of their records (no P16 copy:
    `runtime.params.ParamStreamer.use_records`): the record keeps the P16 of the compute dtype (a section of its
    own, or the master itself where it is of that dtype), and no parameter spans two of its chunks (a block updated
    in chunks keeps one buffer per chunk)."""
    master = "fp32" if state_format(layout.state_format).master_itemsize == 4 else "bf16"
    out = []
    for i in resident:
        b = layout.blocks[i]
        if not b.has_p16 and master != layout.p16_dtype:
            continue
        if b.numel <= chunk_elems or all(p.offset // chunk_elems == (p.offset + p.numel - 1) // chunk_elems
                                         for p in b.params):
            out.append(i)
    return tuple(out)
