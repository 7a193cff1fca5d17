"""The token cache: a record source tokenized once, kept on disk as one token stream and its loss mask, and
memory-mapped by every later run on the same data (a resumed run starts without tokenizing again).

How it is built. The source is opened as a table (:func:`~lohan.data.records.open_records`) and tokenized with
``datasets.Dataset.map`` in batches written to an Arrow file as they are done, so a source larger than memory
streams through; each batch becomes one row holding its examples' tokens and mask, exactly what
:func:`~lohan.data.sources.encode_examples` makes of them (per-example encoding: a batch's stream is the
concatenation of its examples', so the whole stream is bit-identical to encoding all examples at once). The rows
are then written out as two flat files, ``tokens.bin`` (int64) and ``mask.bin`` (one byte per token, 1 for a
prediction target), which a run maps with ``torch.from_file``: the packed windows are a view of them, and only the
pages a batch touches are read.

Where it lives. In ``$LOHAN_DATA_CACHE``, by default ``lohan-tokens`` in the ``datasets`` cache (``$HF_DATASETS_CACHE``,
normally ``~/.cache/huggingface/datasets``): one folder per key, named ``<source name>-<key>``. The key is a
hash of what the stream depends on: the source (its real path, and the size and modification time of each of its
files), the split, ``--data-format``, ``--text-field``, the tokenizer (``datasets``' fingerprint of it, chat template
and special tokens included) and :data:`CACHE_VERSION`. ``seq_len`` is not in it: windows are cut from the stream
when it is mapped, so any ``--seq-len`` reuses it.

Kill safety, and what lohan removes. A folder is built as ``<name>.partial`` under an advisory lock (the file
``<name>.lock`` while it builds: data-parallel ranks and concurrent runs build it once) and renamed into place only
after both files are flushed to disk and ``manifest.json`` (the token count, the counts of examples, each file's
XXH3-64 checksum, the range of the token ids, and the manifest's own checksum) is written; a kill at any moment
leaves at most a ``.partial`` folder, which nothing trusts. The next build of that key continues in it:
``datasets`` writes its own files through temporary names (its builders through ``.incomplete`` folders, ``map``
through a ``tmp*`` file renamed when complete), so a completed tokenization there is reused, not redone. lohan
removes only what it wrote there: the ``tmp*`` files a killed ``map`` left, the intermediate Arrow files once the
manifest is written, and the whole ``.partial`` folder when its build fails on bad data or a full disk.

Reuse is checked. A finished folder is never modified or removed: each reuse checks its manifest and both files
against it (sizes and checksums; what that costs: :func:`_file_sum`), and a folder that fails is set aside whole
(renamed ``<name>.damaged-<time>``, a warning says what was wrong and where it went) and built again, so flipped
bytes are never trained on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from io_engine import durable

from .formats import to_example
from .records import SAVED, Records, open_records, source_kind
from .sources import encode_examples
from .tokenizers import ByteTokenizer, Tokenizer

__all__ = ["CACHE_ENV", "CACHE_VERSION", "TokenStream", "default_cache_root", "load_stream"]

log = logging.getLogger(__name__)

CACHE_VERSION = 2
"""Bumped whenever lohan's encoding of examples or the folder's files change (special tokens, masks, formats; 2:
the manifest carries its files' checksums and the token ids' range): older folders are then simply not found
(their key differs), and never removed."""

CACHE_ENV = "LOHAN_DATA_CACHE"
"""The environment variable naming the token cache's folder."""

MANIFEST = "manifest.json"
TOKENS, MASK = "tokens.bin", "mask.bin"


@dataclass(frozen=True)
class TokenStream:
    """A tokenized source: the token stream and its loss mask, memory-mapped from the token cache.

    Attributes:
        ids: ``int64`` ``[n_tokens]``, the examples' tokens back to back.
        mask: ``bool`` ``[n_tokens]``, True where the token is a prediction target.
        n_examples: Records read.
        description: What was read and how, for the run's header.
        id_range: The smallest and largest token id (None: no tokens), recorded when the cache was built.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    n_examples: int
    description: str
    id_range: tuple[int, int] | None = None
    """The smallest and the largest token id in the stream (None: no tokens)."""


def default_cache_root() -> Path:
    """``$LOHAN_DATA_CACHE``, or ``lohan-tokens`` in the ``datasets`` cache."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from datasets import config

    return Path(config.HF_DATASETS_CACHE) / "lohan-tokens"


