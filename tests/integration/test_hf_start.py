"""The start of a Hugging Face run (issue 42, items 10 and 11): it prints no warning a user cannot act on, and
weights that hold NaN or infinite values are refused as they are imported, naming the tensor and its file, before
a step is trained (they were found only after `max_bad_steps` skipped steps, with advice to lower the lr)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lohan.app.cli import main  # noqa: E402
from tests.unit.models.test_hf import make_hf_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

NOISE = ("torch/utils/_pytree.py", "KernelPreference", "ScaleCalculationMode", "_C_mxfp8", "_C_cutlass_90a",
         "Detected no triton", "torchao")
"""What every Hugging Face run printed while transformers imported torchao (lohan/models/hf_imports.py)."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return Path(make_hf_dir(tmp_path_factory.mktemp("tiny-llama"), "llama"))


def corpus(path: Path) -> Path:
    """Text in the tiny tokenizer's words (w3..w39), enough for a few batches of 16 tokens."""
    path.write_text("\n".join(" ".join(f"w{3 + (7 * i + j) % 37}" for j in range(12)) for i in range(60)) + "\n")
    return path


def test_finetune_and_export_print_no_warning_nobody_can_act_on(tiny_llama: Path, tmp_path: Path):
    pytest.importorskip("torchao", reason="the warnings came from importing torchao; without it there are none")
    args = ["--model", str(tiny_llama), "--data", str(corpus(tmp_path / "corpus.txt")), "--nvme",
            str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--export", str(tmp_path / "export"),
            "--compute-dtype", "fp32", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--backend", "threads"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "finetune.py"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert (tmp_path / "export" / "model.safetensors").is_file(), text[-4000:]
    noise = [line for line in text.splitlines() if any(n in line for n in NOISE)]
    assert not noise, "\n".join(noise)


def test_nan_and_inf_in_imported_weights_are_refused_with_the_tensor_and_file(tiny_llama: Path, tmp_path: Path,
                                                                              capsys):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(tiny_llama):
        (model / name).write_bytes((tiny_llama / name).read_bytes())
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key][3, 5] = math.nan
    tensors[key][0, 0] = -math.inf
    save_file(tensors, weights, metadata={"format": "pt"})
    metrics = tmp_path / "m.jsonl"
    args = ["--model", str(model), "--data", "synthetic", "--nvme", str(tmp_path / "nvme"), "--metrics", str(metrics),
            "--compute-dtype", "fp32", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--backend", "threads"]
    assert main(args) == 2
    text = "".join(capsys.readouterr())
    assert re.search(rf"^error: tensor '{re.escape(key)}' in {re.escape(str(weights))} holds 1 NaN and 1 infinite "
                     r"values \(of 2,048\): the checkpoint is damaged.*--resume .*--overwrite", text, re.M | re.S), text
    assert "skipped" not in text and not metrics.exists()  # refused at import: no step ran, no metrics written
