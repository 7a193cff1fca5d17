"""finetune.py end to end on tiny settings: shipped configs, a run, resume equality, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lohan.cli import build_parser, load_run_config, main

REPO = Path(__file__).resolve().parent.parent
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
