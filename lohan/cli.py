"""`python finetune.py` / `lohan`: parse -> build -> run -> close.

Settings come from a YAML run config (default `configs/tiny.yaml`), then from the flags, then from
`--set key=value` dotted overrides (e.g. `--set engine.prefetch_depth=3`). Every problem with the
settings is reported at once, with how to fix it, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from .config import PRESETS, EngineConfig, RunConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"

# flag -> (section, field); section None = RunConfig, "engine" = EngineConfig
_FLAGS: dict[str, tuple[str | None, str]] = {
    "model": (None, "model"), "data": (None, "data"), "steps": (None, "steps"),
    "batch_size": (None, "batch_size"), "seq_len": (None, "seq_len"), "metrics": (None, "metrics"),
    "nvme": ("engine", "nvme"), "cpu_mem": ("engine", "cpu_mem"), "mode": ("engine", "mode"),
    "compute_dtype": ("engine", "compute_dtype"), "micro_batches": ("engine", "micro_batches"),
    "lr": ("engine", "lr"), "warmup_steps": ("engine", "warmup_steps"), "seed": ("engine", "seed"),
    "backend": ("engine", "backend"), "device": ("engine", "device"),
    "prefetch_depth": ("engine", "prefetch_depth"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="finetune.py",
        description="Fine-tune an LLM with its model states on NVMe SSDs (LoHan). Defaults: configs/tiny.yaml.")
    p.add_argument("--config", type=Path, default=None, help="YAML run config (default: configs/tiny.yaml)")
    p.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--data", help="local UTF-8 .txt file (byte-level tokens), or 'synthetic'")
    p.add_argument("--steps", type=int, help="optimizer steps to run")
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--micro-batches", type=int, help="gradient accumulation: micro-batches per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--nvme", nargs="+", metavar="DIR", help="one directory per SSD (striped)")
    p.add_argument("--cpu-mem", help="main-memory budget of the engine, e.g. 8GiB")
    p.add_argument("--mode", choices=["serial", "naive", "optimized"], help="gradient offloading mode")
    p.add_argument("--compute-dtype", choices=["bf16", "fp32"], help="device compute precision")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps")
    p.add_argument("--seed", type=int, help="initialization seed")
    p.add_argument("--backend", choices=["auto", "aio", "threads"], help="NVMe I/O backend")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="compute device")
    p.add_argument("--prefetch-depth", type=int, help="blocks of parameters read ahead")
    p.add_argument("--metrics", help="JSONL metrics file (one record per step)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of any config field, e.g. engine.max_inflight_blocks=4 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last committed state in the NVMe directories instead of starting over")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    return p


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """YAML, then flags, then --set overrides -> a validated RunConfig (ValueError lists every problem)."""
    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    raw: dict[str, Any] = {}
    if path is not None:
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a run config is a mapping of fields, not {type(raw).__name__}")
    raw = dict(raw)
    engine = dict(raw.pop("engine", {}) or {})
    for flag, (section, field) in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            (engine if section == "engine" else raw)[field] = value
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. engine.lr=1e-4")
        value = yaml.safe_load(text)
        parts = key.split(".")
        if parts[0] == "engine" and len(parts) == 2:
            engine[parts[1]] = value
        elif parts[0] == "model_overrides" and len(parts) == 2:
            raw.setdefault("model_overrides", {})[parts[1]] = value
        elif len(parts) == 1:
            raw[parts[0]] = value
        else:
            raise ValueError(f"--set {key}: unknown key; use FIELD, engine.FIELD or model_overrides.FIELD")
    return _make_run_config(raw, engine)


def _make_run_config(raw: dict, engine: dict) -> RunConfig:
    problems = []
    known = {f.name for f in dataclasses.fields(RunConfig)}
    problems += [f"unknown run setting {k!r} (valid: {', '.join(sorted(known))})" for k in raw if k not in known]
    known_e = {f.name for f in dataclasses.fields(EngineConfig)}
    problems += [f"unknown engine setting {k!r} (valid: {', '.join(sorted(known_e))})" for k in engine
                 if k not in known_e]
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        run = load_run_config(args)
        mcfg = run.model_config()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .train import train  # torch is imported only once the settings are known to be valid

    return train(run, mcfg, resume=args.resume)


if __name__ == "__main__":
    sys.exit(main())
