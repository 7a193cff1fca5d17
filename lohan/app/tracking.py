"""Experiment trackers: ``--report-to tensorboard,wandb,mlflow`` (the names HF Trainer uses).

Each step's record, the same fields as the metrics JSONL, goes to every tracker asked for, with the run's
settings as hyperparameters. Only rank 0 reports (the JSONL's rule). Every tracker writes locally, and each
continues its own run for a lohan run (``run_id``: the store's volume id) across resumes:

- ``tensorboard``: event files in ``<logging_dir>/tensorboard/<name>-<run_id>``, one folder per run
  (``tensorboard --logdir <logging_dir>``);
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise, files in ``<logging_dir>/wandb``, the W&B run id the
  run's id (``wandb sync <logging_dir>/wandb/offline-run-*`` uploads them later, as one run);
  ``WANDB_PROJECT`` names the project;
- ``mlflow``: the tracking URI ``MLFLOW_TRACKING_URI`` when set, else a local SQLite store,
  ``<logging_dir>/mlflow/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///<logging_dir>/mlflow/mlflow.db``),
  one MLflow run per run, tagged ``lohan.run_id``; ``MLFLOW_EXPERIMENT_NAME`` names the experiment.

A resume replays the committed steps (from the metrics JSONL) and each tracker logs only those it does not hold,
read back with its own reader, so after any kill every committed step is in each tracker exactly once
(lohan.app.tracker_backends says how each does it). All three only ever add files of their own naming (time-,
host- or id-stamped) to these folders, so a resumed run adds to them and never overwrites what another run
wrote; lohan removes only the temporary file of a local MLflow store whose builder a kill stopped. A tracker that
cannot open or write stops the run with one line: which tracker, where, the fix. wandb and mlflow are optional
packages: asking for one that is not installed is refused before anything is written, with the pip command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import os
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from lohan.app.metrics import StepMetrics
from lohan.app.tracker_backends import MLflow, TensorBoard, TrackerOpenError, WandB
from lohan.config import TRACKERS, EngineConfig, parse_report_to
from lohan.crashpoints import crashpoint
from lohan.runtime.held import finish_before_interrupts

__all__ = ["TRACKERS", "TrackerOpenError", "TrackerWriteError", "Trackers", "flat_params", "missing_packages",
           "parse_report_to", "step_scalars"]

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def missing_packages(names: Iterable[str]) -> list[str]:
    """The problems of trackers whose package is not installed, each with the command that installs it."""
    out = []
    for name in names:
        pkg = _PACKAGES[name]
        if importlib.util.find_spec(pkg) is None:
            out.append(f"--report-to {name} needs the '{pkg}' package, which is not installed: "
                       f"pip install {pkg} (in lohan's environment: .venv/bin/pip install {pkg}), or drop {name}")
    return out


def step_scalars(m: StepMetrics) -> dict[str, float]:
    """The scalars of a step's record under tracker tags (``train/``, ``eval/``, ``perf/``, ``lanes/``, ``mem/``):
    every numeric field of the JSONL, the lanes each as its own series."""
    values: dict[str, float | None] = {
        "train/loss": m.loss, "train/learning_rate": m.lr, "train/grad_norm": m.grad_norm,
        "train/clip_coef": m.clip_coef, "train/loss_scale": m.loss_scale,
        "train/skipped": float(m.skipped), "train/redone": float(m.redone), "train/deferred": float(m.deferred),
        "eval/loss": m.eval_loss, "eval/perplexity": m.eval_ppl, "eval/seconds": m.eval_s,
        "checkpoint/save_s": m.save_s,
        "perf/step_s": m.step_s, "perf/tokens_per_s": m.tokens_per_s, "perf/tflops": m.tflops,
        "perf/ssd_read_gbps": m.ssd_read_gbps, "perf/ssd_write_gbps": m.ssd_write_gbps,
        "perf/overlap_pct": m.overlap_pct, "perf/tokens": float(m.tokens),
        "mem/rss_gib": m.cpu_mem_gib, "mem/gpu_gib": m.gpu_mem_gib,
        "perf/network_bytes": None if m.network_bytes is None else float(m.network_bytes),
    }
    values.update({f"lanes/{k}_s": v for k, v in m.lanes.items()})
    return {k: float(v) for k, v in values.items() if v is not None}


def flat_params(config: Any, prefix: str = "") -> dict[str, str | int | float | bool]:
    """A (nested) config dataclass or mapping as flat ``a.b`` keys with scalar values (sequences as text): what
    every tracker's hyperparameter table takes."""
    if isinstance(config, EngineConfig):  # by the settings' flat names (engine.lr), as before the sections
        items = config.settings()
    elif dataclasses.is_dataclass(config):
        items = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    else:
        items = dict(config)
    out: dict[str, str | int | float | bool] = {}
    for key, value in items.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) or dataclasses.is_dataclass(value):
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif value is not None:
            out[name] = str(list(value) if isinstance(value, tuple) else value)
    return out


