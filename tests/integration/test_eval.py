"""Evaluation: `Engine.evaluate` equals the plain PyTorch model's loss, leaves training bit-identical, and
`finetune.py --eval-fraction/--eval-data/--eval-every` reports it (step line, metrics, plot, summary) and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lohan
from lohan.app.cli import main
from lohan.config import EngineConfig, get_model_config
from lohan.models.gpt import build_model


def tiny_cfg(**kw):
    return get_model_config("tiny", **{"vocab_size": 256, "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32,
                                       **kw})


def engine_config(dirs, **kw) -> EngineConfig:
    base = dict(nvme=tuple(dirs), cpu_mem="512MiB", compute_dtype="fp32", lr=1e-2, warmup_steps=2, total_steps=6,
                seed=5, backend="threads")
    return EngineConfig(**{**base, **kw})


def batches(n: int, batch: int = 4, seq: int = 32, seed: int = 123) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (batch, seq + 1), generator=g)
        y = x[:, 1:].clone()
        y[:, :5] = -100  # masked targets, as prompt tokens are
        out.append((x[:, :-1], y))
    return out


def reference_loss(model, batch, micro_batches: int) -> float:
    """Plain PyTorch, eval mode, no grad: the mean of the micro-batches' losses, summed as the engine does."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in zip(batch[0].chunk(micro_batches), batch[1].chunk(micro_batches)):
            total += float(model(x, y)[1] / micro_batches)
    return total


def load_engine_weights(model, engine) -> None:
    """The engine's committed fp32 weights into the reference model ('block3.x' -> 'blocks.3.x')."""
    weights = {}
    for name, t in engine.state_dict_fp32().items():
        block, _, rest = name.partition(".")
        weights[f"blocks.{block[5:]}.{rest}" if block.startswith("block") else name] = t
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.pop(name))
    assert not weights, f"engine weights the model does not have: {sorted(weights)}"


@pytest.mark.parametrize(("tied", "micro_batches"), [(True, 1), (False, 2)])
def test_evaluate_equals_the_pytorch_model_in_eval_mode(make_dirs, tied, micro_batches):
    mcfg = tiny_cfg(tie_embeddings=tied)
    ecfg = engine_config(make_dirs(1), micro_batches=micro_batches)
    held_out = batches(2, seed=7)
    model = build_model(mcfg, device="cpu", seed=ecfg.seed)
    with lohan.init(mcfg, ecfg) as engine:
        for b in held_out:  # the initial weights, as build_model draws them from the same seed
            assert engine.evaluate(b) == reference_loss(model, b, micro_batches)
        for b in batches(3):
            engine.step(b)
        load_engine_weights(model, engine)  # the weights after three updates
        for b in held_out:
            assert engine.evaluate(b) == reference_loss(model, b, micro_batches)
        assert engine.streamer.resident == [] and engine.step_count == 3
        x, y = held_out[0]
        with pytest.raises(ValueError, match="equal shape"):
            engine.evaluate((x[:, :4], y))
        if micro_batches > 1:
            with pytest.raises(ValueError, match="not divisible by micro_batches=2"):
                engine.evaluate((x[:3], y[:3]))


def test_training_with_evaluation_interleaved_is_bit_identical(make_dirs):
    """Evaluations before, between and after the steps change neither the losses nor the weights: no state of the
    streamer, the activation manager (swapped activations, first-step plan), the optimizer or the store moves."""
    mcfg = tiny_cfg()
    train, held_out = batches(4), batches(2, seed=9)
    kw = dict(micro_batches=2, act_policy="swap-all", mode="optimized")
    with lohan.init(mcfg, engine_config(make_dirs(1, "a"), **kw)) as engine:
        plain = [engine.step(b) for b in train]
        plain_weights = engine.state_dict_fp32()
    evals = []
    with lohan.init(mcfg, engine_config(make_dirs(1, "b"), **kw)) as engine:
        losses = []
        evals.append(engine.evaluate(held_out[0]))  # before the first step (and its activation plan)
        for b in train:
            losses.append(engine.step(b))
            evals += [engine.evaluate(h) for h in held_out]
        weights = engine.state_dict_fp32()
    assert losses == plain
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    assert evals[1] != evals[0]  # each evaluation sees the weights committed by the step before it


