"""One lane vocabulary (issue 38): the engine measures the cost model's lanes (gpu, m2g, g2m, ssd, cpu) and the
cost model predicts them for the same run; older metrics and commit notes still read; a run whose SSDs bind is
told what they cost."""

from __future__ import annotations

import itertools

import pytest

import lohan
from lohan.app.cli import main
from lohan.app.metrics import StepMetrics
from lohan.config import get_model_config
from lohan.plan import planner
from lohan.plan.capacity import design_plan, plan_capacity
from lohan.plan.planner import LANES_B, parse_hardware, predict_lanes, ssd_cost, upgrade_lanes
from lohan.plan.run_lanes import defers
from lohan.runtime.step import stats_from_note
from tests.integration.test_engine_equivalence import batches, engine_config, tiny_cfg


def test_the_engine_measures_the_cost_models_lanes(make_dirs):
    with lohan.init(tiny_cfg(n_layer=2), engine_config(make_dirs(1))) as engine:
        data = batches(2, 2, 16, 256)
        for b in data:
            engine.step(b)
        s = engine.last_stats
    lanes = s.lanes
    assert {"gpu", "ssd", "cpu"} <= set(lanes) and not {"compute", "cpu_adam"} & set(lanes)
    assert {"m2g", "g2m"}.isdisjoint(lanes)  # a CPU device models no copy engines
    # reads and writes share the drive (simplex): the union lane covers each direction (to the clock reads' ms)
    assert lanes["ssd"] >= max(lanes["ssd_read"], lanes["ssd_write"]) - 1e-3 and max(lanes["ssd_read"],
                                                                                      lanes["ssd_write"]) > 0
    assert lanes["cpu"] >= lanes["adam"] > 0  # AdamW and the records' hashing
    assert s.overlap_efficiency == pytest.approx(max(lanes[k] for k in ("gpu", "ssd", "cpu")) / s.step_s)


def test_a_timed_device_gives_the_gpu_and_copy_lanes(make_dirs):
    """Where the device models its lanes (`Device.lane_busy`: the simulated device with a timing model), the
    step's gpu, m2g and g2m are its busy seconds over the step, not the compute timers."""
    with lohan.init(tiny_cfg(n_layer=2), engine_config(make_dirs(1))) as engine:
        ticks = itertools.count(1)

        def lane_busy() -> dict[str, float]:  # cumulative, as a device reports them
            k = next(ticks)
            return {"gpu": 1.0 * k, "m2g": 0.5 * k, "g2m": 0.25 * k}

        engine.device.lane_busy = lane_busy
        engine.step(next(batches(1, 2, 16, 256)))
        lanes = engine.last_stats.lanes
    # whole counts of the fake's ticks between the step's start and its end, in the fake's proportions
    assert lanes["gpu"] >= 1 and lanes["gpu"] == int(lanes["gpu"])
    assert (lanes["m2g"], lanes["g2m"]) == (lanes["gpu"] / 2, lanes["gpu"] / 4)


def test_older_metrics_and_notes_read_in_the_new_names():
    old = {"compute": 2.0, "ssd_read": 1.0, "ssd_write": 0.5, "cpu_adam": 0.7, "param_wait": 0.1}
    assert upgrade_lanes(old) == {"gpu": 2.0, "ssd_read": 1.0, "ssd_write": 0.5, "cpu": 0.7, "param_wait": 0.1,
                                  "ssd": 1.5}
    new = {"gpu": 1.0, "ssd": 0.9, "ssd_read": 0.5, "cpu": 0.3}
    assert upgrade_lanes(new) == new
    record = {"step": 1, "loss": 2.0, "lr": 1e-3, "tokens": 64, "step_s": 3.0, "tokens_per_s": 21.3, "tflops": 0.0,
              "ssd_read_gbps": 0.1, "ssd_write_gbps": 0.1, "overlap_pct": 50.0, "cpu_mem_gib": 1.0, "lanes": old}
    assert StepMetrics.from_record(record).lanes["gpu"] == 2.0
    note = {"step": 1, "loss": 2.0, "lr": 1e-3, "tokens": 64, "step_s": 4.0, "flops": None, "ssd_read_bytes": 1,
            "ssd_write_bytes": 1, "lanes": old, "cpu_mem_bytes": 1, "gpu_mem_bytes": None, "max_resident_blocks": 2,
            "resident_records": 0, "resident_record_hits": 0, "next_forward_overlapped": False, "deferred": False}
    stats = stats_from_note(note)
    assert stats.lanes["cpu"] == 0.7 and stats.overlap_efficiency == pytest.approx(0.5)


