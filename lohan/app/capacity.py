"""`python -m lohan.capacity` (its shim runs `main`): will a model fine-tune on a machine, and with what?

For a model and a hardware description ("rtx4090,12xP5510,256GB"): the bytes each tier needs
(GPU, main memory, SSD) and whether they fit, the activation plan (Algorithm 1 on the analytic
profile, with its predicted step time), the largest batch, the largest preset the machine trains,
and the same check for a design that keeps activations in main memory (ZeRO-Infinity style); with ``--lora R``,
the plan of a LoRA run instead (`lohan.plan.lora`: the base read-only, no optimizer traffic).
Nothing is run or allocated; it is arithmetic on DESIGN.md §4.4's cost model.

The model is a preset, or a local Hugging Face model folder, of which only config.json is read (no weights:
a folder with the config of a model one has not downloaded plans it). Its shape is planned as the GPT-shaped
stand-in the run's own plan uses (`lohan.models.hf.HFBlocks.planning_config`: its width, layers, heads,
vocabulary and about its parameter count).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lohan.config import COMPUTE_DTYPES, PRESETS, ModelConfig, get_model_config, is_model_dir
from lohan.plan.compute_dtype import choose
from lohan.plan.formats import FORMATS, state_format
from lohan.plan.planner import (
    Hardware,
    activations_in_ram_capacity,
    capacity,
    max_batch,
    max_model,
    parse_hardware,
)


def model_config(model: str) -> ModelConfig:
    """A preset's config, or the planning config of a Hugging Face folder's config.json (ValueError: neither)."""
    return _model(model)[0]


def _model(model: str) -> tuple[ModelConfig, Any]:
    """`model_config`, with a Hugging Face folder's block program (on the meta device; None for a preset)."""
    if model in PRESETS:
        return get_model_config(model), None
    if not is_model_dir(model):
        found = f" ({model} is a folder without config.json)" if os.path.isdir(model) else ""
        raise ValueError(f"--model {model!r}: give a preset ({', '.join(PRESETS)}) or a Hugging Face model folder "
                         f"with a config.json{found}")
    from lohan.models.hf import load_hf_skeleton  # torch and transformers: only for a folder

    try:
        program = load_hf_skeleton(model)
    except (OSError, NotImplementedError) as e:
        raise ValueError(f"--model {model}: {e}") from None
    return program.planning_config(os.path.basename(os.path.normpath(model))), program


def lora_report(model: str, hardware: str, rank: int, targets: tuple[str, ...] = (), seq: int | None = None,
                batch: int = 1, compute_dtype: str = "auto", prefetch_depth: int = 2) -> str:
    """The capacity report of a LoRA run (``--lora R``; `lohan.plan.lora`): the base's bytes on the SSDs and read per
    step, main and GPU memory, the predicted step and the tokens from which the GPU hides the reads; the parameter
    pool takes what the machine's RAM leaves. The adapters are priced on the model's own projections (a Hugging Face
    folder's: grouped-query k and v are narrower), the `targets` alone if given."""
    from lohan.plan.lora import lora_plan

    choice = choose(compute_dtype, "cuda", ())
    cfg, program = _model(model)
    seq = seq or cfg.seq_len
    if seq > cfg.seq_len:
        cfg = cfg.with_overrides(seq_len=seq)
    widths = None
    if program is not None or targets:
        from lohan.models.gpt import build_model
        from lohan.models.lora import projections

        modules = program.modules if program is not None else build_model(cfg, device="meta").block_modules()
        widths = projections(modules, targets)
    plan = lora_plan(cfg, parse_hardware(hardware), batch, seq, rank, choice.dtype, None, prefetch_depth,
                     projections=widths)
    return "\n".join([choice.describe(), plan.format()])