# ---------------------------------------------------------------------------------------------- CLI


def args(tmp_path, *extra):
    return ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--batch-size", "2",
            "--seq-len", "32", "--set", "model_overrides.n_layer=2", "--backend", "threads", *extra]


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_cli_run_with_eval_reports_it_in_the_line_metrics_plot_and_summary(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "5", "--eval-fraction", "0.001", "--eval-every", "2")) == 0
    rs = records(tmp_path / "m.jsonl")
    assert [r["step"] for r in rs if "eval_loss" in r] == [2, 4, 5]  # every 2 steps and at the end
    assert all("eval_loss" not in r and "eval_s" not in r for r in rs if r["step"] in (1, 3))
    for r in (r for r in rs if "eval_loss" in r):
        assert r["eval_ppl"] == pytest.approx(torch.tensor(r["eval_loss"]).exp().item(), rel=1e-5)
        assert r["eval_s"] > 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 5  # a log file (not a terminal): the short line, an evaluation on a line of its own
    evals = [line for line in out.splitlines() if line.startswith("  eval after step ")]
    assert [int(line.split()[3].rstrip(":")) for line in evals] == [2, 4, 5] and all("ppl" in e for e in evals)
    assert "eval: " in out and "held out from" in out
    summary = out[out.index("run summary"):]
    assert "eval        last" in summary and "3 evaluation(s)" in summary and "% of the run time" in summary
    assert (tmp_path / "m.png").stat().st_size > 0
    # the held-out sequences are not trained on: the training stream is the rest
    state = json.loads((tmp_path / "nvme" / "lohan.run.json").read_text())
    corpus_windows = (Path(lohan.__file__).parent.parent / "data" / "corpus.txt").stat().st_size - 1
    assert state["iterator"]["n_windows"] == corpus_windows // 32 - round(0.001 * (corpus_windows // 32))


def test_cli_resume_with_eval_continues_identically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    flags = ["--eval-fraction", "0.001", "--eval-every", "2", "--set", "engine.total_steps=4"]
    assert main(args(a, "--steps", "4", *flags)) == 0
    assert main(args(b, "--steps", "2", *flags)) == 0
    assert main(args(b, "--steps", "4", "--resume", *flags)) == 0
    ra, rb = records(a / "m.jsonl"), records(b / "m.jsonl")
    assert [r["loss"] for r in rb] == [r["loss"] for r in ra]
    assert [(r["step"], r["eval_loss"]) for r in rb if "eval_loss" in r] == [
        (r["step"], r["eval_loss"]) for r in ra if "eval_loss" in r] and len(ra) == 4


def test_cli_eval_data_file_and_bad_eval_settings(tmp_path, capsys):
    text = tmp_path / "eval.txt"
    text.write_text("A small held-out text, read with the same byte-level tokenizer as the data. " * 4)
    assert main(args(tmp_path / "ok", "--steps", "2", "--eval-data", str(text))) == 0
    rs = records(tmp_path / "ok" / "m.jsonl")
    assert "eval_loss" not in rs[0] and rs[1]["eval_loss"] > 0  # no --eval-every: at the end only
    assert f"from {text}" in capsys.readouterr().out
    for extra, problem in [
        (["--eval-fraction", "0.7"], "eval_fraction=0.7 must be a number in (0, 0.5]"),
        (["--eval-fraction", "0"], "eval_fraction=0.0 must be a number in (0, 0.5]"),
        (["--eval-data", str(text), "--eval-every", "0"], "eval_every=0 must be an integer >= 1"),
        (["--eval-every", "5"], "eval_every needs an eval set"),
        (["--eval-data", str(tmp_path / "nope.txt")], "nope.txt' does not exist"),
        (["--eval-data", str(text), "--eval-fraction", "0.1"], "pass one of them"),
        (["--data", "synthetic", "--eval-fraction", "0.1"], "synthetic data has none"),
    ]:
        assert main(args(tmp_path / "bad", "--steps", "1", *extra)) == 2
        assert problem in capsys.readouterr().err, extra
    assert not (tmp_path / "bad").exists()
