"""The training loop behind the CLI: plan, data, engine, progress, metrics, run state, export.

Order matters for "nothing written on refusal": the settings, the model skeleton, the data and the
capacity plan are all checked before the engine creates anything on the NVMe directories.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import io
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from io_engine import IOEngineError, VolumeConfigError
from lohan.app.export import Checkpoints, export_final, tidy
from lohan.app.fit import (
    data_parallel_machine,
    described_hardware,
    detect_hardware,
    local_problems,
    plan_report,
)
from lohan.app.layout import OutputError, RunLayout, default_metrics, plot_owner
from lohan.app.metrics import MetricsWriter, StepMetrics, load_metrics
from lohan.app.ownership import Owner, metrics_owner
from lohan.app.plot import plot_metrics
from lohan.app.report import default_log_every, format_summary, progress_bar, report_step, should_log
from lohan.app.tracking import Trackers, flat_params, missing_packages
from lohan.config import MAX_STEPS, SCHEDULE_FIELDS, EngineConfig, ModelConfig, RunConfig
from lohan.crashpoints import crashpoint
from lohan.data import (
    IGNORE_INDEX,
    Batch,
    BatchIterator,
    ByteTokenizer,
    TokenDataset,
    eval_batches,
    synthetic_batches,
)
from lohan.plan.compute_dtype import DtypeChoice, choose
from lohan.plan.durability import loss_text
from lohan.plan.formats import state_format
from lohan.plan.pools import MemoryPlanError
from lohan.plan.run_plan import RunPlan
from lohan.runtime.device import compute_dtype_choice, resolve_device
from lohan.runtime.engine import Engine, available_memory, init, plan_engine, preset_program
from lohan.runtime.optim import wsd_decay_steps
from lohan.runtime.parallel import (
    DataParallel,
    init_from_env,
    leave_group,
    network_bytes_per_step,
    read_decision,
)
from lohan.runtime.profiler import saved_profile_usable
from lohan.runtime.step import NonFiniteError
from lohan.store.dirlock import DirectoryInUseError, DirLock
from lohan.store.group import rank_dir
from lohan.store.integrity import StoreCorruptError, check_record, read_json_checked, write_json_atomic
from lohan.store.opening import CLI, StoreExistsError, check_request, stored_compute_dtype
from lohan.store.states import StateStore, StoreStatus

log = logging.getLogger(__name__)

RUN_STATE_VERSION = 2


# ------------------------------------------------------------------------------------------ model
@dataclasses.dataclass
class Model:
    """What the loop needs to know of the model, preset or Hugging Face."""

    config: ModelConfig          # for presets the real one; for HF models a GPT-shaped stand-in for planning
    tokenizer: Any
    hf_program: Any = None       # lohan.models.hf.HFBlocks for Hugging Face models

    @property
    def max_seq_len(self) -> int:
        return self.hf_program.max_seq_len if self.hf_program is not None else self.config.seq_len

    def program(self) -> Any:
        """The block program the engine trains, with its parameters on the meta device: what the run is planned
        from (`_run_plan`)."""
        return self.hf_program if self.hf_program is not None else preset_program(self.config)


def load_model(run: RunConfig, dry_run: bool = False) -> Model:
    """The run's model. A Hugging Face directory's weights are checked for a real run only: a dry run plans
    from config.json alone (a real model's shape, no download), and without a tokenizer reads no data."""
    if not run.is_hf:
        return Model(run.model_config(), ByteTokenizer())
    from lohan.data import HFTokenizer
    from lohan.models.hf import check_weights, has_tokenizer, load_hf_skeleton, load_tokenizer

    program = load_hf_skeleton(run.model, run.model_overrides.get("n_layer"))  # --layers N: the first N layers
    if not dry_run:
        check_weights(program, run.model)  # a damaged checkpoint is refused here, not halfway into the store
    tokenizer = (HFTokenizer(load_tokenizer(run.model)) if not dry_run or has_tokenizer(run.model) else None)
    return Model(program.planning_config(os.path.basename(os.path.normpath(run.model))), tokenizer, program)


# ------------------------------------------------------------------------------------------- data
def load_dataset(run: RunConfig, model: Model, seq_len: int, dry_run: bool = False) -> TokenDataset | None:
    """The training data (None for synthetic tokens). Records go through the token cache; a dry run writes none
    (it uses a cached stream if there is one)."""
    if run.data == "synthetic":
        return None
    if model.config.vocab_size < getattr(model.tokenizer, "vocab_size", 0):
        raise ValueError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size} (for presets set model_overrides.vocab_size >= 256)")
    return TokenDataset.from_source(run.data, seq_len, model.tokenizer, data_format=run.data_format,
                                    text_field=run.text_field, split=run.split, write_cache=not dry_run,
                                    vocab_size=model.config.vocab_size)


def load_eval_set(run: RunConfig, model: Model, dataset: TokenDataset | None, seq_len: int,
                  dry_run: bool = False) -> tuple[TokenDataset | None, TokenDataset | None]:
    """(training data, eval set): `eval_fraction` holds whole packed sequences out of the training data
    (seeded by engine.seed), `eval_data` is read like the training data; without either, no eval set."""
    if run.eval_fraction is not None and dataset is not None:
        dataset, held = dataset.split(run.eval_fraction, run.engine.execution.seed)
        what = f"{run.eval_fraction:g} of {run.data}"
    elif run.eval_data is not None:
        held = TokenDataset.from_source(run.eval_data, seq_len, model.tokenizer, data_format=run.data_format,
                                        text_field=run.text_field, split=run.eval_split, write_cache=not dry_run,
                                        vocab_size=model.config.vocab_size)
        what = run.eval_data
    else:
        return dataset, None
    m = run.engine.execution.micro_batches
    used = len(held) // m * m  # eval_batches evaluates whole micro-batches
    more = "use a larger --eval-fraction, a longer --eval-data file or a shorter --seq-len"
    if used == 0:
        raise ValueError(f"the eval set ({what}) packs into {len(held)} sequence(s) of {seq_len} tokens, fewer than "
                         f"the {m} micro-batches an evaluation runs; {more}")
    if held.loss_mask is not None and not held.loss_mask[:used, 1:].any():
        raise ValueError(f"no token of the eval set ({what}: {len(held)} sequence(s) of {seq_len} tokens) is a "
                         f"prediction target, so there is no loss to evaluate; {more}")
    return dataset, held


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


def make_batches(run: RunConfig, model: Model, dataset: TokenDataset | None, seq_len: int, start_step: int,
                 data_state: dict | None) -> Iterator[Batch]:
    """The run's batch stream positioned at optimizer step `start_step` (from the saved data state when
    there is one; batches are deterministic, so counting from the start gives the same position)."""
    seed = run.engine.execution.seed
    if dataset is None:
        return synthetic_batches(model.config.vocab_size, run.batch_size, seq_len, seed=seed, start=start_step)
    it = BatchIterator(dataset, run.batch_size, seed=seed)
    state = it.state_dict()
    if data_state is not None:
        it.load_state_dict(data_state["iterator"])
        for _ in range(start_step - data_state["step"]):  # the step committed after the state was saved
            next(it)
    elif start_step and dataset.loss_mask is not None:  # batches without a trained token are skipped: count
        for _ in range(start_step):
            next(it)
    elif start_step:
        state["epoch"], state["position"] = divmod(start_step, it.batches_per_epoch)
        it.load_state_dict(state)
    return it


