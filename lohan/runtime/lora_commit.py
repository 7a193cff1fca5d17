"""A LoRA step's commit: the adapters, their AdamW states, the step count and the settings, durable every step
for the price of one fsync.

Two slot files beside the store's records, ``<name>.lora.0`` and ``<name>.lora.1``; step k is written in place into
slot ``k % 2`` (the one holding step k - 2), then fsynced. A slot is one record::

    magic (8 bytes) | header length | data length | XXH3-64 of header and data   (little-endian u64s)
    header: JSON (the step, the counters, the settings, the base's identity, each tensor's dtype and shape)
    data:   the tensors' bytes end to end (the adapters, then each one's AdamW state)

A kill or a power cut while a slot is written leaves it torn, which its checksum tells, and the other slot holds the
step before, committed: the latest valid slot is the run's commit, the other one the commit before it, which a
data-parallel group may need (a rank killed before its commit of step k makes the group resume at k - 1). No rename,
so no directory fsync but when a slot is created; no pickling (one copy of each tensor into one buffer).

Format 1 (``<name>.lora.pt`` and ``.lora.pt.prev``, `torch.save` through a renamed temporary: two fsyncs and a
pickle of every tensor a step) is still read, so a run committed by it resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch
import xxhash
from torch import Tensor

from io_engine.durable import fsync_dir
from lohan.crashpoints import crashpoint
from lohan.store.integrity import StoreCorruptError
from lohan.store.states import StateStore

FORMAT = 2
"""Version of a slot's record (format 1: ``<name>.lora.pt``, `torch.save`)."""
MAGIC = b"LOHANLR2"
HEAD = struct.Struct("<8sQQQ")
SLOTS = (".lora.0", ".lora.1")
LEGACY = (".lora.pt", ".lora.pt.prev")
"""Format 1's files: the commit and the one before it."""
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)}


class TornCommitError(StoreCorruptError):
    """A slot whose record is incomplete or does not match its checksum."""


def base_identity(store: StateStore) -> dict[str, Any]:
    """What ties a LoRA run's adapters to the base they were trained on: its volume and its records' checksums."""
    return {"volume_id": store.volume.volume_id, "sums": store.sums}


def commit_paths(dirs: Sequence[str], name: str) -> list[str]:
    """Where a LoRA run's adapters are committed (beside the store's records): the two slots, then format 1's files."""
    return [os.path.join(dirs[0], name + s) for s in SLOTS + LEGACY]


def write_commit(dirs: Sequence[str], name: str, state: dict[str, Any]) -> str:
    """Write `state` (`read_commit`'s shape: ``step``, ``adapters``, ``optimizer`` and JSON values) into the slot of
    its step, durably (one fsync; the directory's too when the slot is new). Returns the slot's path."""
    path = commit_paths(dirs, name)[int(state["step"]) % 2]
    head, data = _encode(state)
    created = not os.path.exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:  # (the record's tail past an earlier, longer one is left: the head says where it ends)
        try:
            _pwrite(fd, head, 0)
            data = memoryview(data.numpy())
            half = len(data) // 2
            _pwrite(fd, data[:half], len(head))
            crashpoint("lora.commit.write")  # a kill here leaves the slot torn: the other one stands
            _pwrite(fd, data[half:], len(head) + half)
            os.fsync(fd)
        except BaseException:
            # a failed commit (a full disk, an I/O error) must not be read as one: the slot torn on purpose
            with contextlib.suppress(OSError):
                os.pwrite(fd, bytes(len(MAGIC)), 0)
            raise
    finally:
        os.close(fd)
    if created:
        fsync_dir(os.path.dirname(path) or ".")
    return path


def _pwrite(fd: int, buf: Any, at: int) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def read_record(path: str) -> dict[str, Any]:
    """The LoRA commit at `path` (a slot, or format 1's file) as `write_commit` took it, checked readable, whole and
    of a format lohan writes (not against a base: `read_commit`). TornCommitError for a slot not whole,
    StoreCorruptError (saying what to do) otherwise."""
    try:
        if path.endswith(LEGACY):
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with open(path, "rb") as f:
                state = _decode(f.read(), path)
    except StoreCorruptError:
        raise
    except Exception as e:
        raise StoreCorruptError(f"{path} (the LoRA adapters' commit) cannot be read: {e}. Restore it from a backup, "
                                "or start over with --overwrite") from e
    if not isinstance(state, dict) or state.get("format") not in (1, FORMAT) or not isinstance(state.get("adapters"),
                                                                                                 list):
        raise StoreCorruptError(f"{path} is not a LoRA commit lohan wrote (format {FORMAT}); start over with "
                                "--overwrite")
    return state


