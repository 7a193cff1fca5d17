"""The training loop behind the CLI: plan, data, engine, progress, metrics, run state, export.

Order matters for "nothing written on refusal": the settings, the model skeleton, the data and the
capacity plan are all checked before the engine creates anything on the NVMe directories.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from io_engine import VolumeConfigError

from .config import ModelConfig, RunConfig
from .data import Batch, BatchIterator, ByteTokenizer, TokenDataset, synthetic_batches
from .engine import Engine, MemoryPlanError, init
from .fit import described_hardware, detect_hardware, fit_report
from .metrics import MetricsWriter, StepMetrics, format_summary, plot_metrics, progress_bar, report_step

log = logging.getLogger(__name__)

RUN_STATE_VERSION = 1


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


def load_model(run: RunConfig) -> Model:
    if not run.is_hf:
        return Model(run.model_config(), ByteTokenizer())
    from .data import HFTokenizer
    from .models.hf import load_hf_skeleton, load_tokenizer

    program = load_hf_skeleton(run.model)
    return Model(planning_config(program, run.model), HFTokenizer(load_tokenizer(run.model)), program)


def planning_config(program: Any, path: str) -> ModelConfig:
    """A GPT-shaped ModelConfig with the HF model's dimensions and (about) its parameter count,
    for the capacity planner, which models GPT blocks."""
    d = int(getattr(program.config, "hidden_size", 0) or program.config.n_embd)
    per_block = sum(p.numel() for p in program.modules[1].parameters())
    ratio = max(1, round((per_block - 4 * d * d) / (2 * d * d)))  # GPT block: 4d^2 attention + 2*ratio*d^2 MLP
    return ModelConfig(name=os.path.basename(os.path.normpath(path)), n_layer=program.n_layer,
                       n_head=int(program.config.num_attention_heads), d_model=d, vocab_size=program.vocab_size,
                       seq_len=program.max_seq_len, mlp_ratio=ratio,
                       tie_embeddings=bool(getattr(program.config, "tie_word_embeddings", False)))


# ------------------------------------------------------------------------------------------- data
def load_dataset(run: RunConfig, model: Model, seq_len: int) -> TokenDataset | None:
    if run.data == "synthetic":
        return None
    if model.config.vocab_size < getattr(model.tokenizer, "vocab_size", 0):
        raise ValueError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size} (for presets set model_overrides.vocab_size >= 256)")
    return TokenDataset.from_file(run.data, seq_len=seq_len, tokenizer=model.tokenizer)


def make_batches(run: RunConfig, model: Model, dataset: TokenDataset | None, seq_len: int, start_step: int,
                 data_state: dict | None) -> Iterator[Batch]:
    """The run's batch stream positioned at optimizer step `start_step` (from the saved data state when
    there is one; batches are deterministic, so counting from the start gives the same position)."""
    seed = run.engine.seed
    if dataset is None:
        return synthetic_batches(model.config.vocab_size, run.batch_size, seq_len, seed=seed, start=start_step)
    it = BatchIterator(dataset, run.batch_size, seed=seed)
    state = it.state_dict()
    if data_state is not None:
        it.load_state_dict(data_state["iterator"])
        for _ in range(start_step - data_state["step"]):  # the step committed after the state was saved
            next(it)
    elif start_step:
        state["epoch"], state["position"] = divmod(start_step, it.batches_per_epoch)
        it.load_state_dict(state)
    return it


# -------------------------------------------------------------------------------------- run state
def run_state_path(run: RunConfig) -> Path:
    return Path(run.engine.nvme[0]) / f"{run.engine.name}.run.json"


def _fingerprint(run: RunConfig, seq_len: int) -> dict[str, Any]:
    return {"model": run.model, "data": run.data, "batch_size": run.batch_size, "seq_len": seq_len,
            "seed": run.engine.seed}


def save_run_state(run: RunConfig, seq_len: int, engine: Engine, batches: Iterator[Batch]) -> None:
    """Atomically record what a resume needs beyond the store, for its committed version: the data
    position and the RNG states."""
    buf = io.BytesIO()
    torch.save(torch.get_rng_state(), buf)
    step = engine.step_count
    state = {"version": RUN_STATE_VERSION, "step": step, "run": _fingerprint(run, seq_len),
             "store": {"step": step, "slot": engine.store.slot, "volume_id": engine.store.volume.volume_id},
             "iterator": batches.state_dict() if isinstance(batches, BatchIterator) else None,
             "torch_rng": base64.b64encode(buf.getvalue()).decode()}
    path = run_state_path(run)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_run_state(run: RunConfig, seq_len: int, engine: Engine) -> dict | None:
    """The saved run state if it belongs to this run, to this store and to its committed step (or the
    one before: a Ctrl-C between a commit and the state's write)."""
    path = run_state_path(run)
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    if state.get("version") != RUN_STATE_VERSION:
        return None
    if state["store"]["volume_id"] != engine.store.volume.volume_id:
        return None  # written for a store that has since been replaced
    store_step = engine.step_count
    if state["run"] != _fingerprint(run, seq_len):
        diff = {k: (state["run"].get(k), v) for k, v in _fingerprint(run, seq_len).items() if state["run"].get(k) != v}
        raise ValueError(f"--resume with other settings than the run being resumed: {diff} (saved, now)")
    if not 0 <= store_step - state["step"] <= 1:
        return None  # a state from another point in time: position from the step count instead
    torch.set_rng_state(torch.load(io.BytesIO(base64.b64decode(state["torch_rng"]))))
    return state if state["iterator"] is not None else None


# ------------------------------------------------------------------------------------------- loop
def _header(console: Console, run: RunConfig, mcfg: ModelConfig, engine: Engine, seq_len: int, label: str) -> None:
    e = run.engine
    layout = engine.store.layout
    plan = engine.memory_plan
    n_params = sum(b.numel for b in layout.blocks)
    console.print(
        f"[bold]lohan[/bold] {label}: {n_params / 1e6:,.1f}M params, {mcfg.n_layer} layers, "
        f"d_model {mcfg.d_model}, vocab {mcfg.vocab_size} | batch {run.batch_size} x {seq_len} tokens, "
        f"{e.micro_batches} micro-batch(es)")
    console.print(
        f"  states on NVMe: {layout.total_bytes / 2**30:.2f} GiB in {len(layout.blocks)} blocks x {layout.slots} "
        f"slot(s) over {len(e.nvme)} dir(s) {list(e.nvme)}, backend {engine.store.volume.backend.name}")
    console.print(
        f"  main memory: {sum(plan.values()) / 2**30:.2f} of {e.cpu_mem / 2**30:.2f} GiB budgeted "
        f"(params {plan['params'] / 2**20:.0f} MiB, grads {plan['grads'] / 2**20:.0f} MiB, optimizer "
        f"{plan['optimizer'] / 2**20:.0f} MiB) | device {engine.device.type}, {e.compute_dtype}, mode {e.mode}, "
        f"activations {e.act_policy}")


def train(run: RunConfig, resume: bool = False, dry_run: bool = False, hardware: str | None = None,
          export: str | None = None) -> int:
    """Run (or, with `dry_run`, only plan) the fine-tune described by `run`; returns a process exit code."""
    console = Console(soft_wrap=True)  # never re-wrap the fixed-width lines, also when piped

    def fail(msg: str) -> int:
        console.print(f"[red]error:[/red] {msg}")
        return 2

    try:
        model = load_model(run)
    except (ValueError, NotImplementedError, OSError) as e:
        return fail(str(e))
    mcfg = model.config
    seq_len = run.seq_len or mcfg.seq_len
    if seq_len > model.max_seq_len:
        return fail(f"seq_len {seq_len} exceeds the model's {model.max_seq_len} positions")
    if run.batch_size % run.engine.micro_batches:
        return fail(f"batch_size {run.batch_size} is not divisible by micro_batches {run.engine.micro_batches}")
    try:
        dataset = load_dataset(run, model, seq_len)
        per_epoch = len(dataset) // run.batch_size if dataset is not None else None
        if dataset is not None and per_epoch < 1:
            return fail(f"{run.data} packs into {len(dataset)} sequences of {seq_len} tokens, fewer than one "
                        f"batch of {run.batch_size}; lower --batch-size or --seq-len")
    except (OSError, ValueError) as e:
        return fail(str(e))
    steps = run.epochs * per_epoch if run.epochs else run.steps
    if export:
        from .models.gpt_export import check_export_dir

        try:
            check_export_dir(export)
        except ValueError as e:
            return fail(str(e))

    # ---- the plan: on this machine (refuse what cannot fit) or on a described one (--hardware)
    e = run.engine
    try:
        machine = (described_hardware(hardware) if hardware else
                   detect_hardware(e.nvme, e.device, e.compute_dtype, e.gpu_mem))
        report = fit_report(mcfg, machine, run.batch_size, seq_len, e.compute_dtype, e.micro_batches,
                            e.prefetch_depth, per_epoch, slots=e.slots)
    except ValueError as err:
        return fail(str(err))
    if dry_run:
        console.print(report.format())
        console.print(f"dry run: {steps} steps would take about {report.step_s * steps / 3600:.3g} h; nothing "
                      "was written")
        return 0
    if not report.fits:
        console.print(report.format())
        missing = "; ".join(report.capacity.reasons)
        return fail(f"{run.model} does not fit this machine: {missing}. Nothing was written. Try a smaller "
                    "model or --layers N (a slice of the same shape), more SSD space (--nvme on larger or more "
                    "drives), or see the plan for another box with --dry-run --hardware "
                    "'rtx4090,12xP5510,256GB'")

    # ---- the engine
    engine_cfg = e.with_overrides(total_steps=e.total_steps or steps)
    try:
        with Progress(TextColumn("initializing states on NVMe"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("blocks"), TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("init", total=mcfg.n_layer + 2)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            if model.hf_program is not None:
                from .models.hf import init_from_hf

                engine = init_from_hf(run.model, engine_cfg, resume=resume, overwrite=not resume, progress=progress)
            else:
                engine = init(mcfg, engine_cfg, resume=resume, overwrite=not resume, progress=progress)
    except (MemoryPlanError, VolumeConfigError, FileExistsError, FileNotFoundError, ValueError) as err:
        return fail(str(err))
    start = engine.step_count
    metrics_path = Path(run.metrics) if run.metrics else Path(e.nvme[0]).parent / "metrics.jsonl"
    try:
        data_state = load_run_state(run, seq_len, engine) if resume else None
        batches = make_batches(run, model, dataset, seq_len, start, data_state)
    except (OSError, ValueError) as err:
        engine.close()
        return fail(str(err))
    if resume:
        console.print(f"resuming from the state committed at step {start}")
    elif metrics_path.exists():
        metrics_path.unlink()  # a fresh run: the store was started over, so are its metrics
    label = os.path.basename(os.path.normpath(run.model)) if model.hf_program is not None else mcfg.name
    _header(console, run, mcfg, engine, seq_len, label)
    history: list[StepMetrics] = []
    code = 0
    try:
        with MetricsWriter(metrics_path) as writer, progress_bar(steps, console, completed=start) as bar:
            for _ in range(start, steps):
                loss = engine.step(next(batches))
                save_run_state(run, seq_len, engine, batches)
                m = engine.last_metrics
                sm = StepMetrics.from_counters(
                    step=m["step"], loss=loss, lr=m["lr"], tokens=m["tokens"], step_s=m["step_s"],
                    flops=(m["tflops"] or 0.0) * 1e12 * m["step_s"], ssd_read_bytes=m["ssd_read_bytes"],
                    ssd_write_bytes=m["ssd_write_bytes"], cpu_mem_bytes=int(m["cpu_mem_gib"] * 2**30),
                    gpu_mem_bytes=None if m["gpu_mem_gib"] is None else int(m["gpu_mem_gib"] * 2**30),
                    lanes=m["lanes"], overlap_pct=100 * m["overlap_efficiency"])
                history.append(sm)
                writer.write(sm)
                report_step(bar, sm, steps)
        if export:
            _export(console, run, model, engine, export)
    except KeyboardInterrupt:
        console.print(f"\ninterrupted; the state committed at step {engine.step_count} is on NVMe with its data "
                      "position (continue with --resume)")
        code = 130
    except (OSError, ValueError) as err:
        code = fail(str(err))
    finally:
        engine.close()
    if history:
        console.print(format_summary(history))
        png = plot_metrics(metrics_path)
        console.print(f"metrics: {metrics_path}" + (f", plot: {png}" if png else ""))
    return code


def _export(console: Console, run: RunConfig, model: Model, engine: Engine, out: str) -> None:
    if model.hf_program is not None:
        from .models.hf import export_hf

        export_hf(engine, model.hf_program, run.model, out)
    else:
        from .models.gpt_export import export_gpt2

        export_gpt2(engine, model.config, out)
    console.print(f"exported the step-{engine.step_count} weights to {out} (loads with transformers "
                  "AutoModelForCausalLM.from_pretrained)")
