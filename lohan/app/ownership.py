"""What a run wrote, proven rather than guessed from contents: the run's identity, and the manifests of its folders.

A run never deletes, replaces or appends to a file it cannot prove it wrote (DESIGN.md §5). The proof:

- **The run's identity** is its store's (`StoreStatus.volume_id`): new with every store created, the same across
  resumes. A store created over another (``--overwrite``) remembers the ones it replaced (`StoreStatus.replaces`), so
  a run owns the outputs of its store and of the stores that store replaced: `Owner`. Another run's outputs (another
  store's, a live one's included) are never its own, however much they look like lohan's.
- **An export folder** (the final export, each checkpoint ``step-N``) holds `EXPORT_MARKER`, its manifest: the run's
  identity, what the folder is and, once complete, every file lohan wrote there with its size, XXH3-64 checksum,
  inode and modification time. A file is lohan's while its inode, size and modification time are the ones listed: a
  file added later, a file changed since, a copy of the folder (new inodes) are not, and stop a removal before
  anything is removed. While it is being written a folder (``<export>.partial``, ``step-N.partial``, made by the run
  with `begin_folder`) says ``writing``: what it holds is the export the run is writing there.
- **A metrics JSONL** carries the run's identity in every record (``run_id``) and, in its first, the file's own
  inode (``file_ino``: a copy is not the file lohan wrote); its plot carries the run's identity in its PNG text.

Links are never followed where lohan writes or removes: an output path that is a symbolic link is refused
(`link_problem`), and a link inside a folder of lohan's is not lohan's.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from io_engine import durable
from lohan.models import EXPORT_MARKER
from lohan.store.integrity import write_json_atomic

MANIFEST_VERSION = 2
"""`EXPORT_MARKER`'s format: 2 lists the files (lohan before it wrote a bare marker, which proves nothing)."""

RUN_ID_KEY = "run_id"
"""The key of the run's identity in each metrics record."""
FILE_KEY = "file_ino"
"""The key, in the first metrics record, of the inode of the file lohan created for it."""


class ForeignFileError(ValueError):
    """A path lohan was about to replace or remove holds something it cannot prove it wrote; nothing was removed."""


@dataclass(frozen=True)
class Owner:
    """The runs whose outputs this run may replace or extend: its store's identity and those it replaced.

    `store` names the store for messages (its first directory and name). `current` is the store's own identity
    where it exists (a resumed or newly created store; None before a new one is created)."""

    store: str
    current: str | None = None
    replaced: frozenset[str] = field(default_factory=frozenset)
    unknown: str | None = None  # why the store's identity could not be read (its description is damaged)

    @property
    def ids(self) -> frozenset[str]:
        return self.replaced | ({self.current} if self.current else set())

    def owns(self, run_id: object) -> bool:
        return isinstance(run_id, str) and run_id in self.ids

    def adopt(self, current: str, replaced: Iterable[str] = ()) -> Owner:
        """The owner once the store is open: its identity, and the stores it replaced besides those known."""
        return Owner(self.store, current, self.replaced | set(replaced) | ({self.current} if self.current else set()))

    def stranger(self, what: str, path: Path, run_id: str) -> str:
        """The problem of `path`, lohan's `what` of another run (`run_id`)."""
        if self.unknown:
            return (f"{path} holds {what} of a lohan run (run id {run_id}), and this run cannot tell whether it is "
                    f"its own: {self.unknown}. lohan never replaces another run's outputs; move it away, or choose "
                    "another path")
        return (f"{path} holds {what} of another lohan run (run id {run_id}), not of the store {self.store} this run "
                "uses or replaces: lohan never replaces another run's outputs; choose another path, or move it away "
                "(delete it yourself if you no longer need it)")


def link_problem(path: Path, label: str, fix: str = "give the path it points to, or another one") -> str | None:
    """The problem if `path` itself is a symbolic link (writes through it would land elsewhere, removals would
    empty its target), else None. The folders above it may be links: they only say where it is."""
    if path.is_symlink():
        return (f"{label} {path} is a symbolic link (to {os.readlink(path)}): lohan does not write or remove "
                f"through links; {fix}")
    return None


# ------------------------------------------------------------------------------------------- export folders
@dataclass(frozen=True)
class Manifest:
    """An export folder's `EXPORT_MARKER`: whose it is, its state, and (complete) the files lohan wrote there."""

    run_id: str
    state: str                     # "writing" | "complete"
    info: dict[str, Any]           # step, model, kind ...
    files: dict[str, dict[str, Any]]

    def unproven(self, entry: Path) -> str | None:
        """Why flat file `entry` is not proven lohan's (None: it is): unlisted, or changed since it was listed."""
        if self.state == "writing":
            return None if not entry.is_symlink() else "a symbolic link"
        want = self.files.get(entry.name)
        if want is None:
            return "not written by lohan"
        return None if _identity(entry) == {k: want[k] for k in ("bytes", "ino", "mtime_ns")} else \
            "not the file lohan wrote there: changed, replaced or copied since"


