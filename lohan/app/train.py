"""The run driver behind the CLI: a `Run` of stages, pre-flight -> plan -> open the store -> position the data ->
the loop -> finish, each a component of its own module (`preflight`, `opening`, `run_state`, `header`, `loop`).

Order matters for "nothing written on refusal": the settings, the model skeleton, the data and the
capacity plan are all checked before the engine creates anything on the NVMe directories.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape

from lohan.app.failures import (
    Interrupted,
    Refusal,
    Terminated,
    fail,
    interrupt_code,
    interrupt_name,
    on_sigterm,
)
from lohan.app.fit import detect_hardware
from lohan.app.header import print_header
from lohan.app.header import resident_line as _resident_line
from lohan.app.inputs import Model, load_dataset, load_eval_set, load_model, make_batches
from lohan.app.layout import RunLayout, plot_owner
from lohan.app.loop import evaluate, train_and_close
from lohan.app.metrics import StepMetrics
from lohan.app.opening import _InitLog, open_store, run_layout
from lohan.app.ownership import metrics_owner
from lohan.app.plot import plot_metrics
from lohan.app.preflight import RunContext, plan_fit, preflight, resolve_compute_dtype
from lohan.app.preflight import plan_fit as _plan
from lohan.app.preflight import preflight as _preflight
from lohan.app.report import format_summary
from lohan.app.run_state import (
    check_resumable,
    load_run_state,
    run_state_path,
    save_run_state,
    schedule_changes,
)
from lohan.app.run_state import schedule_changes as _schedule_changes
from lohan.app.run_state import schedule_settings as _schedule
from lohan.app.verify import verify_store
from lohan.config import RunConfig
from lohan.data import Batch
from lohan.runtime.engine import Engine
from lohan.runtime.parallel import current_group, init_from_env, leave_group

__all__ = [  # the driver, and the names the CLI, the tests and the benchmarks import from here
    "Run", "train", "verify_store", "Refusal", "Terminated", "Model", "load_model", "load_dataset", "load_eval_set",
    "make_batches", "evaluate", "check_resumable", "load_run_state", "save_run_state", "run_state_path", "run_layout",
    "detect_hardware", "_InitLog", "_plan", "_preflight", "_schedule", "_schedule_changes", "_resident_line",
]


def train(run: RunConfig, resume: bool = False, dry_run: bool = False, hardware: str | None = None,
          export: str | None = None, overwrite: bool = False, export_dtype: str | None = None,
          config: str | os.PathLike | None = None, merged: bool = False) -> int:
    """Run (or, with `dry_run`, only plan) the fine-tune described by `run`; returns a process exit code.

    `resume` continues the store in the NVMe directories (or its interrupted initialization);
    `overwrite` discards it. Without either, a directory that holds a store is refused. SIGTERM stops
    the run like Ctrl-C: the step in flight is abandoned and the last commit stands. `config`: the YAML the
    run was read from (an input no output may touch: layout.RunLayout). `merged`: a LoRA run exports its base with
    the adapters merged in (``--export-merged``), not its PEFT adapter folder.
    """
    try:  # launched by torchrun: one process per rank (lohan/runtime/parallel.py), each on its own GPU from here on
        joined = init_from_env(run.engine.execution.device)
    except ValueError as err:  # LOCAL_RANK names a GPU this process cannot see
        Console(soft_wrap=True).print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    code = 2
    try:
        driver = Run(run, resume, dry_run, hardware, export, overwrite, export_dtype, config, merged)
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            code = driver.execute()
            return code
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            code = driver.execute()
            return code
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        if joined:
            leave_group(code == 0)


class Run:
    """One run of the CLI, as stages: `preflight` (nothing written), `plan` (refuses what cannot fit), `open` (the
    store), `position` (the data at the committed step, the header), `loop` (train, export, close) and `finish`
    (the summary and the plot). `execute` runs them in order and turns a refusal into an exit code."""

    def __init__(self, run: RunConfig, resume: bool = False, dry_run: bool = False, hardware: str | None = None,
                 export: str | None = None, overwrite: bool = False, export_dtype: str | None = None,
                 config: str | os.PathLike | None = None, merged: bool = False) -> None:
        self.run, self.resume, self.dry_run, self.hardware = run, resume, dry_run, hardware
        self.export, self.overwrite, self.export_dtype, self.config, self.merged = (export, overwrite, export_dtype,
                                                                                      config, merged)
        self.dp = current_group()
        # never re-wrap the fixed-width lines, also when piped; data parallel: rank 0 speaks for the group
        self.console = Console(soft_wrap=True, quiet=not self.dp.is_main)
        self.ctx: RunContext | None = None

    def execute(self) -> int:
        """pre-flight -> plan -> open the store -> position the data -> the loop -> finish."""
        try:
            ctx = self.preflight()
            report = self.plan(ctx)
            if self.dry_run:
                self.print_dry_run(ctx, report)
                return 0
            engine = self.open(ctx)
        except Refusal as err:
            return fail(self.console, self.dp, str(err))
        except Interrupted as stop:
            return stop.code
        except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM in the pre-flight (a token cache's build, say)
            self.console.print(f"\n{interrupt_name(err)} before the store was opened: nothing of the run was written "
                               "(a token cache being built goes on where it stopped next time)")
            return interrupt_code(err)
        try:
            batches, data_state = self.position(ctx, engine)
        except Refusal as err:
            engine.close()
            return fail(self.console, self.dp, str(err))
        code, history = self.loop(ctx, engine, batches, data_state)
        if history and ctx.main_rank:
            self.finish(ctx, history, batches)
        return code

    def preflight(self) -> RunContext:
        """Everything that can be checked before anything is written (`preflight.preflight`), the compute dtype
        resolved first."""
        run, dtype = resolve_compute_dtype(self.run, self.resume, self.hardware, self.dp)
        ctx = self.ctx = preflight(run, self.dry_run, self.export, self.export_dtype, self.config, self.console,
                                   self.dp)
        ctx.dtype, ctx.merged = dtype, self.merged
        if ctx.checkpoints is not None:
            ctx.checkpoints.merged = self.merged
        return ctx

    def plan(self, ctx: RunContext) -> Any:
        """The plan (`preflight.plan_fit`), kept in the context: the first step's measured lanes are priced with it."""
        report = ctx.fit = plan_fit(ctx, self.hardware, self.dry_run, self.resume)
        return report

    def print_dry_run(self, ctx: RunContext, report: Any) -> None:
        """What `--dry-run` prints: the dtype, the plan, the data and the time the steps would take."""
        console = self.console
        console.print(ctx.dtype.describe())
        console.print(report.format())
        if ctx.dataset is not None and ctx.dataset.description:
            console.print(f"data: {escape(ctx.dataset.description)}")
        console.print(f"dry run: {ctx.steps} steps would take about {report.step_s * ctx.steps / 3600:.3g} h; "
                      "nothing was written")

    def open(self, ctx: RunContext) -> Engine:
        """The store opened, continued or created (`opening.open_store`)."""
        return open_store(ctx, self.resume, self.overwrite)

    def position(self, ctx: RunContext, engine: Engine) -> tuple[Iterator[Batch], dict | None]:
        """The batch stream at the committed step (a resume: the saved data position and RNG, rank 0's for every
        rank), and the header. A fresh run's metrics file (lohan's: checked) starts over with its store."""
        run, dp, start = ctx.run, ctx.dp, engine.step_count
        try:
            data_state = load_run_state(run, ctx.seq_len, engine) if self.resume and ctx.main_rank else None
            data_state = dp.from_main(data_state)  # rank 0's data position and RNG: the same global batches
            batches = make_batches(run, ctx.model, ctx.dataset, ctx.seq_len, start, data_state)
        except (OSError, ValueError) as err:
            raise Refusal(str(err)) from None
        if self.resume:
            self._resume_notes(engine, data_state)
        if ctx.main_rank:
            start_metrics(ctx.layout, self.resume)
        self.header(ctx, engine)
        return batches, data_state

    def _resume_notes(self, engine: Engine, data_state: dict | None) -> None:
        """Where a resume starts, and the settings that differ from the run being resumed."""
        console, start = self.console, engine.step_count
        console.print(f"resuming from the state committed at step {start}")
        changed = schedule_changes((data_state or {}).get("schedule"), engine.cfg)
        if changed:
            console.print(f"[yellow]note:[/yellow] the optimizer's settings differ from the run being resumed "
                          f"({changed}); the steps from {start + 1} on use the new ones")
        # like act_policy, a resume may change it (no state of a step outlives it); it changes the numerics, so say so
        now = engine.cfg.activations.act_compress
        saved = ((data_state or {}).get("activations") or {}).get("act_compress", now)
        if saved != now:
            how = {"none": "kept as they are", "int8": "compressed to int8 (lossy)"}
            console.print(f"[yellow]note:[/yellow] act_compress {saved} -> {now}: swapped activations were "
                          f"{how.get(saved, saved)} in the run being resumed and are {how[now]} from step {start + 1} on")

    def header(self, ctx: RunContext, engine: Engine) -> None:
        """The run header (`header.print_header`, from `Engine.describe`), then the data and the eval set."""
        run, console = ctx.run, self.console
        label = (os.path.basename(os.path.normpath(run.model)) if ctx.model.hf_program is not None
                 else ctx.model.config.name)
        print_header(console, run, ctx.model.config, engine.describe(), ctx.seq_len, label, ctx.dtype, ctx.fit)
        if ctx.dataset is not None and ctx.dataset.description:
            console.print(f"  data: {escape(ctx.dataset.description)}")
        if ctx.eval_set is not None:
            source = f"held out from {run.data}" if run.eval_fraction is not None else f"from {run.eval_data}"
            when = f"every {run.eval_every} steps and at the end" if run.eval_every else "at the end"
            console.print(f"  eval: {len(ctx.eval_set)} sequences {source}, {when} (forward only)")

    def loop(self, ctx: RunContext, engine: Engine, batches: Iterator[Batch],
             data_state: dict | None) -> tuple[int, list[StepMetrics]]:
        """Train to the last step, export, and close (`loop.train_and_close`)."""
        return train_and_close(ctx, engine, batches, data_state, self.export, self.export_dtype)

    def finish(self, ctx: RunContext, history: list[StepMetrics], batches: Iterator[Batch]) -> None:
        """The run's summary and its metrics plot."""
        console = self.console
        console.print(format_summary(history))
        clipped = sum(h.clip_coef is not None and h.clip_coef < 1 for h in history)
        redone, skipped = sum(h.redone for h in history), sum(h.skipped for h in history)
        if clipped or skipped:
            console.print(f"  gradients   clipped in {clipped} of {len(history)} steps ({redone} speculative updates "
                          f"redone), {skipped} skipped as not finite")
        saves = [h.save_s for h in history if h.save_s is not None]
        if saves:
            share = sum(saves) / (sum(h.step_s for h in history) + sum(saves))
            console.print(f"  checkpoints {len(saves)} written, {sum(saves) / len(saves):.2f} s each on average "
                          f"(training waited: {share:.1%} of the steps' and saves' time)")
        untrained = getattr(batches, "untrained_skipped", 0)
        if untrained:
            console.print(f"  data        {untrained} batch(es) skipped: every target masked (no response or "
                          "assistant token), nothing to train on")
        console.print(f"metrics: {ctx.layout.metrics}" + _plot(ctx.layout))