def test_predicted_lanes_are_the_engines_vocabulary():
    m, hw = get_model_config("350m"), parse_hardware("rtx4090,1xP5510,256GB")
    opt, serial = (predict_lanes(m, hw, 1, 512, mode=mode) for mode in ("optimized", "serial"))
    assert tuple(opt) == tuple(serial) == LANES_B
    # the forward of serial reads every P16 from the SSDs: the update hands none over
    assert serial["ssd"] > opt["ssd"] and serial["gpu"] == opt["gpu"] and serial["cpu"] == opt["cpu"]
    est = planner.capacity(m, hw, 1, 512).plan.estimate
    assert opt["gpu"] == pytest.approx(est.lanes_f["gpu"] + est.lanes_b["gpu"])
    # twice the batch, twice the GPU time; the SSD traffic of the states stays
    twice = predict_lanes(m, hw, 2, 512)
    assert twice["gpu"] == pytest.approx(2 * opt["gpu"])


def test_predicted_lanes_are_the_schedule_the_run_takes():
    """Clipping off, where the plan lets an update wait for backward's end and the cost model prices that step
    shorter (the SSDs bind: its forward takes the P16 from the update), the run defers its updates
    (`clip_schedule`), and the predicted lanes are that step's; speculate, clipping and serial price the others."""
    m, hw = get_model_config("350m"), parse_hardware("rtx4090,1xP5510,256GB")
    run = design_plan(m, hw)
    est = plan_capacity(m, hw, 1, 512, run).plan.estimate
    assert run.defer_unclipped and 0 < est.t_deferred < est.t_iter and defers(run, est)
    lanes = predict_lanes(m, hw, 1, 512)
    assert lanes == pytest.approx(est.lanes_deferred) and lanes["ssd"] < est.step_lanes()["ssd"]
    for kw in ({"clip_mode": "speculate"}, {"keep_grads": True}):
        assert predict_lanes(m, hw, 1, 512, **kw) == pytest.approx(
            planner.capacity(m, hw, 1, 512, **kw).plan.estimate.step_lanes())
    assert predict_lanes(m, hw, 1, 512, mode="serial") == pytest.approx(est.lanes_serial)


def test_ssd_cost_where_the_ssds_bind_only():
    m, hw = get_model_config("350m"), parse_hardware("rtx4090,1xP5510,256GB")
    cost = ssd_cost(m, hw, 1, 512)
    assert cost is not None and cost.lanes["ssd"] == max(cost.lanes.values())
    assert set(cost.priced) == {"bf16-moments", "8bit-moments", "bf16-master"}
    assert cost.priced[cost.suggested][0] == min(t for t, _ in cost.priced.values()) < cost.step_s
    # at the tokens it names, the model's gpu lane reaches the ssd lane
    lanes = predict_lanes(m, hw, cost.hide_tokens // 512, 512)
    assert lanes["gpu"] == pytest.approx(lanes["ssd"], rel=0.05)
    assert ssd_cost(m, hw, 1, 512, compute_dtype="fp32").priced.keys() == {"bf16-moments", "8bit-moments"}
    assert ssd_cost(m, parse_hardware("rtx4090,12xP5510,256GB"), 64, 1024) is None  # GPU-bound


def _dry(tmp_path, batch: str, seq: str, hardware: str) -> list[str]:
    return ["--model", "350m", "--nvme", str(tmp_path / "nvme"), "--data", "synthetic", "--batch-size", batch,
            "--seq-len", seq, "--dry-run", "--hardware", hardware]


def test_the_dry_run_says_what_the_ssds_cost(tmp_path, capsys):
    assert main(_dry(tmp_path, "1", "512", "rtx4090,1xP5510,256GB")) == 0
    out = capsys.readouterr().out
    # the run clips (max_grad_norm's default): its steps speculate
    cost = ssd_cost(get_model_config("350m"), parse_hardware("rtx4090,1xP5510,256GB"), 1, 512, keep_grads=True)
    line = next(x for x in out.splitlines() if x.startswith("the SSDs bind"))
    step, _ = cost.priced[cost.suggested]
    assert f"--state-format {cost.suggested} would take {step:.3g} s per step" in line
    assert "bf16-master" in line and "eval loss +0.0008" in line and f"{cost.hide_tokens:,} tokens per step" in line
    assert main(_dry(tmp_path, "64", "1024", "rtx4090,12xP5510,256GB")) == 0  # GPU-bound: not a word of it
    assert "the SSDs bind" not in capsys.readouterr().out
    assert not (tmp_path / "nvme").exists()


def test_the_first_measured_step_says_what_the_ssds_cost_where_they_bind(tmp_path, capsys):
    """A run whose first step after the profiling one measures the SSD lane its slowest (here the directory is
    paced to 50 MB/s) is told what a smaller state format would take, priced from that step's lanes."""
    from tests.integration.test_cli import args

    assert main(args(tmp_path, "--steps", "2", "--compute-dtype", "fp32",
                     "--set", "engine.emulate_ssd_gbps=0.05")) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "the SSDs bind" in x)
    assert "measured by step 2" in line and "--state-format" in line and "tokens per step" in line
