"""`python finetune.py` / `lohan`: parse -> build -> run -> close.

Settings come from a YAML run config (default `configs/tiny.yaml`), then from the flags, then from
`--set key=value` dotted overrides (e.g. `--set engine.prefetch_depth=3`). Every problem with the
settings is reported at once, with how to fix it, before anything is written.

Relative paths. A relative path given on the command line (flags, `--set`) is relative to the current
directory, as a shell user expects. In a config file, relative *input* paths (`data`, a `model`
directory, `engine.profile_from`) are looked up in the current directory first and, when nothing is
there, next to the config file, then in the directory above it: `configs/tiny.yaml` says
`data: data/corpus.txt` and finds the repository's corpus from any working directory, while a file
of that name in the current directory still wins (and keeps the path as written, so a resumed run
sees the same settings). Relative *output* paths (`engine.nvme`, `metrics`) always stay relative to the
current directory: `python /path/to/finetune.py` writes `./runs/tiny/...` where it is run, as the
README shows, never into the repository.

Bad input ends with exit code 2 and one `error: ...` message (cause and fix), with nothing written;
an unexpected exception does too, with "run with -v for the traceback" (`-v` prints it; with the
environment variable LOHAN_DEBUG set it propagates, which the test suite uses so bugs are not masked).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import yaml

from lohan.config import DATA_FORMATS, PRESETS, EngineConfig, RunConfig, is_model_dir, unitless_size_problems
from lohan.plan.formats import FORMATS

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"  # lohan/app/cli.py -> the repository

# flag -> (section, field); section None = RunConfig, "engine" = EngineConfig
_FLAGS: dict[str, tuple[str | None, str]] = {
    "model": (None, "model"), "data": (None, "data"), "steps": (None, "steps"), "epochs": (None, "epochs"),
    "batch_size": (None, "batch_size"), "seq_len": (None, "seq_len"), "metrics": (None, "metrics"),
    "nvme": ("engine", "nvme"), "cpu_mem": ("engine", "cpu_mem"), "mode": ("engine", "mode"),
    "compute_dtype": ("engine", "compute_dtype"), "micro_batches": ("engine", "micro_batches"),
    "lr": ("engine", "lr"), "warmup_steps": ("engine", "warmup_steps"), "seed": ("engine", "seed"),
    "backend": ("engine", "backend"), "device": ("engine", "device"), "sim_gpu": ("engine", "sim_gpu"),
    "prefetch_depth": ("engine", "prefetch_depth"), "gpu_mem": ("engine", "gpu_mem"),
    "weight_decay": ("engine", "weight_decay"), "total_steps": ("engine", "total_steps"),
    "min_lr_ratio": ("engine", "min_lr_ratio"), "eps": ("engine", "eps"), "betas": ("engine", "betas"),
    "act_policy": ("engine", "act_policy"), "act_mem": ("engine", "act_mem"), "slots": ("engine", "slots"),
    "persist_every": ("engine", "persist_every"),
    "act_compress": ("engine", "act_compress"),
    "max_grad_norm": ("engine", "max_grad_norm"), "clip_mode": ("engine", "clip_mode"),
    "log_every": (None, "log_every"), "report_to": (None, "report_to"), "logging_dir": (None, "logging_dir"),
    "eval_data": (None, "eval_data"), "eval_fraction": (None, "eval_fraction"), "eval_every": (None, "eval_every"),
    "data_format": (None, "data_format"), "text_field": (None, "text_field"), "split": (None, "split"),
    "eval_split": (None, "eval_split"),
    "lr_scheduler": ("engine", "lr_scheduler"), "warmup_ratio": ("engine", "warmup_ratio"),
    "min_lr": ("engine", "min_lr"), "decay_ratio": ("engine", "decay_ratio"),
    "save_every": (None, "save_every"), "save_total_limit": (None, "save_total_limit"),
    "state_format": ("engine", "state_format"),
    "lora": ("engine", "lora_r"), "lora_alpha": ("engine", "lora_alpha"), "lora_dropout": ("engine", "lora_dropout"),
    "lora_targets": ("engine", "lora_targets"),
}

# Two ways to say one thing: a flag replaces the config file's other way (the command line overrides the file);
# both on the command line (or both in the file) are refused by EngineConfig.
_ALTERNATIVES = {"warmup_ratio": "warmup_steps", "warmup_steps": "warmup_ratio", "min_lr": "min_lr_ratio",
                 "min_lr_ratio": "min_lr"}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one `error: ...` line, like every other refusal."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


_EXAMPLES = """examples:
  python finetune.py                                    # the default run: configs/tiny.yaml, a 2M GPT on the corpus
  python finetune.py --model runs/tiny-llama --data data/chat_example.jsonl --eval-fraction 0.1 \\
      --steps 300 --nvme /mnt/ssd0/run /mnt/ssd1/run --export runs/llama-ft --save-every 100 --report-to tensorboard
  python finetune.py --model 175b --data synthetic --batch-size 1 --dry-run --hardware rtx4090,12xP5510,256GB