# -------------------------------------------------------------------------------------- run state
def run_state_path(run: RunConfig) -> Path:
    return Path(run.engine.store.nvme[0]) / f"{run.engine.store.name}.run.json"


def _fingerprint(run: RunConfig, seq_len: int) -> dict[str, Any]:
    fp = {"model": run.model, "data": run.data, "batch_size": run.batch_size, "seq_len": seq_len,
          "seed": run.engine.execution.seed}
    if run.eval_fraction is not None:  # it takes sequences out of the training data (eval_data does not)
        fp["eval_fraction"] = run.eval_fraction
    # how the records are read; only when set, so that a run saved before these settings existed still resumes
    for key, default in (("data_format", "auto"), ("text_field", None), ("split", None)):
        if getattr(run, key) != default:
            fp[key] = getattr(run, key)
    return fp


def save_run_state(run: RunConfig, seq_len: int, engine: Engine, iterator: dict | None,
                   prev: dict | None = None) -> dict:
    """Atomically record what a resume needs beyond the store, for its committed version: the data
    position (`iterator`: the batch iterator's state just after the committed step's batch; None for a
    stream that is positioned by the step count) and the RNG states. `prev`, the state this call returned
    for the step before, is kept beside it: with write-behind the store's durable commit can trail the
    step count by one (`Engine.committed_step`), and with a durability interval (`engine.persist_every`) by up to
    the interval: `prev` is then the state of that durable step, which a resume takes."""
    buf = io.BytesIO()
    torch.save(torch.get_rng_state(), buf)
    step = engine.step_count
    state = {"version": RUN_STATE_VERSION, "step": step, "run": _fingerprint(run, seq_len),
             "schedule": _schedule(engine.cfg), "activations": {"act_compress": engine.cfg.activations.act_compress},
             "store": {"step": step, "slot": engine.store.slot, "volume_id": engine.store.volume.volume_id},
             "iterator": iterator,
             "torch_rng": base64.b64encode(buf.getvalue()).decode()}
    keep = _durable_state(prev, engine.committed_step) if engine.committed_step < step else None
    write_json_atomic(run_state_path(run), {**state, "prev": keep})
    return state


def _durable_state(prev: dict | None, durable: int) -> dict | None:
    """The run state of step `durable` (the last durable one) among `prev` and the state kept beside it."""
    for state in (prev, (prev or {}).get("prev")):
        if state is not None and state["step"] == durable:
            return {k: v for k, v in state.items() if k != "prev"}
    return None


LR_WARN = 0.1  # an AdamW peak lr above this is a typo, not a choice (the header says so)
RESUMABLE_SETTINGS = (*SCHEDULE_FIELDS, "max_grad_norm")
"""The settings a resume may change, saved with the run state by their flat names (as before the config had
sections, so every saved state compares): the schedule section and the clipping norm."""


def _schedule(e: EngineConfig) -> dict[str, Any]:
    """The optimizer settings a resume may change (saved with the run state; a change is said, not refused)."""
    settings = e.settings()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, settings[k]) for k in RESUMABLE_SETTINGS)}


def _schedule_changes(saved: dict | None, e: EngineConfig) -> str:
    """``lr 0.001 -> 0.0002, ...``: what differs from the saved settings ('' when nothing, or nothing saved)."""
    if not saved:
        return ""
    now = _schedule(e)
    return ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in RESUMABLE_SETTINGS if k in saved and saved[k] != now[k])


def check_resumable(run: RunConfig, seq_len: int, model: Model, stored_model: dict | None) -> None:
    """Before the store is opened (and so before anything in it is touched): a resume must be of the same
    model and the same data settings. ValueError lists what differs (stored, now)."""
    if model.hf_program is not None:
        from lohan.models.hf import model_meta

        now = model_meta(model.hf_program)
    else:
        now = {"kind": "gpt", "config": dataclasses.asdict(model.config), "seed": run.engine.execution.seed}
    if stored_model is not None and stored_model != now:
        old, new = stored_model.get("config", {}), now.get("config", {})
        diff = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
        if stored_model.get("seed") != now.get("seed"):
            diff["seed"] = (stored_model.get("seed"), now.get("seed"))
        raise ValueError(f"--resume with another model than the stored one: {diff or stored_model.get('kind')} "
                         "(stored, now); resume with the settings it was created with, or start over with --overwrite")
    path = run_state_path(run)
    if path.exists():
        state = _read_run_state(path, f"Delete {path} to resume from the step count instead")
        if state.get("version") == RUN_STATE_VERSION and state["run"] != _fingerprint(run, seq_len):
            diff = {k: (state["run"].get(k), v) for k, v in _fingerprint(run, seq_len).items()
                    if state["run"].get(k) != v}
            raise ValueError(f"--resume with other settings than the run being resumed: {diff} (saved, now); "
                             "pass the same settings, or start over with --overwrite")


_RUN_STATE_FIELDS = {"version": int, "step": int, "run": dict, "store": dict, "iterator": (dict, type(None)),
                     "torch_rng": str}
_RUN_STATE_LATER = {"schedule": dict, "activations": dict}  # (states saved before these settings lack them)


def _read_run_state(path: Path, fix: str) -> dict:
    """The run state at `path`, checked (integrity.read_json_checked); a state of this version also has its
    fields checked, and the one before kept in it (`prev`) too, so damage is refused with the file named."""
    what = "run state (data position, RNG)"
    state = read_json_checked(path, what, fix)
    if state.get("version") == RUN_STATE_VERSION:
        prev = {**_RUN_STATE_LATER, "prev": (dict, type(None))}  # the state of the step before, without its own
        for record, later in ((state, prev), (state.get("prev"), _RUN_STATE_LATER)):
            if record is not None:
                check_record(path, record, what, fix, _RUN_STATE_FIELDS, later)
                check_record(path, record["store"], what, fix, {"step": int, "slot": int, "volume_id": str})
    return state


def load_run_state(run: RunConfig, seq_len: int, engine: Engine) -> dict | None:
    """The saved run state if it belongs to this run, to this store and to its committed step (or the
    one before: a Ctrl-C between a commit and the state's write; or the state kept for the step before
    when the last step's commit never became durable)."""
    path = run_state_path(run)
    if not path.exists():
        return None
    state = _read_run_state(path, f"Delete {path} to resume from the step count instead (the data position is "
                                  "then recomputed, the RNG state is not restored)")
    if state.get("version") != RUN_STATE_VERSION:
        return None
    if state["store"]["volume_id"] != engine.store.volume.volume_id:
        return None  # written for a store that has since been replaced
    store_step = engine.step_count
    if state["run"] != _fingerprint(run, seq_len):
        diff = {k: (state["run"].get(k), v) for k, v in _fingerprint(run, seq_len).items() if state["run"].get(k) != v}
        raise ValueError(f"--resume with other settings than the run being resumed: {diff} (saved, now)")
    if state["step"] > store_step and (state.get("prev") or {}).get("step") == store_step:
        state = state["prev"]  # the steps after the durable one were not (write-behind, the durability interval)
    if not 0 <= store_step - state["step"] <= 1:
        return None  # a state from another point in time: position from the step count instead
    torch.set_rng_state(torch.load(io.BytesIO(base64.b64decode(state["torch_rng"]))))
    return state if state["iterator"] is not None else None