def load_stream(path: str | os.PathLike, tokenizer: Tokenizer | None = None, *, data_format: str = "auto",
                text_field: str | None = None, split: str | None = None,
                cache_root: str | os.PathLike | None = None, write: bool = True) -> TokenStream:
    """Tokenize a record source through the token cache (module docstring), or map it from there if it is cached.

    Args:
        path: A record file or a save_to_disk folder (:func:`~lohan.data.records.source_kind`, not plain text).
        tokenizer: Default :class:`ByteTokenizer`.
        data_format: One of :data:`~lohan.data.formats.DATA_FORMATS`.
        text_field: The text column, if not ``"text"``.
        split: The split of a ``DatasetDict`` folder (default ``train``).
        cache_root: The cache's folder; default :func:`default_cache_root`.
        write: False: write nothing that lasts (a dry run): use the cached stream if there is one, else tokenize
            into a temporary folder that is gone when this returns (the mapping stays valid).

    Raises:
        ValueError: If the source cannot be read, a record is malformed (named by its line or number), or the
            cache's folder cannot be written (its disk full: the folder, the file and the fix named). A damaged
            cache folder is no error: it is set aside and built again, with a warning.
    """
    tokenizer = tokenizer or ByteTokenizer()
    kind = source_kind(path)
    if kind == "text":
        raise ValueError(f"{str(path)!r} is plain text, read in memory (TokenDataset.from_text), not a record source")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    inputs = {"version": CACHE_VERSION, "source": _identity(path), "split": split, "data_format": data_format,
              "text_field": text_field, "tokenizer": _tokenizer_key(tokenizer)}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
    name = f"{re.sub(r'[^A-Za-z0-9._-]+', '_', Path(path).name)[:48]}-{key}"
    if kind == SAVED and _inside(root, Path(path)):
        raise ValueError(f"the token cache {root} lies inside the data folder {str(path)!r}: lohan never writes into "
                         f"its inputs; set {CACHE_ENV} to a folder outside it")

    def build(out: Path) -> None:
        _build(out, path, kind, tokenizer, data_format, text_field, split, key, inputs)

    final = root / name
    damage = None
    if final.exists():
        try:
            return _stream(final, key, path, "reused")
        except DamagedCacheError as e:  # set aside below, under the lock (another process may be doing it now)
            damage = e
    if not write:
        if damage is not None:
            log.warning("%s; this dry run tokenizes into a temporary folder (a run sets the damaged one aside and "
                        "builds it again)", damage)
        with tempfile.TemporaryDirectory(prefix="lohan-tokens-") as tmp:
            _build_explained(Path(tmp), build, "TMPDIR")  # (where a dry run tokenizes)
            return _stream(Path(tmp), key, path, None, check_files=False)
    return _build_cached(root, name, key, path, build)


def _build_cached(root: Path, name: str, key: str, path: str | os.PathLike, build: Callable[[Path], None]
                  ) -> TokenStream:
    """Build folder `name` of the cache in `root` under its lock (or map it, if the process this one waited for
    built it); a damaged folder there is set aside (renamed, never removed) and built again."""
    final = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_path = root / f"{name}.lock"
        lock = _lock(lock_path, final)
    except OSError as e:
        raise ValueError(f"cannot write the token cache in {root} ({e.strerror or e}); set {CACHE_ENV} to a writable "
                         "folder") from None
    try:
        if final.exists():  # built by the process this one waited for, or damaged
            try:
                return _stream(final, key, path, "reused")
            except DamagedCacheError as e:
                log.warning("%s; set aside as %s; building it again", e, durable.set_aside(final))
        partial = root / f"{name}.partial"
        partial.mkdir(exist_ok=True)
        for leftover in partial.glob("tmp*"):  # a killed map's unfinished output (datasets' NamedTemporaryFile)
            if leftover.is_file():
                leftover.unlink()
        try:
            _build_explained(partial, build)
        except Exception:  # bad data fails again the same way, and a full disk wants its space back: keep nothing
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.rename(partial, final)
        durable.fsync_dir(root)
        return _stream(final, key, path, "built", check_files=False)  # (hashed as they were written)
    finally:
        _unlock(lock_path, lock)


def _build_explained(out: Path, build: Callable[[Path], None], env: str = CACHE_ENV) -> None:
    """`build(out)`; a full disk anywhere below it (datasets and pyarrow wrap or re-raise the OSError) becomes a
    ValueError that names the folder, the file, the space left and the fix (another folder, through `env`), not a
    bare ``[Errno 28]``."""
    try:
        build(out)
    except Exception as e:
        full = _disk_full(e)
        if full is None:
            raise
        writing = f" (writing {full.filename})" if full.filename else ""
        left = f" with {shutil.disk_usage(out).free / 2**20:,.1f} MiB left" if out.exists() else ""
        raise ValueError(f"the disk is full while building the token cache in {out}{writing}{left}. The cache "
                         "takes about 9 bytes per token, twice that while it is built, plus a copy of the source: "
                         f"free space there, or set {env} to a folder on a disk with room. Nothing of it was "
                         "kept") from None


