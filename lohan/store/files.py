"""The files a run keeps in its NVMe directories, named after the run (`<name><suffix>`): one list, so that what
lohan removes (an overwrite, a scratch volume), what it knows as its own (the run layout refuses an output over
one of them) and what the pre-flight counts as the store's disk space agree. Torch-free."""

from __future__ import annotations

import os
from collections.abc import Iterable

from lohan.config import store_name_problem

VOLUME_SUFFIXES = (".slab", ".volume.json")
"""An io_engine volume's files in each directory: the striped slab and its manifest."""
VOLUMES = ("", "-act", "-grad", "-probe")
"""The run's volumes: the states store, swapped activations (the SSD tier), the gradient stash, the SSD probe."""
RECORDS = (".store.json", ".commit.json", ".init.json", ".run.json", ".profile.json", ".dp.json", ".lora.0",
           ".lora.1", ".lora.pt", ".lora.pt.prev")
"""The store's description, its commit record, its initialization log, the run's state (data position, schedule),
the activation profile, a data-parallel group's commit record, and a LoRA run's adapters with their AdamW states
(`lohan.runtime.lora_commit`, committed every step into two alternate slots; format 1's commit and the one before
it)."""
SUFFIXES = tuple(v + s for v in VOLUMES for s in VOLUME_SUFFIXES) + RECORDS
"""Every file of a run; JSON records are written through `<file>.tmp` (integrity.write_json_atomic)."""


def check_name(name: str) -> None:
    """ValueError unless `name` can name a store (`lohan.config.store_name_problem`): its files must stay inside the
    directories a run checks and locks, whoever calls the store (the command line, `lohan.init`, a script)."""
    problem = store_name_problem(name)
    if problem:
        raise ValueError(problem)


def is_run_file(filename: str, name: str) -> bool:
    """Whether `filename` (a bare name) is one of run `name`'s files, or a temporary one of them."""
    return any(filename == name + s or filename.startswith(name + s + ".") for s in SUFFIXES)


def run_files(name: str) -> list[str]:
    """The file names run `name` may have in one directory, temporaries included."""
    return [name + s for s in SUFFIXES] + [name + s + ".tmp" for s in RECORDS + (".volume.json",)]


def remove_files(dirs: Iterable[str], names: Iterable[str]) -> None:
    """Remove the files `names` from each of `dirs` where they exist (only those: nothing else is touched)."""
    names = list(names)
    for d in dirs:
        for n in names:
            try:
                os.unlink(os.path.join(d, n))
            except FileNotFoundError:
                pass


def remove_volume(dirs: Iterable[str], volume: str) -> None:
    """Remove a volume's slab and manifest (a scratch volume, or one left by a killed run)."""
    remove_files(dirs, [volume + s for s in VOLUME_SUFFIXES])
