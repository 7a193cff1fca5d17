"""What the user sees each step: one fixed-width line, a JSONL record, a progress bar, a final summary.

Units are in the names and never mixed: bandwidth in GB/s (10^9 bytes, as SSD vendors and ``fio``
report it), memory in GiB (2^30 bytes, as ``free -g`` and ``nvidia-smi`` report it), compute in
TFLOPS (10^12 FLOP/s), time in seconds. Rates of one step are averages over its wall time, so the SSD
figures are what the run achieved, not the device's peak.

Typical use by the run driver (:mod:`lohan.app.train`)::

    progress = progress_bar(total_steps)
    with progress, MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for step in range(1, total_steps + 1):
            ...
            m = StepMetrics.from_counters(step=step, loss=loss, lr=lr, tokens=n, step_s=dt, flops=f, ...)
            writer.write(m)
            report_step(progress, m, total_steps)
    progress.console.print(format_summary(history))
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from io_engine.base import fsync_dir
from lohan.app.layout import PLOT_RUN_KEY, PLOT_TAG
from lohan.app.ownership import FILE_KEY, RUN_ID_KEY, ForeignFileError, metrics_owner
from lohan.crashpoints import crashpoint
from lohan.plan.planner import LANES_B, WAIT_LANES, upgrade_lanes

if TYPE_CHECKING:
    from lohan.runtime.step import StepStats

__all__ = [
    "GB",
    "GIB",
    "MetricsWriter",
    "RunSummary",
    "StepMetrics",
    "format_step_line",
    "format_summary",
    "load_metrics",
    "overlap_percent",
    "progress_bar",
    "report_step",
]

GB = 10**9
"""Bytes in a gigabyte (bandwidth: GB/s)."""
GIB = 2**30
"""Bytes in a gibibyte (memory: GiB)."""

IDLE_LANES = WAIT_LANES
"""Lane names that record waiting, not work (``planner.WAIT_LANES``), as the engine records them
(``Engine.last_stats.lanes``): waits for streamed parameters, for the optimizer pass after backward, and with data
parallelism for the other ranks' parameter all-gathers and gradient sums. :func:`overlap_percent` counts only the
cost model's lanes (``planner.LANES_B``), so neither these nor the parts of a lane (``ssd_read``, ``adam``, ...)."""


def _json_float(x: float) -> float | str:
    # JSON has no NaN/Infinity; a diverged loss must stay visible, so write the names Python's
    # float() reads back ("NaN", "Infinity", "-Infinity") instead of a silent null.
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(f"{x:.6g}")  # 6 significant digits: beyond timer and loss noise


