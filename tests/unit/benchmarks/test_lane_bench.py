"""benchmarks/lane_bench.py's machinery on a micro configuration (its targets live in the benchmark, not here)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import lane_bench  # noqa: E402

from lohan.config import get_model_config  # noqa: E402
from lohan.plan.planner import LANES_B  # noqa: E402

MICRO = ["--rounds", "1", "--warmup-steps", "0", "--steps", "1", "--layers", "2", "--d-model", "64",
         "--vocab", "256", "--seq-len", "16"]


def test_regimes_are_chosen_from_the_cost_model():
    """Each regime's modeled GPU and SSD put the predicted lanes where the regime says (`lane_bench.SHAPES`)."""
    args = lane_bench.parse_args(["--nvme", "unused", "--d-model", "128", "--layers", "2", "--vocab", "512"])
    mcfg = get_model_config("125m", n_layer=2, d_model=128, n_head=2, vocab_size=512, seq_len=64)
    rates = {"exact": 1e8, "8bit-moments": 2e7, "8bit-moments, in RAM": 4e7}
    regimes = lane_bench.choose_regimes(args, mcfg, rates)
    assert [r.name for r in regimes] == list(lane_bench.REGIMES)
    for r in regimes:
        fmt, resident, gpu_x, ssd_x, persist = lane_bench.SHAPES[r.name]
        assert (r.state_format, r.resident_mem, r.persist_every) == (fmt, resident, persist)
        pred = lane_bench.predicted(args, mcfg, r, rates, "optimized")
        assert pred["gpu"] == pytest.approx(gpu_x * pred["cpu"], rel=0.02)
        if ssd_x is None:
            assert r.ssd_gbps == lane_bench.FIXED_SSD_GBPS
        else:
            assert pred["ssd"] == pytest.approx(ssd_x * pred["cpu"], rel=0.02)
    pred = {r.name: lane_bench.predicted(args, mcfg, r, rates, "optimized") for r in regimes}
    assert max(pred["disk"], key=pred["disk"].get) == "ssd" and max(pred["gpu"], key=pred["gpu"].get) == "gpu"
    assert max(pred["optimizer"], key=pred["optimizer"].get) == "cpu"
    # the cpu lane is priced at the rate measured in the regime's own format (and persistence)
    assert pred["balanced"]["cpu"] == pytest.approx(mcfg.param_count() / rates["8bit-moments"], rel=0.1)
    assert pred["optimizer"]["cpu"] == pytest.approx(mcfg.param_count() / rates["8bit-moments, in RAM"], rel=0.1)
    # a rate measured on the regime's own box prices it in place of its format's
    balanced = next(r for r in regimes if r.name == "balanced")
    own = lane_bench.predicted(args, mcfg, balanced, {**rates, "balanced": 1e7}, "optimized")
    assert own["cpu"] == pytest.approx(mcfg.param_count() / 1e7, rel=0.1)


def test_lane_bench_runs_end_to_end_on_a_micro_config(tmp_path, capsys):
    out = tmp_path / "res" / "lanes.json"
    handler = signal.getsignal(signal.SIGTERM)
    assert lane_bench.main(["--nvme", str(tmp_path / "nvme"), "--regimes", "disk", "balanced", "--out", str(out),
                            *MICRO]) == 0
    report = json.loads(out.read_text())
    assert set(lane_bench.TARGETS) <= set(report) and set(report["targets_met"]) == set(lane_bench.TARGETS)
    assert report["step_over_slowest_lane_gpu"] is None and report["optimized_vs_serial_disk"] > 0
    assert report["emulated"] is True and report["environment"]["cpu_model"] is not None
    assert {"exact", "8bit-moments", "disk", "balanced"} <= set(report["cpu_update_params_per_s"])  # (each box's)
    for name in ("disk", "balanced"):
        for mode in lane_bench.MODES:
            m = report["regimes"][name]["modes"][mode]
            assert set(m["predicted_lanes"]) == set(LANES_B) and m["steps"] == 1
            assert {"gpu", "ssd", "cpu", "param_wait"} <= set(m["lanes"]) and m["step_over_slowest_lane"] >= 1.0
            assert m["host_cpu_over_cores_s"] > 0
            assert m["steal_fraction"] is None or 0.0 <= m["steal_fraction"] <= 1.0
        rates = report["regimes"][name]["cpu_update_params_per_s_rounds"]
        assert len(rates) == 1 and rates[0] > 0  # (measured before each round)
        assert len(report["regimes"][name]["calibration_steal_fraction_rounds"]) == 1
    assert os.listdir(tmp_path / "nvme") == []  # the stores (of the rounds and the calibrations) are removed
    assert signal.getsignal(signal.SIGTERM) is handler  # its SIGTERM handler is the process's again
    md = out.with_suffix(".md").read_text()
    assert "step_over_slowest_lane_disk" in md and "| balanced | optimized |" in md
    assert str(tmp_path) not in out.read_text()  # no path of this machine in a committed report


def test_the_command_names_no_path_of_this_machine():
    assert lane_bench.command(["--quick", "--nvme", "/a", "/b", "--out", "/c.json", "--rounds", "2"]) == (
        "python benchmarks/lane_bench.py --quick --nvme <path> <path> --out <path> --rounds 2")


def test_steal_is_read_from_the_machines_cpu_line(tmp_path):
    """`bench_env.cpu_ticks`: steal is /proc/stat's 8th field of the "cpu" line; guest time is not counted twice."""
    from bench_env import cpu_ticks, steal_fraction

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 20 7 0\ncpu0 50 0 25 400 5 0 2 10 3 0\n")
    before = cpu_ticks(str(stat))
    assert before == (20, 985)
    stat.write_text("cpu  150 0 60 850 10 0 5 45 9 0\n")
    assert steal_fraction(before, cpu_ticks(str(stat))) == pytest.approx(25 / 135)
    assert cpu_ticks(str(tmp_path / "missing")) is None and steal_fraction(None, before) is None
    assert steal_fraction(before, before) is None  # (no tick passed)
