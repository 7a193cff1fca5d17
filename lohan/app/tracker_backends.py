"""The three trackers behind ``--report-to``, each continuing its own run for a lohan run id across resumes.

Each reads back at open, with its own reader, which steps (and which scalars of each step) it already holds, and
from then on logs only what it lacks: a resume's replay of the committed steps fills in what a kill lost, and a
step a kill left half-logged ends up whole, exactly once.

- ``tensorboard``: one run folder ``<run_name>-<run_id>``; event files written in the calling thread (an error is
  raised where it happens, not printed by a writer thread) and read back with tensorboard's EventAccumulator. A
  half-logged step is purged with a SessionLog START event at its step (what ``SummaryWriter(purge_step=)``
  writes), which makes every reader drop what the folder holds from that step on, then written whole.
- ``wandb``: ``wandb.init(id=run_id, resume="allow")``. Offline (the default), wandb starts a new
  ``offline-run-<time>-<id>`` folder per process and keeps no resume state; the steps held are read from the
  ``run-<id>.wandb`` files of those folders (wandb's transaction log: LevelDB log blocks of protobuf records), and
  ``wandb sync`` uploads the folders as one run. A SIGKILLed process's wandb service loses what it had not
  written yet: the replay logs it again. Online, a resumed run drops steps below ``run.starting_step`` (wandb's
  own rule), so those count as held.
- ``mlflow``: the run tagged ``lohan.run_id`` in the experiment, found with ``search_runs`` and resumed (a new
  one only for a new run id); a step's scalars go in one ``log_batch`` (one SQL transaction: all or nothing),
  and what a step lacks is read from ``get_metric_history``. The local SQLite store is built under a temporary
  name of lohan's (``mlflow.db.building.<host>.<pid>.<token>``) and linked into place once complete, so a kill
  while it is created leaves no half-built ``mlflow.db``; a builder's temporary file that a kill left behind is
  removed by the next run on that host once its process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from io_engine.base import fsync_dir


class TrackerOpenError(ValueError):
    """A tracker that could not start or continue its run: the message says which, where, and the fix."""


# ----------------------------------------------------------------------------------------------- tensorboard

_EVENTS = "events.out.tfevents."


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """A library's warnings held back while lohan reads its files (TensorBoard's reader warns of each purge)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def tensorboard_steps(run_dir: Path) -> tuple[dict[int, set[str]], bool]:
    """The scalar tags a TensorBoard run folder holds per step, as TensorBoard's reader sees them (purges applied),
    and whether it holds the run's settings (the ``config`` text)."""
    if not run_dir.is_dir():
        return {}, False
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    with _quiet("tensorboard"):
        acc.Reload()
    held: dict[int, set[str]] = {}
    tags = acc.Tags()
    for tag in tags["scalars"]:
        for e in acc.Scalars(tag):
            held.setdefault(e.step, set()).add(tag)
    return held, "config/text_summary" in tags["tensors"]


class TensorBoard:
    """A run's TensorBoard folder: ``<logdir>/<run_name>-<run_id>``, one event file per process."""

    def __init__(self, logdir: Path, run_name: str, run_id: str) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.where = logdir / f"{run_name}-{run_id}"
        self.held, self.has_config = tensorboard_steps(self.where)
        self.last = max(self.held, default=0)
        self.where.mkdir(parents=True, exist_ok=True)
        self.file = _new_event_file(self.where)
        self.writer = RecordWriter(self.file)
        self._write(file_version="brain.Event:2")
        self.file.flush()

    def _write(self, **event: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.writer.write(Event(wall_time=time.time(), **event).SerializeToString())

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.has_config:  # a resumed run's folder holds them from its first start
            return
        from torch.utils.tensorboard.summary import text

        # as text: add_hparams would start a run folder of its own for every call
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self._write(step=0, summary=text("config", "| key | value |\n|---|---|\n" + table))
        self.file.flush()
        self.has_config = True

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        have = self.held.get(step)
        if have is not None and have >= set(scalars):
            return
        if have is not None or self.last > step:  # a step a kill cut short: readers drop it from here on
            from tensorboard.compat.proto.event_pb2 import SessionLog

            self._write(step=step, session_log=SessionLog(status=SessionLog.START))
            self.held = {s: t for s, t in self.held.items() if s < step}
        from tensorboard.compat.proto.summary_pb2 import Summary

        for tag, value in scalars.items():
            self._write(step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)]))
        self.file.flush()  # a killed run keeps every step it reported
        self.held[step] = set(scalars)
        self.last = step

    def close(self, status: str) -> None:
        self.file.close()