class Tracker(Protocol):
    """One tracker's run (lohan.app.tracker_backends): `where` its folder or store, for messages."""

    where: Any

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self, status: str) -> None: ...


class TrackerWriteError(OSError):
    """A tracker could not write a step: which tracker, where, why, and the fix (a full disk: free space or point
    --logging-dir elsewhere). An OSError, so the run stops as on its other I/O failures: the committed state
    intact, continued with --resume."""

    def __init__(self, name: str, where: Any, err: BaseException) -> None:
        cause = getattr(err, "orig", None) or err  # a database error's own message, not its SQL
        why = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        full = getattr(cause, "errno", None) == errno.ENOSPC or "disk is full" in why
        fix = "the disk is full; free space on it or point --logging-dir elsewhere" if full else (
            f"fix the cause, point --logging-dir elsewhere, or drop {name} from --report-to")
        super().__init__(f"--report-to {name} could not write to {where} ({why}: {fix})")


def _open_one(name: str, folder: Path, run_name: str, run_id: str) -> Tracker:
    cls = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}[name]
    try:
        return cls(folder, run_name, run_id)
    except TrackerOpenError:
        raise
    except Exception as err:  # the tracker's own refusal, said as lohan says one: one line, the fix
        cause = getattr(err, "orig", None) or err
        why = (str(cause).strip().splitlines() or [""])[0]
        raise TrackerOpenError(f"--report-to {name} could not start a run in {folder}: {type(cause).__name__}: "
                               f"{why}; fix that, point --logging-dir elsewhere, or drop {name} from "
                               "--report-to") from err


# each in a folder of its own under the logging dir (wandb makes its own `wandb/`)
_FOLDERS = {"tensorboard": "tensorboard", "wandb": "", "mlflow": "mlflow"}


class Trackers:
    """The trackers of a run (none: every call does nothing). Use as a context manager.

    `run_id` names one training run: the same for every resume of it (each tracker then continues its own run
    for it), a new one for a store created afresh; None: a run of its own, never continued. After opening,
    `replay` the committed steps of the run so far, then `log` each new one: every tracker logs only what it
    does not hold, so after any kill and resume each committed step is in each tracker exactly once."""

    def __init__(self, names: Sequence[str], logging_dir: str | os.PathLike, run_name: str,
                 params: Mapping[str, Any] | None = None, run_id: str | None = None) -> None:
        problems = missing_packages(names)
        if problems:
            raise ValueError("; ".join(problems))
        self.run_id = run_id or uuid.uuid4().hex
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id):  # a folder name part and a wandb run id
            raise ValueError(f"a tracker run id is 1-64 letters, digits, '-' or '_', not {self.run_id!r}")
        self.names = tuple(names)
        self.dir = Path(logging_dir)
        self._open: list[tuple[str, Tracker]] = []
        try:
            for name in self.names:
                folder = self.dir / _FOLDERS[name] if _FOLDERS[name] else self.dir
                self._open.append((name, _open_one(name, folder, run_name, self.run_id)))
            if params:
                for name, t in self._open:
                    try:
                        t.log_params(params)
                    except Exception as err:
                        raise TrackerOpenError(str(TrackerWriteError(name, t.where, err))) from err
        except BaseException:
            with contextlib.suppress(Exception):  # the error to report is the one that stopped the opening
                self.close("FAILED")
            raise

    def replay(self, records: Iterable[StepMetrics]) -> None:
        """The run's committed steps so far, in step order (a resume's; none on a fresh run): each tracker logs
        those it lacks, and completes a step a kill left half-logged."""
        for m in records:
            self.log(m)

    def log(self, m: StepMetrics) -> None:
        """A newly committed step (a tracker that holds it already, whole, logs nothing)."""
        if self._open:
            scalars = step_scalars(m)
            for name, t in self._open:
                try:
                    # (held until the call returns: an interrupt raised inside a tracker's code cuts its write short
                    # and leaves the tracker's own traceback, SQLAlchemy's under MLflow, on the terminal)
                    with finish_before_interrupts(True, note=None):
                        t.log(m.step, scalars)
                except Exception as err:
                    raise TrackerWriteError(name, t.where, err) from err
                crashpoint("trackers.logged")  # (the kill harness: between one tracker's log and the next's)

    def close(self, status: str = "FINISHED") -> None:
        """Close every tracker, its run marked `status` (MLflow's FINISHED, FAILED or KILLED)."""
        failed: TrackerWriteError | None = None
        with finish_before_interrupts(True, note=None):  # (a signal meanwhile: delivered once every one is closed)
            while self._open:
                name, t = self._open.pop()
                try:
                    t.close(status)
                except Exception as err:  # the others are closed still
                    failed = failed or TrackerWriteError(name, t.where, err)
        if failed is not None:
            raise failed

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is None:
            self.close()
            return
        # closing after a failure may fail the same way (a full disk): the first error is the one to report
        with contextlib.suppress(Exception):
            self.close("KILLED" if issubclass(kind, KeyboardInterrupt) else "FAILED")
