"""The start of a Hugging Face run (issue 42, item 11): it prints no warning a user cannot act on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.test_hf import make_hf_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

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

