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
import types
import typing
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml

from lohan.config import (
    COMPUTE_DTYPES,
    ENGINE_SECTIONS,
    FINETUNE_LR,
    FINETUNE_WARMUP,
    FLAT_KEYS,
    LORA_LR,
    PRESETS,
    SCHEDULE_FIELDS,
    EngineConfig,
    Flag,
    RunConfig,
    flat_engine_settings,
    is_model_dir,
    unitless_size_problems,
)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"  # lohan/app/cli.py -> the repository

__all__ = ["FINETUNE_LR", "FINETUNE_WARMUP", "LORA_LR", "build_parser", "load_run_config", "main"]


def config_flags() -> list[tuple[str | None, dataclasses.Field, Any]]:
    """(section, field, type) of every config field with a command-line flag (`lohan.config.setting`): RunConfig's
    (section None), then the engine sections' ("engine": the flat name is the key in the engine's settings)."""
    out = []
    for section, cls in [(None, RunConfig), *(("engine", c) for c in ENGINE_SECTIONS.values())]:
        hints = typing.get_type_hints(cls)
        out += [(section, f, hints[f.name]) for f in dataclasses.fields(cls) if "flag" in f.metadata]
    return out


# flag's dest -> (section, field); section None = RunConfig, "engine" = EngineConfig (by the setting's flat name)
_FLAGS: dict[str, tuple[str | None, str]] = {
    f.metadata["flag"].flag or f.name: (section, f.name) for section, f, _ in config_flags()}

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
    groups = {name: p.add_argument_group(name) for name in ("model", "data", "optimization", "memory and storage",
                                                            "run", "output")}
    for _, f, tp in config_flags():
        flag: Flag = f.metadata["flag"]
        groups[flag.group].add_argument("--" + (flag.flag or f.name).replace("_", "-"), **_flag_kwargs(tp, flag))
    groups["model"].add_argument(
        "--layers", type=int, metavar="N",
        help="run a slice of the model: its width with its first N transformer layers (a preset, or a Hugging Face "
             "directory, whose first N layers' weights are imported)")
    _run_flags(groups["run"])
    _export_flags(groups["output"])
    _show_defaults(p)
    return p


def _flag_kwargs(tp: Any, flag: Flag) -> dict[str, Any]:
    """argparse's arguments for a field of type `tp`: choices from a Literal, a number's type, nargs from a tuple
    (``int | str`` sizes and paths are read as text, as the config validates them)."""
    kw: dict[str, Any] = {"help": flag.help}
    if flag.metavar is not None:
        kw["metavar"] = flag.metavar
    if flag.parse is not None:
        return {**kw, "type": _PARSERS[flag.parse]}
    options = [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
    if len(options) != 1:
        return kw
    tp = options[0]
    if typing.get_origin(tp) is Literal:
        values = typing.get_args(tp)
        kw["choices"] = list(values)
        if not isinstance(values[0], str):
            kw["type"] = type(values[0])
    elif typing.get_origin(tp) is tuple:
        items = typing.get_args(tp)
        kw["nargs"] = "+" if items[-1] is Ellipsis else len(items)
        if items[0] is not str:
            kw["type"] = items[0]
    elif tp in (int, float):
        kw["type"] = tp
    return kw


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _run_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--config", type=Path, default=None, help="YAML run config (default: configs/tiny.yaml)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of any config field, e.g. engine.max_inflight_blocks=4 (or with its "
                        "section, engine.memory.max_inflight_blocks=4; repeatable; --help-config lists the keys)")
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


def _export_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--export", metavar="DIR",
                   help="after training, write the weights as a Hugging Face checkpoint to DIR")
    g.add_argument("--export-merged", metavar="DIR",
                   help="a LoRA run: write the base with the adapters merged in as a Hugging Face checkpoint to DIR "
                        "(instead of --export DIR, which writes the PEFT adapter folder)")
    g.add_argument("--export-dtype", choices=[d for d in COMPUTE_DTYPES if d != "auto"],
                   help="dtype of the exported weights (default: the Hugging Face model's own, from its config.json; "
                        "presets export fp32)")


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Append `[value]` to the help of each flag that maps to a config key: the shipped default config's value, else
    the built-in default (what a run without --config starts from); flags without one are left as they are."""
    try:
        shipped = yaml.safe_load(DEFAULT_CONFIG.read_text()) or {} if DEFAULT_CONFIG.exists() else {}
    except (OSError, yaml.YAMLError):
        shipped = {}
    built_in = {(None, f.name): f for f in dataclasses.fields(RunConfig)}
    built_in.update({("engine", f.name): f for c in ENGINE_SECTIONS.values() for f in dataclasses.fields(c)})
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
        raw = _resolve_inputs({**raw, "engine": flat_engine_settings(raw.get("engine"), f"{path}: engine")}, path)
    raw = dict(raw)
    engine = dict(raw.pop("engine", {}) or {})
    if getattr(args, "model", None) and raw.get("model") not in (None, args.model):
        # the YAML's shape overrides belong to its own model, not to the one asked for on the command line
        raw.pop("model_overrides", None)
        if args.config is None:  # nor does the default config's schedule (tuned for its 2M-parameter demo)
            for key in SCHEDULE_FIELDS:
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
        if parts[0] == "engine" and len(parts) == 2 and parts[1] in ENGINE_SECTIONS:  # a section's mapping
            engine.update(flat_engine_settings({parts[1]: value}, f"--set {key}: engine"))
        elif parts[0] == "engine" and len(parts) == 2:
            engine[parts[1]] = value
        elif parts[0] == "engine" and len(parts) == 3 and parts[1] in ENGINE_SECTIONS:
            engine.update(flat_engine_settings({parts[1]: {parts[2]: value}}, f"--set {key}: engine"))
        elif parts[0] == "model_overrides" and len(parts) == 2:
            raw.setdefault("model_overrides", {})[parts[1]] = value
        elif len(parts) == 1:
            raw[parts[0]] = value
        else:
            raise ValueError(f"--set {key}: unknown key; use FIELD, engine.FIELD, engine.SECTION.FIELD or "
                             "model_overrides.FIELD")
    _finetune_defaults(args, raw, engine)
    return _make_run_config(raw, engine)


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


_PARSERS = {"names": _names, "count-or-auto": _persist_every}
"""`lohan.config.Flag.parse`: the flags whose values their type does not say how to read."""


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
    known_e = set(FLAT_KEYS)
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

        ex = run.engine.execution
        device = resolve_device(ex.device)
        if ex.sim_gpu is not None:
            from lohan.runtime.simgpu import parse_sim_gpu

            if device != "sim":
                raise ValueError(f"--sim-gpu {ex.sim_gpu} models a GPU's timing on the simulated device, "
                                 f"but the device is {device}: add --device sim")
            parse_sim_gpu(ex.sim_gpu)
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
    lora = bool(run.engine.lora.lora_r)
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
