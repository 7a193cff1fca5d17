"""The run layout: every path a run reads or writes, owned and checked together before anything is written.

A run never deletes or overwrites a file it did not write (DESIGN.md §5). Its outputs:

- the store directories (``--nvme``): shared places, where lohan writes only the files of its store
  (``<name>.*``, ``<name>-*``: slabs, manifests, commit record, run state, profile) and its default metrics;
- the metrics JSONL (``--metrics``; by default ``<nvme>/<name>.metrics.jsonl``, so that two runs never share
  it) and its plot beside it (``.png``);
- the export directory (``--export``), whose files are replaced whole, and the ``.partial`` sibling it is
  written into; the periodic checkpoints (``--save-every N``) inside it, ``<export>/step-N``, each written into
  ``step-N.partial`` beside it and removed (``--save-total-limit``, a step saved again) by way of ``step-N.old``;
- the trackers' directory (``--logging-dir``, with ``--report-to``), where they only add files of their own.

Its inputs: the model directory, the data and eval data files, the config file. `RunLayout.problems` finds,
before anything is written, every path that would make the run destroy or corrupt something: an output that
is an input or lies inside one, an input or another output inside the export (replaced whole), an output that
names another one, and a file where an output goes that lohan did not write. What lohan wrote says so: a
metrics file is JSON records with a step, a plot carries lohan's tag in its PNG text, an export and each
checkpoint hold `EXPORT_MARKER` (written first, removed last: a folder a kill leaves half-written or
half-removed still holds it, or is empty).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lohan.models import EXPORT_MARKER
from lohan.store.files import is_run_file

PLOT_TAG = "lohan metrics plot"
"""The PNG ``Software`` text of the metrics plot (metrics.plot_metrics)."""


@dataclass(frozen=True)
class Place:
    """One path of a run: what it is to the user (`label`), and how lohan uses it.

    `kind`: ``store`` (a directory lohan shares: it writes only its store's files there), ``dir`` (a directory
    lohan replaces whole), or ``file``."""

    label: str
    path: Path
    kind: str
    output: bool


def default_metrics(nvme: str, name: str) -> Path:
    """The metrics of a run that names none: with its store, so runs whose stores share a parent do not share it."""
    return Path(nvme) / f"{name}.metrics.jsonl"


class RunLayout:
    """Every path of a run, with the checks that keep a run from destroying what is not its own."""

    def __init__(self, nvme: tuple[str, ...], store_name: str, metrics: str | os.PathLike,
                 export: str | os.PathLike | None = None, inputs: dict[str, str | os.PathLike] | None = None,
                 logging_dir: str | os.PathLike | None = None) -> None:
        self.store_name = store_name
        self.logging_dir = Path(logging_dir) if logging_dir else None
        self.metrics = Path(metrics)
        self.plot = self.metrics.with_suffix(".png")
        self.export = Path(export) if export else None
        outs = [Place("--nvme", _real(d), "store", True) for d in nvme]
        outs += [Place("--metrics", _real(self.metrics), "file", True),
                 Place("the metrics plot", _real(self.plot), "file", True)]
        if self.export is not None:
            outs += [Place("--export", _real(self.export), "dir", True),
                     Place("the export's staging directory", _real(partial_dir(self.export)), "dir", True)]
        if self.logging_dir is not None:  # the trackers only add files of their own (time- and id-stamped) there
            outs.append(Place("--logging-dir", _real(self.logging_dir), "store", True))
        ins = [Place(label, _real(p), "dir" if os.path.isdir(p) else "file", False)
               for label, p in (inputs or {}).items() if p]
        self.places = outs + ins

    def problems(self) -> list[str]:
        """What would make this run write over or into what is not its own; each says how to fix it."""
        out = []
        for i, a in enumerate(self.places):
            for b in self.places[i + 1:]:
                if a.kind == b.kind == "store":  # the SSD directories among themselves: fit.nvme_problems
                    continue
                problem = _clash(a, b, self.store_name) or _clash(b, a, self.store_name)
                if problem:
                    out.append(problem)
        out += self._foreign_files()
        return list(dict.fromkeys(out))

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of step `step` goes (``<export>/step-N``)."""
        assert self.export is not None, "checkpoints go into the export directory: the run has none"
        return self.export / f"{CHECKPOINT_PREFIX}{step}"

    def check_export(self) -> None:
        """At export and checkpoint time, again: the export directory holds nothing but lohan's (the run may have
        taken hours, and the export's files are replaced whole)."""
        if self.export is not None:
            problem = _foreign_export(self.export) or _foreign_export(partial_dir(self.export), "staging ")
            if problem:
                raise ValueError(problem)

    def _foreign_files(self) -> list[str]:
        out = []
        if self.metrics.is_dir():
            out.append(f"--metrics {self.metrics} is a directory: give the path of a file (e.g. "
                       f"{self.metrics / 'metrics.jsonl'})")
        elif self.metrics.exists() and not is_lohan_metrics(self.metrics):
            out.append(f"--metrics {self.metrics} holds a file lohan did not write (not a metrics JSONL): lohan "
                       "never overwrites one; choose another --metrics path, or move that file away")
        if self.plot.exists() and not self.plot.is_dir() and not is_lohan_plot(self.plot):
            out.append(f"the metrics plot goes to {self.plot}, which holds a file lohan did not write: choose another "
                       "--metrics path (the plot is written beside it, as .png), or move that file away")
        elif self.plot.is_dir():
            out.append(f"the metrics plot goes to {self.plot}, which is a directory: choose another --metrics path")
        if self.logging_dir is not None and self.logging_dir.exists() and not self.logging_dir.is_dir():
            out.append(f"--logging-dir {self.logging_dir} is a file: the trackers need a directory; choose another")
        if self.export is not None:
            for problem in (_foreign_export(self.export), _foreign_export(partial_dir(self.export), "staging ")):
                if problem:
                    out.append(problem)
        return out