Every flag overrides the run config (--config, default configs/tiny.yaml; --help-config lists its keys), and
--set KEY=VALUE overrides both. A local Hugging Face model without --config trains with fine-tuning defaults
(lr 2e-5, a 3% warm-up) instead of the demo's schedule."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="finetune.py", epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune an LLM with its model states on NVMe SSDs (LoHan). [brackets]: the value a run without "
                    "--config starts from (configs/tiny.yaml, else the built-in default).")
    _model_flags(p.add_argument_group("model"))
    _data_flags(p.add_argument_group("data"))
    _optimization_flags(p.add_argument_group("optimization"))
    _storage_flags(p.add_argument_group("memory and storage"))
    _run_flags(p.add_argument_group("run"))
    _output_flags(p.add_argument_group("output"))
    _show_defaults(p)
    return p


def _model_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a local Hugging Face model directory")
    g.add_argument("--layers", type=int, metavar="N",
                   help="run a slice of the model: its width with its first N transformer layers (a preset, or a "
                        "Hugging Face directory, whose first N layers' weights are imported)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    g.add_argument("--compute-dtype", choices=["auto", "bf16", "fp16", "fp32"],
                   help="device compute precision. auto: bf16 on a GPU and on a CPU with native bf16 (AMX or "
                        "AVX-512 bf16), fp32 on other CPUs, where bf16 runs ~10x slower (the header says which and "
                        "why); fp16 uses dynamic loss scaling")
    g.add_argument("--device", choices=["auto", "cpu", "cuda", "sim"],
                   help="compute device (sim: the CPU simulating a separate GPU, to test lohan's device code)")
    g.add_argument("--sim-gpu", metavar="SPEC",
                   help="with --device sim: run at a modeled GPU's pace, e.g. rtx4090, h100 or "
                        "tflops=150,h2d=25GB/s,d2h=25GB/s,hbm=1000GB/s (default: LOHAN_SIM_GPU, else order only)")


def _data_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data", metavar="PATH",
                   help="training data: a .txt file (plain text), a file of records (.jsonl, .json, .parquet, .arrow, "
                        ".csv: text, prompt/response, chat messages, Alpaca or ShareGPT records), a folder written by "
                        "datasets' save_to_disk, or 'synthetic'; records are tokenized once into the token cache "
                        "($LOHAN_DATA_CACHE, default: the datasets cache)")
    g.add_argument("--data-format", choices=DATA_FORMATS,
                   help="how records are read (auto: by their columns: messages, conversations -> sharegpt, "
                        "instruction+output -> alpaca, prompt+response, text); also for --eval-data")
    g.add_argument("--text-field", metavar="NAME", help="the column holding the text of text records, if not 'text'")
    g.add_argument("--split", metavar="NAME", help="the split of a saved DatasetDict folder given as --data "
                                                   "(default train)")
    g.add_argument("--batch-size", type=int, help="sequences per optimizer step")
    g.add_argument("--micro-batches", type=int, help="gradient accumulation: micro-batches per step")
    g.add_argument("--eval-data", metavar="PATH", help="evaluate on this data (forward only): anything --data takes")
    g.add_argument("--eval-split", metavar="NAME", help="the split of a saved DatasetDict folder given as --eval-data "
                                                        "(default train)")
    g.add_argument("--eval-fraction", type=float, metavar="F",
                   help="hold out this share of the data's sequences, in (0, 0.5], for evaluation (seeded)")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate every N steps and at the end (default: only at the end)")


