"""Opening a run's store: the refusals of what would discard or misread one, then open, continue or create it (with
its progress), and the paths the run owns (`layout.RunLayout`) with whose outputs it may replace."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from io_engine import IOEngineError, VolumeConfigError
from lohan.app.failures import Interrupted, Refusal, interrupt_code, interrupt_name, os_error_text
from lohan.app.inputs import Model
from lohan.app.layout import RunLayout, default_metrics
from lohan.app.ownership import Owner
from lohan.app.run_state import check_resumable
from lohan.config import EngineConfig, RunConfig
from lohan.plan.pools import MemoryPlanError
from lohan.plan.records import P16_ITEMSIZE
from lohan.plan.run_plan import RunPlan
from lohan.runtime.engine import Engine, init
from lohan.runtime.parallel import Group, current_group
from lohan.runtime.profiler import saved_profile_usable
from lohan.store.dirlock import DirectoryInUseError
from lohan.store.integrity import StoreCorruptError
from lohan.store.opening import CLI, StoreExistsError, check_request
from lohan.store.states import StateStore, StoreStatus

if TYPE_CHECKING:
    from lohan.app.preflight import RunContext


def open_store(ctx: RunContext, resume: bool, overwrite: bool) -> Engine:
    """Refuse what would discard or misread a store, then open it, continue its creation, or create it."""
    run, e = ctx.run, ctx.run.engine
    store_dirs = ctx.dp.rank_dirs(e.store.nvme)  # where this process's store lives
    _check_store(ctx, resume, overwrite)
    engine_cfg = e.with_overrides(total_steps=e.schedule.total_steps or ctx.steps)
    saved_profile = Path(store_dirs[0]) / f"{e.store.name}.profile.json"
    if resume and not e.activations.profile_from and saved_profile.exists() and saved_profile_usable(
            saved_profile, lambda text: ctx.console.print(escape(text))):
        # a resumed run keeps the activation plan it was trained with (a re-measured one may choose otherwise)
        engine_cfg = engine_cfg.with_overrides(profile_from=str(saved_profile))
    try:
        engine = _open_engine(ctx.console, run, ctx.model, engine_cfg, resume, ctx.run_plan)
        ctx.layout.adopt(engine.store.volume.volume_id)  # the run's outputs carry its store's identity
        return engine
    except KeyboardInterrupt as err:
        ctx.console.print(f"\n{interrupt_name(err)} while initializing the states; every block written so far is "
                          "durable: continue with --resume")
        raise Interrupted(interrupt_code(err)) from None
    except IOEngineError as err:
        raise Refusal(f"{err}. The blocks initialized before the failure are durable; fix the cause (free space, "
                      "check the drive), then continue with --resume") from None
    except (MemoryPlanError, VolumeConfigError, FileExistsError, FileNotFoundError, ValueError,
            StoreCorruptError, DirectoryInUseError, RuntimeError) as err:
        raise Refusal(str(err)) from None
    except OSError as err:  # the directories themselves: a full disk, a failing drive, permissions
        raise Refusal(os_error_text(err, "opening the store") + "; the store is as it was. Fix the cause, then run "
                      "the same command again") from None


def _check_store(ctx: RunContext, resume: bool, overwrite: bool) -> StoreStatus:
    """What the NVMe directories hold, against what was asked (resume, overwrite, a new run; ranks): the store
    layer's refusals (`check_request`, worded for the command line), then what only a run knows (its model and
    settings, its step count)."""
    e, dp = ctx.run.engine, ctx.dp
    try:
        status = check_request(e.store.nvme, e.store.name, resume=resume, overwrite=overwrite, world=ctx.world,
                               rank=dp.store_rank, must_exist=True, asked=CLI)
    except (StoreCorruptError, StoreExistsError, ValueError) as err:
        raise Refusal(str(err)) from None
    if resume:
        try:
            check_resumable(ctx.run, ctx.seq_len, ctx.model, status.model)
        except (StoreCorruptError, ValueError) as err:
            raise Refusal(str(err)) from None
        if status.state == "complete" and status.step > ctx.steps:
            raise Refusal(f"the store in {e.store.nvme[0]} is committed at step {status.step}, past the {ctx.steps} steps "
                          f"asked for (--steps is the total, the steps already run included): pass --steps above "
                          f"{status.step} to train on, or --steps {status.step} with --export DIR to export it as "
                          "it is")
    return status


def _open_engine(console: Console, run: RunConfig, model: Model, engine_cfg: EngineConfig, resume: bool,
                 plan: RunPlan | None = None) -> Engine:
    """Open the store (resume), continue its interrupted initialization (resume), or create it, with a
    progress bar over the blocks written (on a terminal), or a line every few seconds (a log file). `plan`: the
    run plan the pre-flight priced, which the engine executes."""
    with Progress(TextColumn("initializing states on NVMe"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("blocks"), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("init", total=model.config.n_layer + 2)
        states = _store_bytes(model.config.param_count(), engine_cfg)
        log_line = None if console.is_terminal else _InitLog(console, states)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            if log_line is not None:
                log_line(done, total)

        if model.hf_program is not None:
            from lohan.runtime.hf_engine import init_from_hf

            return init_from_hf(run.model, engine_cfg, resume=resume, overwrite=not resume, progress=progress,
                                n_layer=run.model_overrides.get("n_layer"), plan=plan)
        return init(model.config, engine_cfg, resume=resume, overwrite=not resume, progress=progress, plan=plan)


def _store_bytes(params: int, cfg: EngineConfig) -> int:
    """What store creation writes, about: one slot of the state format at rest (a LoRA run: its frozen base), for
    the progress line's total."""
    from lohan.plan.formats import state_format

    p16 = P16_ITEMSIZE[cfg.execution.compute_dtype]
    return round(params * state_format("frozen" if cfg.lora.lora_r > 0 else cfg.store.state_format).at_rest(p16))


