"""The run header: what the run will do, printed before its first step, from the engine's own summary
(`Engine.describe`, `runtime.summary.EngineSummary`) and the run's settings."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console

from lohan.config import EngineConfig, ModelConfig, RunConfig
from lohan.plan.compute_dtype import DtypeChoice
from lohan.plan.durability import loss_text
from lohan.plan.formats import state_format
from lohan.runtime.optim import wsd_decay_steps
from lohan.runtime.summary import EngineSummary

LR_WARN = 0.1  # an AdamW peak lr above this is a typo, not a choice (the header says so)


def schedule_line(e: EngineConfig) -> str:
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


def resident_line(s: EngineSummary) -> str:
    """How many blocks' optimizer records stay in memory (plan.pools.plan_resident), and what keeps them all."""
    if not s.cfg.memory.resident_records:
        return "none (engine.resident_records=false)"
    line = f"{s.resident_blocks} of {s.n_blocks} blocks"
    if s.resident_blocks < s.n_blocks and s.host_memory is not None:
        plan = s.host_memory
        need = plan.resident_all  # what resident_mem takes to keep every record that can stay (pools.resident_every)
        if need > plan.resident and s.cfg.memory.resident_mem != "all":
            if s.cfg.memory.resident_mem == "auto":  # auto takes half of what cpu_mem leaves after the other pools
                others = plan.total - plan.resident
                cpu = math.ceil((others + 2 * need) / 2**28) / 4
                line += f"; --cpu-mem {cpu:g}GiB keeps all of them (resident_mem auto takes half of what it leaves)"
            else:
                line += f"; --set engine.resident_mem={math.ceil(need / 2**20)}MiB keeps all of them (within cpu_mem)"
    return line


def persist_line(s: EngineSummary, fit: Any = None) -> str:
    """The durability interval in force (engine.persist_every) and what a kill can lose, in steps and in time at
    the pre-flight's predicted step (`fit`: its FitReport, whose plan also priced `auto`'s interval)."""
    asked, n = s.cfg.execution.persist_every, s.persist_every
    step_s = fit.step_s if fit is not None else None
    if s.persist_refusal is not None:
        why = f" ({s.persist_refusal})" if asked != 1 else ""
        return f"records written and committed every step{why}; {loss_text(1, None)}"
    if asked == "auto":
        planned = fit.capacity.persist_every if fit is not None else 1
        priced = (f"; the plan prices every {planned} steps: {loss_text(planned, step_s)}" if planned > 1 else "")
        return ("persist_every auto: every step until the first step has measured the SSDs' write rate, then the least "
                "interval that keeps the persist writes under 10% of the run's time (every record is in RAM; a kill "
                f"replays the steps after the last durable one){priced}")
    return f"records written and committed every {n} step(s), held in RAM between; {loss_text(n, step_s)}"


def print_header(console: Console, run: RunConfig, mcfg: ModelConfig, s: EngineSummary, seq_len: int, label: str,
                 dtype: DtypeChoice, fit: Any = None) -> None:
    """The header of a run whose engine `s` describes (`Engine.describe`), before its first step."""
    store, ex, act = run.engine.store, run.engine.execution, run.engine.activations
    ranks = f" (rank {s.rank}'s shards; every rank holds as much)" if s.rank is not None else ""
    console.print(  # the whole model's parameters (a rank's store holds its shards)
        f"[bold]lohan[/bold] {label}: {s.param_count / 1e6:,.1f}M params, {mcfg.n_layer} layers, "
        f"d_model {mcfg.d_model}, vocab {mcfg.vocab_size} | batch {run.batch_size} x {seq_len} tokens, "
        f"{ex.micro_batches} micro-batch(es)")
    if s.lora is not None or s.host_memory is None:  # (a LoRA engine streams its base through one pool)
        _lora_header(console, s, dtype)
        return
    plan = s.host_memory
    console.print(
        f"  states on NVMe: {s.state_bytes / 2**30:.2f} GiB{ranks} in {s.n_blocks} blocks x "
        f"{s.slots} slot(s) over {len(store.nvme)} dir(s) {list(s.dirs)}, backend "
        f"{s.backend}, format {s.state_format} "
        f"({state_format(s.state_format).at_rest(s.p16_itemsize):.2f} B/param)")
    console.print(
        f"  main memory: {plan.total / 2**30:.2f} of {plan.budget / 2**30:.2f} GiB budgeted ({plan.describe()}) | "
        f"device {s.device}, {ex.compute_dtype}, mode {ex.mode}, activations {act.act_policy}"
        + (f" ({act.act_compress} on the CPU and SSD tiers)" if act.act_compress != "none" else ""))
    console.print(f"  {dtype.describe()}")
    console.print(f"  optimizer: {schedule_line(s.cfg)}")
    if s.cfg.schedule.lr > LR_WARN:  # AdamW moves every weight by up to lr a step, whatever the gradient's size
        console.print(f"  [yellow]warning:[/yellow] lr {s.cfg.schedule.lr:g} is far above what AdamW training uses "
                      "(1e-5 to 1e-3): each step moves every weight by up to lr, so training will not converge; "
                      "check --lr")
    console.print(f"  optimizer records kept in memory across steps (not read back): {resident_line(s)}")
    console.print(f"  durability: {persist_line(s, fit)}")
    _rss_line(console, run, mcfg, seq_len, s.device_is_cuda)


