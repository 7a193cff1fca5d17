"""Opening a run's states store: resume it, continue its interrupted initialization, or create it, and refuse
everything else with the reason (a store is never discarded silently)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from lohan.config import EngineConfig
from lohan.plan.pools import chunk_elem_bytes
from lohan.store.files import remove_files, run_files
from lohan.store.group import rank_dir, read_decision
from lohan.store.integrity import StoreCorruptError, unit_bounds
from lohan.store.states import StateStore, StoreLayout, StoreStatus, _read_meta


@dataclass(frozen=True)
class Asked:
    """How the caller names what a refusal asks for: the API's keywords, or the command line's flags."""

    resume: str
    overwrite: str
    launch: str  # how a data-parallel group is started
    nvme: str    # where the store is looked for
    fresh: str   # how a new run is asked for instead of a resume
    same: str    # what a relaunch repeats


API = Asked("resume=True", "overwrite=True", "torchrun", "the nvme directories (and name)", "pass resume=False",
            "the same settings")
CLI = Asked("--resume", "--overwrite", "torchrun --nproc-per-node ...", "the --nvme path (and engine.name)",
            "drop --resume", "the same command line")


class StoreRequestError(ValueError):
    """What the directories hold cannot be used as asked (resume, a new run, the number of ranks)."""


class StoreExistsError(FileExistsError):
    """The directories already hold a store (complete or half-built) and neither resume nor overwrite was asked."""

    def __init__(self, directory: str, status: StoreStatus, asked: Asked = API) -> None:
        self.directory, self.status = directory, status
        if asked is API:
            what = "continue it" if status.state == "complete" else "continue its initialization"
            text = (f"{directory} already holds {status.describe()}; pass {asked.resume} to {what}, or "
                    f"{asked.overwrite} to start over (its contents are lost), or use another name/directory")
        else:
            what = "continue it" if status.state == "complete" else "continue it where it stopped"
            text = (f"{directory} already holds {status.describe()}. Pass {asked.resume} to {what}, or "
                    f"{asked.overwrite} to discard it and start over")
        super().__init__(text)


def status_for(dirs: Sequence[str], name: str, overwrite: bool) -> StoreStatus:
    """`StateStore.status`, except that a store whose metadata is damaged is, to an overwrite, a ``damaged`` store it
    discards (with its identity where its description still tells it): the fix the damage's message gives."""
    try:
        return StateStore.status(dirs, name)
    except StoreCorruptError:
        if not overwrite:
            raise
    try:
        current, replaced = StateStore.identity(dirs, name)
    except StoreCorruptError:
        current, replaced = None, ()
    return StoreStatus("damaged", volume_id=current, replaces=replaced)


def stored_compute_dtype(dirs: Sequence[str], name: str) -> str | None:
    """The compute dtype the store `name` in `dirs` was laid out in (its P16 copy's: bf16, fp16 or fp32), or None
    where there is none, or its description cannot be read (opening it then says what is wrong)."""
    try:
        meta = _read_meta(os.path.join(dirs[0], f"{name}.store.json"))
    except (OSError, ValueError, StoreCorruptError):  # missing, damaged, written by another lohan version
        return None
    return StoreLayout.from_json(meta["layout"]).p16_dtype


def check_request(base_dirs: Sequence[str], name: str, *, resume: bool, overwrite: bool, world: int = 1,
                  rank: int | None = None, must_exist: bool = False, asked: Asked = API) -> StoreStatus:
    """What the NVMe directories hold against what was asked, refused alike wherever a run starts (the command
    line before anything is built, `lohan.init`, rank 0 of a torchrun group for the group); returns the status
    of the store this process would open. `rank`: this process's rank in a data-parallel group (its store is in
    `<dir>/rank<r>`), None in one process. `must_exist`: a resume with nothing to resume is refused (the API
    starts a new store instead). Raises StoreExistsError, or StoreRequestError with the reason and the fix."""
    dirs = [rank_dir(d, rank) for d in base_dirs] if rank is not None else list(base_dirs)
    status = status_for(dirs, name, overwrite)
    decided = read_decision(base_dirs, name)
    where = base_dirs[0]
    if rank is not None and resume and decided is not None and decided["world"] != world:
        raise StoreRequestError(
            f"{where} holds the states of a run on {decided['world']} ranks, and this run has {world}: resume it "
            f"with {decided['world']} ranks in all ({asked.launch}). Another world size would need the optimizer "
            "states re-sharded, which lohan does not do; export the model and start a new run to change it")
    if rank is not None and resume and decided is None and StateStore.status(list(base_dirs), name).state != "none":
        raise StoreRequestError(f"{where} holds the states of a single-process run; resume it without torchrun "
                                "(one process), or start a new run in another directory")
    if rank is None and decided is not None and status.state == "none":
        raise StoreRequestError(
            f"{where} holds the states of a run on {decided['world']} ranks (under rank0 .. rank{decided['world'] - 1});"
            f" launch it as it was: {asked.launch} with {decided['world']} ranks in all, and {asked.same}")
    if must_exist and resume and status.state == "none":
        raise StoreRequestError(f"nothing to resume in {where}: it holds no lohan store named {name!r}. Check "
                                f"{asked.nvme}, or {asked.fresh} to start a new run")
    if not resume and not overwrite and status.state != "none":
        raise StoreExistsError(dirs[0], status, asked)
    return status


