"""A run's first stages, before anything is written: the pre-flight (the compute dtype, the model, the shapes, the
data, the paths the run owns) and the plan (this machine's or a described one's), which refuses a run that
cannot fit with the same words as the engine."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rich.console import Console

from lohan.app.export import Checkpoints
from lohan.app.failures import Refusal
from lohan.app.fit import (
    data_parallel_machine,
    described_hardware,
    detect_hardware,
    local_problems,
    plan_report,
)
from lohan.app.inputs import Model, load_dataset, load_eval_set, load_model
from lohan.app.layout import RunLayout
from lohan.app.opening import run_layout
from lohan.app.tracking import missing_packages
from lohan.config import MAX_STEPS, RunConfig
from lohan.data import TokenDataset
from lohan.plan.compute_dtype import DtypeChoice, choose
from lohan.plan.records import P16_ITEMSIZE
from lohan.plan.run_plan import RunPlan
from lohan.runtime.device import compute_dtype_choice, resolve_device
from lohan.runtime.engine import available_memory, plan_engine
from lohan.runtime.parallel import Group, current_group, network_bytes_per_step
from lohan.store.opening import stored_compute_dtype
from lohan.store.states import StateStore


@dataclasses.dataclass
class RunContext:
    """What the stages of a run share: the settings, the model and data, the steps, the paths it owns."""

    run: RunConfig
    model: Model
    seq_len: int
    dataset: TokenDataset | None
    eval_set: TokenDataset | None
    per_epoch: int | None
    steps: int
    layout: RunLayout
    dp: Group
    console: Console
    checkpoints: Checkpoints | None = None
    fit: Any = None  # the plan's FitReport (`plan_fit`): the first step's measured lanes are priced with it
    run_plan: RunPlan | None = None  # the plan the engine executes (`plan_fit`, on this machine), the one priced
    dtype: DtypeChoice | None = None  # the compute dtype `run.engine` was resolved to, and why (`resolve_compute_dtype`)
    merged: bool = False  # a LoRA run exports its merged weights (--export-merged), not its adapters

    @property
    def world(self) -> int:
        return self.dp.world

    @property
    def main_rank(self) -> bool:
        """Rank 0 (or the one process) writes the metrics, the run state and the export."""
        return self.dp.is_main


def resolve_compute_dtype(run: RunConfig, resume: bool, hardware: str | None,
                   dp: Group) -> tuple[RunConfig, DtypeChoice]:
    """`run` with its compute dtype resolved once, for this machine or the one `hardware` describes (whose GPU
    computes bf16), and why; a resume under ``auto`` keeps the dtype its store was created with."""
    e = run.engine
    if hardware:
        choice = choose(e.execution.compute_dtype, "cuda", (), state_format=e.store.state_format)
    else:
        dirs = dp.rank_dirs(e.store.nvme)
        stored = stored_compute_dtype(dirs, e.store.name) if resume and e.execution.compute_dtype == "auto" else None
        try:
            choice = compute_dtype_choice(e.execution.compute_dtype, e.execution.device, e.store.state_format, stored)
        except ValueError as err:  # the device: LOHAN_DEVICE unknown, or cuda asked for where there is none
            raise Refusal(str(err)) from None
    return dataclasses.replace(run, engine=e.with_overrides(compute_dtype=choice.dtype)), choice


def preflight(run: RunConfig, dry_run: bool, export: str | None, export_dtype: str | None,
               config: str | os.PathLike | None, console: Console, dp: Group | None) -> RunContext:
    """Everything that can be checked before anything is written: the model, the shapes, the data and its
    steps, and the paths the run owns (layout.RunLayout). `dp`: the process's group (None: the one it was launched
    in, `parallel.current_group`)."""
    dp = current_group(dp)
    world = dp.world
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
    return RunContext(run, model, seq_len, dataset, eval_set, per_epoch, steps, layout, dp, console, ckpt)


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


def plan_fit(ctx: RunContext, hardware: str | None, dry_run: bool, resume: bool = False) -> Any:
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
        # one rank's plan: its slice of the batch, its share of the machine and of the states (one process: all)
        machine = data_parallel_machine(machine, world, dp.local_world)
        if lora.lora_r:  # a frozen base streamed, adapters on the device: its own plan (lohan.plan.lora)
            return _lora_fit(ctx, machine, dry_run)
        plan = _run_plan(ctx, resume, None if hardware else available_memory(dp.local_world),
                         False if hardware else resolve_device(ex.device) == "cpu")
        if not hardware:
            ctx.run_plan = plan
        report = plan_report(ctx.model.config, machine, run.batch_size // world, ctx.seq_len, plan, ctx.per_epoch)
    except ValueError as err:
        raise Refusal(str(err)) from None
    if world > 1:
        net = network_bytes_per_step(ctx.model.config.param_count(), world, P16_ITEMSIZE[ex.compute_dtype])
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


def _run_plan(ctx: RunContext, resume: bool, free: int | None, host_device: bool) -> RunPlan:
    """The run plan the engine executes (`engine.plan_engine`): the whole engine config, as this process's engine
    gets it (a rank's: its share of cpu_mem), on the model's blocks as the store lays them out (a resume: as the
    stored layout shares the P16), with `free` bytes of main memory available (None: the described machine's)."""
    dp = ctx.dp
    cfg = dp.rank_config(ctx.run.engine)
    shared = StateStore.stored_p16_sharing(list(cfg.store.nvme), cfg.store.name) if resume else None
    return plan_engine(ctx.model.program(), cfg, ctx.world, dp.rank, free, host_device, shared)


def _lora_fit(ctx: RunContext, machine: Any, dry_run: bool) -> Any:
    """`plan_fit` for a LoRA run (`lohan.plan.lora.lora_plan`; data parallel: one rank's, its slice of the batch on its
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