def _json_safe(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item"):  # 0-d torch / numpy scalars
        return _json_safe(value.item())
    raise TypeError(
        f"cannot write {type(value).__name__} {value!r} to the metrics file; use numbers or strings"
    )


def overlap_percent(
    lanes_s: Mapping[str, float], step_s: float, idle_lanes: Sequence[str] = IDLE_LANES
) -> float:
    """How much of the step's work ran concurrently, from per-lane busy times.

    With busy times ``t_i`` of the lanes (the cost model's: ``gpu``, ``m2g``, ``g2m``, ``ssd``, ``cpu``), a serial step
    takes ``sum(t)`` and a perfectly overlapped one ``max(t)``. The overlap is where the wall time falls
    between the two: ``100 * (sum(t) - step_s) / (sum(t) - max(t))``, clamped to ``[0, 100]``. 100 % means
    the step took as long as its longest lane (everything else hidden behind it); 0 % means the lanes ran
    one after another. This is our measure of the paper's goal (LoHan §IV: overlap SSD traffic, CPU
    optimizer and GPU compute), not a number from the paper.

    Args:
        lanes_s: Busy seconds per lane for the step (an older lohan's names are read as `upgrade_lanes` says).
        step_s: Wall-clock seconds of the step.
        idle_lanes: Lanes that record waiting rather than work (excluded, as is every name not in ``LANES_B``).

    Returns:
        The overlap in percent; 0.0 when fewer than two lanes did work (nothing to overlap).
    """
    busy = [t for name, t in upgrade_lanes(lanes_s).items() if name in LANES_B and name not in idle_lanes and t > 0]
    if len(busy) < 2:
        return 0.0
    total, longest = sum(busy), max(busy)
    return 100.0 * min(1.0, max(0.0, (total - step_s) / (total - longest)))


# -------------------------------------------------------------------------------------- one step


@dataclass
class StepMetrics:
    """Measurements of one optimizer step. Build it with :meth:`from_counters` to get the units right."""

    step: int
    """Step number, counted from 1."""
    loss: float
    """Training loss of the step (mean over its micro-batches)."""
    lr: float
    """Learning rate used by the step."""
    tokens: int
    """Tokens processed by the step (``batch_size * seq_len``)."""
    step_s: float
    """Wall-clock seconds of the step."""
    tokens_per_s: float
    """Throughput, ``tokens / step_s``."""
    tflops: float
    """Achieved model TFLOPS (forward + backward FLOPs / step_s / 1e12)."""
    ssd_read_gbps: float
    """SSD bytes read during the step / step_s, in GB/s (10^9 B/s)."""
    ssd_write_gbps: float
    """SSD bytes written during the step / step_s, in GB/s (10^9 B/s)."""
    overlap_pct: float
    """Overlap of the lanes in percent, see :func:`overlap_percent`."""
    cpu_mem_gib: float
    """Resident CPU memory of the process, GiB (2^30 B)."""
    gpu_mem_gib: float | None = None
    """Peak GPU memory allocated, GiB; None when running on the CPU."""
    lanes: dict[str, float] = field(default_factory=dict)
    """Seconds per lane: the cost model's (``gpu``, ``m2g``, ``g2m``, ``ssd``, ``cpu``: `runtime.step.measure`), their
    parts (``ssd_read``, ``ssd_write``, ``adam``, ``checksum``) and the waits (``param_wait``, ``optimizer_tail``)."""
    grad_norm: float | None = None
    """Global L2 norm of the step's gradients (before clipping)."""
    clip_coef: float | None = None
    """Factor the gradients were multiplied by (``clip_grad_norm_``'s, at most 1); None without clipping."""
    redone: bool = False
    """The speculative update guessed the clip coefficient wrong and was redone from the previous slot."""
    deferred: bool = False
    """The update waited for the global gradient norm (clipping's deferred schedule, or slots=1)."""
    next_forward_overlapped: bool = False
    """The next step's forward ran beside this step's optimizer pass (a deferred or redone one)."""
    skipped: bool = False
    """The loss or the gradients were not finite: the step was not applied (its batch is consumed)."""
    loss_scale: float | None = None
    """fp16: the dynamic loss scale the step ran with (a skipped overflow step halves it)."""
    eval_loss: float | None = None
    """Loss on the eval set after this step (forward only, the committed weights); None: no eval here."""
    eval_ppl: float | None = None
    """Perplexity on the eval set, ``exp(eval_loss)``."""
    eval_s: float | None = None
    """Wall-clock seconds of the evaluation (not part of :attr:`step_s`)."""
    network_bytes: int | None = None
    """Data parallel: bytes this rank sent over the network during the step (ring collectives; it received as
    many); None in one process."""
    save_s: float | None = None
    """Wall-clock seconds of the checkpoint written after this step (``--save-every``; training waited for it,
    not part of :attr:`step_s`); None: no checkpoint here."""

    @classmethod
    def from_counters(
        cls,
        *,
        step: int,
        loss: float,
        lr: float,
        tokens: int,
        step_s: float,
        flops: float = 0.0,
        ssd_read_bytes: int = 0,
        ssd_write_bytes: int = 0,
        cpu_mem_bytes: int = 0,
        gpu_mem_bytes: int | None = None,
        lanes: Mapping[str, float] | None = None,
        overlap_pct: float | None = None,
        grad_norm: float | None = None,
        clip_coef: float | None = None,
        redone: bool = False,
        deferred: bool = False,
        next_forward_overlapped: bool = False,
        skipped: bool = False,
        loss_scale: float | None = None,
        eval_loss: float | None = None,
        eval_s: float | None = None,
        network_bytes: int | None = None,
        save_s: float | None = None,
    ) -> StepMetrics:
        """Derive the rates of a step from raw counters (bytes, FLOPs, seconds).

        Args:
            step: Step number, counted from 1.
            loss: Training loss.
            lr: Learning rate.
            tokens: Tokens processed.
            step_s: Wall-clock seconds of the step; must be positive.
            flops: Model FLOPs of the step (forward + backward).
            ssd_read_bytes: Bytes read from the SSDs during the step.
            ssd_write_bytes: Bytes written to the SSDs during the step.
            cpu_mem_bytes: Resident CPU memory (the process's RSS).
            gpu_mem_bytes: Peak GPU memory, None on the CPU.
            lanes: Busy seconds per lane.
            overlap_pct: Overlap in percent; computed from ``lanes`` by :func:`overlap_percent` if None.
            eval_loss: Eval loss measured after the step (its perplexity is derived), None if none was.
            eval_s: Seconds the evaluation took.
            save_s: Seconds the checkpoint written after the step took, None if none was.

        Returns:
            The step's metrics.
        """
        if not step_s > 0:
            raise ValueError(f"step_s={step_s!r} must be positive (measure it with time.perf_counter())")
        lanes = dict(lanes or {})
        return cls(
            step=step,
            loss=float(loss),
            lr=float(lr),
            tokens=tokens,
            step_s=step_s,
            tokens_per_s=tokens / step_s,
            tflops=flops / step_s / 1e12,
            ssd_read_gbps=ssd_read_bytes / step_s / GB,
            ssd_write_gbps=ssd_write_bytes / step_s / GB,
            overlap_pct=overlap_percent(lanes, step_s) if overlap_pct is None else overlap_pct,
            cpu_mem_gib=cpu_mem_bytes / GIB,
            gpu_mem_gib=None if gpu_mem_bytes is None else gpu_mem_bytes / GIB,
            lanes=lanes,
            grad_norm=grad_norm,
            clip_coef=clip_coef,
            redone=redone,
            deferred=deferred,
            next_forward_overlapped=next_forward_overlapped,
            skipped=skipped,
            loss_scale=loss_scale,
            eval_loss=None if eval_loss is None else float(eval_loss),
            eval_ppl=None if eval_loss is None else perplexity(eval_loss),
            eval_s=eval_s,
            network_bytes=network_bytes,
            save_s=save_s,
        )

    @classmethod
    def from_stats(cls, stats: StepStats, eval_loss: float | None = None, eval_s: float | None = None,
                   save_s: float | None = None) -> StepMetrics:
        """A step's record from what the engine measured (`Engine.last_stats`), with the evaluation and the
        checkpoint after it."""
        return cls.from_counters(
            step=stats.step, loss=stats.loss, lr=stats.lr, tokens=stats.tokens, step_s=stats.step_s,
            flops=stats.flops or 0.0, ssd_read_bytes=stats.ssd_read_bytes, ssd_write_bytes=stats.ssd_write_bytes,
            cpu_mem_bytes=stats.cpu_mem_bytes, gpu_mem_bytes=stats.gpu_mem_bytes, lanes=stats.lanes,
            overlap_pct=100 * stats.overlap_efficiency, grad_norm=stats.grad_norm, clip_coef=stats.clip_coef,
            redone=stats.redone, deferred=stats.deferred, next_forward_overlapped=stats.next_forward_overlapped,
            skipped=stats.skipped, loss_scale=stats.loss_scale, eval_loss=eval_loss,
            eval_s=eval_s, network_bytes=stats.network_bytes, save_s=save_s)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> StepMetrics:
        """A record of the metrics file back as a `StepMetrics` (what the trackers are given again after a resume):
        the names of NaN and the infinities read back as floats, other keys (``run_id``) left out, the lanes of an
        older lohan's record under their names now (`planner.upgrade_lanes`)."""
        names = {f.name for f in dataclasses.fields(cls)}

        def back(value: Any) -> Any:
            if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
                return float(value)
            return {k: back(v) for k, v in value.items()} if isinstance(value, Mapping) else value

        fields = {k: back(v) for k, v in record.items() if k in names}
        if isinstance(fields.get("lanes"), Mapping):
            fields["lanes"] = upgrade_lanes(fields["lanes"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe record: floats rounded to 6 significant digits, NaN/inf as ``"NaN"``/``"Infinity"``.
        The ``eval_*`` fields appear only on the records of steps that evaluated, ``save_s`` only on those that
        wrote a checkpoint, ``network_bytes`` only in data-parallel runs."""
        record = dataclasses.asdict(self)
        if self.eval_loss is None:
            for name in EVAL_FIELDS:
                del record[name]
        for name in ("network_bytes", "save_s"):
            if record[name] is None:
                del record[name]
        return _json_safe(record)


EVAL_FIELDS = ("eval_loss", "eval_ppl", "eval_s")
"""The :class:`StepMetrics` fields of an evaluation, written only on the steps that evaluated."""


def perplexity(loss: float) -> float:
    """``exp(loss)``, inf past what a float holds (a diverged model), NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _fit(value: float, width: int, spec: str) -> str:
    """``format(value, spec)`` right-aligned in ``width``; fewer decimals, then e-notation, if too wide."""
    candidates = [spec]
    if spec.endswith("f"):
        decimals = int(spec.rstrip("f").split(".")[-1] or 0)
        prefix = spec.rstrip("f").split(".")[0]
        candidates += [f"{prefix}.{d}f" for d in range(decimals - 1, -1, -1)]
    candidates += [f".{p}e" for p in (2, 1, 0)]
    texts = [format(value, c) for c in candidates]
    return next((t for t in texts if len(t) <= width), min(texts, key=len)).rjust(width)


def _step_flag(m: StepMetrics) -> str:
    """One character after the gradient norm: ``c`` clipped, ``r`` clipped after a redone speculative
    update, ``!`` skipped (not finite), blank otherwise."""
    if m.skipped:
        return "!"
    if m.redone:
        return "r"
    return "c" if m.clip_coef is not None and m.clip_coef < 1 else " "


def format_step_line(m: StepMetrics, total_steps: int | None = None) -> str:
    """The one log line of a step, fixed width so consecutive lines align column by column.

    Example::

        step   12/200 | loss  3.4521 | lr 2.00e-04 |     1,234 tok/s |   0.012 TFLOPS | SSD r  1.23 w  0.98 GB/s | overlap  87% | RAM   3.2 GiB |   1.230 s

    Every number is padded to a fixed width (values that would not fit switch to fewer decimals or
    e-notation), so the width depends only on ``total_steps`` and on whether a GPU field is present. A step
    that evaluated adds ``| eval loss  3.2100 ppl    24.78 (  0.41 s)`` at the end.

    Args:
        m: The step's metrics.
        total_steps: Planned number of steps, shown as ``step/total``; None for open-ended runs.

    Returns:
        The line, without a trailing newline.
    """
    if total_steps is None:
        head = f"step {m.step:>8}"
    else:
        head = f"step {m.step:>{max(4, len(str(total_steps)))}}/{total_steps}"
    parts = [
        head,
        f"loss {_fit(m.loss, 7, '.4f')}",
        f"lr {_fit(m.lr, 8, '.2e')}",
        *([f"gnorm {_fit(m.grad_norm, 6, '.3f')}{_step_flag(m)}"] if m.grad_norm is not None else []),
        f"{_fit(m.tokens_per_s, 9, ',.0f')} tok/s",
        f"{_fit(m.tflops, 7, '.3f')} TFLOPS",
        f"SSD r {_fit(m.ssd_read_gbps, 5, '.2f')} w {_fit(m.ssd_write_gbps, 5, '.2f')} GB/s",
        f"overlap {_fit(m.overlap_pct, 3, '.0f')}%",
        f"RAM {_fit(m.cpu_mem_gib, 5, '.1f')} GiB",
    ]
    if m.gpu_mem_gib is not None:
        parts.append(f"GPU {_fit(m.gpu_mem_gib, 5, '.1f')} GiB")
    parts.append(f"{_fit(m.step_s, 7, '.3f')} s")
    if m.eval_loss is not None:  # last, so the columns before it align with the other steps' lines
        ppl = m.eval_ppl if m.eval_ppl is not None else perplexity(m.eval_loss)
        parts.append(f"eval loss {_fit(m.eval_loss, 7, '.4f')} ppl {_fit(ppl, 8, '.2f')} "
                     f"({_fit(m.eval_s or 0.0, 6, '.2f')} s)")
    return " | ".join(parts)


def _hms(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    h, minutes = divmod(minutes, 60)
    return f"{h}:{minutes:02d}:{s:02d}"


LOG_LINE_WIDTH = 120
"""The most columns a plain log line takes (:func:`format_log_line`)."""


def format_log_line(m: StepMetrics, total_steps: int, elapsed_s: float, eta_s: float | None) -> str:
    """The plain line of a step for a log file (no terminal): at most :data:`LOG_LINE_WIDTH` columns, with what a
    progress bar would show (elapsed, ETA) and without the lanes, memory, FLOPs and step seconds (the metrics JSONL
    has them).

    Example::

        step  120/2000 | loss  3.4521 | lr 2.00e-04 | gnorm  0.531c |   1,234 tok/s | SSD 1.23/0.98 GB/s | 0:02:27<0:38:32

    (read and write GB/s; the time run so far < the time left).

    An evaluation is a line of its own (:func:`format_eval_line`).
    """
    width = len(str(total_steps))
    parts = [
        f"step {m.step:>{width}}/{total_steps}",
        f"loss {_fit(m.loss, 7, '.4f')}",
        f"lr {_fit(m.lr, 8, '.2e')}",
        *([f"gnorm {_fit(m.grad_norm, 6, '.3f')}{_step_flag(m)}"] if m.grad_norm is not None else []),
        f"{_fit(m.tokens_per_s, 7, ',.0f')} tok/s",
        f"SSD {_fit(m.ssd_read_gbps, 4, '.2f')}/{_fit(m.ssd_write_gbps, 4, '.2f')} GB/s",
        f"{_hms(elapsed_s)}<{'-:--:--' if eta_s is None else _hms(eta_s)}",  # elapsed<left, as tqdm shows them
    ]
    line = " | ".join(parts)
    while len(line) > LOG_LINE_WIDTH and len(parts) > 3:  # runs of 10^6 steps or 100+ hours: drop throughput first
        parts.pop(-3)
        line = " | ".join(parts)
    return line


def format_eval_line(m: StepMetrics) -> str:
    """The line of an evaluation, below its step's line in a log file."""
    ppl = m.eval_ppl if m.eval_ppl is not None else perplexity(m.eval_loss or math.nan)
    return f"  eval after step {m.step}: loss {m.eval_loss:.4f} | ppl {ppl:.2f} | {m.eval_s or 0.0:.2f} s"


def default_log_every(total_steps: int, terminal: bool) -> int:
    """Steps between log lines when ``--log-every`` is not given: every step on a terminal (the bar is live), else
    about 200 lines over the run, on a round number of steps (a long run's log stays readable)."""
    if terminal or total_steps <= 200:
        return 1
    raw = total_steps / 200
    return int(next(n for n in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10**4, 10**5, 10**6)
                    if n >= raw))


def should_log(step: int, total_steps: int, every: int, first: int = 1, evaluated: bool = False) -> bool:
    """Whether a step gets its line: the run's first step, every ``every``-th, the last, and any that evaluated."""
    return step == first or step == total_steps or step % every == 0 or evaluated


# ------------------------------------------------------------------------------------- JSONL file


class MetricsWriter:
    """The run's JSONL metrics file: one JSON object per line, each carrying the run's identity (``run_id``,
    `lohan.app.ownership`), durable (flushed and fsynced) as it is written.

    The file is created with its first record, linked into place from a temporary file: it never exists empty,
    and a file that appeared at its path in the meantime is never written over (ForeignFileError). A resumed run
    appends to the file of its own run (anything else is refused: ForeignFileError), after cutting it back to the
    committed steps: the records of steps after `through` (a kill took them back, and the resumed run writes them
    again) and a line a kill cut short. Use as a context manager, or call :meth:`close`.

    Args:
        path: The file; missing parent directories are created.
        run_id: The run's identity (its store's volume id).
        through: The last committed step (None: keep every record).
    """

    def __init__(self, path: str | Path, run_id: str, through: int | None = None) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None
        self.last_step: int | None = None
        """The step of the last record in the file (None: no record yet)."""
        if self.path.exists() or self.path.is_symlink():
            owner, why = metrics_owner(self.path) if not self.path.is_symlink() else (None, "a symbolic link")
            if owner != run_id:
                raise ForeignFileError(f"--metrics {self.path} holds " + (
                    f"a file lohan did not write ({why})" if owner is None else f"the metrics of another run ({owner})")
                    + ": lohan never writes over it; choose another --metrics path, or move that file away")
            self.last_step = _cut_back(self.path, through)
            self._file = _append(self.path)
        self._closed = False

    def write(self, record: StepMetrics | Mapping[str, Any]) -> None:
        """Append one record (a step's metrics, or any mapping with a ``step``) durably.

        Args:
            record: A :class:`StepMetrics` (written via :meth:`StepMetrics.to_dict`) or a mapping of
                JSON-compatible values (floats are rounded and NaN/inf spelled out the same way).
        """
        if self._closed:
            raise ValueError(f"MetricsWriter({str(self.path)!r}) is closed")
        data = record.to_dict() if isinstance(record, StepMetrics) else _json_safe(record)
        data[RUN_ID_KEY] = self.run_id
        crashpoint("metrics.write")
        if self._file is None:
            self._file = self._create(data)
        else:
            self._file.write(json.dumps(data, allow_nan=False) + "\n")
            self._file.flush()
        os.fsync(self._file.fileno())  # a kill, or a power cut, loses no committed step's record
        self.last_step = data.get("step", self.last_step)

    def _create(self, first: dict[str, Any]) -> IO[str]:
        """The file, created holding the record `first` and its own inode (`ownership.FILE_KEY`: a copy is not
        lohan's): written under a temporary name of this run's, then linked to its path (the same inode), which
        fails if anything is there (a file lohan did not write is never replaced)."""
        tmp = self.path.with_name(f".{self.path.name}.{self.run_id}.tmp")
        tmp.unlink(missing_ok=True)  # this run's own, left by a kill (its name carries the run's identity)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            line = json.dumps({**first, FILE_KEY: os.fstat(fd).st_ino}, allow_nan=False) + "\n"
            os.write(fd, line.encode())
            os.fsync(fd)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise ForeignFileError(f"--metrics {self.path} appeared while the run was starting; lohan never "
                                       "writes over a file it did not write: choose another --metrics path") from None
        finally:
            os.close(fd)
            tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        return _append(self.path)

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _append(path: Path) -> IO[str]:
    """`path` opened to append, never through a link."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW), "a", encoding="utf-8")


def _cut_back(path: Path, through: int | None) -> int | None:
    """Cut a metrics file (this run's) back to its complete records of steps up to `through`; returns the step of
    the last record kept (None: none)."""
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1  # a line a kill cut short is not a record
        pos, last = 0, None
        for line in data[:keep].splitlines(keepends=True):
            step = json.loads(line).get("step", 0)
            if through is not None and step > through:
                keep = pos
                break
            pos, last = pos + len(line), step
        if keep < len(data):
            f.truncate(keep)
            os.fsync(f.fileno())
    return last


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read back a JSONL metrics file (for reports and tests); blank lines are skipped, and so is a last line a
    kill or a full disk cut short (no newline: not a record yet)."""
    with Path(path).open(encoding="utf-8") as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def plot_metrics(metrics_path: str | Path, png_path: str | Path | None = None, run_id: str | None = None) -> Path | None:
    """Plot loss, learning rate and tokens/s per step of a JSONL metrics file next to it (``<stem>.png``); the
    eval loss of the records that have one is drawn next to the training loss, the steps that wrote a checkpoint
    are marked on the lr panel (the schedule).

    The PNG's text names lohan and `run_id` (the run the plot is of: `layout.plot_owner`, so that only that run
    replaces it; the caller checks that it may); it is written under a temporary name and renamed in.

    Returns the PNG path, or None when matplotlib is unavailable or there is nothing to plot.
    """
    records = [r for r in load_metrics(metrics_path) if isinstance(r.get("loss"), int | float)]
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out = Path(png_path) if png_path else Path(metrics_path).with_suffix(".png")
    steps = [r["step"] for r in records]
    fig, (ax1, ax_lr, ax2) = plt.subplots(3, 1, figsize=(7, 7), sharex=True, height_ratios=(2, 1, 1.5))
    ax1.plot(steps, [r["loss"] for r in records], lw=1, label="train")
    evals = [r for r in records if isinstance(r.get("eval_loss"), int | float)]
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], lw=1.5, marker="o", ms=3,
                 color="tab:orange", label="eval")
        ax1.legend(loc="upper right")
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    _plot_lr(ax_lr, records)
    ax2.plot(steps, [r.get("tokens_per_s", float("nan")) for r in records], lw=1, color="tab:green")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.suptitle(Path(metrics_path).name)
    fig.tight_layout()
    # tagged: the run replaces this file, and only this one (layout.plot_owner)
    tmp = out.with_name(f".{out.name}.{run_id or os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100,
                    metadata={"Software": PLOT_TAG, **({PLOT_RUN_KEY: run_id} if run_id else {})})
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _plot_lr(ax: Any, records: list[dict[str, Any]]) -> None:
    """The learning rate each step ran with (the schedule as it happened, a resume's changes included), and a
    mark at each step that wrote a checkpoint."""
    ax.plot([r["step"] for r in records], [r.get("lr", float("nan")) for r in records], lw=1, color="tab:purple")
    saved = [r for r in records if isinstance(r.get("save_s"), int | float)]
    if saved:
        ax.plot([r["step"] for r in saved], [r.get("lr", float("nan")) for r in saved], ls="none", marker="v",
                ms=4, color="tab:gray", label="checkpoint")
        ax.legend(loc="upper right")
    ax.set_ylabel("lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.grid(alpha=0.3)


# ----------------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class RunSummary:
    """End-of-run figures. Rates are time-weighted means (total work / total time) over the measured
    steps, i.e. all steps but the first ``warmup_steps`` (allocator, kernel and page-cache warm-up)."""

    steps: int
    """Number of steps in the run."""
    measured_steps: int
    """Steps the rates are averaged over (``steps - warmup_steps``, or all steps if that leaves none)."""
    first_loss: float
    """Loss of the first step."""
    last_loss: float
    """Loss of the last step."""
    min_loss: float
    """Lowest loss (NaN steps ignored; NaN if every step was NaN)."""
    min_loss_step: int
    """Step number of :attr:`min_loss`."""
    total_s: float
    """Sum of the step times, seconds (all steps, warm-up included)."""
    total_tokens: int
    """Tokens processed by all steps."""
    tokens_per_s: float
    """Mean throughput over the measured steps."""
    tflops: float
    """Mean TFLOPS over the measured steps."""
    ssd_read_gbps: float
    """Mean SSD read bandwidth over the measured steps, GB/s."""
    ssd_write_gbps: float
    """Mean SSD write bandwidth over the measured steps, GB/s."""
    overlap_pct: float
    """Mean overlap over the measured steps, percent."""
    peak_cpu_mem_gib: float
    """Largest CPU memory of any step, GiB."""
    peak_gpu_mem_gib: float | None
    """Largest GPU memory of any step, GiB; None on the CPU."""
    evals: int = 0
    """Evaluations run (steps with an ``eval_loss``)."""
    eval_total_s: float = 0.0
    """Seconds spent evaluating, over all evaluations."""
    last_eval_loss: float | None = None
    """Eval loss of the last evaluation."""
    min_eval_loss: float | None = None
    """Lowest eval loss (NaN ignored)."""
    min_eval_step: int | None = None
    """Step of :attr:`min_eval_loss`."""

    @property
    def eval_share(self) -> float:
        """Share of the run's time spent evaluating: ``eval_total_s / (total_s + eval_total_s)``."""
        total = self.total_s + self.eval_total_s
        return self.eval_total_s / total if total > 0 else 0.0

    @classmethod
    def from_steps(cls, steps: Sequence[StepMetrics], warmup_steps: int = 1) -> RunSummary:
        """Summarize a run.

        Args:
            steps: The metrics of every step, in order.
            warmup_steps: Leading steps left out of the means (kept in losses and totals).

        Raises:
            ValueError: If ``steps`` is empty.
        """
        if not steps:
            raise ValueError("cannot summarize a run with no steps")
        measured = list(steps[warmup_steps:]) or list(steps)
        time_s = sum(m.step_s for m in measured)

        def time_weighted(name: str) -> float:
            return sum(getattr(m, name) * m.step_s for m in measured) / time_s

        finite = [m for m in steps if not math.isnan(m.loss)]
        best = min(finite, key=lambda m: m.loss) if finite else steps[0]
        gpu = [m.gpu_mem_gib for m in steps if m.gpu_mem_gib is not None]
        evals = [m for m in steps if m.eval_loss is not None]
        scored = [(m.eval_loss, m.step) for m in evals if m.eval_loss is not None and not math.isnan(m.eval_loss)]
        best_eval = min(scored) if scored else None  # the lowest eval loss, the earliest step on a tie
        return cls(
            steps=len(steps),
            measured_steps=len(measured),
            first_loss=steps[0].loss,
            last_loss=steps[-1].loss,
            min_loss=best.loss if finite else math.nan,
            min_loss_step=best.step,
            total_s=sum(m.step_s for m in steps),
            total_tokens=sum(m.tokens for m in steps),
            tokens_per_s=sum(m.tokens for m in measured) / time_s,
            tflops=time_weighted("tflops"),
            ssd_read_gbps=time_weighted("ssd_read_gbps"),
            ssd_write_gbps=time_weighted("ssd_write_gbps"),
            overlap_pct=time_weighted("overlap_pct"),
            peak_cpu_mem_gib=max(m.cpu_mem_gib for m in steps),
            peak_gpu_mem_gib=max(gpu) if gpu else None,
            evals=len(evals),
            eval_total_s=sum(m.eval_s or 0.0 for m in evals),
            last_eval_loss=evals[-1].eval_loss if evals else None,
            min_eval_loss=best_eval[0] if best_eval else None,
            min_eval_step=best_eval[1] if best_eval else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe record (same rounding as :meth:`StepMetrics.to_dict`)."""
        return _json_safe(dataclasses.asdict(self))


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    h, minutes = divmod(minutes, 60)
    return f"{seconds:.1f} s ({h}:{minutes:02d}:{s:02d})"


def format_summary(steps: Sequence[StepMetrics] | RunSummary, warmup_steps: int = 1) -> str:
    """Multi-line end-of-run summary.

    Args:
        steps: The metrics of every step (or an already computed :class:`RunSummary`).
        warmup_steps: Leading steps left out of the means.

    Returns:
        The summary text, without a trailing newline.
    """
    s = steps if isinstance(steps, RunSummary) else RunSummary.from_steps(steps, warmup_steps)
    skipped = s.steps - s.measured_steps
    window = f"mean over {s.measured_steps:,} steps" + (f", {skipped} warm-up excluded" if skipped else "")
    memory = f"peak RAM {s.peak_cpu_mem_gib:.1f} GiB"
    if s.peak_gpu_mem_gib is not None:
        memory += f"   peak GPU {s.peak_gpu_mem_gib:.1f} GiB"
    evaluation = []
    if s.evals:
        best = f"   min {s.min_eval_loss:.4f} (step {s.min_eval_step})" if s.min_eval_loss is not None else ""
        evaluation = [
            f"  eval        last {s.last_eval_loss:.4f} (ppl {perplexity(s.last_eval_loss):.2f}){best}   "
            f"{s.evals} evaluation(s), {s.eval_total_s / s.evals:.2f} s each, {100 * s.eval_share:.1f}% of the run "
            f"time"
        ]
    return "\n".join(
        [
            f"run summary: {s.steps:,} steps, {s.total_tokens:,} tokens in {_duration(s.total_s)}",
            f"  loss        first {s.first_loss:.4f}   last {s.last_loss:.4f}   "
            f"min {s.min_loss:.4f} (step {s.min_loss_step})",
            f"  throughput  {s.tokens_per_s:,.0f} tok/s   {s.tflops:.3f} TFLOPS   ({window})",
            f"  SSD         read {s.ssd_read_gbps:.2f} GB/s   write {s.ssd_write_gbps:.2f} GB/s   "
            f"overlap {s.overlap_pct:.0f}%",
            f"  memory      {memory}",
            *evaluation,
        ]
    )


# ------------------------------------------------------------------------------------ progress bar


def progress_bar(total_steps: int | None, console: Console | None = None, completed: int = 0) -> Progress:
    """A rich progress bar for the training loop, with one task (the steps) already added.

    Columns: bar, percentage, ``M/N`` steps, elapsed, ETA, last loss. Use it as a context manager and
    report steps with :func:`report_step`, which prints the step line *above* the bar. When stdout is
    not a terminal (CI, ``| tee``), rich does not redraw the bar: the step lines are printed as plain
    lines and the bar appears once, in its final state, when the context exits.

    Args:
        total_steps: Planned steps; None gives an open-ended bar without percentage or ETA.
        console: Where to draw; a new ``rich.console.Console()`` (stdout) if None.
        completed: Steps already done (when resuming), so the bar and the ETA start there.

    Returns:
        The configured, not yet started, ``Progress``.
    """
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[loss]}"),
        console=console or Console(),
    )
    progress.add_task("train", total=total_steps, completed=completed, loss="loss -")
    return progress


def report_step(
    progress: Progress, m: StepMetrics, total_steps: int | None = None, task_id: TaskID | None = None,
    print_line: bool = True,
) -> str:
    """Print the step line above the bar and move the bar to step ``m.step`` with its loss.

    On a terminal the line is :func:`format_step_line`'s; without one (a log file) the shorter
    :func:`format_log_line`, with the elapsed time and ETA the bar would show, and an eval on a line of its own.

    Args:
        progress: From :func:`progress_bar`.
        m: The step's metrics.
        total_steps: For the ``step/total`` field of the line.
        task_id: Task to update; the first task of ``progress`` if None.
        print_line: False moves the bar only (a step between ``--log-every`` lines).

    Returns:
        The printed line (for logs).
    """
    task = progress.tasks[0].id if task_id is None else task_id
    line = format_step_line(m, total_steps)
    if print_line:
        console = progress.console
        if not console.is_terminal and total_steps is not None:  # a log file: the short line, with the bar's ETA
            t = next(t for t in progress.tasks if t.id == task)
            progress.update(task, completed=m.step)
            line = format_log_line(m, total_steps, t.elapsed or 0.0, t.time_remaining)
            if m.eval_loss is not None:
                line += "\n" + format_eval_line(m)
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    progress.update(task, completed=m.step, loss=f"loss {m.loss:.4f}")
    return line
