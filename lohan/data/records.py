"""Training data sources and how each is opened: plain text in memory, and every other source as a table of records
through the ``datasets`` library (memory-mapped Arrow, so a source larger than memory is not loaded into it).

What a path is (:func:`source_kind`): a ``.txt``/``.text``/``.md`` file is plain text; a ``.jsonl`` file is read line by
line by lohan (:func:`~lohan.data.sources.iter_jsonl`: every problem named by its line); ``.json`` (an array of
objects, or one object per line), ``.parquet``, ``.arrow`` and ``.csv`` files are read by ``datasets``' builders of
those names; a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` is opened with
``datasets.load_from_disk`` (a ``DatasetDict``'s split picked by ``split``, default ``train``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .formats import check_columns
from .sources import TEXT_SUFFIXES, iter_jsonl

if TYPE_CHECKING:
    import datasets

__all__ = ["RECORD_SUFFIXES", "Records", "open_records", "source_kind"]

RECORD_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
"""File extensions read as tables of records, and the reader of each (``datasets`` builder names, but ``jsonl``)."""

SAVED = "saved"
"""The kind of a ``save_to_disk`` folder."""

_READS = ("plain text (.txt, .text, .md), JSON lines (.jsonl), JSON (.json), Parquet (.parquet), Arrow (.arrow), "
          "CSV (.csv), or a folder written by datasets' save_to_disk")


def source_kind(path: str | os.PathLike) -> str:
    """How `path` is read: ``text``, a :data:`RECORD_SUFFIXES` value, or :data:`SAVED` (a save_to_disk folder).

    Raises:
        FileNotFoundError: If nothing is at `path`.
        IsADirectoryError: If `path` is a folder that ``save_to_disk`` did not write.
        ValueError: If the file's extension is not one lohan reads.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"training data {str(p)!r} does not exist; pass an existing file (the shipped ones are "
                                "in the repository's data/ folder) or 'synthetic'")
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()):
            return SAVED
        raise IsADirectoryError(f"training data {str(p)!r} is a directory; pass one file inside it, or a folder written "
                                "by datasets' save_to_disk (it has a dataset_dict.json, or a state.json and a "
                                "dataset_info.json)")
    suffix = p.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in RECORD_SUFFIXES:
        return RECORD_SUFFIXES[suffix]
    # a file read as plain text would "train" on its syntax: say what is read instead
    raise ValueError(f"training data {str(p)!r} has the extension {suffix or '(none)'!r}; lohan reads {_READS}: "
                     "convert or rename the file")


@dataclass(frozen=True)
class Records:
    """A source opened as a table of records: the ``datasets.Dataset``, how its rows are named in messages, and
    what they are read as."""

    dataset: datasets.Dataset
    """Memory-mapped rows; for a ``.jsonl`` file, lohan's examples (already checked) with their line."""
    name: Callable[[int, dict[str, Any]], str]
    """``name(index, row)``: a row in messages, by its file and line or its record number."""
    description: str
    """What the records are read as, e.g. ``alpaca (instruction, input, output)``."""
    data_format: str
    """The format the rows are in now (``auto`` for the checked examples of a ``.jsonl`` file)."""
    text_field: str | None
    """The text column of ``text`` rows; None for ``"text"``."""