def _optimization_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--steps", type=int, help="optimizer steps to run (in total, when resuming)")
    g.add_argument("--epochs", type=int, help="passes over the data (instead of --steps)")
    g.add_argument("--lr", type=float, help="peak learning rate (a local Hugging Face model without --config: "
                   f"{FINETUNE_LR:g}; a preset other than the config's: 3e-4)")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (a local Hugging Face model without "
                   f"--config: {FINETUNE_WARMUP * 100:.0f}%% of --steps)")
    g.add_argument("--total-steps", type=int, help="length of the schedule (default: the run's steps)")
    g.add_argument("--lr-scheduler", choices=["cosine", "linear", "constant", "wsd"],
                   help="after the warm-up: cosine or linear decay, constant, or wsd (stable, then a 1-sqrt decay over "
                        "the last --decay-ratio of the steps)")
    g.add_argument("--warmup-ratio", type=float, metavar="R", help="warm-up: a share of the steps (or --warmup-steps)")
    g.add_argument("--min-lr-ratio", type=float, help="the decay ends at lr x this")
    g.add_argument("--min-lr", type=float, help="the decay ends at this lr (instead of --min-lr-ratio)")
    g.add_argument("--decay-ratio", type=float, metavar="R", help="wsd: the final decay's share of the steps")
    g.add_argument("--weight-decay", type=float, help="AdamW decoupled weight decay")
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"), help="Adam betas")
    g.add_argument("--eps", type=float, help="Adam epsilon")
    g.add_argument("--max-grad-norm", type=float, metavar="NORM",
                   help="clip gradients to this global L2 norm (0 turns clipping off)")
    g.add_argument("--clip-mode", choices=["auto", "speculate", "defer"],
                   help="clipping under overlapped updates: speculate and redo, or defer updates")
    g.add_argument("--seed", type=int, help="initialization and data-order seed")
    g.add_argument("--lora", type=int, metavar="R",
                   help="LoRA of rank R: the weights stay frozen (stored once as read-only P16 and streamed), only "
                        "adapters of the decoder layers' projections train, as PEFT's; fixed when the store is created")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scaling alpha / R (default 8, PEFT's)")
    g.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (only 0 so far)")
    g.add_argument("--lora-targets", type=_names, metavar="NAMES",
                   help="comma-separated module names to adapt, e.g. q_proj,v_proj (default: every linear projection "
                        "of the decoder layers, attention and MLP)")


def _storage_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--nvme", nargs="+", metavar="DIR", help="one directory per SSD (striped)")
    g.add_argument("--cpu-mem", help="main-memory budget of the engine, e.g. 8GiB")
    g.add_argument("--gpu-mem", help="device memory the plan must fit in, e.g. 24GiB (default: the device's)")
    g.add_argument("--mode", choices=["serial", "naive", "optimized"], help="gradient offloading mode")
    g.add_argument("--act-policy", help="activations: plan | interblock | swap-all | recompute-all | ops:NAME,...")
    g.add_argument("--act-mem", help="main memory for swapped activations (the rest goes to the SSDs)")
    g.add_argument("--act-compress", choices=["none", "int8"],
                   help="int8: swapped activations travel and wait as int8 codes with a scale per row (lossy)")
    g.add_argument("--slots", type=int, choices=[1, 2], help="2: crash-consistent alternate slots; 1: in place")
    g.add_argument("--persist-every", type=_persist_every, metavar="N|auto",
                   help="durability interval: write and commit the records every N steps (between, a step commits "
                        "nothing to the SSDs and a kill replays it); only with every record resident; auto (default): "
                        "the least N that keeps the writes under ~10%% of the run's time")
    g.add_argument("--state-format", choices=list(FORMATS),
                   help="optimizer states on the SSDs: exact (fp32, 14 B/param), bf16-moments (10), 8bit-moments "
                        "(8), bf16-master (4; stochastic rounding, needs --compute-dtype bf16); fixed at creation")
    g.add_argument("--backend", choices=["auto", "aio", "threads"], help="NVMe I/O backend")
    g.add_argument("--prefetch-depth", type=int, help="blocks of parameters read ahead")


def _run_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--config", type=Path, default=None, help="YAML run config (default: configs/tiny.yaml)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of any config field, e.g. engine.max_inflight_blocks=4 (repeatable; "
                        "--help-config lists the keys)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run whose states are in the NVMe directories (from its last committed step, "
                        "or where its initialization stopped)")
    g.add_argument("--overwrite", action="store_true",
                   help="discard the states already in the NVMe directories and start over (without --resume or "
                        "--overwrite, a directory that holds a run is refused)")
    g.add_argument("--verify", action="store_true",
                   help="check every stored record against its checksum, report, and exit (writes nothing); with "
                        "--export DIR, every file of that export and its checkpoints instead")
    g.add_argument("--dry-run", action="store_true",
                   help="print the plan (placement, bytes per tier, predicted step time) and exit; writes nothing")
    g.add_argument("--hardware", metavar="DESC",
                   help="plan for another machine, e.g. 'rtx4090,12xP5510,256GB' (with --dry-run)")
    g.add_argument("--help-config", action="store_true",
                   help="list every key of a run config and of --set, with its default and meaning, and exit")
    g.add_argument("-v", "--verbose", action="store_true", help="log engine details")


def _output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--metrics", help="JSONL metrics file, one record per step (default: <nvme>/<name>.metrics.jsonl)")
    g.add_argument("--log-every", type=int, metavar="N",
                   help="a log line every N steps (and the first, the last and evaluating ones); default: every step "
                        "on a terminal, about 200 lines over the run in a log file")
    g.add_argument("--report-to", metavar="TRACKERS",
                   help="also send each step's metrics and the run's settings to tensorboard, wandb and/or mlflow "
                        "(comma-separated; 'all'; default none). wandb runs offline unless WANDB_MODE says otherwise; "
                        "mlflow writes a local store unless MLFLOW_TRACKING_URI is set")
    g.add_argument("--logging-dir", metavar="DIR",
                   help="where the trackers write (default: <metrics dir>/<run name>.logs)")
    g.add_argument("--export", metavar="DIR",
                   help="after training, write the weights as a Hugging Face checkpoint to DIR")
    g.add_argument("--export-merged", metavar="DIR",
                   help="a LoRA run: write the base with the adapters merged in as a Hugging Face checkpoint to DIR "
                        "(instead of --export DIR, which writes the PEFT adapter folder)")
    g.add_argument("--export-dtype", choices=["bf16", "fp16", "fp32"],
                   help="dtype of the exported weights (default: the Hugging Face model's own, from its config.json; "
                        "presets export fp32)")
    g.add_argument("--save-every", type=int, metavar="N",
                   help="every N steps, also write a Hugging Face checkpoint to DIR/step-N (needs --export DIR)")
    g.add_argument("--save-total-limit", type=int, metavar="K",
                   help="keep only the last K DIR/step-N checkpoints (default: all)")


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Append `[value]` to the help of each flag that maps to a config key: the shipped default config's value, else
    the built-in default (what a run without --config starts from); flags without one are left as they are."""
    try:
        shipped = yaml.safe_load(DEFAULT_CONFIG.read_text()) or {} if DEFAULT_CONFIG.exists() else {}
    except (OSError, yaml.YAMLError):
        shipped = {}
    built_in = {(None, f.name): f for f in dataclasses.fields(RunConfig)}
    built_in.update({("engine", f.name): f for f in dataclasses.fields(EngineConfig)})
    for action in p._actions:  # argparse has no public iterator over its actions
        key = _FLAGS.get(action.dest)
        if key is None or action.help is None or "[" in action.help:
            continue
        section, name = key
        given = (shipped.get("engine") or {}) if section == "engine" else shipped
        if name in given:
            value = given[name]
        else:
            f = built_in.get(key)
            value = None if f is None or f.default is dataclasses.MISSING else f.default
        if value is not None and value != ():
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            action.help += f" [{str(shown).replace('%', '%%')}]"


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """YAML, then flags, then --set overrides -> a validated RunConfig (ValueError lists every problem)."""
    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    raw: dict[str, Any] = {}
    if path is not None:
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ValueError(f"config file {path} {what}; pass a YAML file (the shipped ones are in "
                             f"{DEFAULT_CONFIG.parent})")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML{_yaml_problem(e)}; fix the file there") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a run config is a mapping of fields (key: value lines), not a "
                             f"{type(raw).__name__}")
        raw = _resolve_inputs(dict(raw), path)
    raw = dict(raw)
    engine = dict(raw.pop("engine", {}) or {})
    if getattr(args, "model", None) and raw.get("model") not in (None, args.model):
        # the YAML's shape overrides belong to its own model, not to the one asked for on the command line
        raw.pop("model_overrides", None)
        if args.config is None:  # nor does the default config's schedule (tuned for its 2M-parameter demo)
            for key in SCHEDULE_KEYS:
                engine.pop(key, None)
    for flag, other in _ALTERNATIVES.items():
        if getattr(args, flag, None) is not None and getattr(args, other, None) is None:
            engine.pop(other, None)
    for flag, (section, field) in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            (engine if section == "engine" else raw)[field] = tuple(value) if isinstance(value, list) else value
    if getattr(args, "layers", None) is not None:
        raw["model_overrides"] = {**(raw.get("model_overrides") or {}), "n_layer": args.layers}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. engine.lr=1e-4")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: cannot read the value{_yaml_problem(e)}; quote it, e.g. "
                             f"--set '{key}=\"...\"'") from None
        value = _number(value)
        parts = key.split(".")
        if parts[0] == "engine" and len(parts) == 2:
            engine[parts[1]] = value
        elif parts[0] == "model_overrides" and len(parts) == 2:
            raw.setdefault("model_overrides", {})[parts[1]] = value
        elif len(parts) == 1:
            raw[parts[0]] = value
        else:
            raise ValueError(f"--set {key}: unknown key; use FIELD, engine.FIELD or model_overrides.FIELD")
    _finetune_defaults(args, raw, engine)
    return _make_run_config(raw, engine)


SCHEDULE_KEYS = ("lr", "lr_scheduler", "warmup_steps", "warmup_ratio", "total_steps", "min_lr_ratio", "min_lr",
                 "decay_ratio", "weight_decay", "betas")
FINETUNE_LR = 2e-5
"""Peak learning rate of a local Hugging Face model run without --config (full fine-tuning of a pretrained model:
the range 1e-5..5e-5 that fine-tuning recipes use; the presets' 3e-4 would wreck pretrained weights)."""
LORA_LR = 2e-4
"""Peak learning rate of a LoRA run of a local Hugging Face model without --config: adapters start at zero and
take the 1e-4..3e-4 that LoRA recipes (PEFT's examples, axolotl, torchtune) use."""
FINETUNE_WARMUP = 0.03
"""Its warm-up, as a fraction of the run's steps (at least one step)."""


def _finetune_defaults(args: argparse.Namespace, raw: dict, engine: dict) -> None:
    """A local Hugging Face model run without --config: the fine-tuning defaults (FINETUNE_LR, a warm-up of
    FINETUNE_WARMUP of the steps) where the flags and --set leave the schedule open; the cosine's total is
    the run's steps (train.py)."""
    model = getattr(args, "model", None)
    if args.config is not None or not model or not is_model_dir(str(model)):
        return
    # (flags and --set, applied before this, win)
    engine.setdefault("lr", LORA_LR if engine.get("lora_r") else FINETUNE_LR)
    steps = raw.get("steps")
    if raw.get("epochs") is None and _is_count(steps) and engine.get("warmup_ratio") is None:
        engine.setdefault("warmup_steps", max(1, round(FINETUNE_WARMUP * steps)))


def _names(text: str) -> list[str]:
    """--lora-targets: comma-separated names (argparse prints a ValueError's type name, so this raises its own)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give module names such as q_proj,v_proj")
    return names


def _persist_every(text: str) -> int | str:
    """--persist-every: a step count >= 1 or auto (argparse prints a ValueError's type name, so this raises its own)."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of steps >= 1 or auto")
    return n


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _yaml_problem(e: yaml.YAMLError) -> str:
    """` (line L, column C): problem` of a YAML error, for a one-line message."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{where}: {getattr(e, 'problem', None) or e}"


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number(value: Any) -> Any:
    """YAML 1.1 reads `1e-4` (no dot) as a string; on the command line it can only mean the number."""
    return float(value) if isinstance(value, str) and _EXPONENT.fullmatch(value) else value


def _resolve_inputs(raw: dict, config: Path) -> dict:
    """The config file's relative input paths, found as the module docstring says (outputs untouched)."""
    bases = [config.resolve().parent, config.resolve().parent.parent]

    def find(value: Any) -> Any:
        if not isinstance(value, str) or not value or os.path.isabs(value) or os.path.exists(value):
            return value
        return next((str(b / value) for b in bases if (b / value).exists()), value)

    if "data" in raw and raw["data"] != "synthetic":
        raw["data"] = find(raw["data"])
    if raw.get("eval_data"):
        raw["eval_data"] = find(raw["eval_data"])
    if isinstance(raw.get("model"), str) and raw["model"] not in PRESETS:
        raw["model"] = find(raw["model"])
    if isinstance(raw.get("engine"), dict) and "profile_from" in raw["engine"]:
        raw["engine"] = {**raw["engine"], "profile_from": find(raw["engine"]["profile_from"])}
    return raw


RENAMED = {"chunk_bytes": ("stripe_bytes", "the SSD volumes' stripe unit; the optimizer's unit is opt_chunk_bytes")}
"""Engine settings that were renamed: a config or --set that uses the old name is told the new one."""


def _make_run_config(raw: dict, engine: dict) -> RunConfig:
    problems = []
    known = {f.name for f in dataclasses.fields(RunConfig)}
    problems += [f"unknown run setting {k!r} (valid: {', '.join(sorted(known))})" for k in raw if k not in known]
    known_e = {f.name for f in dataclasses.fields(EngineConfig)}
    problems += [f"engine setting {k!r} is now {RENAMED[k][0]!r} ({RENAMED[k][1]})" if k in RENAMED else
                 f"unknown engine setting {k!r} (valid: {', '.join(sorted(known_e))})" for k in engine if k not in known_e]
    problems += unitless_size_problems(engine)
    if problems:
        raise ValueError("invalid run config:\n  - " + "\n  - ".join(problems))
    if isinstance(engine.get("nvme"), list):
        engine["nvme"] = tuple(engine["nvme"])
    if isinstance(engine.get("betas"), list):
        engine["betas"] = tuple(engine["betas"])
    try:
        ecfg = EngineConfig(**engine)
    except ValueError as e:
        ecfg_error = str(e)
        try:
            RunConfig(**{k: v for k, v in raw.items() if k != "engine"})
        except ValueError as e2:
            ecfg_error += "\n" + str(e2)
        raise ValueError(ecfg_error) from None
    return RunConfig(**raw, engine=ecfg)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a usage mistake already reported as "error: ..." (2)
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.help_config:
        from lohan.app.help_text import config_reference

        print(config_reference(args.config or DEFAULT_CONFIG), end="")
        return 0
    try:
        return _main(args)
    except KeyboardInterrupt as e:  # one the run's own handling did not meet: a second Ctrl-C during the first one's
        # clean-up (or one while torch loads): stop at once, quietly, with the code a scheduler expects
        train = sys.modules.get("lohan.app.train")
        term = train is not None and isinstance(e, train.Terminated)
        print(f"\n{'terminated (SIGTERM)' if term else 'interrupted'}: stopped at once; a store keeps its last "
              "committed step (continue with --resume)", file=sys.stderr)
        return 128 + signal.SIGTERM if term else 130
    except Exception as e:  # the safety net: KeyboardInterrupt and SystemExit are not Exceptions
        if os.environ.get("LOHAN_DEBUG"):
            raise  # tests and developers: the real traceback, nothing masked
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else "; run with -v for the traceback"
        print(f"error: unexpected {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    try:
        run = load_run_config(args)
        if run.is_hf and run.model_overrides:
            extra = sorted(set(run.model_overrides) - {"n_layer"})
            if extra:
                raise ValueError(f"model_overrides {', '.join(extra)} apply to presets; a Hugging Face model keeps its "
                                 "shape (only --layers N, model_overrides.n_layer, cuts it to its first N layers)")
        if not run.is_hf:
            run.model_config()
        if args.hardware is not None and not args.hardware.strip():
            raise ValueError("--hardware is empty: describe the machine, e.g. rtx4090,12xP5510,256GB (with --dry-run)")
        if args.hardware and not args.dry_run:
            raise ValueError("--hardware describes another machine: use it with --dry-run")
        if args.steps is not None and args.epochs is not None:
            raise ValueError(f"--steps {args.steps} and --epochs {args.epochs} both say how long to train: pass one "
                             "(--epochs counts passes over the data, --steps optimizer steps)")
        _check_lora_exports(args, run)
        if args.export_dtype and not (args.export or args.export_merged):
            raise ValueError("--export-dtype sets the dtype of --export DIR: pass --export too")
        if run.save_every and not (args.export or args.export_merged) and not args.dry_run:
            raise ValueError(f"--save-every {run.save_every} writes checkpoints into the export directory: pass "
                             "--export DIR too (checkpoints go to DIR/step-N, the final weights to DIR)")
        if args.resume and args.overwrite:
            raise ValueError("--resume continues the stored run and --overwrite discards it: pass one of them")
        from lohan.runtime.device import (
            resolve_device,  # imports torch: last, once everything else is known to be valid
        )

        device = resolve_device(run.engine.device)
        if run.engine.sim_gpu is not None:
            from lohan.runtime.simgpu import parse_sim_gpu

            if device != "sim":
                raise ValueError(f"--sim-gpu {run.engine.sim_gpu} models a GPU's timing on the simulated device, "
                                 f"but the device is {device}: add --device sim")
            parse_sim_gpu(run.engine.sim_gpu)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if run.is_hf:  # before transformers builds a model: its torchao import only prints noise (hf_imports.py)
        from lohan.models.hf_imports import keep_torchao_out

        keep_torchao_out()
    from lohan.app.train import (  # torch is imported only once the settings are known to be valid
        train,
        verify_store,
    )

    if args.verify and args.export:
        from pathlib import Path

        from rich.console import Console

        from lohan.app.export import verify_export

        return verify_export(Path(args.export), Console(soft_wrap=True, highlight=False))
    if args.verify:
        return verify_store(run)
    return train(run, resume=args.resume, dry_run=args.dry_run, hardware=args.hardware,
                 export=args.export or args.export_merged, overwrite=args.overwrite, export_dtype=args.export_dtype,
                 config=args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None),
                 merged=bool(args.export_merged))


def _check_lora_exports(args: argparse.Namespace, run: RunConfig) -> None:
    """--export (a LoRA run: its PEFT adapter folder) and --export-merged (its merged weights): one per run."""
    lora = bool(run.engine.lora_r)
    if args.export_merged and not lora:
        raise ValueError("--export-merged writes a LoRA run's base with its adapters merged in: add --lora R, or use "
                         "--export DIR")
    if args.export_merged and args.export:
        raise ValueError("--export DIR (the PEFT adapter folder) and --export-merged DIR (the merged weights): pass "
                         "one; the other can be written afterwards from the same store with --resume --steps N (N the "
                         "committed step)")
    if lora and args.export and not run.is_hf:
        raise ValueError("--export of a LoRA run writes a PEFT adapter folder, for a Hugging Face base; a preset has "
                         "none: use --export-merged DIR (a GPT-2 checkpoint with the adapters merged in)")
    if lora and args.export and args.export_dtype:
        raise ValueError("--export-dtype: a PEFT adapter folder keeps the adapters in fp32, as PEFT does; the dtype "
                         "applies to --export-merged DIR")


if __name__ == "__main__":
    sys.exit(main())