def partial_dir(export: Path) -> Path:
    """Where an export is written before it replaces the export directory (a kill leaves the old one whole)."""
    return export.with_name(export.name + ".partial")


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.abspath(p)))


def _inside(a: Path, b: Path) -> bool:
    return a != b and a.is_relative_to(b)


def _clash(a: Place, b: Place, store: str) -> str | None:
    """The problem if `a` is `b`, or lies inside it, in a way that puts something at risk (None if not)."""
    if a.path == b.path and (a.output or b.output):
        return f"{a.label} and {b.label} are the same path ({a.path}): give each its own"
    if not _inside(a.path, b.path) or not (a.output or b.output):
        return None
    if b.output and b.kind == "dir":  # replaced whole: whatever is inside would go with it
        return (f"{a.label} {a.path} lies inside {b.label} {b.path}, which lohan replaces whole when it exports: "
                f"choose a {'new directory for ' + b.label if b.label == '--export' else 'path outside it'}")
    if not b.output and a.output:  # lohan would write into an input (the model folder)
        return f"{a.label} {a.path} lies inside {b.label} {b.path}: lohan never writes into its inputs; choose a path outside it"
    if b.kind == "store" and not a.output:
        return (f"{a.label} {a.path} lies inside the store directory {b.path} (--nvme): keep inputs out of the "
                "directories lohan writes its states to")
    if b.kind == "store" and a.kind == "file" and a.path.parent == b.path and _store_file(a.path.name, store):
        return f"{a.label} {a.path} is the name of one of the store's own files: choose another"
    return None


def _store_file(name: str, store: str) -> bool:
    return is_run_file(name, store)


def is_lohan_metrics(path: Path) -> bool:
    """Whether `path` is a metrics JSONL (every line a JSON record with a step; the last may be cut short by a
    kill) or empty: what a fresh run may replace and a resumed run appends to."""
    try:
        with path.open(encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return False
    complete, last = lines[:-1], lines[-1]
    for line in complete:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            return False
        if not isinstance(record, dict) or "step" not in record:
            return False
    return not last.strip() or last.lstrip().startswith("{")


def is_lohan_plot(path: Path) -> bool:
    """Whether `path` is a PNG lohan wrote (its ``Software`` text is `PLOT_TAG`)."""
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"Software\x00" + PLOT_TAG.encode() in head


CHECKPOINT_PREFIX = "step-"
_CHECKPOINT = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"step-(\d+)\.(partial|old)")


def checkpoint_step(path: Path) -> int | None:
    """The step of `path` if it is a checkpoint of lohan's (``step-N``, holding `EXPORT_MARKER`), else None."""
    match = _CHECKPOINT.fullmatch(path.name)
    if match is None or path.is_symlink() or not (path / EXPORT_MARKER).is_file():
        return None
    return int(match.group(1))


def is_leftover(path: Path) -> bool:
    """Whether `path` is what a killed save or removal of a checkpoint left (``step-N.partial``, ``step-N.old``):
    lohan's if it holds `EXPORT_MARKER` (written first, removed last) or is empty (a kill right after mkdir)."""
    if _LEFTOVER.fullmatch(path.name) is None or path.is_symlink() or not path.is_dir():
        return False
    return (path / EXPORT_MARKER).is_file() or not any(path.iterdir())


def _is_ours(entry: Path, exported: bool) -> bool:
    """Whether lohan wrote `entry` of an export directory: a checkpoint or a leftover of one; or, in a directory
    lohan exported to (`exported`: it holds the marker), a file (an export is flat) not named like those."""
    if entry.is_dir() and not entry.is_symlink():
        return checkpoint_step(entry) is not None or is_leftover(entry)
    return exported and not (_CHECKPOINT.fullmatch(entry.name) or _LEFTOVER.fullmatch(entry.name))


def _foreign_export(out: Path, what: str = "") -> str | None:
    """The problem if `out` exists and holds anything lohan did not write there (None if it may be replaced)."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"the export {what}path {out} is a file; give a directory (a new or empty one)"
    exported = (out / EXPORT_MARKER).is_file()
    foreign = sorted(e.name for e in out.iterdir() if not _is_ours(e, exported))
    if foreign:
        names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (f"the export {what}directory {out} holds files that are not an export of lohan's ({names}; an "
                f"export holds {EXPORT_MARKER}, its checkpoints step-N/ too): lohan replaces an export's files and "
                "manages its checkpoints, so it takes only a new or empty directory, or one it exported to before; "
                "choose another --export, or move those away")
    return None