# ------------------------------------------------------------------------------------------- loop
def _schedule_line(e: EngineConfig) -> str:
    """What the optimizer does, as the run will do it (the header: a schedule is easy to inherit by mistake)."""
    sch, stab = e.schedule, e.stability
    clip = (f"clipped at global norm {stab.max_grad_norm:g} ({stab.clip_mode})" if stab.max_grad_norm > 0
            else "not clipped")
    share = f" ({sch.warmup_ratio:g} of {sch.total_steps})" if sch.warmup_ratio is not None else ""
    warm = f"warm-up {sch.warmup} step(s){share}, " if sch.warmup else "no warm-up, "
    return (f"AdamW lr {sch.lr:g}, {warm}{_decay_text(e)}, weight decay {sch.weight_decay:g}, betas ({sch.betas[0]:g}, "
            f"{sch.betas[1]:g}), eps {sch.eps:g}; gradients {clip}")


def _decay_text(e: EngineConfig) -> str:
    """What the lr does after the warm-up, in the run's steps (`lohan.runtime.optim.lr_factor`)."""
    sch = e.schedule
    floor = f"{sch.lr * sch.floor_ratio:g}" + (" (--min-lr)" if sch.min_lr is not None else "")
    if sch.lr_scheduler == "constant" or sch.total_steps is None or sch.total_steps <= sch.warmup:
        return "then constant"
    if sch.lr_scheduler == "wsd":
        decay = wsd_decay_steps(sch.warmup, sch.total_steps, sch.decay_ratio)
        return (f"then constant to step {sch.total_steps - decay} and 1-sqrt decay over the last {decay} "
                f"(decay ratio {sch.decay_ratio:g}) to {floor} at step {sch.total_steps} (wsd)")
    return f"{sch.lr_scheduler} to {floor} at step {sch.total_steps}"


def _resident_line(engine: Engine) -> str:
    """How many blocks' optimizer records stay in memory (plan.pools.plan_resident), and what keeps them all."""
    blocks = engine.store.layout.blocks
    resident = engine.offloader.resident
    if not engine.cfg.memory.resident_records:
        return "none (engine.resident_records=false)"
    line = f"{len(resident)} of {len(blocks)} blocks"
    if len(resident) < len(blocks):
        plan = engine.host_memory
        need = plan.resident_all  # what resident_mem takes to keep every record that can stay (pools.resident_every)
        if need > plan.resident and engine.cfg.memory.resident_mem != "all":
            if engine.cfg.memory.resident_mem == "auto":  # auto takes half of what cpu_mem leaves after the other pools
                others = plan.total - plan.resident
                cpu = math.ceil((others + 2 * need) / 2**28) / 4
                line += f"; --cpu-mem {cpu:g}GiB keeps all of them (resident_mem auto takes half of what it leaves)"
            else:
                line += f"; --set engine.resident_mem={math.ceil(need / 2**20)}MiB keeps all of them (within cpu_mem)"
    return line


def _persist_line(engine: Engine, fit: Any = None) -> str:
    """The durability interval in force (engine.persist_every) and what a kill can lose, in steps and in time at
    the pre-flight's predicted step (`fit`: its FitReport, whose plan also priced `auto`'s interval)."""
    asked, n = engine.cfg.execution.persist_every, engine.persist_every
    step_s = fit.step_s if fit is not None else None
    if engine.persist_refusal is not None:
        why = f" ({engine.persist_refusal})" if asked != 1 else ""
        return f"records written and committed every step{why}; {loss_text(1, None)}"
    if asked == "auto":
        planned = fit.capacity.persist_every if fit is not None else 1
        priced = (f"; the plan prices every {planned} steps: {loss_text(planned, step_s)}" if planned > 1 else "")
        return ("persist_every auto: every step until the first step has measured the SSDs' write rate, then the least "
                "interval that keeps the persist writes under 10% of the run's time (every record is in RAM; a kill "
                f"replays the steps after the last durable one){priced}")
    return f"records written and committed every {n} step(s), held in RAM between; {loss_text(n, step_s)}"


def _header(console: Console, run: RunConfig, mcfg: ModelConfig, engine: Engine, seq_len: int, label: str,
            dtype: DtypeChoice, fit: Any = None) -> None:
    store, mem, ex, act = run.engine.store, run.engine.memory, run.engine.execution, run.engine.activations
    layout = engine.store.layout
    n_params = engine.layout.param_count  # the whole model (a rank's store holds its shards)
    ranks = f" (rank {engine.dp.rank}'s shards; every rank holds as much)" if engine.dp else ""
    console.print(
        f"[bold]lohan[/bold] {label}: {n_params / 1e6:,.1f}M params, {mcfg.n_layer} layers, "
        f"d_model {mcfg.d_model}, vocab {mcfg.vocab_size} | batch {run.batch_size} x {seq_len} tokens, "
        f"{ex.micro_batches} micro-batch(es)")
    if getattr(engine, "lora", None) is not None:
        _lora_header(console, engine, dtype)
        return
    plan = engine.host_memory
    console.print(
        f"  states on NVMe: {layout.total_bytes / 2**30:.2f} GiB{ranks} in {len(layout.blocks)} blocks x "
        f"{layout.slots} slot(s) over {len(store.nvme)} dir(s) {list(engine.store.volume.dirs)}, backend "
        f"{engine.store.volume.backend.name}, format {layout.state_format} "
        f"({state_format(layout.state_format).at_rest(engine.store.p16_dtype.itemsize):.2f} B/param)")
    console.print(
        f"  main memory: {plan.total / 2**30:.2f} of {plan.budget / 2**30:.2f} GiB budgeted ({plan.describe()}) | "
        f"device {engine.device.describe()}, {ex.compute_dtype}, mode {ex.mode}, activations {act.act_policy}"
        + (f" ({act.act_compress} on the CPU and SSD tiers)" if act.act_compress != "none" else ""))
    console.print(f"  {dtype.describe()}")
    console.print(f"  optimizer: {_schedule_line(engine.cfg)}")
    if engine.cfg.schedule.lr > LR_WARN:  # AdamW moves every weight by up to lr a step, whatever the gradient's size
        console.print(f"  [yellow]warning:[/yellow] lr {engine.cfg.schedule.lr:g} is far above what AdamW training uses "
                      "(1e-5 to 1e-3): each step moves every weight by up to lr, so training will not converge; "
                      "check --lr")
    console.print(f"  optimizer records kept in memory across steps (not read back): {_resident_line(engine)}")
    console.print(f"  durability: {_persist_line(engine, fit)}")
    # The RSS bound (lohan/plan/memory.py): cpu_mem covers the pools and the activations kept in main memory;
    # the overhead is this process as measured now, before the first step, plus what no budget covers.
    import psutil

    from lohan.plan.memory import rss_overhead

    over = rss_overhead(psutil.Process().memory_info().rss, mcfg, run.batch_size, seq_len, ex.micro_batches,
                        ex.compute_dtype, mem.prefetch_depth, act.act_policy, device_is_cpu=not engine.device.is_cuda)
    console.print(
        f"  peak RSS at most {(mem.cpu_mem + sum(over.values())) / 2**30:.2f} GiB = cpu_mem {mem.cpu_mem / 2**30:.2f} "
        f"+ overhead {sum(over.values()) / 2**30:.2f} (process {over['process'] / 2**30:.2f} measured now, device "
        f"working set {over['device working set'] / 2**30:.2f}"
        + (" as the CPU computes" if not engine.device.is_cuda else "")
        + f", allocator slack {over['allocator slack'] / 2**30:.2f})")


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
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            code = _train(run, resume, dry_run, hardware, export, overwrite, export_dtype, config, merged)
            return code
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            code = _train(run, resume, dry_run, hardware, export, overwrite, export_dtype, config, merged)
            return code
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        if joined:
            leave_group(code == 0)


