"""The run layout: every path a run reads or writes, owned and checked together before anything is written.

A run never deletes or overwrites a file it did not write (DESIGN.md §5). Its outputs:

- the store directories (``--nvme``): shared places, where lohan writes only the files of its store
  (``<name>.*``, ``<name>-*``: slabs, manifests, commit record, run state, profile; the store name is a file name,
  `lohan.config.store_name_problem`) and its default metrics;
- the metrics JSONL (``--metrics``; by default ``<nvme>/<name>.metrics.jsonl``, so that two runs never share
  it) and its plot beside it (``.png``);
- the export directory (``--export``), whose files are replaced whole, and the ``.partial`` sibling it is
  written into; the periodic checkpoints (``--save-every N``) inside it, ``<export>/step-N``, each written into
  ``step-N.partial`` beside it and removed (``--save-total-limit``, a step saved again) by way of ``step-N.old``;
- the trackers' directory (``--logging-dir``, with ``--report-to``), where they only add files of their own.

Its inputs: the model directory, the data and eval data files, the config file. `RunLayout.problems` finds,
before anything is written, every path that would make the run destroy or corrupt something: an output that
is an input or lies inside one, an input or another output inside the export (replaced whole), an output that
names another one, an output that is a symbolic link (`ownership.link_problem`), and a file where an output goes
that this run cannot prove it wrote: what lohan wrote carries the identity of the run that wrote it
(`lohan.app.ownership`: the metrics' records, the plot's PNG text, the manifest of every export and checkpoint, which
lists each file with its checksum), and a run replaces only what its own store or a store it replaced wrote.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lohan.app.ownership import (
    ForeignFileError,
    Owner,
    folder_problem,
    link_problem,
    metrics_owner,
    read_manifest,
)
from lohan.models import EXPORT_MARKER  # noqa: F401 (export.py and the tests name it here)
from lohan.store.dirlock import LOCK_NAME
from lohan.store.files import is_run_file, run_files

PLOT_TAG = "lohan metrics plot"
"""The PNG ``Software`` text of the metrics plot (plot.plot_metrics)."""
PLOT_RUN_KEY = "lohan run id"
"""The PNG text key of the run that drew the plot (plot.plot_metrics)."""


class OutputError(OSError):
    """An output of the run (its metrics, plot, export, a checkpoint) could not be written: the OS error, with the
    output's path and what lohan was doing (`doing`), which messages name instead of a bare ``[Errno 28]``."""

    def __init__(self, err: OSError, doing: str, path: str | os.PathLike) -> None:
        super().__init__(err.errno, err.strerror or str(err), os.fspath(path))
        self.doing = doing


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
    """Every path of a run, with the checks that keep a run from destroying what is not its own.

    `owner`: the runs whose outputs this run may replace (`ownership.Owner`; by default none: a new store's);
    `adopt` adds the store's identity once it is open."""

    def __init__(self, nvme: tuple[str, ...], store_name: str, metrics: str | os.PathLike,
                 export: str | os.PathLike | None = None, inputs: dict[str, str | os.PathLike] | None = None,
                 logging_dir: str | os.PathLike | None = None, owner: Owner | None = None) -> None:
        self.nvme = tuple(nvme)
        self.store_name = store_name
        self.owner = owner or Owner(os.path.join(nvme[0], store_name))
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

    def adopt(self, current: str, replaced: tuple[str, ...] = ()) -> None:
        """The store is open: its identity (and those of the stores it replaced) own the run's outputs from now."""
        self.owner = self.owner.adopt(current, replaced)

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
        out += self._links()
        out += self._foreign_files()
        return list(dict.fromkeys(out))

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of step `step` goes (``<export>/step-N``)."""
        assert self.export is not None, "checkpoints go into the export directory: the run has none"
        return self.export / f"{CHECKPOINT_PREFIX}{step}"

    def check_export(self) -> None:
        """At export and checkpoint time, again: the export directory holds nothing but this run's (the run may
        have taken hours, and the export's files are replaced whole). ForeignFileError if it does."""
        problem = self._export_problem()
        if problem:
            raise ForeignFileError(problem)

    def _export_problem(self) -> str | None:
        if self.export is None:
            return None
        return (folder_problem(self.export, self.owner, in_export, "the export")
                or folder_problem(partial_dir(self.export), self.owner, in_export, "the export's staging"))

    def _links(self) -> list[str]:
        """Outputs that are symbolic links: the store's files in each SSD directory too (a slab or a record through
        a link would be written into whatever it points at)."""
        paths = [("--metrics", self.metrics), ("the metrics plot", self.plot)]
        if self.export is not None:
            paths += [("--export", self.export), ("the export's staging directory", partial_dir(self.export))]
        if self.logging_dir is not None:
            paths.append(("--logging-dir", self.logging_dir))
        out = [p for label, path in paths if (p := link_problem(path, label))]
        fix = "remove the link (it is not a file of lohan's), or choose other --nvme directories"
        return out + [p for d in self.nvme for f in (*run_files(self.store_name), LOCK_NAME)
                      if (p := link_problem(Path(d) / f, "the store's file", fix))]

    def _foreign_files(self) -> list[str]:
        out = []
        if self.metrics.is_dir():
            out.append(f"--metrics {self.metrics} is a directory: give the path of a file (e.g. "
                       f"{self.metrics / 'metrics.jsonl'})")
        elif self.metrics.exists() and not self.metrics.is_symlink():
            run_id, why = metrics_owner(self.metrics)
            if run_id is None:
                out.append(f"--metrics {self.metrics} holds a file lohan did not write ({why}): lohan never "
                           "overwrites one; choose another --metrics path, or move that file away")
            elif not self.owner.owns(run_id):
                out.append(self.owner.stranger("the metrics", self.metrics, run_id))
        if self.plot.is_dir():
            out.append(f"the metrics plot goes to {self.plot}, which is a directory: choose another --metrics path")
        elif self.plot.exists() and not self.plot.is_symlink():
            run_id = plot_owner(self.plot)
            if run_id is None:
                out.append(f"the metrics plot goes to {self.plot}, which holds a file lohan did not write: choose "
                           "another --metrics path (the plot is written beside it, as .png), or move that file away")
            elif not self.owner.owns(run_id):
                out.append(self.owner.stranger("the metrics plot", self.plot, run_id))
        if self.logging_dir is not None and self.logging_dir.exists() and not self.logging_dir.is_dir():
            out.append(f"--logging-dir {self.logging_dir} is a file: the trackers need a directory; choose another")
        problem = self._export_problem()
        if problem and not (self.export.is_symlink() or partial_dir(self.export).is_symlink()):
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
    if b.kind == "store" and a.kind == "file" and a.path.parent == b.path and is_run_file(a.path.name, store):
        return f"{a.label} {a.path} is the name of one of the store's own files: choose another"
    return None


