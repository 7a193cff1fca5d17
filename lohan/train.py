"""The training loop behind the CLI: data, engine, progress, metrics, summary."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from io_engine import VolumeConfigError

from .config import ModelConfig, RunConfig
from .data import Batch, BatchIterator, ByteTokenizer, TokenDataset, synthetic_batches
from .engine import Engine, MemoryPlanError, init
from .metrics import MetricsWriter, StepMetrics, format_summary, progress_bar, report_step

log = logging.getLogger(__name__)


def make_batches(run: RunConfig, mcfg: ModelConfig, seq_len: int, start_step: int) -> Iterator[Batch]:
    """The run's batch stream, positioned at optimizer step `start_step`."""
    seed = run.engine.seed
    if run.data == "synthetic":
        return synthetic_batches(mcfg.vocab_size, run.batch_size, seq_len, seed=seed, start=start_step)
    tokenizer = ByteTokenizer()
    if mcfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the byte-level tokenizer needs vocab_size >= {tokenizer.vocab_size}; the model has "
                         f"{mcfg.vocab_size} (set model_overrides.vocab_size)")
    dataset = TokenDataset.from_file(run.data, seq_len=seq_len, tokenizer=tokenizer)
    it = BatchIterator(dataset, run.batch_size, seed=seed)
    if start_step:
        state = it.state_dict()
        state["epoch"], state["position"] = divmod(start_step, it.batches_per_epoch)
        it.load_state_dict(state)
    return it


def _header(console: Console, run: RunConfig, mcfg: ModelConfig, engine: Engine, seq_len: int) -> None:
    e = run.engine
    layout = engine.store.layout
    plan = engine.memory_plan
    console.print(
        f"[bold]lohan[/bold] {mcfg.name}: {mcfg.param_count() / 1e6:,.1f}M params, {mcfg.n_layer} layers, "
        f"d_model {mcfg.d_model}, vocab {mcfg.vocab_size} | batch {run.batch_size} x {seq_len} tokens, "
        f"{e.micro_batches} micro-batch(es)")
    console.print(
        f"  states on NVMe: {layout.total_bytes / 2**30:.2f} GiB in {len(layout.blocks)} blocks x {layout.slots} "
        f"slot(s) over {len(e.nvme)} dir(s) {list(e.nvme)}, backend {engine.store.volume.backend.name}")
    console.print(
        f"  main memory: {sum(plan.values()) / 2**30:.2f} of {e.cpu_mem / 2**30:.2f} GiB budgeted "
        f"(params {plan['params'] / 2**20:.0f} MiB, grads {plan['grads'] / 2**20:.0f} MiB, optimizer "
        f"{plan['optimizer'] / 2**20:.0f} MiB) | device {engine.device.type}, {e.compute_dtype}, mode {e.mode}")


def train(run: RunConfig, mcfg: ModelConfig, resume: bool = False) -> int:
    """Run the fine-tune described by `run`; returns a process exit code."""
    console = Console(soft_wrap=True)  # never re-wrap the fixed-width lines, also when piped
    seq_len = run.seq_len or mcfg.seq_len
    if seq_len > mcfg.seq_len:
        console.print(f"[red]error:[/red] seq_len {seq_len} exceeds the model's {mcfg.seq_len} positions")
        return 2
    engine_cfg = run.engine.with_overrides(total_steps=run.engine.total_steps or run.steps)
    try:
        with Progress(TextColumn("initializing states on NVMe"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("blocks"), TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("init", total=mcfg.n_layer + 2)
            engine = init(mcfg, engine_cfg, resume=resume, overwrite=not resume,
                          progress=lambda done, total: bar.update(task, completed=done, total=total))
    except (MemoryPlanError, VolumeConfigError, FileExistsError, FileNotFoundError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    start = engine.step_count
    if resume:
        console.print(f"resuming from the state committed at step {start}")
    try:
        batches = make_batches(run, mcfg, seq_len, start)
    except (OSError, ValueError) as e:
        engine.close()
        console.print(f"[red]error:[/red] {e}")
        return 2
    _header(console, run, mcfg, engine, seq_len)
    metrics_path = Path(run.metrics) if run.metrics else Path(run.engine.nvme[0]).parent / "metrics.jsonl"
    history: list[StepMetrics] = []
    code = 0
    try:
        with MetricsWriter(metrics_path) as writer, progress_bar(run.steps, console, completed=start) as progress:
            for _ in range(start, run.steps):
                loss = engine.step(next(batches))
                m = engine.last_metrics
                sm = StepMetrics.from_counters(
                    step=m["step"], loss=loss, lr=m["lr"], tokens=m["tokens"], step_s=m["step_s"],
                    flops=(m["tflops"] or 0.0) * 1e12 * m["step_s"], ssd_read_bytes=m["ssd_read_bytes"],
                    ssd_write_bytes=m["ssd_write_bytes"], cpu_mem_bytes=int(m["cpu_mem_gib"] * 2**30),
                    gpu_mem_bytes=None if m["gpu_mem_gib"] is None else int(m["gpu_mem_gib"] * 2**30),
                    lanes=m["lanes"], overlap_pct=100 * m["overlap_efficiency"])
                history.append(sm)
                writer.write(sm)
                report_step(progress, sm, run.steps)
    except KeyboardInterrupt:
        console.print(f"\ninterrupted; the state committed at step {engine.step_count} is on NVMe "
                      "(continue with --resume)")
        code = 130
    finally:
        engine.close()
    if history:
        console.print(format_summary(history))
        console.print(f"metrics: {metrics_path}")
    return code