def _identity(path: Path) -> dict[str, int] | None:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return None
    return {"bytes": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}


def file_checksum(path: Path) -> str:
    """XXH3-64 of a file's bytes, as ``xxh3:<hex>`` (the store's checksum, integrity.json_checksum's notation)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return f"xxh3:{h.hexdigest()}"


def read_manifest(folder: Path) -> tuple[Manifest | None, str]:
    """(the folder's manifest, '') or (None, why there is none that proves anything)."""
    path = folder / EXPORT_MARKER
    if path.is_symlink() or not path.is_file():
        return None, f"no {EXPORT_MARKER}"
    try:
        data, problem = durable.load_json(path)
    except OSError as err:
        return None, f"its {EXPORT_MARKER} cannot be read ({err.strerror or err})"
    if problem is None and (not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION):
        return None, (f"its {EXPORT_MARKER} was written by an older lohan, which kept no list of the files it wrote "
                      "(lohan cannot tell them from files added since)")
    problem = problem or durable.checksum_problem(data)
    if problem:
        return None, f"its {EXPORT_MARKER} is damaged: {problem}"
    try:
        files = {str(k): dict(v) for k, v in data["files"].items()}
        return Manifest(str(data["run_id"]), str(data["state"]), dict(data["info"]), files), ""
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, f"its {EXPORT_MARKER} does not have a manifest's fields"


def begin_folder(folder: Path, run_id: str, info: dict[str, Any]) -> None:
    """Make `folder` (new: it must not exist) with its manifest saying ``writing``, before anything goes in: a
    kill at any later moment leaves a folder that says it is lohan's and this run's."""
    folder.mkdir(parents=True)
    _write_manifest(folder, run_id, "writing", info, {})


def seal_folder(folder: Path, run_id: str, info: dict[str, Any]) -> Manifest:
    """Make the files written into `folder` durable and list them in its manifest (``complete``): from now on each
    is lohan's only as long as it is unchanged. The folder holds files only (an export is flat)."""
    files = {}
    for entry in sorted(folder.iterdir()):
        if entry.name in (EXPORT_MARKER, EXPORT_MARKER + ".tmp"):
            continue
        ident = _identity(entry)
        if ident is None:
            raise RuntimeError(f"export: {entry} is not a regular file; an export holds files only")
        with open(entry, "rb") as fh:
            os.fsync(fh.fileno())
        files[entry.name] = {**ident, "checksum": file_checksum(entry)}
    _write_manifest(folder, run_id, "complete", info, files)
    return Manifest(run_id, "complete", info, files)


def _write_manifest(folder: Path, run_id: str, state: str, info: dict, files: dict) -> None:
    write_json_atomic(folder / EXPORT_MARKER, {"version": MANIFEST_VERSION, "run_id": run_id, "state": state,
                                               "info": info, "files": files})


def verify_folder(folder: Path) -> list[str]:
    """Every file of a complete export folder read back against its manifest's checksum: the damaged or missing
    ones, described (an empty list: intact)."""
    manifest, why = read_manifest(folder)
    if manifest is None or manifest.state != "complete":
        return [f"{folder}: {why or 'its export was never completed'}"]
    out = []
    for name, want in sorted(manifest.files.items()):
        path = folder / name
        if not path.is_file():
            out.append(f"{path}: missing")
        elif file_checksum(path) != want["checksum"]:
            out.append(f"{path}: its bytes do not match the checksum lohan recorded when it wrote them")
    return out


Subfolders = Callable[[Path], str | None]
"""What a folder inside an export folder is: ``deep`` (checked like the folder itself: what a killed save left, to be
removed), ``owned`` (a checkpoint: its manifest must be this run's; it is kept or moved, never removed unproven), or
None (a stranger's)."""


def folder_problem(folder: Path, owner: Owner, subfolders: Subfolders | None = None,
                   what: str = "the export") -> str | None:
    """Why `folder` may not be replaced or removed by this run (None: all of it is this run's to replace).

    `subfolders` says what the folders inside it are (an export holds its run's checkpoints); any other folder,
    and any file the manifest does not prove, is a stranger's."""
    if folder.is_symlink():
        return link_problem(folder, what)
    if not folder.exists():
        return None
    if not folder.is_dir():
        return f"{what} path {folder} is a file; give a directory (a new or empty one)"
    manifest, why = read_manifest(folder)
    if manifest is not None and not owner.owns(manifest.run_id):
        return owner.stranger(f"{what} of step {manifest.info.get('step')}", folder, manifest.run_id)
    strangers = []
    for entry in folder.iterdir():
        if entry.name in (EXPORT_MARKER, EXPORT_MARKER + ".tmp"):
            continue
        kind = subfolders(entry) if subfolders is not None and entry.is_dir() and not entry.is_symlink() else None
        if kind is not None:
            problem = _subfolder_problem(entry, owner, kind)
            if problem:
                return problem
        elif manifest is None:
            strangers.append((entry.name, why))
        elif (reason := manifest.unproven(entry)) is not None or entry.is_dir():
            strangers.append((entry.name, reason or "a folder"))
    if strangers:
        names = "; ".join(f"{n} ({r})" for n, r in strangers[:3]) + (
            f"; and {len(strangers) - 3} more" if len(strangers) > 3 else "")
        return (f"{what} directory {folder} holds what lohan cannot prove it wrote: {names}. lohan replaces only "
                f"files it can prove are its own (listed with their checksums in {EXPORT_MARKER}); choose another "
                "--export, or move those away")
    return None


def _subfolder_problem(entry: Path, owner: Owner, kind: str) -> str | None:
    if kind == "deep":
        return folder_problem(entry, owner, None, "the leftover checkpoint folder")
    manifest, _ = read_manifest(entry)
    if manifest is not None and not owner.owns(manifest.run_id):
        return owner.stranger(f"the checkpoint of step {manifest.info.get('step')}", entry, manifest.run_id)
    if manifest is None and any(entry.iterdir()):
        return (f"{entry} is named like a checkpoint of lohan's but is not one (no {EXPORT_MARKER} manifest); move "
                "it out of the export directory, or choose another --export")
    return None


def remove_folder(folder: Path, owner: Owner, what: str = "the export") -> None:
    """Remove `folder` and the folders in it, everything proven this run's (`folder_problem`; ForeignFileError
    before anything is removed if not): files the manifest lists unchanged, the manifest last, then the folder. A
    kill midway leaves a folder whose manifest still proves what is left, or an empty one."""
    problem = folder_problem(folder, owner, lambda e: "deep", what)
    if problem:
        raise ForeignFileError(problem)
    manifest, _ = read_manifest(folder)
    for entry in folder.iterdir():
        if entry.name in (EXPORT_MARKER, EXPORT_MARKER + ".tmp"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            remove_folder(entry, owner, "the checkpoint")
        elif manifest is not None and manifest.unproven(entry) is None:
            entry.unlink()
        else:  # appeared since the check: not lohan's, and what is left keeps its manifest
            raise ForeignFileError(f"{entry} appeared in {folder} while lohan was removing it; it is not lohan's, so "
                                   f"it and the rest of {folder} are left as they are: move {entry} away and run again")
    (folder / (EXPORT_MARKER + ".tmp")).unlink(missing_ok=True)
    (folder / EXPORT_MARKER).unlink(missing_ok=True)
    folder.rmdir()


# ----------------------------------------------------------------------------------------------- metrics
def metrics_owner(path: Path) -> tuple[str | None, str]:
    """(the run id every record of a metrics JSONL carries, '') or (None, why it is not a metrics file lohan wrote).
    The first record names the file it was written into (`FILE_KEY`: its inode), so a copy of one is not lohan's.
    The last line may be cut short (a kill during its write): it is not a record yet."""
    try:
        with path.open(encoding="utf-8") as f:
            lines = f.read().split("\n")
        ino = os.lstat(path).st_ino
    except UnicodeDecodeError:
        return None, "not text"
    ids = set()
    for i, line in enumerate(lines[:-1]):
        try:
            record = json.loads(line)
        except ValueError:
            return None, "not JSON records"
        if not isinstance(record, dict) or "step" not in record:
            return None, "not lohan's records"
        if RUN_ID_KEY not in record:  # a user's log, or an older lohan's metrics: neither proves whose it is
            return None, "not lohan's records, or an older lohan's: they name no run"
        if i == 0 and record.get(FILE_KEY) != ino:
            return None, ("a copy of a metrics file lohan wrote, not the file itself" if FILE_KEY in record else
                          "written by an older lohan, whose records name no file")
        ids.add(record[RUN_ID_KEY])
    if len(ids) != 1:
        return None, "empty" if not ids else "records of several runs"
    return str(ids.pop()), ""
