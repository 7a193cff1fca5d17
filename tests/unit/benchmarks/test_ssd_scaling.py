"""The pure helpers of benchmarks/ssd_scaling.py (no engine, no timing)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import ssd_scaling as ss  # noqa: E402

from lohan.config import get_model_config  # noqa: E402
from lohan.plan.planner import Hardware, analytic_profile, estimate  # noqa: E402


def _profile(n_ssds: int, gbps: float = 0.1, adam: float = 0.0):
    hw = Hardware("test", thp_g=2e11, bw_g=20e9, bw_s2m=n_ssds * gbps * 1e9, bw_m2s=n_ssds * gbps * 1e9,
                  mem_avail=8 << 30, cpu_adam_params_per_s=adam)
    cfg = get_model_config("13b", n_layer=4, d_model=512, n_head=8, vocab_size=1024, seq_len=256)
    return analytic_profile(cfg, 1, 256, hw)


def test_visit_order_covers_every_point_once_per_round_and_rotates():
    ssds, batches = [1, 2, 3, 4, 6], [1, 4, 16]
    firsts = set()
    for r in range(4):
        order = ss.visit_order(ssds, batches, r)
        assert sorted(order) == sorted((n, b) for n in ssds for b in batches)
        firsts.add(order[0])
    assert len(firsts) > 1  # the round's first point changes


def test_predict_is_the_planner_estimate_with_rates_replaced():
    prof = _profile(1)
    same = ss.predict(prof, ["fc_proj"])
    assert same == estimate(prof, ["fc_proj"])
    faster = ss.predict(prof, ["fc_proj"], thp_g=4e11, cpu_adam_params_per_s=1e8)
    assert faster.lanes_b["gpu"] == pytest.approx(same.lanes_b["gpu"] / 2)
    assert faster.lanes_b["cpu"] == pytest.approx(prof.param_count / 1e8)
    assert same.lanes_b["cpu"] == 0.0  # an engine profile leaves the CPU lane unpriced


def test_ssd_bound_prediction_scales_with_the_ssd_count():
    # states move 30 bytes per parameter per step at bf16: N SSDs take 1/N of the time
    t = {n: ss.predict(_profile(n), [], cpu_adam_params_per_s=2e8).t_iter for n in (1, 4)}
    assert 3.5 < t[1] / t[4] <= 4.0
    assert ss.predict(_profile(1), []).bottleneck_b == "ssd"


def test_scaling_and_errors():
    points = [{"n_ssds": n, "batch": b, "tokens_per_s": tps, "prediction_error": e}
              for n, b, tps, e in [(1, 1, 10.0, 0.1), (4, 1, 38.0, -0.2), (1, 4, 40.0, 0.0), (4, 4, 80.0, 0.1)]]
    assert ss.scaling(points, 1, 4) == pytest.approx(3.8)
    assert ss.scaling(points, 4, 4) == pytest.approx(2.0)
    assert ss.scaling(points, 1, 6) is None
    assert ss.mean_abs_error(points) == pytest.approx(0.1)
    assert ss.relative_error(1.1, 1.0) == pytest.approx(0.1)


def test_user_ssds_are_not_emulated_and_take_the_first_n(tmp_path):
    dirs = [str(tmp_path / f"nvme{k}") for k in range(3)]
    args = ss.parse_args(["--nvme", *dirs])
    assert args.ssds == [1, 2, 3] and args.emulate_ssd_gbps is None and not args.emulated_dirs
    args = ss.parse_args(["--nvme", *dirs, "--ssds", "1", "3", "--emulate-ssd-gbps", "0.2"])
    assert args.ssds == [1, 3] and args.emulate_ssd_gbps == 0.2
    with pytest.raises(SystemExit):
        ss.parse_args(["--nvme", *dirs, "--ssds", "4"])
    default = ss.parse_args(["--quick"])
    assert default.ssds == [1, 2, 3, 4, 6] and default.emulate_ssd_gbps == ss.DEFAULT_EMULATE_GBPS
    assert len(default.nvme) == 6 and default.rounds == 1


def test_zero_infinity_note_says_what_is_missing():
    none = dict.fromkeys(ss.striped_path_support(), False)
    note = ss.zero_infinity_note({**none, "root": True}, emulated=True)
    assert "cannot build one" in note and "mdadm" in note and "emulated" in note
    raid = ss.zero_infinity_note({**none, "root": True, "mdadm": True, "md_driver": True}, emulated=False)
    assert "could build one" in raid and "emulated" not in raid


def test_predict_does_not_mutate_the_profile():
    prof = _profile(2)
    before = dataclasses.asdict(prof)
    ss.predict(prof, ["qkv"], thp_g=1e12, cpu_adam_params_per_s=1e9)
    assert dataclasses.asdict(prof) == before
