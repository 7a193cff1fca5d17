"""Checksums of what the store writes, verified on every read, and self-checking JSON files.

Why: an SSD (or a cable, a controller, a bad DIMM on the way) can hand back other bytes than were
written, and a days-long run then trains on garbage without a word. Every record section the store
writes is hashed on the write path (xxHash XXH3-64, ~10 GB/s per core here, and it releases the GIL,
so the optimizer thread hashes while the device computes) and the hashes are committed with the step
that wrote them (`<name>.commit.json`); every read is checked against the committed hashes.

Units. A block's record is checked in *units* of `chunk_elems` elements (the optimizer's chunk size,
fixed when the store is created), so whatever reads or writes a unit can hash exactly it: per unit,
`state` = hash of its P32, m and v elements (in that order) and `p16` = hash of its P16 elements.
Padding bytes between sections are not covered (they carry nothing).

Metadata (`store.json`, `commit.json`, the run state, the init progress, the group's record) carries a
`checksum` field over its canonical JSON (`io_engine.durable`), so a damaged or hand-edited file is detected
too; a file without one is damaged (every record of store format 2 has carried one), and each record's keys
and value types are checked when it is read, so damage never reaches a constructor as a TypeError.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from io_engine import durable
from io_engine.durable import Types, json_checksum  # noqa: F401  (json_checksum: its home is io_engine.durable)
from lohan.crashpoints import crashpoint

Sums = list[list[list[int]]]  # [block][unit] -> [state, p16]


class StoreCorruptError(RuntimeError):
    """Bytes or metadata read back from the NVMe directories are not what lohan wrote."""


def tensor_hash(*tensors: torch.Tensor) -> int:
    """XXH3-64 over the bytes of `tensors` (contiguous CPU tensors), in order."""
    h = xxhash.xxh3_64()
    for t in tensors:
        if t.numel():
            h.update(t.detach().reshape(-1).view(torch.uint8).numpy())
    return h.intdigest()


def unit_bounds(numel: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of a block's checksum units."""
    return [(lo, min(lo + chunk_elems, numel)) for lo in range(0, numel, chunk_elems)]


def write_json_atomic(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write `data` plus its checksum to `path` atomically and durably (temp file, fsync, rename, fsync dir)."""
    name = os.path.basename(os.fspath(path))
    durable.write_json_atomic(path, data, before_rename=lambda: crashpoint(f"json.rename:{name}"))


def read_json_checked(path: str | os.PathLike, what: str, fix: str, required: Mapping[str, Types] | None = None,
                      optional: Mapping[str, Types] | None = None) -> dict[str, Any]:
    """Load a JSON file written by `write_json_atomic`; StoreCorruptError (naming the file, what is wrong and
    `fix`) when it does not parse, carries no checksum (never trusted as it is: the key's name may be what was
    damaged) or its checksum does not match, and, given `required` keys (`check_record`), when its record does
    not have the keys and types of a `what`."""
    path = os.fspath(path)
    data, problem = durable.load_json(path)
    problem = problem or durable.checksum_problem(data)
    if problem:
        raise StoreCorruptError(f"{path} ({what}) is damaged: {problem}. {fix}")
    if required is not None:
        check_record(path, data, what, fix, required, optional)
    return data


def check_record(path: str | os.PathLike, data: Mapping[str, Any], what: str, fix: str,
                 required: Mapping[str, Types], optional: Mapping[str, Types] | None = None) -> None:
    """StoreCorruptError unless `data` has the `required` keys, no key outside them and `optional`, and values of
    their types (`io_engine.durable.fields_problem`): a record that passed its checksum but is not what this
    lohan writes (an edit, a bug) is refused with the file named, never handed to a constructor."""
    problem = durable.fields_problem(data, required, optional)
    if problem:
        raise StoreCorruptError(f"{os.fspath(path)} ({what}) is damaged: its fields are not those of a {what}: "
                                f"{problem}. {fix}")


def describe_range(dirs: Sequence[str], offset: int, nbytes: int) -> str:
    """Where a byte range of a store lives, for error messages."""
    if len(dirs) == 1:
        return f"{dirs[0]}, bytes {offset}..{offset + nbytes} of the volume"
    return f"striped over {', '.join(dirs)}, bytes {offset}..{offset + nbytes} of the volume"
