"""benchmarks/mem_bench.py's accounting of the peak RSS (over a synthetic report; no model is trained here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import mem_bench  # noqa: E402

GiB = 1 << 30


def _report() -> dict:
    torch_run = {"system": "torch", "states_bytes": 16 * 100_000_000, "rss_ready_bytes": int(0.42 * GiB),
                 "peak_rss_steps_bytes": int(2.7 * GiB), "peak_rss_bytes": int(2.7 * GiB), "step_s": [3.0, 2.9]}
    lohan_run = {"system": "lohan", "rss_ready_bytes": int(2.2 * GiB), "peak_rss_steps_bytes": int(4.1 * GiB),
                 "peak_rss_bytes": int(4.1 * GiB), "step_s": [3.2, 3.1],
                 "ready": {"pool_allocated": {"params": 0, "grads": 0, "records": int(1.6 * GiB)}},
                 "pool_peak_allocated": {"params": int(0.4 * GiB), "grads": int(0.4 * GiB),
                                         "records": int(1.6 * GiB)},
                 "memory_plan": {"params": int(0.4 * GiB)}, "resident_blocks": "14 of 14",
                 "activation_tier_bytes": int(0.6 * GiB)}
    return {"runs": {"torch": torch_run, "lohan": lohan_run}}


def test_accounting_parts_add_up_to_each_peak():
    rows = mem_bench.accounting(_report())
    *parts, (name, torch_peak, lohan_peak) = rows
    assert name == "peak RSS of the steps"
    assert sum(t for _, t, _ in parts) == pytest.approx(torch_peak)
    assert sum(v for _, _, v in parts) == pytest.approx(lohan_peak)
    by = {k: (t, v) for k, t, v in rows}
    # torch's states: weights, m and v (12 B a parameter) beside lohan's records, its gradients beside lohan's pool
    assert by["records pool (P32, m, v; P16 where kept)"][0] * GiB == pytest.approx(12 * 100_000_000)
    assert by["grads pool (with the stash)"][0] * GiB == pytest.approx(4 * 100_000_000)
    assert by["process"][1] == pytest.approx(2.2 - 1.6)  # lohan's RSS once built, less its pools then
    assert by["activation records in RAM (lohan's CPU tier)"] == pytest.approx((0.0, 0.6))


def test_command_names_an_outside_scratch_by_its_role(tmp_path):
    outside = mem_bench.command(["--scratch", str(tmp_path), "--seq", "64"], tmp_path)
    assert outside == "benchmarks/mem_bench.py --scratch SCRATCH --seq 64"
    inside = mem_bench.REPO / "benchmarks" / "scratch" / "mem_bench"
    assert mem_bench.command(["--scratch", str(inside)], inside) == \
        "benchmarks/mem_bench.py --scratch benchmarks/scratch/mem_bench"
