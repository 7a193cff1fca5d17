"""finetune.py end to end on tiny settings: shipped configs, a run, resume equality, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lohan.app.cli import build_parser, load_run_config, main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_is_valid(path):
    run = load_run_config(build_parser().parse_args(["--config", str(path)]))
    assert run.model_config().param_count() > 0
    assert yaml.safe_load(path.read_text())["model"] == run.model


def args(tmp_path, *extra):
    return ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--batch-size", "2",
            "--seq-len", "32", "--set", "model_overrides.n_layer=2", "--backend", "threads", *extra]


def losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


def test_run_writes_metrics_and_loss_falls(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "8", "--lr", "3e-3", "--warmup-steps", "0")) == 0
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"]
    out = capsys.readouterr().out
    assert "tok/s" in out and "TFLOPS" in out and "GB/s" in out and "run summary" in out


def test_resume_continues_bit_identically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(args(a, "--steps", "4")) == 0
    assert main(args(b, "--steps", "2")) == 0
    assert main(args(b, "--steps", "4", "--resume")) == 0
    assert losses(b / "m.jsonl") == losses(a / "m.jsonl")


def test_bad_settings_exit_cleanly_and_write_nothing(tmp_path, capsys):
    assert main(args(tmp_path, "--cpu-mem", "1KiB", "--steps", "1")) == 2
    assert "cpu_mem" in capsys.readouterr().out
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir())
    assert main(args(tmp_path, "--set", "engine.prefetch=3")) == 2
    assert "unknown engine setting 'prefetch'" in capsys.readouterr().err
    assert main(args(tmp_path, "--model", "nope")) == 2
    assert "choose a preset" in capsys.readouterr().err


def _run(*argv: str):
    return load_run_config(build_parser().parse_args(list(argv)))


def test_a_model_other_than_the_default_configs_does_not_inherit_its_schedule(tmp_path):
    """The default config (configs/tiny.yaml) tunes lr, warm-up and a 150-step cosine for its 2M-parameter demo: a
    local Hugging Face model run without --config gets the fine-tuning defaults instead (lr 2e-5, warm-up 3% of
    the steps, the cosine over the run's steps), a preset the EngineConfig defaults; flags, --set and an explicit
    --config still decide."""
    from lohan.app.cli import FINETUNE_LR
    from lohan.config import EngineConfig

    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    tiny = _run()
    assert (tiny.engine.lr, tiny.engine.warmup_steps, tiny.engine.total_steps) == (2e-3, 15, 150)
    run = _run("--model", str(hf), "--steps", "300")
    assert (run.engine.lr, run.engine.warmup_steps, run.engine.total_steps) == (FINETUNE_LR, 9, None)
    assert run.engine.weight_decay == EngineConfig.weight_decay and run.engine.betas == EngineConfig.betas
    assert _run("--model", str(hf), "--steps", "300", "--lr", "1e-3").engine.lr == 1e-3
    assert _run("--model", str(hf), "--set", "engine.lr=5e-5").engine.lr == 5e-5
    assert _run("--model", str(hf), "--steps", "300", "--warmup-steps", "0").engine.warmup_steps == 0
    preset = _run("--model", "13b")
    assert (preset.engine.lr, preset.engine.warmup_steps, preset.engine.total_steps) == (
        EngineConfig.lr, EngineConfig.warmup_steps, None)
    own = tmp_path / "run.yaml"
    own.write_text(f"model: {hf}\nengine:\n  lr: 1.0e-4\n  nvme: [{tmp_path / 'nvme'}]\n")
    assert _run("--config", str(own)).engine.lr == 1e-4  # a config of one's own is taken as it is


def test_the_header_states_the_schedule(tmp_path, capsys):
    assert main(["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--steps", "1",
                 "--set", "model_overrides.n_layer=1", "--batch-size", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert ("optimizer: AdamW lr 0.002, warm-up 15 step(s), cosine to 0.0002 at step 150, weight decay 0.01, "
            "betas (0.9, 0.95), eps 1e-08; gradients clipped at global norm 1 (auto)") in out


def test_help_config_lists_every_key_with_its_default_and_meaning(capsys):
    import dataclasses

    from lohan.config import FLAT_KEYS, RunConfig

    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(RunConfig):
        if f.name not in ("engine", "model_overrides"):
            assert f"\n  {f.name}  [" in out
    for name, section in FLAT_KEYS.items():  # by section, each under its flat name
        assert f"\n  engine.{name}  [" in out
        assert out.index(f"\nengine.{section} (") < out.index(f"\n  engine.{name}  [")
    assert "  engine.cpu_mem  [8GiB] tiny.yaml: 2GiB\n      Main-memory budget" in out  # built-in, shipped, doc
    assert "``" not in out and ":mod:" not in out  # read as text, not reST


def test_help_is_grouped_with_defaults_and_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    groups = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups[-7:] == ["model", "data", "optimization", "memory and storage", "run", "output", "examples"]
    flat = " ".join(out.split())
    assert "sequences per optimizer step [8]" in flat and "Adam betas [0.9 0.95]" in flat  # the shipped config's
    assert "initialization and data-order seed [0]" in flat  # a built-in default
    assert flat.count("python finetune.py") >= 3  # the examples
