"""The training loop and its components: a step, its run state once committed (`RunStateWriter`), an evaluation
(`Evaluator`) and a checkpoint (`Saves`) when due, its record out once its commit is durable (`MetricsSink`);
around it (`train_and_close`), what a failure or a stop leaves and says."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from rich.markup import escape

from io_engine import IOEngineError
from lohan.app.export import Checkpoints, export_final, tidy
from lohan.app.failures import fail, interrupt_code, interrupt_name, os_error_text, root_cause
from lohan.app.layout import OutputError
from lohan.app.metrics import MetricsWriter, StepMetrics, load_metrics
from lohan.app.preflight import RunContext
from lohan.app.report import default_log_every, progress_bar, report_step, should_log
from lohan.app.run_state import RunStateWriter
from lohan.app.tracking import Trackers, flat_params
from lohan.crashpoints import crashpoint
from lohan.data import IGNORE_INDEX, Batch, BatchIterator, TokenDataset, eval_batches
from lohan.runtime.engine import Engine
from lohan.runtime.step import NonFiniteError
from lohan.store.integrity import StoreCorruptError

log = logging.getLogger(__name__)


def train_and_close(ctx: RunContext, engine: Engine, batches: Iterator[Batch], data_state: dict | None,
                    export: str | None, export_dtype: str | None) -> tuple[int, list[StepMetrics]]:
    """Train to the last step, export, and close; a failure or a stop says what stands and how to go on. The exit
    code, and the records of the steps that went out (for the summary)."""
    history: list[StepMetrics] = []
    code = 0
    try:
        if export and ctx.main_rank:
            tidy(ctx.layout, ctx.console)  # what a killed save or export left (lohan's: checked)
        Loop(ctx, engine, history).run(batches, data_state)
        if export:
            if ctx.main_rank:
                export_final(ctx.console, ctx.run, ctx.model, engine, ctx.layout, export_dtype, ctx.merged)
            else:
                _gather_whole(engine)
    except KeyboardInterrupt as err:
        with contextlib.suppress(Exception):  # the last step's staged commit, the steps held in RAM: durable
            engine.persist()
        ctx.console.print(f"\n{interrupt_name(err)}; the state committed at step {engine.committed_step} is on NVMe "
                          "with its data position (continue with --resume)")
        code = interrupt_code(err)
    except NonFiniteError as err:
        code = fail(ctx.console, ctx.dp, str(err))
    except (StoreCorruptError, IOEngineError, RuntimeError) as err:
        cause = root_cause(err)
        if isinstance(cause, StoreCorruptError):  # the committed state itself is damaged: no "intact" claim
            code = fail(ctx.console, ctx.dp, f"{cause}. Training stopped before using the damaged bytes")
        else:
            code = fail(ctx.console, ctx.dp, f"{cause}. The step in flight was abandoned; the state committed at "
                        f"step {engine.committed_step} is intact. Fix the cause, then continue with --resume")
    except OSError as err:
        code = fail(ctx.console, ctx.dp, os_error_text(err, "training") + f"; the state committed at step "
                    f"{engine.committed_step} is intact. Fix the cause, then continue with --resume")
    except ValueError as err:
        code = fail(ctx.console, ctx.dp, str(err))
    finally:
        try:
            engine.close()
        except (OSError, RuntimeError) as err:  # a failing disk may fail the close too; the commit stands
            log.warning("closing the engine failed: %s", err)
    return code, history


class Loop:
    """The loop: a step, its run state (the data position a resume needs) once it is committed, an evaluation
    and a checkpoint when due, its metrics (the JSONL, the trackers: each step exactly once, when its commit is
    durable, `MetricsSink`; a log line when due). One batch is drawn ahead: a step whose optimizer pass runs after
    backward runs the next step's forward beside it."""

    def __init__(self, ctx: RunContext, engine: Engine, history: list[StepMetrics]) -> None:
        self.ctx, self.engine, self.history = ctx, engine, history
        self.evaluator = Evaluator(ctx.eval_set, ctx.run.batch_size, ctx.run.eval_every, ctx.steps)
        self.saves = Saves(ctx, engine)

    def run(self, batches: Iterator[Batch], data_state: dict | None) -> None:
        ctx, engine = self.ctx, self.engine
        run, start = ctx.run, engine.step_count
        run_id = ctx.layout.owner.current
        writer_cm = MetricsWriter(ctx.layout.metrics, run_id, through=start) if ctx.main_rank \
            else contextlib.nullcontext(None)
        report_to = run.report_to if ctx.main_rank else ()
        trackers_cm = Trackers(report_to, ctx.layout.logging_dir or ".", run.engine.store.name, flat_params(run),
                               run_id=run_id)
        with writer_cm as writer, trackers_cm as trackers, progress_bar(ctx.steps, ctx.console, completed=start) as bar:
            if writer is not None and writer.last_step is not None and report_to:
                # the committed steps so far (the file is cut back to them): each tracker takes those a kill kept
                trackers.replay(StepMetrics.from_record(r) for r in load_metrics(writer.path))
            sink = MetricsSink(engine, writer, trackers, self.history)
            try:
                self.catch_up(sink)
                self.steps(batches, data_state, sink, bar)
                engine.persist()  # the last step's commit (staged with write-behind, or in RAM), then its record
            except BaseException as err:  # what is durable goes out, whatever stopped the loop; the rest is run
                with contextlib.suppress(Exception):  # again by a resume (the error that stopped it is reported)
                    if isinstance(err, KeyboardInterrupt):  # a clean stop loses nothing: the steps held in RAM too
                        engine.persist()
                    sink.flush()
                raise
            sink.flush()

    def steps(self, batches: Iterator[Batch], data_state: dict | None, sink: MetricsSink, bar: Any) -> None:
        ctx, engine = self.ctx, self.engine
        steps, start = ctx.steps, engine.step_count
        every = ctx.run.log_every or default_log_every(steps, ctx.console.is_terminal)
        position = (lambda: batches.state_dict()) if isinstance(batches, BatchIterator) else (lambda: None)
        batch = next(batches) if start < steps else None
        if start < steps and not ctx.console.is_terminal:  # a log file: say why the first line takes long to come
            ctx.console.print("note: the first step of a process also profiles the model and the SSDs (unless a saved "
                              "profile is loaded) and plans the activations, so its line takes longer to come")
        state = RunStateWriter(ctx.run, ctx.seq_len, ctx.main_rank,
                               data_state if data_state is not None and data_state.get("step") == start else None)
        for s in range(start, steps):
            after = position()  # the data position once this step's batch is consumed
            nxt = next(batches) if s + 1 < steps else None
            engine.step(batch, next_batch=nxt)
            state.save(engine, after)
            batch = nxt
            # the steps before it are durable now (write-behind: this step made its predecessor's commit durable);
            # out before this step's evaluation and checkpoint, which make this one durable too
            sink.flush()
            if s == min(start + 1, steps - 1):  # the process's first step profiles: its second measures the lanes
                self.ssd_note()
            sm, saved = self.after_step(engine.last_stats)
            sink.record(sm)
            report_step(bar, sm, steps, print_line=should_log(sm.step, steps, every, start + 1,
                                                              sm.eval_loss is not None or bool(saved)))
            if saved:
                ctx.console.print(saved)

    def ssd_note(self) -> None:
        """Where the step just run (a process's first after the one that profiles) found the SSD lane its slowest,
        what a smaller state format or more tokens per step would do (`FitReport.measured_ssd`); nothing otherwise."""
        ctx, stats = self.ctx, self.engine.last_stats
        cost = (ctx.fit.measured_ssd(stats.lanes, stats.step_s, self.engine.cfg.execution.mode)
                if ctx.fit is not None else None)
        if cost is not None:
            ctx.console.print(f"note: {escape(cost.format(f'measured by step {stats.step}'))}")

    def after_step(self, stats: Any, catching_up: bool = False) -> tuple[StepMetrics, str]:
        """A committed step's evaluation and checkpoint where due (both read the committed weights and nothing
        else), and its record; the line that says what was saved ('' if nothing). `catching_up` (`catch_up`): a
        checkpoint the step already has stands."""
        eval_loss, eval_s = self.evaluator.maybe(self.engine, stats.step)
        save_s, saved = self.saves.maybe(stats.step, catching_up)
        return StepMetrics.from_stats(stats, eval_loss, eval_s, save_s), saved

    def catch_up(self, sink: MetricsSink) -> None:
        """A resumed run's first task: the committed step's record, if a kill lost it (between the commit and the
        record's write, or in its evaluation or checkpoint), taken from the commit (`Engine.committed_stats`), its
        evaluation and checkpoint done now where due; or a checkpoint of the committed step that a kill cut short."""
        ctx, engine = self.ctx, self.engine
        start, ckpt = engine.step_count, ctx.checkpoints
        last = sink.writer.last_step if sink.writer is not None else None
        if not agreed(ctx, start > 0 and (last or 0) < start):
            if ckpt is not None and ckpt.due(start) and agreed(ctx, not ckpt.has(start)):
                ctx.console.print(self.saves.save()[1])
            return
        stats = engine.committed_stats
        if stats is None or stats.step != start:  # a store written by an older lohan keeps no record in its commits
            if ctx.main_rank:
                ctx.console.print(f"note: the metrics of step {start} were not recorded before the run stopped, and "
                                  f"its commit keeps none (written by an older lohan): the file goes on from step "
                                  f"{start + 1}")
            return
        sm, saved = self.after_step(stats, catching_up=True)
        sink.record(sm)
        if saved:
            ctx.console.print(saved)