class _InitLog:
    """Store creation's progress as plain lines, for output that is not a terminal (nohup, a scheduler's log):
    the first block, then one line every `every` seconds, then the last (at 175b it takes hours)."""

    def __init__(self, console: Console, state_bytes: int, every: float = 5.0) -> None:
        self.console, self.state_bytes, self.every = console, state_bytes, every
        self.t0 = time.monotonic()
        self.last = -every

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic() - self.t0
        if now - self.last < self.every and 1 < done < total:
            return
        self.last = now
        frac = done / max(total, 1)
        eta = f", about {now / frac - now:.0f} s left" if 0 < frac < 1 else ""
        self.console.print(f"initializing states on NVMe: {done} of {total} blocks (about "
                           f"{frac * self.state_bytes / 2**30:.2f} of {self.state_bytes / 2**30:.2f} GiB) in "
                           f"{now:.0f} s{eta}")


def run_layout(run: RunConfig, model: Model, export: str | None, config: str | os.PathLike | None,
               dp: Group | None = None) -> RunLayout:
    """The run's paths (layout.RunLayout): its outputs, and the inputs none of them may touch."""
    e = run.engine
    inputs = {"--model": run.model if model.hf_program is not None else None,
              "--data": None if run.data == "synthetic" else run.data, "--eval-data": run.eval_data,
              "--config": config}
    metrics = run.metrics or default_metrics(e.store.nvme[0], e.store.name)
    logging_dir = (run.logging_dir or Path(metrics).parent / f"{e.store.name}.logs") if run.report_to else None
    return RunLayout(e.store.nvme, e.store.name, metrics, export, inputs, logging_dir, owner=_owner(run, current_group(dp)))


def _owner(run: RunConfig, dp: Group) -> Owner:
    """Whose outputs this run may replace (`ownership.Owner`): those of the store it resumes or replaces (rank 0's,
    which writes the outputs), and of the stores that one replaced. A store whose description is damaged owns
    nothing (the run is refused when the store is checked)."""
    e = run.engine
    dirs = dp.main_dirs(e.store.nvme)
    where = os.path.join(e.store.nvme[0], e.store.name)
    try:
        current, replaced = StateStore.identity(dirs, e.store.name)
    except (StoreCorruptError, ValueError, OSError) as err:
        return Owner(where, unknown=str(err).split(". ")[0])
    return Owner(where, current, frozenset(replaced))