def _disk_full(err: BaseException | None) -> OSError | None:
    """The ENOSPC or EDQUOT error behind `err` (its causes and contexts, wrapped or suppressed), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
        err = err.__cause__ or err.__context__
    return None


def _build(out: Path, path: str | os.PathLike, kind: str, tokenizer: Tokenizer, data_format: str,
           text_field: str | None, split: str | None, key: str, inputs: dict[str, Any]) -> None:
    """Tokenize the source into `out`: tokens.bin, mask.bin, then the manifest that makes them trusted (their
    sizes and XXH3-64 checksums, computed as they are written, and the range of the token ids)."""
    import datasets

    t0 = time.perf_counter()
    records = open_records(path, kind, out / "datasets", data_format, text_field, split)
    table = records.dataset
    features = datasets.Features({"ids": datasets.List(datasets.Value("int64")),
                                  "mask": datasets.List(datasets.Value("bool")), "examples": datasets.Value("int64"),
                                  "text": datasets.Value("int64"), "prompt": datasets.Value("int64"),
                                  "chat": datasets.Value("int64")})
    tokens = table.map(_encoder(records, tokenizer), batched=True, with_indices=True, features=features,
                       remove_columns=table.column_names, cache_file_name=str(out / "tokens.arrow"),
                       new_fingerprint=key, desc=f"tokenizing {Path(path).name}")
    n_tokens, lo, hi = 0, None, None
    sums = {TOKENS: xxhash.xxh3_64(), MASK: xxhash.xxh3_64()}
    with open(out / TOKENS, "wb") as ft, open(out / MASK, "wb") as fm:
        for batch in tokens.data.table.to_batches():
            ids = batch.column("ids").flatten().to_numpy()
            mask = batch.column("mask").flatten().to_numpy(zero_copy_only=False).view("uint8")
            for f, part in ((ft, TOKENS), (fm, MASK)):
                data = memoryview(ids if part == TOKENS else mask).cast("B")
                f.write(data)
                sums[part].update(data)
            if len(ids):
                lo = int(ids.min()) if lo is None else min(lo, int(ids.min()))
                hi = int(ids.max()) if hi is None else max(hi, int(ids.max()))
            n_tokens += len(ids)
        for f in (ft, fm):
            f.flush()
            os.fsync(f.fileno())
    counts = {c: sum(tokens[c]) for c in ("examples", "text", "prompt", "chat")}
    manifest = {"version": CACHE_VERSION, "key": key, "inputs": inputs, "n_tokens": n_tokens, "counts": counts,
                "records": records.description, "seconds": round(time.perf_counter() - t0, 3),
                "files": {f: h.hexdigest() for f, h in sums.items()}, "ids": None if lo is None else [lo, hi]}
    _write_manifest(out / MANIFEST, manifest)
    # only now: a build killed before this point finds its map output (and datasets' copy of the source) again
    del tokens, table, records  # their memory maps (a mapped file may be unlinked, too)
    shutil.rmtree(out / "datasets", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out / "tokens.arrow")


def _encoder(records: Records, tokenizer: Tokenizer) -> Callable[[dict[str, list], list[int]], dict[str, list]]:
    """The map function: a batch of rows -> one row of their tokens, mask and counts (every row checked and named)."""

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        columns = list(batch)
        examples, names = [], []
        for i, values in zip(indices, zip(*batch.values())):
            row = dict(zip(columns, values))
            name = records.name(i, row)
            try:  # a missing value of a table is a key the record does not have
                examples.append(to_example({k: v for k, v in row.items() if v is not None}, records.data_format,
                                           records.text_field, unit="record"))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            names.append(name)
        ids, mask = encode_examples(examples, tokenizer, names)
        forms = Counter("chat" if "messages" in ex else "text" if "text" in ex else "prompt" for ex in examples)
        return {"ids": [ids.numpy()], "mask": [mask.numpy()], "examples": [len(examples)], "text": [forms["text"]],
                "prompt": [forms["prompt"]], "chat": [forms["chat"]]}

    return encode


class DamagedCacheError(ValueError):
    """A cache folder whose files are not what its manifest says (or whose manifest is damaged)."""


_MANIFEST_FIELDS = {"version": int, "key": str, "inputs": dict, "n_tokens": int, "counts": dict, "records": str,
                    "seconds": float, "files": dict, "ids": (list, type(None))}
_COUNTS = {c: int for c in ("examples", "text", "prompt", "chat")}


def _manifest(folder: Path, key: str) -> dict[str, Any]:
    """A folder's manifest, checked: it parses, carries its checksum, has the manifest's fields and names `key`
    (DamagedCacheError otherwise)."""
    try:
        data, problem = durable.load_json(folder / MANIFEST)
    except OSError as e:
        data, problem = None, f"it cannot be read ({e.strerror or e})"
    problem = problem or durable.checksum_problem(data) or durable.fields_problem(data, _MANIFEST_FIELDS)
    if problem is None:
        problem = durable.fields_problem(data["counts"], _COUNTS) or durable.fields_problem(
            data["files"], {TOKENS: str, MASK: str})
    ids = data.get("ids") if problem is None else None
    if ids is not None and not (len(ids) == 2 and all(type(i) is int for i in ids)):
        problem = f"its token id range {ids} is not two integers"
    if problem is None and (data["key"], data["version"]) != (key, CACHE_VERSION):
        problem = f"it names key {data['key']} (version {data['version']}), not the folder's {key}"
    if problem:
        raise DamagedCacheError(f"the token cache {folder} is damaged: its {MANIFEST}: {problem}")
    return data


def _file_sum(path: Path) -> str:
    """XXH3-64 of a file, read in 1 MiB pieces. What checking costs on reuse, measured on the 2-core box this was
    written on: ~5 GiB/s from the page cache (the hash alone runs at ~15 GiB/s), so a cache of 1B tokens (8 GiB of
    tokens and 1 GiB of mask) takes ~2 s when cached, and a cold read at the disk's speed otherwise (~5 s at
    2 GB/s): seconds, against the hours of a run and the tens of minutes its tokenization took."""
    h = xxhash.xxh3_64()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _stream(folder: Path, key: str, path: str | os.PathLike, how: str | None, check_files: bool = True
            ) -> TokenStream:
    """Map a built folder's stream, after checking that it is whole: its manifest, its files' sizes and (with
    `check_files`) their checksums (DamagedCacheError otherwise); `how` it came to be there ("built", "reused";
    None: a dry run's temporary folder), for the description."""
    manifest = _manifest(folder, key)
    n = manifest["n_tokens"]
    for file, size in ((TOKENS, 8 * n), (MASK, n)):
        have = os.path.getsize(folder / file) if (folder / file).is_file() else None
        if have != size:
            raise DamagedCacheError(f"the token cache {folder} is damaged: {file} has {have} bytes, its manifest "
                                    f"says {size}")
        if check_files and _file_sum(folder / file) != manifest["files"][file]:
            raise DamagedCacheError(f"the token cache {folder} is damaged: {file} does not match the checksum in "
                                    f"its {MANIFEST} (its bytes changed after it was built)")
    if n == 0:
        ids, mask = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)
    else:  # shared=False: a private mapping, paged in as batches touch it; nothing is written back
        ids = torch.from_file(str(folder / TOKENS), shared=False, size=n, dtype=torch.long)
        mask = torch.from_file(str(folder / MASK), shared=False, size=n, dtype=torch.bool)
    counts = manifest["counts"]
    forms = ", ".join(f"{counts[c]:,} {what}" for c, what in (("text", "text"), ("prompt", "prompt/response"),
                                                              ("chat", "chat")) if counts[c])
    if how is None:
        cache = "tokenized for this dry run, not cached"
    else:
        took = f" in {manifest['seconds']:.1f} s" if how == "built" else ""
        cache = f"token cache {how}{took}: {folder}"
    id_range = tuple(manifest["ids"]) if manifest["ids"] is not None else None
    return TokenStream(ids, mask, counts["examples"],
                       f"{path}: {manifest['records']}; {forms or 'no'} examples, {n:,} tokens; {cache}", id_range)


