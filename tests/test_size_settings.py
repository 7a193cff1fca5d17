"""Flag names in the engine settings' messages (issue 42, item 10): the bf16-master refusal names the flag that
exists (``--compute-dtype``, not ``--dtype``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lohan.app.cli import build_parser, main
from lohan.config import EngineConfig


def test_bf16_master_refusal_names_the_compute_dtype_flag(tmp_path: Path, capsys):
    with pytest.raises(ValueError, match=r"needs compute_dtype bf16, not fp32 \(--compute-dtype bf16\)"):
        EngineConfig(state_format="bf16-master", compute_dtype="fp32")
    assert main(["--nvme", str(tmp_path / "nvme"), "--state-format", "bf16-master", "--compute-dtype", "fp16"]) == 2
    out = "".join(capsys.readouterr())
    assert "(--compute-dtype bf16)" in out and "--dtype" not in out, out
    help_text = "".join(build_parser().format_help().split())  # argparse wraps lines, also after a hyphen
    assert "needs--compute-dtypebf16" in help_text and "--dtype" not in help_text


def test_the_store_layer_names_the_compute_dtype_flag_too():
    torch = pytest.importorskip("torch")
    from lohan.store.states import plan_layout

    with pytest.raises(ValueError, match=r"not fp32 \(--compute-dtype bf16\)"):
        plan_layout([torch.nn.Linear(4, 4, device="meta")], ["block0"], "fp32", 2, state_format="bf16-master")