def _rss_line(console: Console, run: RunConfig, mcfg: ModelConfig, seq_len: int, cuda: bool) -> None:
    """The RSS bound (lohan/plan/memory.py): cpu_mem covers the pools and the activations kept in main memory;
    the overhead is this process as measured now, before the first step, plus what no budget covers."""
    import psutil

    from lohan.plan.memory import rss_overhead

    mem, ex, act = run.engine.memory, run.engine.execution, run.engine.activations
    over = rss_overhead(psutil.Process().memory_info().rss, mcfg, run.batch_size, seq_len, ex.micro_batches,
                        ex.compute_dtype, mem.prefetch_depth, act.act_policy, device_is_cpu=not cuda)
    console.print(
        f"  peak RSS at most {(mem.cpu_mem + sum(over.values())) / 2**30:.2f} GiB = cpu_mem {mem.cpu_mem / 2**30:.2f} "
        f"+ overhead {sum(over.values()) / 2**30:.2f} (process {over['process'] / 2**30:.2f} measured now, device "
        f"working set {over['device working set'] / 2**30:.2f}"
        + (" as the CPU computes" if not cuda else "")
        + f", allocator slack {over['allocator slack'] / 2**30:.2f})")


def _lora_header(console: Console, s: EngineSummary, dtype: DtypeChoice) -> None:
    """The header's lines for a LoRA run (`LoraEngine`): the adapters, the read-only base, the memory it streams
    through, the schedule."""
    e, lora = s.cfg, s.lora
    assert lora is not None, "a summary without host memory pools is a LoRA engine's"
    store, ex, act = e.store, e.execution, e.activations
    targets = ", ".join(lora.targets)
    console.print(
        f"  LoRA: rank {lora.r}, alpha {lora.alpha:g} (scaling {lora.scaling:g}), {lora.n_targets} adapted "
        f"projections ({targets}), {lora.numel / 1e6:,.3f}M trainable parameters "
        f"({lora.numel / max(1, s.store_param_count):.3%} of the model); the adapters and their AdamW states on the "
        f"device, committed every step with the run's step ({s.dirs[0]})")
    console.print(
        f"  base on NVMe: {_gib(s.state_bytes)} of read-only {s.p16_dtype} weights (no master, "
        f"no moments, one slot, never written after import) in {s.n_blocks} blocks over {len(store.nvme)} dir(s), "
        f"backend {s.backend}; streamed through a {_gib(lora.params_pool_bytes)} "
        f"pool that keeps what it can across passes | device {s.device}, {ex.compute_dtype}, "
        f"activations {act.act_policy}" + (f" ({act.act_compress} on the CPU and SSD tiers)" if act.act_compress != "none"
                                         else ""))
    console.print(f"  {dtype.describe()}")
    console.print(f"  optimizer: {schedule_line(e)}")


def _gib(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's 0.00 GiB says nothing)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