class MetricsSink:
    """The records of the run's steps on their way out. A record goes to the metrics file and the trackers once its
    step's commit is durable, and not before: a step that a kill or a failed commit takes back is run again by the
    resumed run, and must not be recorded twice; a committed step's record that a kill kept from going out is in
    its commit (`Loop.catch_up`)."""

    def __init__(self, engine: Engine, writer: MetricsWriter | None, trackers: Trackers,
                 history: list[StepMetrics]) -> None:
        self.engine, self.writer, self.trackers, self.history = engine, writer, trackers, history
        self.pending: list[StepMetrics] = []

    def record(self, sm: StepMetrics) -> None:
        """A step's record, sent out with those before it as far as the engine's commits are durable."""
        self.pending.append(sm)
        self.flush()

    def flush(self) -> None:
        """Send out the records of the steps up to the engine's durable commit, in order. One that cannot be written
        stops the run, and the step after it, if its commit is still staged, is taken back (`Engine.drop_staged`): a
        resumed run finds at most its last committed step's record missing, which its commit keeps."""
        committed = self.engine.committed_step
        while self.pending and self.pending[0].step <= committed:
            sm = self.pending.pop(0)
            self.history.append(sm)
            try:
                if self.writer is not None:
                    try:
                        self.writer.write(sm)
                    except OSError as err:
                        raise OutputError(err, "writing the metrics", self.writer.path) from err
                self.trackers.log(sm)
            except BaseException:
                self.engine.drop_staged()
                raise


