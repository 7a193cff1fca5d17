"""A run's step records: `StepMetrics` (one step's measurements, units in the names) and the JSONL file they are
written to (`MetricsWriter`, `load_metrics`). What the user sees of them, the console lines, the progress bar and
the summary, is `lohan.app.report`; the plot is `lohan.app.plot`.

Units are in the names and never mixed: bandwidth in GB/s (10^9 bytes, as SSD vendors and ``fio``
report it), memory in GiB (2^30 bytes, as ``free -g`` and ``nvidia-smi`` report it), compute in
TFLOPS (10^12 FLOP/s), time in seconds. Rates of one step are averages over its wall time, so the SSD
figures are what the run achieved, not the device's peak.

Typical use by the run driver (:mod:`lohan.app.loop`)::

    with MetricsWriter(path, run_id, through=start) as writer, progress_bar(steps, console) as bar:
        for s in range(start, steps):
            engine.step(batch)
            m = StepMetrics.from_stats(engine.last_stats, eval_loss, eval_s, save_s)  # the engine's StepStats
            writer.write(m)                                  # once the step's commit is durable (loop.MetricsSink)
            report_step(bar, m, steps)                       # lohan.app.report
    console.print(format_summary(history))                   # lohan.app.report

`StepMetrics.from_counters` builds a record from raw counters instead (benchmarks, tests).
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

from io_engine.base import fsync_dir
from lohan.app.ownership import FILE_KEY, RUN_ID_KEY, ForeignFileError, metrics_owner
from lohan.crashpoints import crashpoint
from lohan.plan.planner import LANES_B, WAIT_LANES, upgrade_lanes

if TYPE_CHECKING:
    from lohan.runtime.step import StepStats

__all__ = [
    "GB",
    "GIB",
    "MetricsWriter",
    "StepMetrics",
    "json_safe",
    "load_metrics",
    "overlap_percent",
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


def json_safe(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item"):  # 0-d torch / numpy scalars
        return json_safe(value.item())
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
    parts (``ssd_read``, ``ssd_write``, ``adam``, ``checksum``) and the waits (``param_wait``, ``provision_wait``, ``optimizer_tail``)."""
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
        return json_safe(record)


EVAL_FIELDS = ("eval_loss", "eval_ppl", "eval_s")
"""The :class:`StepMetrics` fields of an evaluation, written only on the steps that evaluated."""


def perplexity(loss: float) -> float:
    """``exp(loss)``, inf past what a float holds (a diverged model), NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf



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
        data = record.to_dict() if isinstance(record, StepMetrics) else json_safe(record)
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