def open_records(path: str | os.PathLike, kind: str, work_dir: str | os.PathLike, data_format: str = "auto",
                 text_field: str | None = None, split: str | None = None) -> Records:
    """Open a record source (any :func:`source_kind` but ``text``) as a memory-mapped table.

    Args:
        path: The file or save_to_disk folder.
        kind: Its :func:`source_kind`.
        work_dir: Where ``datasets`` may write its Arrow copy of a file (not needed for a save_to_disk folder,
            which is mapped where it is; nothing is ever written into it).
        data_format: One of :data:`~lohan.data.formats.DATA_FORMATS`.
        text_field: The text column, if not ``"text"``.
        split: The split of a ``DatasetDict`` folder (default ``train``); other sources hold one split,
            ``train``.

    Raises:
        ValueError: If the source cannot be read (the reader's own reason attached), its columns do not fit the
            format, or the split does not exist (naming the splits there).
    """
    import datasets  # lazy: the library is slow to import, and .txt runs do not need it

    source = repr(str(path))
    if kind == "jsonl":
        return _jsonl_records(path, work_dir, data_format, text_field)
    if kind == SAVED:
        table = _saved(path, split)
    else:
        if split not in (None, "train"):
            raise ValueError(f"--split {split}: {source} is one file, read as the single split 'train'; --split picks "
                             "a split of a folder written by DatasetDict.save_to_disk (drop it)")
        try:
            table = datasets.load_dataset(kind, data_files=str(Path(path).expanduser().resolve()), split="train",
                                          cache_dir=str(work_dir))
        except Exception as e:  # pyarrow, pandas and datasets raise their own types; the cause is what helps
            raise ValueError(f"training data {source} could not be read as {kind.upper()}: {_root_cause(e)}") from None
    description = check_columns(table.column_names, data_format, text_field, source)

    def name(i: int, row: dict[str, Any]) -> str:
        return f"{source} record {i + 1}" + (f" (split {split!r})" if split else "")

    return Records(table, name, description, data_format, text_field)


def _saved(path: str | os.PathLike, split: str | None) -> datasets.Dataset:
    import datasets

    try:
        opened = datasets.load_from_disk(str(Path(path).expanduser()))
    except Exception as e:
        raise ValueError(f"training data {str(path)!r} could not be opened with datasets.load_from_disk: "
                         f"{_root_cause(e)}") from None
    if isinstance(opened, datasets.DatasetDict):
        want = split or "train"
        if want not in opened:
            raise ValueError(f"{str(path)!r} has no split {want!r}; its splits are {', '.join(map(repr, opened))}: "
                             "pick one with --split NAME (--eval-split NAME for --eval-data)")
        return opened[want]
    if split not in (None, "train", opened.split):
        raise ValueError(f"--split {split}: {str(path)!r} holds one dataset (Dataset.save_to_disk), not splits; drop "
                         "--split, or pass the folder DatasetDict.save_to_disk wrote")
    return opened


def _jsonl_records(path: str | os.PathLike, work_dir: str | os.PathLike, data_format: str,
                   text_field: str | None) -> Records:
    """A ``.jsonl`` file's checked examples as a table: lohan reads the lines (each problem named by its line) and
    ``datasets`` writes the rows to Arrow as they come, so the file is never held in memory whole."""
    import datasets

    source = repr(str(Path(path).expanduser()))
    features = datasets.Features({
        "line": datasets.Value("int64"), "text": datasets.Value("string"), "prompt": datasets.Value("string"),
        "response": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    })

    def rows(path: str, data_format: str, text_field: str | None) -> Iterator[dict[str, Any]]:
        for line, example in iter_jsonl(path, data_format, text_field):
            yield {"line": line, "text": None, "prompt": None, "response": None, "messages": None, **example}

    try:
        table = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(work_dir),
                                                gen_kwargs={"path": str(path), "data_format": data_format,
                                                            "text_field": text_field})
    except datasets.exceptions.DatasetGenerationError as e:  # it wraps our own, line-numbered error
        cause = e.__cause__ or e.__context__
        if isinstance(cause, (ValueError, OSError)):
            raise cause from None
        raise

    def name(i: int, row: dict[str, Any]) -> str:
        return f"{source} line {row['line']}"

    how = data_format + (f", key {text_field!r}" if text_field else "")
    return Records(table, name, f"{how}, line by line", "auto", None)


def _root_cause(err: BaseException) -> str:
    """The innermost error behind `err`, as `Type: message` (datasets wraps the reader's error in its own)."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return f"{type(err).__name__}: {err}"