def report(model: str, hardware: str, seq: int | None = None, batch: int = 1, compute_dtype: str = "auto",
           micro_batches: int = 1, prefetch_depth: int = 2, compare: bool = True) -> str:
    """The capacity report as text (what the command prints); `model` is a preset or a Hugging Face folder.
    ``compute_dtype`` auto is what a run on the described machine picks: its GPU computes bf16."""
    choice = choose(compute_dtype, "cuda", ())
    compute_dtype = choice.dtype
    cfg = model_config(model)
    model = cfg.name
    seq = seq or cfg.seq_len
    if seq > cfg.seq_len:
        cfg = cfg.with_overrides(seq_len=seq)
    hw = parse_hardware(hardware)
    kw = dict(compute_dtype=compute_dtype, micro_batches=micro_batches, prefetch_depth=prefetch_depth)
    ours = capacity(cfg, hw, batch, seq, **kw)
    lines = [choice.describe(), ours.format(), "", ours.plan.format_table(clip=False), ""]  # priced without clipping (no stash)
    best = max_batch(cfg, hw, seq, **kw)
    lines.append(f"largest batch for {model} at seq {seq}: {best}" if best else
                 f"{model} does not fit at any batch size at seq {seq}")
    biggest = max_model(hw, seq, batch, compute_dtype=compute_dtype, prefetch_depth=prefetch_depth)
    lines.append(f"largest preset this machine fine-tunes at batch {batch} x seq {seq}: {biggest or 'none'}")
    lines += ["", format_table(cfg, hw, batch, seq, **kw)]
    if compare:
        lines += ["", activations_in_ram_capacity(cfg, hw, batch, seq, **kw).format()]
    return "\n".join(lines)


def format_table(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, **kw: object) -> str:
    """Each state format's SSD need (two slots of states), SSD bytes moved per step and predicted step time."""
    lines = ["SSD need per state format (--state-format; lohan/plan/formats.py; the CPU lane is priced at each",
             "format's update cost relative to exact's AdamW, measured by benchmarks/compressed_states.py):",
             f"  {'format':<14}{'bytes/param':>12}{'states on SSD':>15}{'SSD per step':>14}{'step':>10}"]
    for name in FORMATS:
        c = capacity(cfg, hw, batch, seq, state_format=name, **kw)
        e = c.plan.estimate
        moved = e.traffic["ssd_read"] + e.traffic["ssd_write"]
        lines.append(f"  {name:<14}{state_format(name).at_rest():>12.2f}{c.ssd_states_bytes / 1e9:>12.1f} GB"
                     f"{moved / 1e9:>11.0f} GB{e.t_iter:>9.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lohan.capacity", description=__doc__.split("\n\n")[0])
    presets = sorted(PRESETS, key=lambda n: PRESETS[n].get("d_model", 0))
    p.add_argument("--model", default="175b", metavar="MODEL",
                   help=f"a preset ({', '.join(presets)}) or a Hugging Face model folder (its config.json is read; "
                        "no weights needed)")
    p.add_argument("--hardware", default="rtx4090,12xP5510,256GB",
                   help="GPU, SSD count x model and RAM, e.g. 'rtx4090,12xP5510,256GB'")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (the paper uses 1024)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="auto",
                   help="auto: what a run on the machine picks (bf16 on its GPU)")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--no-compare", action="store_true", help="skip the activations-in-RAM comparison")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="price a LoRA run of rank R instead of full fine-tuning (the base frozen, read-only)")
    p.add_argument("--lora-targets", default="", metavar="NAMES",
                   help="with --lora: the projections adapted, comma-separated (default: all of them)")
    args = p.parse_args(argv)
    try:
        if args.lora < 0:
            raise ValueError(f"--lora {args.lora}: give a rank >= 1 (0: full fine-tuning)")
        if args.lora:
            targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
            print(lora_report(args.model, args.hardware, args.lora, targets, args.seq, args.batch,
                              args.compute_dtype, args.prefetch_depth))
        else:
            print(report(args.model, args.hardware, args.seq, args.batch, args.compute_dtype, args.micro_batches,
                         args.prefetch_depth, not args.no_compare))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