def _new_event_file(run_dir: Path) -> Any:
    """A new event file, named as TensorBoard names them but sorting after every one the folder holds: readers
    take the files in name order, and a resume's purge must come after what it purges."""
    newest = 0
    for p in run_dir.iterdir():
        parts = p.name[len(_EVENTS):].split(".")
        if p.name.startswith(_EVENTS) and parts[0].isdigit():
            newest = max(newest, int(parts[0]))
    stamp = max(int(time.time()), newest + 1)
    for n in range(100):
        with contextlib.suppress(FileExistsError):
            return open(run_dir / f"{_EVENTS}{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{n}", "xb")
    raise FileExistsError(f"no free event file name in {run_dir}")


# ----------------------------------------------------------------------------------------------------- wandb

_WANDB_BLOCK, _WANDB_HEADER = 32768, 7
_WANDB_CRC = [zlib.crc32(bytes([kind])) for kind in range(5)]


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B run file, up to the first torn or damaged one (where a kill stopped it):
    wandb's transaction log, LevelDB's log format (32 KiB blocks; records of a 7-byte header: CRC-32 of the kind
    byte and the data, length, kind 1 full / 2 first / 3 middle / 4 last) after a 7-byte ``:W&B`` header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    pos, buf = _WANDB_HEADER, b""
    while pos + _WANDB_HEADER <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        crc = int.from_bytes(data[pos:pos + 4], "little")
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < _WANDB_HEADER or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        piece = data[pos + _WANDB_HEADER:pos + _WANDB_HEADER + length]
        if kind > 4 or len(piece) < length or zlib.crc32(piece, _WANDB_CRC[kind]) != crc:
            return
        buf += piece
        pos += _WANDB_HEADER + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def wandb_run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The run files of every local folder wandb made for `run_id` (``offline-run-<time>-<id>[-n]`` offline,
    ``run-<time>-<id>[-n]`` online), in name (time) order."""
    folder = re.compile(rf"(offline-)?run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    if not wandb_dir.is_dir():
        return []
    found = [p / f"run-{run_id}.wandb" for p in wandb_dir.iterdir()
             if folder.fullmatch(p.name) and not p.is_symlink()]
    return sorted(f for f in found if f.is_file())


def wandb_steps(wandb_dir: Path, run_id: str) -> list[int]:
    """The step of every history record of `run_id`'s local run files, in file order."""
    return [rec.history.step.num for f in wandb_run_files(wandb_dir, run_id) for rec in wandb_records(f)
            if rec.WhichOneof("record_type") == "history"]


