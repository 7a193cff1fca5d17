"""Learning-rate schedules (--lr-scheduler cosine|linear|constant|wsd, --warmup-ratio, --min-lr, --decay-ratio): the
lr the engine updates with at every step against closed forms written out here, the settings' refusals, the
run header, the plot's lr panel, and a resume that changes the schedule."""

from __future__ import annotations

import json
import math

import pytest

import lohan
from lohan.app.cli import build_parser, load_run_config, main
from lohan.config import EngineConfig
from tests.integration.test_cli import args
from tests.integration.test_engine_equivalence import batches, tiny_cfg

LR, MIN_LR, TOTAL = 1e-3, 1e-4, 12
WARMUP = 3  # warmup_ratio 0.25 of 12 steps
DECAY = 3   # wsd: decay_ratio 0.25 of 12 steps, the steps 9, 10, 11 (0-based)


def reference_lr(scheduler: str, step: int) -> float:
    """The lr of 0-based step `step`, from the definitions (not from lohan's code)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    if scheduler == "constant":
        return LR
    if scheduler == "cosine":
        return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP))) / 2
    if scheduler == "linear":
        return MIN_LR + (LR - MIN_LR) * (TOTAL - step) / (TOTAL - WARMUP)
    assert scheduler == "wsd"
    if step < TOTAL - DECAY:
        return LR
    return MIN_LR + (LR - MIN_LR) * (1 - math.sqrt((step - (TOTAL - DECAY)) / DECAY))


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant", "wsd"])
def test_the_engine_updates_with_the_schedules_lr_at_every_step(make_dirs, scheduler):
    mcfg = tiny_cfg(n_layer=1, d_model=32, n_head=2, vocab_size=64, seq_len=16)
    ecfg = EngineConfig(nvme=tuple(make_dirs(1)), cpu_mem="512MiB", compute_dtype="fp32", backend="threads",
                        lr=LR, min_lr=MIN_LR, warmup_ratio=0.25, total_steps=TOTAL, lr_scheduler=scheduler,
                        decay_ratio=0.25)
    used = []
    with lohan.init(mcfg, ecfg) as engine:
        for batch in batches(TOTAL, 2, 16, 64):
            engine.step(batch)
            used.append(engine.last_stats.lr)
    want = [reference_lr(scheduler, s) for s in range(TOTAL)]
    # equal to the last bits or so: lohan computes lr x factor (as LambdaLR does), the reference min + (lr - min) x c
    assert used == pytest.approx(want, rel=1e-12, abs=0)
    if scheduler == "wsd":
        assert used[WARMUP:TOTAL - DECAY] == [LR] * (TOTAL - DECAY - WARMUP)  # the stable phase, exactly


def _run(*argv: str):
    return load_run_config(build_parser().parse_args(list(argv)))


def test_two_ways_to_set_one_thing_are_refused_and_a_flag_replaces_the_files_other_way(tmp_path, capsys):
    assert main(args(tmp_path, "--min-lr", "1e-5", "--min-lr-ratio", "0.1")) == 2
    assert "min_lr=1e-05 and min_lr_ratio=0.1 both set where the decay ends: give one" in capsys.readouterr().err
    assert main(args(tmp_path, "--warmup-steps", "5", "--warmup-ratio", "0.1")) == 2
    assert "warmup_steps=5 and warmup_ratio=0.1 both set the warm-up: give one" in capsys.readouterr().err
    assert main(args(tmp_path, "--lr", "1e-4", "--min-lr", "1e-3")) == 2
    assert "min_lr=0.001 is above the peak lr=0.0001" in capsys.readouterr().err
    assert main(args(tmp_path, "--decay-ratio", "0")) == 2
    assert "decay_ratio=0.0 must be a number in (0, 1]" in capsys.readouterr().err
    assert main(args(tmp_path, "--lr-scheduler", "step")) == 2  # argparse's choices
    assert not (tmp_path / "nvme").exists()
    # configs/tiny.yaml says warmup_steps: 15; --warmup-ratio on the command line replaces it
    run = _run("--warmup-ratio", "0.1")
    assert (run.engine.warmup_steps, run.engine.warmup_ratio, run.engine.warmup) == (0, 0.1, 15)  # of 150
    own = tmp_path / "run.yaml"
    own.write_text("model: tiny\nengine:\n  min_lr_ratio: 0.2\n  total_steps: 10\n")
    run = _run("--config", str(own), "--min-lr", "1e-5")
    assert (run.engine.min_lr, run.engine.min_lr_ratio, run.engine.floor_ratio) == (1e-5, None, 1e-5 / 3e-4)
    assert _run("--config", str(own)).engine.floor_ratio == 0.2
    assert EngineConfig().min_lr_ratio == 0.1  # the default floor when neither is given
    hf = tmp_path / "model"  # a local Hugging Face model's fine-tuning warm-up (3% of the steps) yields to a ratio
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert _run("--model", str(hf), "--steps", "300").engine.warmup_steps == 9
    run = _run("--model", str(hf), "--steps", "300", "--set", "engine.warmup_ratio=0.1")
    assert (run.engine.warmup_steps, run.engine.warmup_ratio) == (0, 0.1)


def test_the_header_and_the_plot_show_the_schedule(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    assert main(args(tmp_path, "--steps", "4", "--lr-scheduler", "wsd", "--warmup-ratio", "0.25", "--decay-ratio",
                     "0.5", "--set", "engine.total_steps=8", "--min-lr", "1e-4")) == 0
    out = capsys.readouterr().out
    assert ("AdamW lr 0.002, warm-up 2 step(s) (0.25 of 8), then constant to step 4 and 1-sqrt decay over the last 4 "
            "(decay ratio 0.5) to 0.0001 (--min-lr) at step 8 (wsd), weight decay") in out
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lrs == [0.001, 0.002, 0.002, 0.002]
    (panel,) = [ax for ax in figures[0].axes if ax.get_ylabel() == "lr"]
    assert list(panel.lines[0].get_ydata()) == lrs
    assert main(args(tmp_path / "b", "--steps", "1", "--lr-scheduler", "linear", "--set", "engine.total_steps=8",
                     "--warmup-steps", "0")) == 0
    assert "no warm-up, linear to 0.0002 at step 8" in capsys.readouterr().out


def test_a_resume_with_another_schedule_says_what_changed(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "2", "--set", "engine.total_steps=6")) == 0
    capsys.readouterr()
    assert main(args(tmp_path, "--steps", "3", "--resume", "--set", "engine.total_steps=6", "--lr-scheduler", "wsd",
                     "--min-lr", "1e-5")) == 0
    out = capsys.readouterr().out
    assert ("the optimizer's settings differ from the run being resumed (lr_scheduler cosine -> wsd, min_lr_ratio "
            "0.1 -> None, min_lr None -> 1e-05); the steps from 3 on use the new ones") in out