class Evaluator:
    """The eval set's loss after a step where due: every `every` steps (if set) and after the last one."""

    def __init__(self, eval_set: TokenDataset | None, batch_size: int, every: int | None, last: int) -> None:
        self.eval_set, self.batch_size, self.every, self.last = eval_set, batch_size, every, last

    def maybe(self, engine: Engine, step: int) -> tuple[float | None, float | None]:
        """(eval loss, seconds) after `step` where due, else (None, None)."""
        due = self.eval_set is not None and (step == self.last or bool(self.every and step % self.every == 0))
        return evaluate(engine, self.eval_set, self.batch_size) if due else (None, None)


class Saves:
    """The checkpoints of committed steps (`export.Checkpoints`, every `save_every` steps; rank 0 writes them, every
    rank takes part in gathering the blocks)."""

    def __init__(self, ctx: RunContext, engine: Engine) -> None:
        self.ctx, self.engine = ctx, engine
        self.checkpoints: Checkpoints | None = ctx.checkpoints

    def maybe(self, step: int, catching_up: bool = False) -> tuple[float | None, str]:
        """The checkpoint of `step` where due (`catching_up`: not where it has one already): (seconds, line), or
        (None, '')."""
        ckpt = self.checkpoints
        if ckpt is not None and ckpt.due(step) and (not catching_up or agreed(self.ctx, not ckpt.has(step))):
            return self.save()
        return None, ""

    def save(self) -> tuple[float, str]:
        """The checkpoint of the committed step: the seconds training waited for it, and the line that says so
        ('' on the other ranks)."""
        t0 = time.perf_counter()
        if self.ctx.main_rank:
            saved = self.checkpoints.save(self.engine)
            return saved.seconds, saved.describe(self.checkpoints.limit)
        _gather_whole(self.engine)
        return time.perf_counter() - t0, ""


def _gather_whole(engine: Engine) -> None:
    """A data-parallel rank's part of rank 0's export: the same reads, in the same order (each gathers a block
    from every rank)."""
    for b in engine.layout.blocks:
        engine.read_params(b.index)


def agreed(ctx: RunContext, decision: bool) -> bool:
    """Rank 0's `decision`, on every rank (they must all take part in what follows, or none)."""
    return ctx.dp.broadcast(decision)


def evaluate(engine: Engine, eval_set: TokenDataset, batch_size: int) -> tuple[float, float]:
    """(eval loss, seconds): each batch's loss from `Engine.evaluate`, weighted by its target tokens; with one
    micro-batch per step that is the mean loss over every target of the eval set."""
    t0 = time.perf_counter()
    total, weight = 0.0, 0
    for batch in eval_batches(eval_set, batch_size, engine.cfg.execution.micro_batches):
        crashpoint("eval.batch")
        n = int((batch[1] != IGNORE_INDEX).sum())
        if n:
            total += engine.evaluate(batch) * n
            weight += n
    return total / weight, time.perf_counter() - t0
