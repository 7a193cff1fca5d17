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

Metadata (`store.json`, `commit.json`, the run state, the init progress) carries a `checksum` field
over its canonical JSON, so a damaged or hand-edited file is detected too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from io_engine.base import fsync_dir
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


def json_checksum(data: dict[str, Any]) -> str:
    payload = json.dumps({k: v for k, v in data.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return f"xxh3:{xxhash.xxh3_64_hexdigest(payload.encode())}"


def write_json_atomic(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write `data` plus its checksum to `path` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path = os.fspath(path)
    data = {**data, "checksum": json_checksum(data)}
    tmp = f"{path}.tmp"
    # never through a link: a `.tmp` that links elsewhere would have its target truncated (ELOOP instead)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    crashpoint(f"json.rename:{os.path.basename(path)}")
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # make the rename itself durable


def read_json_checked(path: str | os.PathLike, what: str, fix: str) -> dict[str, Any]:
    """Load a JSON file written by `write_json_atomic`; StoreCorruptError (naming the file and `fix`)
    when it does not parse or its checksum does not match."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreCorruptError(f"{path} ({what}) is damaged: it does not parse ({e}). {fix}") from None
    if not isinstance(data, dict):
        raise StoreCorruptError(f"{path} ({what}) is damaged: not a JSON object. {fix}")
    if "checksum" in data and data["checksum"] != json_checksum(data):
        raise StoreCorruptError(f"{path} ({what}) is damaged: its checksum does not match its contents. {fix}")
    return data


def describe_range(dirs: Sequence[str], offset: int, nbytes: int) -> str:
    """Where a byte range of a store lives, for error messages."""
    if len(dirs) == 1:
        return f"{dirs[0]}, bytes {offset}..{offset + nbytes} of the volume"
    return f"striped over {', '.join(dirs)}, bytes {offset}..{offset + nbytes} of the volume"
