"""Opening a run's states store: resume it, continue its interrupted initialization, or create it, and refuse
everything else with the reason (a store is never discarded silently)."""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import Tensor

from lohan.config import EngineConfig
from lohan.store.integrity import unit_bounds
from lohan.store.states import StateStore, StoreLayout, StoreStatus


class StoreExistsError(FileExistsError):
    """The directories already hold a store (complete or half-built) and neither resume nor overwrite was asked."""

    def __init__(self, directory: str, status: StoreStatus) -> None:
        self.directory, self.status = directory, status
        what = "continue it" if status.state == "complete" else "continue its initialization"
        super().__init__(f"{directory} already holds {status.describe()}; pass resume=True to {what}, or "
                         "overwrite=True to start over (its contents are lost), or use another name/directory")


def open_or_create(dirs: list[str], cfg: EngineConfig, layout: StoreLayout, model_meta: dict,
                   init_block: Callable[[int], list[Tensor]], resume: bool, overwrite: bool,
                   progress: Callable[[int, int], None] | None, check_elems: int) -> StateStore:
    """Open the store in `dirs` (resume), continue its interrupted initialization (resume), or create it
    (nothing there, or overwrite). Anything else is refused: a store is never discarded silently. `check_elems`:
    the optimizer's unit, in which the records' checksums are taken."""
    status = StateStore.status(dirs, cfg.name)
    if status.state != "none" and not resume and not overwrite:
        raise StoreExistsError(dirs[0], status)
    if status.state in ("complete", "partial") and resume and status.model != model_meta:
        raise ValueError(f"the store in {dirs[0]} holds another model ({status.model}); cannot resume it with "
                         f"{model_meta}")
    if status.state == "complete" and resume:
        store = StateStore.open(dirs, cfg.backend, cfg.chunk_bytes, cfg.name, emulate_ssd_gbps=cfg.emulate_ssd_gbps)
        problem = None
        if store.layout != layout:
            problem = "was laid out for other settings (slots or compute_dtype differ)"
        elif any(unit_bounds(b.numel, store.check_elems) != unit_bounds(b.numel, check_elems) for b in layout.blocks):
            per_elem = 12 + layout.blocks[0].p16_itemsize
            problem = (f"was created with other optimizer chunks (resume with --set "
                       f"engine.opt_chunk_bytes={store.check_elems * per_elem})")
        if problem:
            store.close()
            raise ValueError(f"the store in {dirs[0]} {problem}; resume with the settings it was created with")
        return store
    if status.state == "partial" and resume:
        return StateStore.create(dirs, layout, model_meta, init_block, staging_budget=64 << 20, backend=cfg.backend,
                                 chunk_bytes=cfg.chunk_bytes, name=cfg.name, progress=progress,
                                 emulate_ssd_gbps=cfg.emulate_ssd_gbps, check_elems=check_elems,
                                 checksums=cfg.checksums)
    if status.state != "none":  # overwrite, or the slab files of a creation that stopped before its first block
        remove_store(dirs, cfg.name)
    return StateStore.create(dirs, layout, model_meta, init_block, staging_budget=64 << 20, backend=cfg.backend,
                             chunk_bytes=cfg.chunk_bytes, name=cfg.name, progress=progress,
                             emulate_ssd_gbps=cfg.emulate_ssd_gbps, check_elems=check_elems, checksums=cfg.checksums)


STORE_SUFFIXES = (".dp.json", ".dp.json.tmp", ".slab", ".volume.json", ".volume.json.tmp", ".store.json", ".store.json.tmp", ".commit.json",
                  ".commit.json.tmp", ".init.json", ".init.json.tmp", ".run.json", ".run.json.tmp", ".profile.json",
                  "-act.slab", "-act.volume.json", "-grad.slab", "-grad.volume.json")


def remove_store(dirs: list[str], name: str) -> None:
    """Remove the files of the run `name` (`STORE_SUFFIXES`) from `dirs`; nothing else."""
    for d in dirs:
        for suffix in STORE_SUFFIXES:
            path = os.path.join(d, f"{name}{suffix}")
            if os.path.exists(path):
                os.unlink(path)