def open_or_create(dirs: list[str], cfg: EngineConfig, layout: StoreLayout, model_meta: dict,
                   init_block: Callable[[int], list[Tensor]], resume: bool, overwrite: bool,
                   progress: Callable[[int, int], None] | None, chunk_elems: int) -> StateStore:
    """Open the store in `dirs` (resume), continue its interrupted initialization (resume), or create it
    (nothing there, or overwrite). Anything else is refused: a store is never discarded silently. `chunk_elems`:
    the optimizer's unit, in which the records' checksums are taken."""
    status = status_for(dirs, cfg.store.name, overwrite)
    if status.state != "none" and not resume and not overwrite:  # (check_request, for a caller that did not ask)
        raise StoreExistsError(dirs[0], status)
    if status.state in ("complete", "partial") and resume and status.model != model_meta:
        raise ValueError(f"the store in {dirs[0]} holds another model ({status.model}); cannot resume it with "
                         f"{model_meta}")
    if status.state == "complete" and resume:
        store = StateStore.open(dirs, cfg.store.backend, cfg.store.stripe_bytes, cfg.store.name, emulate_ssd_gbps=cfg.store.emulate_ssd_gbps)
        problem = None
        if "frozen" in (store.layout.state_format, layout.state_format) and \
                store.layout.state_format != layout.state_format:
            store.close()
            raise ValueError(
                f"the store in {dirs[0]} holds a LoRA run's frozen base (no optimizer states), and this run fine-tunes "
                "every weight: resume it with the --lora settings it was started with" if store.layout.state_format
                == "frozen" else f"the store in {dirs[0]} holds a full fine-tuning's states, and this run asks for "
                "LoRA (--lora): resume it without --lora, or start the LoRA run in another --nvme directory")
        if store.layout.state_format != layout.state_format:
            store.close()
            raise ValueError(
                f"the store in {dirs[0]} keeps its optimizer states in the {store.layout.state_format} format and "
                f"this run asks for {layout.state_format}: a store's format is fixed when it is created (its records "
                f"are laid out for it, and converting them would change the states). Resume with --state-format "
                f"{store.layout.state_format}, or export the model and fine-tune the export in a new store")
        if store.layout.p16_dtype != layout.p16_dtype:
            store.close()
            raise ValueError(
                f"the store in {dirs[0]} was created with compute_dtype {store.layout.p16_dtype} and this run asks "
                f"for {layout.p16_dtype}: its P16 copy is laid out in the compute dtype it was created with. Resume "
                f"with --compute-dtype {store.layout.p16_dtype}, or auto (which keeps the store's)")
        if store.layout != layout:
            problem = "was laid out for other settings (slots or compute_dtype differ)"
        elif any(unit_bounds(b.numel, store.chunk_elems) != unit_bounds(b.numel, chunk_elems) for b in layout.blocks):
            per_elem = chunk_elem_bytes(layout)
            problem = (f"was created with other optimizer chunks (resume with --set "
                       f"engine.opt_chunk_bytes={store.chunk_elems * per_elem})")
        if problem:
            store.close()
            raise ValueError(f"the store in {dirs[0]} {problem}; resume with the settings it was created with")
        return store
    if status.state == "partial" and resume:
        return StateStore.create(dirs, layout, model_meta, init_block, staging_budget=64 << 20, backend=cfg.store.backend,
                                 stripe_bytes=cfg.store.stripe_bytes, name=cfg.store.name, progress=progress,
                                 emulate_ssd_gbps=cfg.store.emulate_ssd_gbps, chunk_elems=chunk_elems,
                                 checksums=cfg.store.checksums)
    replaces = (status.volume_id, *status.replaces) if status.volume_id else ()
    if status.state != "none":  # overwrite, or the slab files of a creation that stopped before its first block
        remove_store(dirs, cfg.store.name)
    return StateStore.create(dirs, layout, model_meta, init_block, staging_budget=64 << 20, backend=cfg.store.backend,
                             stripe_bytes=cfg.store.stripe_bytes, name=cfg.store.name, progress=progress,
                             emulate_ssd_gbps=cfg.store.emulate_ssd_gbps, chunk_elems=chunk_elems, checksums=cfg.store.checksums,
                             replaces=replaces)


def remove_store(dirs: list[str], name: str) -> None:
    """Remove the files of run `name` (`files.run_files`) from `dirs`; nothing else."""
    remove_files(dirs, run_files(name))
