"""EngineConfig in sections: the flat spellings (YAML, --set, keyword arguments, saved run states) stay aliases of
the sectioned ones, `dataclasses.replace` keeps working, and the command line is generated from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
import typing
from pathlib import Path

import pytest
import yaml

from lohan import config as C
from lohan.app.cli import _FLAGS, build_parser, load_run_config
from lohan.config import ENGINE_SECTIONS, FLAT_KEYS, EngineConfig, MemoryConfig

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "configs").rglob("*.yaml"))


def _load(*argv: str):
    return load_run_config(build_parser().parse_args(list(argv)))


def test_every_setting_is_in_exactly_one_section_and_has_a_type_and_a_doc():
    from lohan.app.help_text import field_docs

    names = [f.name for cls in ENGINE_SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(FLAT_KEYS)  # unique: the flat names are unambiguous
    for cls in ENGINE_SECTIONS.values():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f.name in hints and docs.get(f.name), f"{cls.__name__}.{f.name} needs a type and a docstring"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads_unchanged(path):
    """Every key a shipped YAML sets (flat, as they are written) arrives in its section with the value given."""
    run = _load("--config", str(path))
    given = yaml.safe_load(path.read_text()).get("engine") or {}
    settings = run.engine.settings()
    for key, value in given.items():
        section = FLAT_KEYS[key]
        assert getattr(getattr(run.engine, section), key) == settings[key]
        if key not in C.SIZE_FIELDS:  # (sizes are stored as bytes)
            assert settings[key] == (tuple(value) if isinstance(value, list) else value), key


def test_flat_and_sectioned_spellings_build_the_same_config():
    flat = EngineConfig(cpu_mem="2GiB", mode="serial", lr=1e-3)
    assert flat == EngineConfig(memory={"cpu_mem": "2GiB"}, execution={"mode": "serial"}, schedule={"lr": 1e-3})
    assert flat == EngineConfig(memory=MemoryConfig(cpu_mem="2GiB"), mode="serial", lr=1e-3)
    assert flat.memory.cpu_mem == 2 << 30 and flat.execution.mode == "serial" and flat.schedule.lr == 1e-3
    assert flat.settings()["cpu_mem"] == 2 << 30


def test_yaml_sections_and_set_keys_in_both_spellings(tmp_path):
    own = tmp_path / "own.yaml"
    own.write_text("model: tiny\ndata: synthetic\nengine:\n  nvme: [n]\n  memory:\n    cpu_mem: 2GiB\n  lr: 1.0e-3\n")
    run = _load("--config", str(own))
    assert (run.engine.memory.cpu_mem, run.engine.schedule.lr) == (2 << 30, 1e-3)
    for key in ("engine.cpu_mem", "engine.memory.cpu_mem"):  # --set overrides the file, in either spelling
        assert _load("--config", str(own), "--set", f"{key}=3GiB").engine.memory.cpu_mem == 3 << 30
    assert _load("--config", str(own), "--set", "engine.execution.mode=serial").engine.execution.mode == "serial"
    both = _load("--config", str(own), "--set", "engine.memory={cpu_mem: 1GiB, prefetch_depth: 3}").engine.memory
    assert (both.cpu_mem, both.prefetch_depth) == (1 << 30, 3)


@pytest.mark.parametrize("engine, message", [
    ({"memory": {"cpu_mem": "2GiB"}, "cpu_mem": "4GiB"}, "cpu_mem is given twice"),
    ({"memory": {"mode": "serial"}}, "engine.memory.mode: unknown setting of engine.memory"),
    ({"memory": 5}, "engine.memory: give a mapping of its settings"),
])
def test_a_sectioned_yaml_mistake_is_named(tmp_path, engine, message):
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({"model": "tiny", "data": "synthetic", "engine": engine}))
    with pytest.raises(ValueError, match=message):
        _load("--config", str(own))
    with pytest.raises(ValueError, match=message):  # and the same from the Python API
        EngineConfig(**engine)


def test_set_of_a_setting_under_another_section_is_refused():
    with pytest.raises(ValueError, match="engine.memory.mode: unknown setting of engine.memory"):
        _load("--set", "engine.memory.mode=serial")


def test_replace_and_with_overrides_change_one_setting_and_validate_again():
    cfg = EngineConfig(cpu_mem="2GiB", lr=1e-3)
    new = dataclasses.replace(cfg, mode="serial")
    assert (new.execution.mode, new.memory.cpu_mem, new.schedule.lr) == ("serial", 2 << 30, 1e-3)
    assert cfg.execution.mode == "optimized"  # the original is untouched (each config owns its sections)
    assert cfg.with_overrides(memory=MemoryConfig(cpu_mem="1GiB")).memory.cpu_mem == 1 << 30
    with pytest.raises(ValueError, match="slots=3"):
        dataclasses.replace(cfg, slots=3)
    with pytest.raises(TypeError, match="unknown setting"):
        EngineConfig(chunk_bytes="1MiB")


def test_flat_aliases_are_read_only_and_the_class_attribute_is_the_default():
    cfg = EngineConfig(cpu_mem="2GiB")
    assert cfg.cpu_mem == cfg.memory.cpu_mem and cfg.warmup == cfg.schedule.warmup
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cpu_mem = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.memory.cpu_mem = 1  # type: ignore[misc]
    assert EngineConfig.weight_decay == C.ScheduleConfig.weight_decay and EngineConfig.mode == "optimized"
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # (configs travel to data-parallel workers)


def test_a_run_state_saved_with_flat_schedule_keys_still_compares():
    """The run state saves the settings a resume may change by their flat names; one written before the sections
    (these keys) is compared key by key, so a change is still said."""
    from lohan.app.train import _schedule, _schedule_changes

    old_keys = ("lr", "lr_scheduler", "warmup_steps", "warmup_ratio", "total_steps", "min_lr_ratio", "min_lr",
                "decay_ratio", "weight_decay", "betas", "eps", "max_grad_norm")
    saved = {k: v for k, v in _schedule(EngineConfig()).items() if k in old_keys}
    assert set(saved) == set(old_keys)
    assert _schedule_changes(saved, EngineConfig()) == ""
    assert _schedule_changes(saved, EngineConfig(lr=1e-3, max_grad_norm=0.5)) == (
        "lr 0.0003 -> 0.001, max_grad_norm 1.0 -> 0.5")


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in build_parser()._actions}


def test_flags_are_generated_from_the_fields():
    """Each flag's choices come from its field's Literal type, its type from the annotation, its help from the
    field; the flag table maps every one to its field."""
    actions = _actions()
    assert actions["mode"].choices == list(C.MODES) and actions["compute_dtype"].choices == list(C.COMPUTE_DTYPES)
    assert actions["state_format"].choices == list(C.STATE_FORMATS)
    assert actions["slots"].choices == [1, 2] and actions["slots"].type is int
    assert actions["data_format"].choices == list(C.DATA_FORMATS)
    assert actions["betas"].nargs == 2 and actions["betas"].type is float and actions["nvme"].nargs == "+"
    assert actions["steps"].type is int and actions["eval_fraction"].type is float
    for dest, (section, name) in _FLAGS.items():
        assert dest in actions
        field = {f.name: f for f in dataclasses.fields(C.RunConfig if section is None else ENGINE_SECTIONS[
            FLAT_KEYS[name]])}[name]
        assert actions[dest].help.startswith(field.metadata["flag"].help.split("%")[0])
    assert _FLAGS["lora"] == ("engine", "lora_r")


def test_every_flag_keeps_its_spelling():
    """The flags before they were generated (tests/integration/test_cli.py covers their behaviour)."""
    before = {"model", "layers", "seq_len", "compute_dtype", "device", "sim_gpu", "data", "data_format", "text_field",
              "split", "batch_size", "micro_batches", "eval_data", "eval_split", "eval_fraction", "eval_every",
              "steps", "epochs", "lr", "warmup_steps", "total_steps", "lr_scheduler", "warmup_ratio", "min_lr_ratio",
              "min_lr", "decay_ratio", "weight_decay", "betas", "eps", "max_grad_norm", "clip_mode", "seed", "lora",
              "lora_alpha", "lora_dropout", "lora_targets", "nvme", "cpu_mem", "gpu_mem", "mode", "act_policy",
              "act_mem", "act_compress", "slots", "persist_every", "state_format", "backend", "prefetch_depth",
              "config", "set", "resume", "overwrite", "verify", "dry_run", "hardware", "help_config", "verbose",
              "metrics", "log_every", "report_to", "logging_dir", "export", "export_merged", "export_dtype",
              "save_every", "save_total_limit", "help"}
    assert set(_actions()) == before


def _config_reads():
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_reads", REPO / "scripts" / "config_reads.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("config_reads", module)  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_no_module_in_lohan_reads_a_flat_alias():
    """lohan/ reads settings through their sections, so the flat aliases can be retired once other code has moved
    (`python scripts/config_reads.py --write` moves a merged branch's reads)."""
    reads = _config_reads()
    left = [f"{path.relative_to(REPO)}:{r.line}: {r.receiver}.{r.name} (use {r.receiver}.{r.section}.{r.name})"
            for path in sorted((REPO / "lohan").rglob("*.py")) for r in reads.flat_reads(path.read_text())]
    assert not left, "flat config reads:\n" + "\n".join(left)


def test_the_read_finder_knows_how_lohan_names_its_configs():
    reads = _config_reads()
    source = '''
def f(cfg: ModelConfig, e: EngineConfig, run):
    a, b = cfg.name, e.cpu_mem              # a model config's name; an engine config's budget
    c = run.engine.mode + self.cfg.lr
    for cfg in presets:
        cfg.name
    x = e.with_overrides(slots=1)
    return x.slots, e.memory.cpu_mem, engine.device
'''
    found = [(r.receiver, r.name) for r in reads.flat_reads(source)]
    assert found == [("e", "cpu_mem"), ("run.engine", "mode"), ("self.cfg", "lr"), ("x", "slots")]
    assert "e.memory.cpu_mem" in reads.rewrite(source) and "x.store.slots" in reads.rewrite(source)


def test_no_choice_list_is_written_out_of_the_config():
    """Each list of choices is written once, as a Literal type in lohan/config/: a tuple or list of the same
    names elsewhere in lohan/ (or three or more of them) would drift from it."""
    import ast

    choices = [set(getattr(C, n)) for n in ("MODES", "COMPUTE_DTYPES", "STATE_FORMATS", "SCHEDULERS", "CLIP_MODES",
                                            "BACKENDS", "DEVICES", "ACT_COMPRESSIONS", "ACT_POLICIES", "DATA_FORMATS",
                                            "NO_DECAY_KINDS")]
    found = []
    for path in sorted((REPO / "lohan").rglob("*.py")):
        if path.parent == REPO / "lohan" / "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                names = {e.value for e in node.elts}
                if any(names == c or (len(names) >= 3 and names <= c) for c in choices):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {sorted(names)}")
    assert not found, "choice lists written out (use lohan.config's):\n" + "\n".join(found)