def _identity(path: str | os.PathLike) -> dict[str, Any]:
    """What the cached stream was made from: the real path, and the size and mtime of each file (a changed file
    gives another key, so a stale stream is never used; a content hash would read the whole source each start)."""
    p = Path(path).expanduser().resolve()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return {"path": str(p), "files": [[str(q.relative_to(p)) if p.is_dir() else q.name, q.stat().st_size,
                                       q.stat().st_mtime_ns] for q in files]}


def _tokenizer_key(tokenizer: Tokenizer) -> str:
    if type(tokenizer) is ByteTokenizer:
        return "bytes"
    from datasets.fingerprint import Hasher  # what datasets itself fingerprints a tokenizer with

    return f"{type(tokenizer).__name__}:{Hasher.hash(getattr(tokenizer, 'tok', tokenizer))}"


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    durable.write_json_atomic(path, manifest)  # with its checksum, atomically: the last write of a build


def _inside(a: Path, b: Path) -> bool:
    a, b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    return a == b or a.is_relative_to(b)


def _lock(path: Path, final: Path) -> int:
    """Exclusive building of one key: the descriptor returned holds an advisory lock on `path` until
    :func:`_unlock`; the kernel drops it when its holder dies, however it dies."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process that is building the token cache %s", final)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder before removes the file as it lets go: then lock the file that is there now
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _unlock(path: Path, fd: int) -> None:
    """Remove the lock file, then let go of it (in this order, so every waiter sees the removal: :func:`_lock`)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)
