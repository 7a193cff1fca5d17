"""Durable, self-checking JSON files, and setting a damaged file aside. Torch-free: the planning layer (a saved
activation profile) uses it as well as the volume (its manifests) and lohan's store (its commit records).

A file written by :func:`write_json_atomic` carries a ``checksum`` field, XXH3-64 over the canonical JSON of
everything else, and reaches its name only whole (temp file, fsync, rename, fsync of the directory). A reader
asks :func:`checksum_problem` and :func:`fields_problem` what, if anything, is wrong with what it loaded: a file
without its checksum is damage too (a flipped byte in the key's name, or a hand edit), never trusted as it is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import xxhash

CHECKSUM = "checksum"
"""The key of a file's own checksum."""

Types = type | tuple[type, ...]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames and creations in directory `path` durable (each is a change of the directory, which a
    power cut can lose even after the files themselves were fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_checksum(data: Mapping[str, Any]) -> str:
    """``xxh3:<hex>`` over the canonical JSON (sorted keys, no spaces) of `data` less its own checksum."""
    payload = json.dumps({k: v for k, v in data.items() if k != CHECKSUM}, sort_keys=True, separators=(",", ":"))
    return f"xxh3:{xxhash.xxh3_64_hexdigest(payload.encode())}"


def write_json_atomic(path: str | os.PathLike, data: Mapping[str, Any], indent: int | None = 1,
                      before_rename: Callable[[], None] | None = None) -> None:
    """Write `data` plus its checksum to `path` atomically and durably (temp file `<path>.tmp`, fsync, rename,
    fsync of the directory). `before_rename` runs between the fsync and the rename (a test's crash point)."""
    path = os.fspath(path)
    text = json.dumps({**data, CHECKSUM: json_checksum(data)}, indent=indent)
    tmp = f"{path}.tmp"
    # never through a link: a `.tmp` that links elsewhere would have its target truncated (ELOOP instead)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # make the rename itself durable


def load_json(path: str | os.PathLike) -> tuple[Any, str | None]:
    """(the parsed contents, None), or (None, what is wrong) for a file that is not JSON text. OSError (a file
    that cannot be read at all) is the caller's."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), None
    except UnicodeDecodeError:
        return None, "it is not text"
    except json.JSONDecodeError as e:
        return None, f"it does not parse as JSON ({e})"


def checksum_problem(data: Any) -> str | None:
    """What is wrong with a loaded file's checksum, or None: it is a JSON object that carries a checksum that
    matches its contents."""
    if not isinstance(data, dict):
        return f"it is not a JSON object (a {type(data).__name__})"
    if CHECKSUM not in data:
        return f"it carries no {CHECKSUM!r} field"
    if data[CHECKSUM] != json_checksum(data):
        return "its checksum does not match its contents"
    return None


def fields_problem(data: Mapping[str, Any], required: Mapping[str, Types],
                   optional: Mapping[str, Types] | None = None) -> str | None:
    """What is wrong with the keys and value types of a record (its checksum aside), or None: a key of
    `required` missing, a key in neither `required` nor `optional`, a value not of its key's types (null is a
    value of ``type(None)``; `bool` is never taken for an `int`, as JSON keeps them apart; an int is a `float`)."""
    optional = optional or {}
    known = {**required, **optional}
    problems = []
    missing = [k for k in required if k not in data]
    if missing:
        problems.append(f"missing {', '.join(map(repr, missing))}")
    unknown = [k for k in data if k not in known and k != CHECKSUM]
    if unknown:
        problems.append(f"unknown {', '.join(map(repr, unknown))}")
    for k, want in known.items():
        if k in data and not _is(data[k], want):
            names = "/".join("null" if t is type(None) else t.__name__ for t in _kinds(want))
            problems.append(f"{k!r} is {_short(data[k])}, not {names}")
    return "; ".join(problems) or None


def dataclass_problem(cls: type, data: Any, where: str = "") -> str | None:
    """:func:`fields_problem` for the record a dataclass `cls` is built from, with its fields' annotations as the
    types (a field with a default may be absent; a tuple or list is a JSON list; dataclasses inside it, alone or
    as the items of a tuple or list, are checked the same way)."""
    if not isinstance(data, dict):
        return f"{where}{_short(data)} is not a JSON object"
    hints = typing.get_type_hints(cls)
    required: dict[str, Types] = {}
    optional: dict[str, Types] = {}
    nested: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(cls):
        kinds, inner = _json_kinds(hints[f.name])
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        (optional if has_default else required)[f.name] = kinds
        if inner is not None:
            nested[f.name] = inner
    problem = fields_problem(data, required, optional)
    if problem:
        return where + problem
    for name, (sub, many) in nested.items():
        value = data.get(name)
        items = list(enumerate(value)) if many and isinstance(value, list) else [(None, value)]
        for i, item in items:
            if item is not None:
                problem = dataclass_problem(sub, item, f"{where}{name}{'' if i is None else f'[{i}]'}: ")
                if problem:
                    return problem
    return None


def _json_kinds(hint: Any) -> tuple[tuple[type, ...], tuple[type, bool] | None]:
    """The JSON value types of an annotation, and the dataclass it holds (with whether it holds a sequence)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_json_kinds(a) for a in args]
        return tuple(k for kinds, _ in parts for k in kinds), next((i for _, i in parts if i is not None), None)
    if hint in (int, float, str, bool, type(None)):
        return (hint,), None
    if dataclasses.is_dataclass(hint):
        return (dict,), (hint, False)
    if origin in (tuple, list):
        return (list,), ((args[0], True) if args and dataclasses.is_dataclass(args[0]) else None)
    if origin is dict or hint is dict:
        return (dict,), None
    return (object,), None


def _kinds(want: Types) -> tuple[type, ...]:
    return want if isinstance(want, tuple) else (want,)


def _is(value: Any, want: Types) -> bool:
    kinds = _kinds(want)
    if isinstance(value, bool):
        return bool in kinds or object in kinds
    return isinstance(value, kinds) or (float in kinds and isinstance(value, int))


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def set_aside(path: str | os.PathLike, tag: str = "damaged") -> str:
    """Rename `path` (a file or a folder) to a free name ``<path>.<tag>-<UTC time>[-n]`` beside it, durably, and
    return that name: what is damaged is kept for a look, never deleted, and no longer found under its name."""
    path = os.fspath(path).rstrip(os.sep)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        aside = f"{path}.{tag}-{stamp}" + (f"-{n}" if n else "")
        if not os.path.lexists(aside):
            break
    else:
        raise FileExistsError(f"no free name to set {path} aside under ({path}.{tag}-{stamp}-*)")
    os.rename(path, aside)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return aside