class Refusal(Exception):
    """A run refused before (or instead of) training: the message says what is wrong and how to fix it, and
    nothing was written. `_train` prints it as one `error:` line and exits 2."""


@dataclasses.dataclass
class _Run:
    """What the stages of a run share: the settings, the model and data, the steps, the paths it owns."""

    run: RunConfig
    model: Model
    seq_len: int
    dataset: TokenDataset | None
    eval_set: TokenDataset | None
    per_epoch: int | None
    steps: int
    layout: RunLayout
    dp: DataParallel | None
    console: Console
    checkpoints: Checkpoints | None = None
    fit: Any = None  # the plan's FitReport (`_plan`): the first step's measured lanes are priced with it
    run_plan: RunPlan | None = None  # the plan the engine executes (`_plan`, on this machine), the one priced
    dtype: DtypeChoice | None = None  # the compute dtype `run.engine` was resolved to, and why (`_compute_dtype`)
    merged: bool = False  # a LoRA run exports its merged weights (--export-merged), not its adapters

    @property
    def world(self) -> int:
        return self.dp.world if self.dp else 1

    @property
    def main_rank(self) -> bool:
        """Rank 0 (or the one process) writes the metrics, the run state and the export."""
        return self.dp is None or self.dp.is_main


def _train(run: RunConfig, resume: bool, dry_run: bool, hardware: str | None, export: str | None,
           overwrite: bool, export_dtype: str | None = None, config: str | os.PathLike | None = None,
           merged: bool = False) -> int:
    """The run driver: pre-flight -> plan -> open the store -> position the data -> the loop -> finish."""
    dp = DataParallel.detect()
    # never re-wrap the fixed-width lines, also when piped; data parallel: rank 0 speaks for the group
    console = Console(soft_wrap=True, quiet=bool(dp and not dp.is_main))
    try:
        run, dtype = _compute_dtype(run, resume, hardware, dp)
        ctx = _preflight(run, dry_run, export, export_dtype, config, console, dp)
        ctx.dtype, ctx.merged = dtype, merged
        if ctx.checkpoints is not None:
            ctx.checkpoints.merged = merged
        report = ctx.fit = _plan(ctx, hardware, dry_run, resume)
        if dry_run:
            console.print(dtype.describe())
            console.print(report.format())
            if ctx.dataset is not None and ctx.dataset.description:
                console.print(f"data: {escape(ctx.dataset.description)}")
            console.print(f"dry run: {ctx.steps} steps would take about {report.step_s * ctx.steps / 3600:.3g} h; "
                          "nothing was written")
            return 0
        engine = _open_store(ctx, resume, overwrite)
    except Refusal as err:
        return _fail(console, dp, str(err))
    except _Interrupted as stop:
        return stop.code
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM in the pre-flight (a token cache's build, say)
        console.print(f"\n{_interrupt_name(err)} before the store was opened: nothing of the run was written (a "
                      "token cache being built goes on where it stopped next time)")
        return _interrupt_code(err)
    try:
        batches, data_state = _position(ctx, engine, resume)
    except Refusal as err:
        engine.close()
        return _fail(console, dp, str(err))
    return _loop(ctx, engine, batches, data_state, export, export_dtype)


def _compute_dtype(run: RunConfig, resume: bool, hardware: str | None,
                   dp: DataParallel | None) -> tuple[RunConfig, DtypeChoice]:
    """`run` with its compute dtype resolved once, for this machine or the one `hardware` describes (whose GPU
    computes bf16), and why; a resume under ``auto`` keeps the dtype its store was created with."""
    e = run.engine
    if hardware:
        choice = choose(e.execution.compute_dtype, "cuda", (), state_format=e.store.state_format)
    else:
        dirs = dp.rank_dirs(e.store.nvme) if dp else e.store.nvme
        stored = stored_compute_dtype(dirs, e.store.name) if resume and e.execution.compute_dtype == "auto" else None
        try:
            choice = compute_dtype_choice(e.execution.compute_dtype, e.execution.device, e.store.state_format, stored)
        except ValueError as err:  # the device: LOHAN_DEVICE unknown, or cuda asked for where there is none
            raise Refusal(str(err)) from None
    return dataclasses.replace(run, engine=e.with_overrides(compute_dtype=choice.dtype)), choice


def _fail(console: Console, dp: DataParallel | None, msg: str) -> int:
    if dp and not dp.is_main:  # a rank's own trouble (its disk, its memory) must be seen too
        print(f"rank {dp.rank}: error: {msg}", file=sys.stderr)
    else:
        console.print(f"[red]error:[/red] {escape(msg)}")  # messages quote paths and lists: "[...]" is not markup
    return 2


def _preflight(run: RunConfig, dry_run: bool, export: str | None, export_dtype: str | None,
               config: str | os.PathLike | None, console: Console, dp: DataParallel | None) -> _Run:
    """Everything that can be checked before anything is written: the model, the shapes, the data and its
    steps, and the paths the run owns (layout.RunLayout)."""
    world = dp.world if dp else 1
    try:
        model = load_model(run, dry_run)
    except (ValueError, NotImplementedError, OSError) as e:
        raise Refusal(str(e)) from None
    if model.tokenizer is None and run.data != "synthetic":
        console.print(f"note: {run.model} has no tokenizer, so {run.data} is not read: the plan counts --steps "
                      "with random tokens")
        run = dataclasses.replace(run, data="synthetic", epochs=None, eval_data=None, eval_fraction=None,
                                  eval_every=None)
    if export_dtype not in (None, "fp32") and model.hf_program is None:
        raise Refusal(f"--export-dtype {export_dtype}: presets export fp32 GPT-2 checkpoints; drop the flag")
    seq_len = run.seq_len or model.config.seq_len
    _check_shapes(run, model, seq_len, world)
    try:
        dataset = load_dataset(run, model, seq_len, dry_run)
        dataset, eval_set = load_eval_set(run, model, dataset, seq_len, dry_run)
    except (OSError, ValueError) as e:
        raise Refusal(str(e)) from None
    per_epoch = len(dataset) // run.batch_size if dataset is not None else None
    if dataset is not None and per_epoch < 1:
        raise Refusal(f"{run.data} packs into {len(dataset)} sequences of {seq_len} tokens, fewer than one batch "
                      f"of {run.batch_size}; lower --batch-size or --seq-len")
    steps = run.epochs * per_epoch if run.epochs else run.steps
    if steps > MAX_STEPS:  # RunConfig bounds --steps; --epochs is only known in steps now
        raise Refusal(f"{run.epochs:,} epochs of {per_epoch:,} steps are {steps:,} steps, more than lohan counts "
                      f"({MAX_STEPS:,}); ask for fewer epochs")
    layout = run_layout(run, model, export, config, dp)
    problems = missing_packages(run.report_to) + ([] if dry_run else layout.problems())
    if problems:
        raise Refusal("; ".join(problems))
    if run.save_every and export is None and not dry_run:
        raise Refusal(f"save_every={run.save_every} writes checkpoints into the export directory: give one "
                      "(--export DIR; checkpoints go to DIR/step-N)")
    ckpt = (Checkpoints(layout, run, model, run.save_every, run.save_total_limit, export_dtype)
            if run.save_every and export is not None else None)
    return _Run(run, model, seq_len, dataset, eval_set, per_epoch, steps, layout, dp, console, ckpt)


def _check_shapes(run: RunConfig, model: Model, seq_len: int, world: int) -> None:
    """The sequence and batch shapes the model and the ranks can take."""
    m = run.engine.execution.micro_batches
    if seq_len > model.max_seq_len:
        more = ("" if model.hf_program is not None else
                f", or give the preset more positions (--set model_overrides.seq_len={seq_len})")
        raise Refusal(f"seq_len {seq_len} exceeds the model's {model.max_seq_len} positions; use --seq-len "
                      f"{model.max_seq_len} or less{more}")
    if run.batch_size % m:
        raise Refusal(f"batch_size {run.batch_size} is not divisible by micro_batches {m}")
    if run.batch_size % (m * world):
        raise Refusal(f"batch_size {run.batch_size} does not split over {world} ranks x {m} micro-batch(es): each "
                      f"rank trains batch_size / {world} sequences; use a multiple of {world * m}")


def _plan(ctx: _Run, hardware: str | None, dry_run: bool, resume: bool = False) -> Any:
    """The plan, on this machine or on a described one; a run (not a dry run) that cannot fit is refused, with
    the plan. On this machine the run plan priced is the one the engine is handed (`ctx.run_plan`): a dry run
    and a run price and allocate the same pools, and refuse the same cpu_mem in the same words."""
    run, e, world, dp = ctx.run, ctx.run.engine, ctx.world, ctx.dp
    store, mem, ex, lora, act = e.store, e.memory, e.execution, e.lora, e.activations
    problems = [] if hardware else local_problems(store.nvme, mem.cpu_mem)
    if problems:
        raise Refusal("; ".join(problems))
    try:
        machine = (described_hardware(hardware) if hardware else
                   detect_hardware(store.nvme, ex.device, ex.compute_dtype, mem.gpu_mem, store_name=store.name,
                                   checksums=store.checksums, act_compress=act.act_compress))
        if dp:  # one rank's plan: its slice of the batch, its share of the machine and of the states
            machine = data_parallel_machine(machine, world, dp.local_world)
        if lora.lora_r:  # a frozen base streamed, adapters on the device: its own plan (lohan.plan.lora)
            return _lora_fit(ctx, machine, dry_run)
        plan = _run_plan(ctx, resume, None if hardware else available_memory(dp.local_world if dp else 1),
                         False if hardware else resolve_device(ex.device) == "cpu")
        if not hardware:
            ctx.run_plan = plan
        report = plan_report(ctx.model.config, machine, run.batch_size // world, ctx.seq_len, plan, ctx.per_epoch)
    except ValueError as err:
        raise Refusal(str(err)) from None
    if dp:
        net = network_bytes_per_step(ctx.model.config.param_count(), world, 4 if ex.compute_dtype == "fp32" else 2)
        ctx.console.print(
            f"data parallel: {world} ranks ({dp.local_world} on this machine), each trains {run.batch_size // world} "
            f"of the {run.batch_size} sequences of a batch and stores and updates 1/{world} of every block's "
            f"optimizer states under its own rank<r> directory; the plan below is one rank's. Network per step and "
            f"rank: {net / 1e9:.2f} GB sent and as much received (gradient all-reduce in fp32, P16 all-gathers in "
            "forward and backward)")
    if not dry_run and report.capacity.reasons == (plan.refusal,):  # the engine's own refusal, in its words
        raise Refusal(plan.refusal)
    if not dry_run and not report.fits:
        ctx.console.print(report.format())
        raise Refusal(f"{run.model} does not fit this machine: {'; '.join(report.capacity.reasons)}. Nothing was "
                      "written. Try a smaller model or --layers N (a slice of the same shape), more SSD space "
                      "(--nvme on larger or more drives), or see the plan for another box with --dry-run "
                      "--hardware 'rtx4090,12xP5510,256GB'")
    return report


def _run_plan(ctx: _Run, resume: bool, free: int | None, host_device: bool) -> RunPlan:
    """The run plan the engine executes (`engine.plan_engine`): the whole engine config, as this process's engine
    gets it (a rank's: its share of cpu_mem), on the model's blocks as the store lays them out (a resume: as the
    stored layout shares the P16), with `free` bytes of main memory available (None: the described machine's)."""
    dp = ctx.dp
    cfg = dp.rank_config(ctx.run.engine) if dp else ctx.run.engine
    shared = StateStore.stored_p16_sharing(list(cfg.store.nvme), cfg.store.name) if resume else None
    return plan_engine(ctx.model.program(), cfg, ctx.world, dp.rank if dp else 0, free, host_device, shared)


def _lora_fit(ctx: _Run, machine: Any, dry_run: bool) -> Any:
    """`_plan` for a LoRA run (`lohan.plan.lora.lora_plan`; data parallel: one rank's, its slice of the batch on its
    share of the machine); refused, with the plan, where it does not fit."""
    from lohan.models.lora import projections
    from lohan.plan.lora import lora_plan

    e = ctx.run.engine
    try:  # the adapters priced on the model's own projections (grouped-query k and v are narrower)
        widths = projections(ctx.model.program().modules, e.lora.lora_targets)
    except ValueError:  # (targets that match nothing: the engine refuses them, saying what there is)
        widths = None
    # the CPU keeps the forward's graphs where they fit, under the planner's policy and plain records (lora_graphs)
    graphs = machine.device_is_host and e.activations.act_policy == "plan" and e.activations.act_compress == "none"
    act_mem = None if e.activations.act_mem is None else int(e.activations.act_mem)
    report = lora_plan(ctx.model.config, machine.hardware, ctx.run.batch_size // ctx.world, ctx.seq_len, e.lora.lora_r,
                       e.execution.compute_dtype, int(e.memory.cpu_mem), e.memory.prefetch_depth, machine.notes, ctx.per_epoch, widths,
                       graphs, e.execution.micro_batches, act_mem)
    if not dry_run and not report.fits:
        ctx.console.print(report.format())
        raise Refusal(f"{ctx.run.model} does not fit this machine for LoRA: {'; '.join(report.capacity.reasons)}. "
                      "Nothing was written")
    return report


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM while the store was being created: reported, with the exit code to return."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _open_store(ctx: _Run, resume: bool, overwrite: bool) -> Engine:
    """Refuse what would discard or misread a store, then open it, continue its creation, or create it."""
    run, e = ctx.run, ctx.run.engine
    store_dirs = ctx.dp.rank_dirs(e.store.nvme) if ctx.dp else e.store.nvme  # where this process's store lives
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
        ctx.console.print(f"\n{_interrupt_name(err)} while initializing the states; every block written so far is "
                          "durable: continue with --resume")
        raise _Interrupted(_interrupt_code(err)) from None
    except IOEngineError as err:
        raise Refusal(f"{err}. The blocks initialized before the failure are durable; fix the cause (free space, "
                      "check the drive), then continue with --resume") from None
    except (MemoryPlanError, VolumeConfigError, FileExistsError, FileNotFoundError, ValueError,
            StoreCorruptError, DirectoryInUseError, RuntimeError) as err:
        raise Refusal(str(err)) from None
    except OSError as err:  # the directories themselves: a full disk, a failing drive, permissions
        raise Refusal(_os_error_text(err, "opening the store") + "; the store is as it was. Fix the cause, then run "
                      "the same command again") from None


def _check_store(ctx: _Run, resume: bool, overwrite: bool) -> StoreStatus:
    """What the NVMe directories hold, against what was asked (resume, overwrite, a new run; ranks): the store
    layer's refusals (`check_request`, worded for the command line), then what only a run knows (its model and
    settings, its step count)."""
    e, dp = ctx.run.engine, ctx.dp
    try:
        status = check_request(e.store.nvme, e.store.name, resume=resume, overwrite=overwrite, world=ctx.world,
                               rank=dp.rank if dp else None, must_exist=True, asked=CLI)
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


def _lora_header(console: Console, engine: Any, dtype: DtypeChoice) -> None:
    """The header's lines for a LoRA run (`LoraEngine`): the adapters, the read-only base, the memory it streams
    through, the schedule."""
    e, lora, layout = engine.cfg, engine.lora, engine.store.layout
    store, ex, act = e.store, e.execution, e.activations
    targets = ", ".join(lora.target_names())
    console.print(
        f"  LoRA: rank {lora.r}, alpha {lora.alpha:g} (scaling {lora.scaling:g}), {len(lora.targets)} adapted "
        f"projections ({targets}), {lora.numel / 1e6:,.3f}M trainable parameters "
        f"({lora.numel / max(1, layout.param_count):.3%} of the model); the adapters and their AdamW states on the "
        f"device, committed every step with the run's step ({engine.store.volume.dirs[0]})")
    console.print(
        f"  base on NVMe: {_gib(layout.total_bytes)} of read-only {layout.p16_dtype} weights (no master, "
        f"no moments, one slot, never written after import) in {len(layout.blocks)} blocks over {len(store.nvme)} dir(s), "
        f"backend {engine.store.volume.backend.name}; streamed through a {_gib(engine.params_pool.budget_bytes)} "
        f"pool that keeps what it can across passes | device {engine.device.describe()}, {ex.compute_dtype}, "
        f"activations {act.act_policy}" + (f" ({act.act_compress} on the CPU and SSD tiers)" if act.act_compress != "none"
                                         else ""))
    console.print(f"  {dtype.describe()}")
    console.print(f"  optimizer: {_schedule_line(e)}")


def _gib(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's 0.00 GiB says nothing)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _position(ctx: _Run, engine: Engine, resume: bool) -> tuple[Iterator[Batch], dict | None]:
    """The batch stream at the committed step (a resume: the saved data position and RNG, rank 0's for every
    rank), and the header. A fresh run's metrics file (lohan's: checked) starts over with its store."""
    run, dp, start = ctx.run, ctx.dp, engine.step_count
    try:
        data_state = load_run_state(run, ctx.seq_len, engine) if resume and ctx.main_rank else None
        if dp:  # rank 0's data position and RNG: every rank must cut the same global batches
            data_state, rng = dp.broadcast((data_state, torch.get_rng_state()))
            torch.set_rng_state(rng)
        batches = make_batches(run, ctx.model, ctx.dataset, ctx.seq_len, start, data_state)
    except (OSError, ValueError) as err:
        raise Refusal(str(err)) from None
    console = ctx.console
    if resume:
        console.print(f"resuming from the state committed at step {start}")
        changed = _schedule_changes((data_state or {}).get("schedule"), engine.cfg)
        if changed:
            console.print(f"[yellow]note:[/yellow] the optimizer's settings differ from the run being resumed "
                          f"({changed}); the steps from {start + 1} on use the new ones")
        # like act_policy, a resume may change it (no state of a step outlives it); it changes the numerics, so say so
        saved = ((data_state or {}).get("activations") or {}).get("act_compress", engine.cfg.activations.act_compress)
        if saved != engine.cfg.activations.act_compress:
            how = {"none": "kept as they are", "int8": "compressed to int8 (lossy)"}
            console.print(f"[yellow]note:[/yellow] act_compress {saved} -> {engine.cfg.activations.act_compress}: swapped "
                          f"activations were {how.get(saved, saved)} in the run being resumed and are "
                          f"{how[engine.cfg.activations.act_compress]} from step {start + 1} on")
    if ctx.main_rank:
        _start_metrics(ctx.layout, resume)
    label = os.path.basename(os.path.normpath(run.model)) if ctx.model.hf_program is not None else ctx.model.config.name
    _header(console, run, ctx.model.config, engine, ctx.seq_len, label, ctx.dtype, ctx.fit)
    if ctx.dataset is not None and ctx.dataset.description:
        console.print(f"  data: {escape(ctx.dataset.description)}")
    if ctx.eval_set is not None:
        source = f"held out from {run.data}" if run.eval_fraction is not None else f"from {run.eval_data}"
        when = f"every {run.eval_every} steps and at the end" if run.eval_every else "at the end"
        console.print(f"  eval: {len(ctx.eval_set)} sequences {source}, {when} (forward only)")
    return batches, data_state


def _start_metrics(layout: RunLayout, resume: bool) -> None:
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


def _loop(ctx: _Run, engine: Engine, batches: Iterator[Batch], data_state: dict | None, export: str | None,
          export_dtype: str | None) -> int:
    """Train to the last step, export, and close; a failure or a stop says what stands and how to go on."""
    history: list[StepMetrics] = []
    code = 0
    try:
        if export and ctx.main_rank:
            tidy(ctx.layout, ctx.console)  # what a killed save or export left (lohan's: checked)
        _train_steps(ctx, engine, batches, data_state, history)
        if export:
            if ctx.main_rank:
                export_final(ctx.console, ctx.run, ctx.model, engine, ctx.layout, export_dtype, ctx.merged)
            else:
                _gather_whole(engine)
    except KeyboardInterrupt as err:
        with contextlib.suppress(Exception):  # the last step's staged commit, the steps held in RAM: durable
            engine.persist()
        ctx.console.print(f"\n{_interrupt_name(err)}; the state committed at step {engine.committed_step} is on NVMe "
                          "with its data position (continue with --resume)")
        code = _interrupt_code(err)
    except NonFiniteError as err:
        code = _fail(ctx.console, ctx.dp, str(err))
    except (StoreCorruptError, IOEngineError, RuntimeError) as err:
        cause = _root_cause(err)
        if isinstance(cause, StoreCorruptError):  # the committed state itself is damaged: no "intact" claim
            code = _fail(ctx.console, ctx.dp, f"{cause}. Training stopped before using the damaged bytes")
        else:
            code = _fail(ctx.console, ctx.dp, f"{cause}. The step in flight was abandoned; the state committed at "
                         f"step {engine.committed_step} is intact. Fix the cause, then continue with --resume")
    except OSError as err:
        code = _fail(ctx.console, ctx.dp, _os_error_text(err, "training") + f"; the state committed at step "
                     f"{engine.committed_step} is intact. Fix the cause, then continue with --resume")
    except ValueError as err:
        code = _fail(ctx.console, ctx.dp, str(err))
    finally:
        try:
            engine.close()
        except (OSError, RuntimeError) as err:  # a failing disk may fail the close too; the commit stands
            log.warning("closing the engine failed: %s", err)
    if history and ctx.main_rank:
        _finish(ctx, history, batches)
    return code


def _train_steps(ctx: _Run, engine: Engine, batches: Iterator[Batch], data_state: dict | None,
                 history: list[StepMetrics]) -> None:
    """The loop: a step, its run state (the data position a resume needs) once it is committed, an evaluation
    and a checkpoint when due, its metrics (the JSONL, the trackers: each step exactly once, when its commit is
    durable, `_Outbox`; a log line when due). One batch is drawn ahead: a step whose optimizer pass runs after
    backward runs the next step's forward beside it."""
    run, steps, start = ctx.run, ctx.steps, engine.step_count
    run_id = ctx.layout.owner.current
    writer_cm = MetricsWriter(ctx.layout.metrics, run_id, through=start) if ctx.main_rank \
        else contextlib.nullcontext(None)
    report_to = run.report_to if ctx.main_rank else ()
    trackers_cm = Trackers(report_to, ctx.layout.logging_dir or ".", run.engine.store.name, flat_params(run),
                           run_id=run_id)
    every = run.log_every or default_log_every(steps, ctx.console.is_terminal)
    with writer_cm as writer, trackers_cm as trackers, progress_bar(steps, ctx.console, completed=start) as bar:
        if writer is not None and writer.last_step is not None and report_to:
            # the committed steps so far (the file is cut back to them): each tracker takes those a kill kept from it
            trackers.replay(StepMetrics.from_record(r) for r in load_metrics(writer.path))
        out = _Outbox(engine, writer, trackers, history)
        try:
            _catch_up(ctx, engine, out)
            _steps(ctx, engine, batches, data_state, out, bar, every)
            engine.persist()  # the last step's commit (staged with write-behind, or in RAM), then its record
        except BaseException as err:  # what is durable goes out, whatever stopped the loop; the rest is run again
            with contextlib.suppress(Exception):  # by a resume (the error that stopped it is the one to report)
                if isinstance(err, KeyboardInterrupt):  # a clean stop loses nothing: the steps held in RAM too
                    engine.persist()
                out.emit(engine.committed_step)
            raise
        out.emit(engine.committed_step)


def _steps(ctx: _Run, engine: Engine, batches: Iterator[Batch], data_state: dict | None, out: _Outbox, bar: Any,
           every: int) -> None:
    run, steps, start = ctx.run, ctx.steps, engine.step_count
    position = (lambda: batches.state_dict()) if isinstance(batches, BatchIterator) else (lambda: None)
    batch = next(batches) if start < steps else None
    if start < steps and not ctx.console.is_terminal:  # a log file: say why the first line takes long to come
        ctx.console.print("note: the first step of a process also profiles the model and the SSDs (unless a saved "
                          "profile is loaded) and plans the activations, so its line takes longer to come")
    run_state = data_state if data_state is not None and data_state.get("step") == start else None
    for s in range(start, steps):
        after = position()  # the data position once this step's batch is consumed
        nxt = next(batches) if s + 1 < steps else None
        engine.step(batch, next_batch=nxt)
        if ctx.main_rank:
            run_state = save_run_state(run, ctx.seq_len, engine, after, run_state)
        batch = nxt
        # the steps before it are durable now (write-behind: this step made its predecessor's commit durable);
        # out before this step's evaluation and checkpoint, which make this one durable too
        out.emit(engine.committed_step)
        if s == min(start + 1, steps - 1):  # the process's first step profiles: its second measures the lanes
            _ssd_note(ctx, engine)
        sm, saved = _after_step(ctx, engine, engine.last_stats)
        out.add(sm)
        out.emit(engine.committed_step)
        step = sm.step
        report_step(bar, sm, steps, print_line=should_log(step, steps, every, start + 1,
                                                          sm.eval_loss is not None or bool(saved)))
        if saved:
            ctx.console.print(saved)


def _ssd_note(ctx: _Run, engine: Engine) -> None:
    """Where the step just run (a process's first after the one that profiles) found the SSD lane its slowest,
    what a smaller state format or more tokens per step would do (`FitReport.measured_ssd`); nothing otherwise."""
    stats = engine.last_stats
    cost = ctx.fit.measured_ssd(stats.lanes, stats.step_s, engine.cfg.execution.mode) if ctx.fit is not None else None
    if cost is not None:
        ctx.console.print(f"note: {escape(cost.format(f'measured by step {stats.step}'))}")


def _after_step(ctx: _Run, engine: Engine, stats: Any, catching_up: bool = False) -> tuple[StepMetrics, str]:
    """A committed step's evaluation and checkpoint where due (both read the committed weights and nothing else),
    and its record; the line that says what was saved ('' if nothing). `catching_up` (`_catch_up`): a checkpoint
    the step already has stands."""
    step, ckpt = stats.step, ctx.checkpoints
    due = ctx.eval_set is not None and (step == ctx.steps or bool(ctx.run.eval_every and step % ctx.run.eval_every == 0))
    eval_loss, eval_s = evaluate(engine, ctx.eval_set, ctx.run.batch_size) if due else (None, None)
    save_s, saved = (None, "")
    if ckpt is not None and ckpt.due(step) and (not catching_up or _agreed(ctx, not ckpt.has(step))):
        save_s, saved = _save(ctx, engine)
    return StepMetrics.from_stats(stats, eval_loss, eval_s, save_s), saved


def _catch_up(ctx: _Run, engine: Engine, out: _Outbox) -> None:
    """A resumed run's first task: the committed step's record, if a kill lost it (between the commit and the
    record's write, or in its evaluation or checkpoint), taken from the commit (`Engine.committed_stats`), its
    evaluation and checkpoint done now where due; or a checkpoint of the committed step that a kill cut short."""
    start, ckpt = engine.step_count, ctx.checkpoints
    last = out.writer.last_step if out.writer is not None else None
    if not _agreed(ctx, start > 0 and (last or 0) < start):
        if ckpt is not None and ckpt.due(start) and _agreed(ctx, not ckpt.has(start)):
            ctx.console.print(_save(ctx, engine)[1])
        return
    stats = engine.committed_stats
    if stats is None or stats.step != start:  # a store written by an older lohan keeps no record in its commits
        if ctx.main_rank:
            ctx.console.print(f"note: the metrics of step {start} were not recorded before the run stopped, and its "
                              "commit keeps none (written by an older lohan): the file goes on from step "
                              f"{start + 1}")
        return
    sm, saved = _after_step(ctx, engine, stats, catching_up=True)
    out.add(sm)
    out.emit(engine.committed_step)
    if saved:
        ctx.console.print(saved)


class _Outbox:
    """The records of the run's steps on their way out. A record goes to the metrics file and the trackers once its
    step's commit is durable, and not before: a step that a kill or a failed commit takes back is run again by the
    resumed run, and must not be recorded twice; a committed step's record that a kill kept from going out is in
    its commit (`_catch_up`)."""

    def __init__(self, engine: Engine, writer: MetricsWriter | None, trackers: Trackers,
                 history: list[StepMetrics]) -> None:
        self.engine, self.writer, self.trackers, self.history = engine, writer, trackers, history
        self.pending: list[StepMetrics] = []

    def add(self, sm: StepMetrics) -> None:
        self.pending.append(sm)

    def emit(self, committed: int) -> None:
        """Send out the records of the steps up to `committed`, in order. One that cannot be written stops the
        run, and the step after it, if its commit is still staged, is taken back (`Engine.drop_staged`): a
        resumed run finds at most its last committed step's record missing, which its commit keeps."""
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


def _save(ctx: _Run, engine: Engine) -> tuple[float, str]:
    """The checkpoint of the committed step (rank 0 writes it; every rank takes part in gathering the blocks):
    the seconds training waited for it, and the line that says so ('' on the other ranks)."""
    t0 = time.perf_counter()
    if ctx.main_rank:
        saved = ctx.checkpoints.save(engine)
        return saved.seconds, saved.describe(ctx.checkpoints.limit)
    _gather_whole(engine)
    return time.perf_counter() - t0, ""


def _gather_whole(engine: Engine) -> None:
    """A data-parallel rank's part of rank 0's export: the same reads, in the same order (each gathers a block
    from every rank)."""
    for b in engine.layout.blocks:
        engine.read_params(b.index)


def _agreed(ctx: _Run, decision: bool) -> bool:
    """Rank 0's `decision`, on every rank (they must all take part in what follows, or none)."""
    return ctx.dp.broadcast(decision) if ctx.dp else decision


def _finish(ctx: _Run, history: list[StepMetrics], batches: Iterator[Batch]) -> None:
    """The run's summary and its metrics plot."""
    console = ctx.console
    console.print(format_summary(history))
    clipped = sum(h.clip_coef is not None and h.clip_coef < 1 for h in history)
    redone, skipped = sum(h.redone for h in history), sum(h.skipped for h in history)
    if clipped or skipped:
        console.print(f"  gradients   clipped in {clipped} of {len(history)} steps ({redone} speculative updates "
                      f"redone), {skipped} skipped as not finite")
    saves = [h.save_s for h in history if h.save_s is not None]
    if saves:
        share = sum(saves) / (sum(h.step_s for h in history) + sum(saves))
        console.print(f"  checkpoints {len(saves)} written, {sum(saves) / len(saves):.2f} s each on average (training "
                      f"waited: {share:.1%} of the steps' and saves' time)")
    untrained = getattr(batches, "untrained_skipped", 0)
    if untrained:
        console.print(f"  data        {untrained} batch(es) skipped: every target masked (no response or assistant "
                      "token), nothing to train on")
    console.print(f"metrics: {ctx.layout.metrics}" + _plot(ctx.layout))


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

    p16 = 4 if cfg.execution.compute_dtype == "fp32" else 2
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


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and `kill` send): stops the run exactly as Ctrl-C does."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _interrupt_name(err: BaseException) -> str:
    return "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"


def _interrupt_code(err: BaseException) -> int:
    return 128 + signal.SIGTERM if isinstance(err, Terminated) else 130


def _os_error_text(err: OSError, doing: str) -> str:
    """An OSError as a sentence with its path, and what a full disk means (the usual one on a long run). An
    `OutputError` says itself what was being done."""
    if isinstance(err, OutputError):
        doing = err.doing
    where = f" ({err.filename})" if err.filename else ""
    text = f"{err.strerror or err} while {doing}{where}"
    if err.errno == errno.ENOSPC:
        text += ": the disk is full; free space on it (or point --nvme / --metrics / --export elsewhere)"
    return text


def _root_cause(err: BaseException) -> BaseException | str:
    """The innermost I/O or integrity error behind `err` (the optimizer thread's failures arrive wrapped)."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, StoreCorruptError | IOEngineError):
            return cause
        cause = cause.__cause__
    return str(err) if not err.__cause__ else f"{err}: {err.__cause__}"


def run_layout(run: RunConfig, model: Model, export: str | None, config: str | os.PathLike | None,
               dp: DataParallel | None = None) -> RunLayout:
    """The run's paths (layout.RunLayout): its outputs, and the inputs none of them may touch."""
    e = run.engine
    inputs = {"--model": run.model if model.hf_program is not None else None,
              "--data": None if run.data == "synthetic" else run.data, "--eval-data": run.eval_data,
              "--config": config}
    metrics = run.metrics or default_metrics(e.store.nvme[0], e.store.name)
    logging_dir = (run.logging_dir or Path(metrics).parent / f"{e.store.name}.logs") if run.report_to else None
    return RunLayout(e.store.nvme, e.store.name, metrics, export, inputs, logging_dir, owner=_owner(run, dp))


def _owner(run: RunConfig, dp: DataParallel | None) -> Owner:
    """Whose outputs this run may replace (`ownership.Owner`): those of the store it resumes or replaces (rank 0's,
    which writes the outputs), and of the stores that one replaced. A store whose description is damaged owns
    nothing (the run is refused when the store is checked)."""
    e = run.engine
    dirs = tuple(rank_dir(d, 0) for d in e.store.nvme) if dp else e.store.nvme
    where = os.path.join(e.store.nvme[0], e.store.name)
    try:
        current, replaced = StateStore.identity(dirs, e.store.name)
    except (StoreCorruptError, ValueError, OSError) as err:
        return Owner(where, unknown=str(err).split(". ")[0])
    return Owner(where, current, frozenset(replaced))


def verify_store(run: RunConfig) -> int:
    """`finetune.py --verify`: read every record of the store in the run's NVMe directories and check it
    against the committed checksums (a data-parallel run's: every rank's store, one after the other, in
    one process). Exit code 0: intact; 1: damaged (each damaged unit is listed); 2: no store, or its
    metadata is unreadable."""
    console = Console(soft_wrap=True)
    e = run.engine
    store = e.store
    try:
        decided = read_decision(store.nvme, store.name)
    except StoreCorruptError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    stores = ([tuple(os.path.join(d, f"rank{r}") for d in store.nvme) for r in range(decided["world"])]
              if decided is not None and StateStore.status(store.nvme, store.name).state == "none" else [store.nvme])
    worst = 0
    for dirs in stores:
        worst = max(worst, _verify_one(console, e, dirs, named=len(stores) > 1))
    return worst


def _verify_one(console: Console, e: EngineConfig, dirs: tuple[str, ...], named: bool) -> int:
    try:
        status = StateStore.status(dirs, e.store.name)
        if status.state != "complete":
            console.print(f"[red]error:[/red] {escape(dirs[0])} holds {status.describe()}: nothing to verify")
            return 2
        with DirLock(list(dirs)):
            store = StateStore.open(list(dirs), e.store.backend, e.store.stripe_bytes, e.store.name)
            try:
                with Progress(TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TextColumn("blocks"),
                              TimeElapsedColumn(), console=console, transient=True) as bar:
                    task = bar.add_task("verify", total=len(store.layout.blocks))
                    problems = store.verify(lambda done, total: bar.update(task, completed=done))
                gib = store.layout.slot_bytes / 2**30
                lora = _verify_lora(store, dirs, e.store.name, problems)
            finally:
                store.close()
    except (StoreCorruptError, DirectoryInUseError, VolumeConfigError, IOEngineError, ValueError, RuntimeError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    if problems:
        for p in problems:
            console.print(f"[red]damaged:[/red] {escape(p)}")
        console.print(f"{len(problems)} damaged unit(s) in {escape(', '.join(dirs))}: restore the directories from a "
                      "backup, or start over with --overwrite")
        return 1
    where = f" in {dirs[0]}" if named else ""
    console.print(f"{status.describe()}{where}: all {len(store.layout.blocks)} blocks ({gib:.2f} GiB) match their "
                  f"checksums{lora}")
    return 0


def _verify_lora(store: StateStore, dirs: tuple[str, ...], name: str, problems: list[str]) -> str:
    """A LoRA run's store (its frozen base): its adapters' commit read back and checked against that base (a problem
    added to `problems` if it is not); what to add to the report ('' for any other store)."""
    if store.layout.state_format != "frozen":
        return ""
    from lohan.runtime.lora_commit import latest_commit

    try:
        latest = latest_commit(dirs, name, store)
    except StoreCorruptError as err:
        problems.append(str(err))
        return ""
    if latest is None:
        return " (a LoRA run's base; no adapters committed yet)"
    path, state = latest
    return f"; the LoRA adapters committed at step {state['step']} ({path}) read back, over this base"