def read_commit(path: str, store: StateStore) -> dict[str, Any]:
    """`read_record`, and checked committed over `store`'s base."""
    state = read_record(path)
    if state.get("base") != repr(base_identity(store)):
        raise StoreCorruptError(f"{path} was committed over another base store than the one beside it; start over "
                                "with --overwrite")
    return state


def commits(dirs: Sequence[str], name: str, store: StateStore) -> dict[int, str]:
    """The whole commits a run has, by step. A torn slot (one a kill or a power cut left half-written) is not one:
    the other slot holds the step before, or none exists yet (a first commit torn: the run is at step 0). Two
    slots that are both not whole are not what a crash leaves: StoreCorruptError, as for a whole one that is not
    this run's."""
    found: dict[int, str] = {}
    torn = []
    for path in commit_paths(dirs, name):
        if not os.path.exists(path):
            continue
        try:
            found.setdefault(int(read_commit(path, store)["step"]), path)
        except TornCommitError:
            torn.append(path)
    if len(torn) > 1:
        raise StoreCorruptError(f"{' and '.join(torn)} (the LoRA adapters' commits) are both incomplete or damaged; "
                                "restore them from a backup, or start over with --overwrite")
    return found


def latest_commit(dirs: Sequence[str], name: str, store: StateStore) -> tuple[str, dict[str, Any]] | None:
    """(path, state) of a run's latest commit, or None before its first."""
    found = commits(dirs, name, store)
    if not found:
        return None
    path = found[max(found)]
    return path, read_commit(path, store)


def _split(raw: bytes, path: str) -> tuple[dict[str, Any], memoryview]:
    """A slot's header and data, checked whole."""
    if len(raw) < HEAD.size:
        raise TornCommitError(f"{path}: a LoRA commit cut short ({len(raw)} bytes)")
    magic, n_head, n_data, digest = HEAD.unpack_from(raw)
    body = memoryview(raw)[HEAD.size:HEAD.size + n_head + n_data]
    if magic != MAGIC or len(body) != n_head + n_data or xxhash.xxh3_64_intdigest(body) != digest:
        raise TornCommitError(f"{path}: the LoRA commit is incomplete or damaged (its checksum does not match); "
                              "restore it from a backup, or start over with --overwrite")
    return json.loads(bytes(body[:n_head])), body[n_head:]


def _encode(state: dict[str, Any]) -> tuple[bytes, Tensor]:
    """(record head with its JSON header, data): the tensors of `state` copied once into one buffer."""
    opt = state["optimizer"]
    tensors = [("adapter", k, "", t) for k, t in enumerate(state["adapters"])]
    tensors += [("state", int(k), name, t) for k, s in opt["state"].items() for name, t in s.items()]
    sizes = [_padded(t.numel() * t.element_size()) for *_, t in tensors]
    data = torch.empty(sum(sizes), dtype=torch.uint8)
    at = 0
    for (*_, t), size in zip(tensors, sizes):
        n = t.numel() * t.element_size()
        data[at:at + n].view(t.dtype).view(t.shape).copy_(t.detach())
        data[at + n:at + size].zero_()  # (the padding: a record's bytes depend on its values only)
        at += size
    header = {k: v for k, v in state.items() if k not in ("adapters", "optimizer")}
    header.update(format=FORMAT, param_groups=opt["param_groups"],
                  tensors=[[kind, k, name, str(t.dtype), list(t.shape)] for kind, k, name, t in tensors])
    head_json = json.dumps(header).encode()
    h = xxhash.xxh3_64(head_json)
    h.update(data.numpy())
    return HEAD.pack(MAGIC, len(head_json), len(data), h.intdigest()) + head_json, data


def _padded(n: int) -> int:
    """Bytes a tensor takes in the data: its own, up to a multiple of 16 (each starts aligned for its dtype)."""
    return -(-n // 16) * 16


def _decode(raw: bytes, path: str) -> dict[str, Any]:
    header, data = _split(raw, path)
    adapters: list[Tensor] = []
    states: dict[int, dict[str, Tensor]] = {}
    at = 0
    for kind, k, name, dtype, shape in header.pop("tensors"):
        t = _DTYPES[dtype]
        size = t.itemsize * int(torch.Size(shape).numel())
        value = torch.frombuffer(bytearray(data[at:at + size]), dtype=t).view(shape) if size else \
            torch.empty(shape, dtype=t)
        at += _padded(size)
        if kind == "adapter":
            adapters.append(value)
        else:
            states.setdefault(int(k), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in header.pop("param_groups")]
    return {**header, "adapters": adapters, "optimizer": {"state": states, "param_groups": groups}}