class WandB:
    """A run's W&B run (offline unless ``WANDB_MODE`` says otherwise), its files in ``<logdir>/wandb``."""

    def __init__(self, logdir: Path, run_name: str, run_id: str) -> None:
        import wandb

        self.wandb = wandb
        self.where = logdir / "wandb"
        self.held = set(wandb_steps(self.where, run_id))  # before init: it starts a folder of its own
        logdir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lohan"), name=run_name, id=run_id,
                              resume="allow", dir=str(logdir), mode=os.environ.get("WANDB_MODE", "offline"),
                              reinit="finish_previous")
        self.below = int(getattr(self.run, "starting_step", 0) or 0)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if step in self.held or step < self.below:
            return
        self.run.log(dict(scalars), step=step, commit=True)  # commit: not held back until the next step
        self.held.add(step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        # wandb's service may write the run file after finish returns; its teardown waits for it (what exit does),
        # so the file holds every step before anything reads it back
        self.wandb.teardown()


# ---------------------------------------------------------------------------------------------------- mlflow

_RUN_TAG = "lohan.run_id"
_BATCH = 100  # MLflow's limit on params (and tags) in one log_batch


def _building_name(db: Path) -> str:
    return f"{db.name}.building.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def _remove_dead_builds(db: Path) -> None:
    """Remove what a killed builder of this host left of its temporary store (lohan's name; its process gone)."""
    pattern = re.compile(rf"{re.escape(db.name)}\.building\.{re.escape(socket.gethostname())}\.(\d+)\.[0-9a-f]+"
                         r"(-journal)?")
    for p in db.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m is None or p.is_symlink() or not p.is_file():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:  # gone: a half-built store nobody will finish
            p.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass


def build_sqlite_store(db: Path, experiment: str, artifacts: str) -> None:
    """Create the local MLflow store `db` with its experiment, unless it exists: built under a temporary name and
    linked into place once complete (never over a file that appeared meanwhile), so a kill cannot strand a
    half-built store at `db`."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    db.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(db)
    if db.exists() or db.is_symlink():
        return
    tmp = db.with_name(_building_name(db))
    uri = f"sqlite:///{tmp.resolve()}"
    try:
        store = SqlAlchemyStore(uri, artifacts)
        try:
            store.create_experiment(experiment, artifact_location=artifacts)
        finally:
            store.engine.dispose()  # no connection left open on the file, nor cached under its temporary name
            getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another run built it first: that one is used
            os.link(tmp, db)
        fsync_dir(db.parent)
    finally:
        for p in (tmp, tmp.with_name(tmp.name + "-journal")):
            p.unlink(missing_ok=True)


def _first_line(err: BaseException) -> str:
    """An error as one line: a database error's own message, without the SQL and background link SQLAlchemy adds."""
    cause = getattr(err, "orig", None) or err
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


class MLflow:
    """A run's MLflow run: the tracking URI ``MLFLOW_TRACKING_URI``, else ``<logdir>/mlflow.db``."""

    def __init__(self, logdir: Path, run_name: str, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "lohan")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        db = logdir / "mlflow.db"
        self.where: str | Path = uri or db
        artifacts = None
        if not uri:
            # a local SQLite store (MLflow 3 refuses new plain-file stores), its artifacts beside it rather than
            # in the working directory
            artifacts = (logdir / "artifacts").resolve().as_uri()
            build_sqlite_store(db, name, artifacts)
            uri = f"sqlite:///{db.resolve()}"
        self.uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(name, artifact_location=artifacts)
            self.run = self._find_or_create(exp_id, run_name, run_id)
        except Exception as err:
            fix = ("if a kill of an earlier lohan left it half-built, move the file aside (lohan builds a new "
                   "one), or point --logging-dir elsewhere" if artifacts else "check MLFLOW_TRACKING_URI")
            raise TrackerOpenError(f"--report-to mlflow could not open its store {self.where}: {_first_line(err)}; "
                                   f"{fix}") from None
        self.id = self.run.info.run_id
        self.held: dict[int, set[str]] = {}
        for key in self.run.data.metrics:
            for m in self.client.get_metric_history(self.id, key):
                self.held.setdefault(m.step, set()).add(key)

    def _find_or_create(self, exp_id: str, run_name: str, run_id: str) -> Any:
        found = self.client.search_runs([exp_id], filter_string=f"tags.`{_RUN_TAG}` = '{run_id}'", max_results=1,
                                        order_by=["attributes.start_time ASC"])
        if found:  # a resume: the same run goes on
            self.client.update_run(found[0].info.run_id, status="RUNNING")
            return self.client.get_run(found[0].info.run_id)
        # the tag in the same transaction as the run: a kill cannot leave a run that a resume would not find
        return self.client.create_run(exp_id, tags={_RUN_TAG: run_id}, run_name=run_name)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow refuses to change a param: a resume keeps the settings of the run's first start. It caps a value
        # at 6000 characters; the run's settings are far below it
        new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in self.run.data.params]
        for i in range(0, len(new), _BATCH):
            self.client.log_batch(self.id, params=new[i:i + _BATCH])

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        have = self.held.setdefault(step, set())
        missing = {k: v for k, v in scalars.items() if k not in have}
        if missing:
            # one batch, one transaction: a kill leaves all of the step or none of it
            # (MLflow's metric keys take '/', shown as groups)
            now = int(time.time() * 1000)
            self.client.log_batch(self.id, metrics=[Metric(k, v, now, step) for k, v in missing.items()])
            have.update(missing)

    def close(self, status: str) -> None:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        try:
            self.client.set_terminated(self.id, status)
        finally:  # the store's file closed; MLflow keeps the engine (for a later open of the same path) in a cache
            engine = getattr(SqlAlchemyStore, "_engine_map", {}).get(self.uri)
            if engine is not None:
                engine.dispose()