def start_metrics(layout: RunLayout, resume: bool) -> None:
    """A new run starts its metrics file afresh: the file there is its store's, or a replaced store's (proven at the
    pre-flight, and again now). A resumed run appends to its own, and starts afresh over one of a store it replaced
    (it was killed before its first record)."""
    path, owner = layout.metrics, layout.owner
    if path.is_symlink() or not path.exists():
        return
    run_id, why = metrics_owner(path)
    if run_id is None or not owner.owns(run_id):  # it changed since the pre-flight
        raise Refusal(f"--metrics {path} holds a file lohan did not write ({why})" if run_id is None else
                      owner.stranger("the metrics", path, run_id))
    if not resume or run_id != owner.current:
        path.unlink()


def _plot(layout: RunLayout) -> str:
    """The metrics plot, drawn over a previous one only if it is this run's (it was checked at the pre-flight, and
    is again now); ', plot: <path>', or what kept it from being drawn."""
    owner = plot_owner(layout.plot) if layout.plot.exists() or layout.plot.is_symlink() else layout.owner.current
    if layout.plot.is_symlink() or not layout.owner.owns(owner):
        return f" (no plot: {layout.plot} holds a file that is not this run's plot)"
    try:
        png = plot_metrics(layout.metrics, layout.plot, run_id=layout.owner.current)
    except (OSError, ValueError) as err:  # the plot is a convenience: a full disk must not fail a finished run
        return f" (no plot: {err})"
    return f", plot: {png}" if png else ""
