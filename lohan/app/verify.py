"""``finetune.py --verify``: every record of a store read back and checked against its committed checksums."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from io_engine import IOEngineError, VolumeConfigError
from lohan.config import EngineConfig, RunConfig
from lohan.runtime.parallel import read_decision
from lohan.store.dirlock import DirectoryInUseError, DirLock
from lohan.store.integrity import StoreCorruptError
from lohan.store.states import StateStore


def verify_store(run: RunConfig) -> int:
    """`finetune.py --verify`: read every record of the store in the run's NVMe directories and check it
    against the committed checksums (a data-parallel run's: every rank's store, one after the other, in
    one process). Exit code 0: intact; 1: damaged (each damaged unit is listed); 2: no store, or its
    metadata is unreadable."""
    console = Console(soft_wrap=True)
    e = run.engine
    store = e.store
    try:
        decided = read_decision(store.nvme, store.name)
    except StoreCorruptError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    stores = ([tuple(os.path.join(d, f"rank{r}") for d in store.nvme) for r in range(decided["world"])]
              if decided is not None and StateStore.status(store.nvme, store.name).state == "none" else [store.nvme])
    worst = 0
    for dirs in stores:
        worst = max(worst, _verify_one(console, e, dirs, named=len(stores) > 1))
    return worst


def _verify_one(console: Console, e: EngineConfig, dirs: tuple[str, ...], named: bool) -> int:
    try:
        status = StateStore.status(dirs, e.store.name)
        if status.state != "complete":
            console.print(f"[red]error:[/red] {escape(dirs[0])} holds {status.describe()}: nothing to verify")
            return 2
        with DirLock(list(dirs)):
            store = StateStore.open(list(dirs), e.store.backend, e.store.stripe_bytes, e.store.name)
            try:
                with Progress(TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TextColumn("blocks"),
                              TimeElapsedColumn(), console=console, transient=True) as bar:
                    task = bar.add_task("verify", total=len(store.layout.blocks))
                    problems = store.verify(lambda done, total: bar.update(task, completed=done))
                gib = store.layout.slot_bytes / 2**30
                lora = _verify_lora(store, dirs, e.store.name, problems)
            finally:
                store.close()
    except (StoreCorruptError, DirectoryInUseError, VolumeConfigError, IOEngineError, ValueError, RuntimeError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    if problems:
        for p in problems:
            console.print(f"[red]damaged:[/red] {escape(p)}")
        console.print(f"{len(problems)} damaged unit(s) in {escape(', '.join(dirs))}: restore the directories from a "
                      "backup, or start over with --overwrite")
        return 1
    where = f" in {dirs[0]}" if named else ""
    console.print(f"{status.describe()}{where}: all {len(store.layout.blocks)} blocks ({gib:.2f} GiB) match their "
                  f"checksums{lora}")
    return 0


def _verify_lora(store: StateStore, dirs: tuple[str, ...], name: str, problems: list[str]) -> str:
    """A LoRA run's store (its frozen base): its adapters' commit read back and checked against that base (a problem
    added to `problems` if it is not); what to add to the report ('' for any other store)."""
    if store.layout.state_format != "frozen":
        return ""
    from lohan.runtime.lora_commit import latest_commit

    try:
        latest = latest_commit(dirs, name, store)
    except StoreCorruptError as err:
        problems.append(str(err))
        return ""
    if latest is None:
        return " (a LoRA run's base; no adapters committed yet)"
    path, state = latest
    return f"; the LoRA adapters committed at step {state['step']} ({path}) read back, over this base"