def plot_owner(path: Path) -> str | None:
    """The run id in the PNG text of a plot lohan drew (`PLOT_TAG`, `PLOT_RUN_KEY`), or None if lohan did not."""
    texts = png_texts(path)
    return texts.get(PLOT_RUN_KEY) if texts.get("Software") == PLOT_TAG else None


def png_texts(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (keyword -> text), read up to its image data; {} if it is not a PNG."""
    out: dict[str, str] = {}
    try:
        with path.open("rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return {}
            while len(head := f.read(8)) == 8:
                size, kind = int.from_bytes(head[:4], "big"), head[4:]
                if kind in (b"IDAT", b"IEND") or size > 1 << 20:
                    break
                data = f.read(size)
                f.seek(4, os.SEEK_CUR)  # the chunk's CRC
                if kind == b"tEXt" and b"\x00" in data:
                    key, _, text = data.partition(b"\x00")
                    out[key.decode("latin-1")] = text.decode("latin-1")
    except OSError:
        return {}
    return out


CHECKPOINT_PREFIX = "step-"
_CHECKPOINT = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"step-(\d+)\.(partial|old)")


def in_export(entry: Path) -> str | None:
    """What folder `entry` of an export directory is (`ownership.Subfolders`): a checkpoint (``owned``: kept, moved
    with the export, removed only once proven), what a killed save or removal of one left (``step-N.partial``,
    ``step-N.old``: ``deep``, removed, so proven now), or a stranger's (None)."""
    if _CHECKPOINT.fullmatch(entry.name):
        return "owned"
    return "deep" if _LEFTOVER.fullmatch(entry.name) else None


def checkpoint_step(path: Path) -> int | None:
    """The step of `path` if it is a complete checkpoint of lohan's (``step-N``, its manifest complete), else None
    (whose it is, `ownership.folder_problem` says)."""
    match = _CHECKPOINT.fullmatch(path.name)
    if match is None or path.is_symlink() or not path.is_dir():
        return None
    manifest, _ = read_manifest(path)
    return int(match.group(1)) if manifest is not None and manifest.state == "complete" else None


def is_leftover(path: Path) -> bool:
    """Whether `path` is named as what a killed save or removal of a checkpoint left (``step-N.partial``,
    ``step-N.old``), a folder (whose it is, `ownership.folder_problem` says)."""
    return _LEFTOVER.fullmatch(path.name) is not None and not path.is_symlink() and path.is_dir()
