"""Byte sizes and flag names in the engine settings (issue 42, item 10): a negative, infinite or meaningless size is
refused by config validation, for every size field, with what is wrong and how to write it (``--act-mem=-5GiB``
was accepted); the bf16-master refusal names the flag that exists (``--compute-dtype``, not ``--dtype``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lohan.app.cli import build_parser, main
from lohan.config import SIZE_FIELDS, EngineConfig, parse_bytes


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value,problem", [("-5GiB", "is below zero: a size is 0 or more"), (-4096, "is below zero"),
                                           ("-0.5MiB", "is below zero"), ("1e400GiB", "cannot read")])
def test_every_size_field_refuses_a_negative_or_unreadable_size(field, value, problem):
    with pytest.raises(ValueError) as err:
        EngineConfig(**{field: value})
    line = next(x for x in str(err.value).splitlines() if x.startswith(f"  - {field}:"))
    assert repr(value) in line and problem in line and "write e.g. 8GiB" in line, line


@pytest.mark.parametrize("settings,problem", [
    (dict(gpu_mem=0), "gpu_mem=0: give the device memory the run must fit in, e.g. 24GiB, or leave it unset"),
    (dict(opt_chunk_bytes="0MiB"), "opt_chunk_bytes=0: give the largest piece of a record"),
    (dict(stripe_bytes="3000B"), "stripe_bytes=3000: the stripe unit over the SSD directories must be a positive "
                                 "multiple of 4 KiB"),
    (dict(stripe_bytes=0), "stripe_bytes=0: .* positive multiple of 4 KiB"),
])
def test_sizes_that_mean_nothing_are_refused(settings, problem):
    with pytest.raises(ValueError, match=problem):
        EngineConfig(**settings)


def test_zero_and_ordinary_sizes_are_accepted():
    e = EngineConfig(cpu_mem="8GiB", act_mem=0, gpu_mem="24GiB", stripe_bytes="1MiB", opt_chunk_bytes="512MiB",
                     resident_mem=0, readahead_mem="0B")
    assert (e.act_mem, e.gpu_mem, e.stripe_bytes, e.resident_mem, e.readahead_mem) == (0, 24 * 2**30, 2**20, 0, 0)
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes(0) == 0


def test_negative_act_mem_flag_is_refused_and_nothing_is_written(tmp_path: Path, capsys):
    args = ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--steps", "1",
            "--act-mem=-5GiB"]
    assert main(args) == 2
    out = "".join(capsys.readouterr())
    assert re.search(r"^error: invalid engine config:\n  - act_mem: '-5GiB' is below zero: a size is 0 or more; write "
                     "e.g. 8GiB", out, re.M), out
    assert list(tmp_path.iterdir()) == []


def test_a_bare_negative_number_is_refused_as_negative_not_asked_for_a_unit(tmp_path: Path, capsys):
    assert main(["--nvme", str(tmp_path / "nvme"), "--set", "engine.act_mem=-5"]) == 2
    out = "".join(capsys.readouterr())
    assert "act_mem: -5 is below zero" in out and "-5GiB" not in out, out
    assert list(tmp_path.iterdir()) == []


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
