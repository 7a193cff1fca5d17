"""Experiment trackers: ``--report-to tensorboard,wandb,mlflow`` (the names HF Trainer uses).

Each step's record, the same fields as the metrics JSONL, goes to every tracker asked for, with the run's
settings as hyperparameters. Only rank 0 reports (the JSONL's rule). Every tracker writes locally:

- ``tensorboard``: event files through ``torch.utils.tensorboard`` in ``<logging_dir>/tensorboard``
  (``tensorboard --logdir <logging_dir>``);
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise, files in ``<logging_dir>/wandb``
  (``wandb sync <logging_dir>/wandb/offline-run-*`` uploads them later); ``WANDB_PROJECT`` names the project;
- ``mlflow``: the tracking URI ``MLFLOW_TRACKING_URI`` when set, else a local SQLite store,
  ``<logging_dir>/mlflow/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///<logging_dir>/mlflow/mlflow.db``);
  ``MLFLOW_EXPERIMENT_NAME`` names the experiment.

All three only ever add files of their own naming (time-, host- or id-stamped) to these folders, so a resumed
run adds to them and never overwrites what another run wrote. wandb and mlflow are optional packages: asking
for one that is not installed is refused before anything is written, with the pip command.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from lohan.app.metrics import StepMetrics
from lohan.config import TRACKERS, parse_report_to

__all__ = ["TRACKERS", "Trackers", "flat_params", "missing_packages", "parse_report_to", "step_scalars"]

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
    items = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    out: dict[str, str | int | float | bool] = {}
    for key, value in items.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif value is not None:
            out[name] = str(list(value) if isinstance(value, tuple) else value)
    return out


class Tracker(Protocol):
    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, logdir: Path, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir / run_name))

    def log_params(self, params: Mapping[str, Any]) -> None:
        # as text: add_hparams would start a run folder of its own for every call
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a killed run keeps every step it reported

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, logdir: Path, run_name: str) -> None:
        import wandb

        self.wandb = wandb
        logdir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lohan"), name=run_name, dir=str(logdir),
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="finish_previous")

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, logdir: Path, run_name: str) -> None:
        import mlflow

        self.mlflow = mlflow
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "lohan")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # a local SQLite store (MLflow 3 refuses new plain-file stores), its artifacts beside it rather than
            # in the working directory
            logdir.mkdir(parents=True, exist_ok=True)
            mlflow.set_tracking_uri(f"sqlite:///{(logdir / 'mlflow.db').resolve()}")
            if mlflow.get_experiment_by_name(name) is None:
                mlflow.create_experiment(name, artifact_location=(logdir / "artifacts").resolve().as_uri())
        mlflow.set_experiment(name)
        self.run = mlflow.start_run(run_name=run_name)

    def log_params(self, params: Mapping[str, Any]) -> None:
        # MLflow caps a value at 6000 characters; the run's settings are far below it
        self.mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        # MLflow's metric keys take '/' (they are shown as groups), not every other character
        self.mlflow.log_metrics(dict(scalars), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


# each in a folder of its own under the logging dir (wandb makes its own `wandb/`)
_OPEN = {"tensorboard": (_TensorBoard, "tensorboard"), "wandb": (_WandB, ""), "mlflow": (_MLflow, "mlflow")}


class Trackers:
    """The trackers of a run (none: every call does nothing). Use as a context manager."""

    def __init__(self, names: Sequence[str], logging_dir: str | os.PathLike, run_name: str,
                 params: Mapping[str, Any] | None = None) -> None:
        problems = missing_packages(names)
        if problems:
            raise ValueError("; ".join(problems))
        self.names = tuple(names)
        self.dir = Path(logging_dir)
        self._open: list[Tracker] = []
        try:
            for name in self.names:
                cls, sub = _OPEN[name]
                try:
                    self._open.append(cls(self.dir / sub if sub else self.dir, run_name))
                except Exception as err:  # the tracker's own refusal, said as lohan says one
                    raise ValueError(f"--report-to {name}: it could not start a run in {self.dir}: "
                                     f"{type(err).__name__}: {err}") from err
            if params:
                for t in self._open:
                    t.log_params(params)
        except BaseException:
            self.close()
            raise

    def log(self, m: StepMetrics) -> None:
        if self._open:
            scalars = step_scalars(m)
            for t in self._open:
                t.log(m.step, scalars)

    def close(self) -> None:
        while self._open:
            self._open.pop().close()

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
