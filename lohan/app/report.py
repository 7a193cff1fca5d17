"""What the user sees of a run's steps: the fixed-width step line (a terminal) or log line (a file), the eval line,
how often a line is printed, the progress bar and the end-of-run summary. The records themselves are
`lohan.app.metrics`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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

from lohan.app.metrics import StepMetrics, json_safe, perplexity

__all__ = [
    "LOG_LINE_WIDTH",
    "RunSummary",
    "default_log_every",
    "format_eval_line",
    "format_log_line",
    "format_step_line",
    "format_summary",
    "progress_bar",
    "report_step",
    "should_log",
]



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
        return json_safe(dataclasses.asdict(self))


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
