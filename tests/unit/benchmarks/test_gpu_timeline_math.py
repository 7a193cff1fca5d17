"""benchmarks/gpu_timeline.py's interval arithmetic and trace classification, on synthetic intervals and a
synthetic Chrome trace (no GPU needed: the benchmark itself runs in `bash benchmarks/gpu_suite.sh`)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import gpu_timeline as gt  # noqa: E402


def _covered(intervals, grid):
    """Brute force: which grid points lie inside some interval (half-open [s, e))."""
    return {x for x in grid if any(s <= x < e for s, e in intervals)}


def test_union_merges_overlapping_and_touching_and_drops_empty():
    assert gt.union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6), (9, 8)]) == [(0, 4), (5, 7)]
    assert gt.union([]) == []
    assert gt.length([(0, 10), (2, 3), (8, 12)]) == 12
    assert gt.length([(1, 1)]) == 0


def test_intersect_and_clip():
    a = [(0, 10), (20, 30)]
    b = [(5, 25), (28, 40)]
    assert gt.intersect(a, b) == [(5, 10), (20, 25), (28, 30)]
    assert gt.intersect(b, a) == gt.intersect(a, b)
    assert gt.intersect(a, []) == []
    assert gt.intersect([(0, 1)], [(1, 2)]) == []  # touching is not overlapping
    assert gt.clip([(0, 10), (15, 20), (25, 30)], 5, 17) == [(5, 10), (15, 17)]


def test_interval_math_matches_brute_force_on_random_intervals():
    rng = random.Random(0)
    grid = range(200)
    for _ in range(200):
        a = [(s, s + rng.randint(0, 30)) for s in (rng.randint(0, 170) for _ in range(rng.randint(0, 8)))]
        b = [(s, s + rng.randint(0, 30)) for s in (rng.randint(0, 170) for _ in range(rng.randint(0, 8)))]
        ca, cb = _covered(a, grid), _covered(b, grid)
        assert gt.length(a) == len(ca)
        assert gt.length(gt.intersect(a, b)) == len(ca & cb)
        assert _covered(gt.union(a), grid) == ca


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def _trace():
    """Two steps on one timeline (us). Step 0 [0, 100): kernels [10, 40) and [30, 60) (two streams), a pinned
    HtoD copy [20, 50) (under kernels from 20) and a DtoH copy [70, 80) (idle GPU). Step 1 [200, 300): one kernel
    [200, 300) with a copy [250, 260) under it. Noise: a memset, a GPU-side annotation spanning everything,
    a DtoD copy, CPU ops, metadata, and a kernel outside both steps."""
    return [
        {"ph": "M", "name": "process_name", "ts": 0, "pid": 1, "tid": 0, "args": {"name": "python"}},
        _x("user_annotation", f"{gt.STEP_PREFIX}0", 0, 100),
        _x("user_annotation", f"{gt.STEP_PREFIX}1", 200, 100),
        _x("user_annotation", "something_else", 0, 1000),
        _x("gpu_user_annotation", f"{gt.STEP_PREFIX}0", 0, 100),
        _x("cpu_op", "aten::mm", 5, 50),
        _x("kernel", "sm90_gemm", 10, 30, stream=7),
        _x("kernel", "flash_fwd", 30, 30, stream=8),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 30, bytes=3_000_000, stream=9),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 70, 10, bytes=1_000_000, stream=9),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 85, 5, bytes=10),
        _x("gpu_memset", "Memset (Device)", 90, 5),
        _x("kernel", "sm90_gemm", 200, 100, stream=7),
        _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 250, 10, bytes=8),
        _x("kernel", "late", 500, 10),
    ]


def test_classify_sorts_kernels_copies_and_step_ranges():
    tr = gt.classify(_trace())
    assert sorted(tr.windows) == [f"{gt.STEP_PREFIX}0", f"{gt.STEP_PREFIX}1"]
    assert tr.kernels == [(10, 40), (30, 60), (200, 300), (500, 510)]  # not the GPU-side annotation
    assert sorted(tr.copies) == ["DtoD", "DtoH", "HtoD"]
    assert gt.copy_direction("Memcpy HtoD (Pinned -> Device)") == "HtoD"


def test_window_stats_idle_copies_and_overlap():
    tr = gt.classify(_trace())
    s0 = gt.window_stats(tr, tr.windows[f"{gt.STEP_PREFIX}0"])
    assert s0["wall_us"] == 100 and s0["kernel_busy_us"] == 50  # [10, 60)
    assert s0["idle_fraction"] == pytest.approx(0.5)
    assert s0["copy_us"] == {"DtoD": 5, "DtoH": 10, "HtoD": 30}
    assert s0["copy_bytes"] == {"DtoD": 10, "DtoH": 1_000_000, "HtoD": 3_000_000}
    assert s0["host_device_copy_us"] == 40  # DtoD is not a host<->device copy
    assert s0["copy_overlap_us"] == 30  # the HtoD copy [20, 50) lies within the kernels [10, 60)
    assert s0["copy_overlap_fraction"] == pytest.approx(0.75)
    assert s0["kernel_count"] == 2
    s1 = gt.window_stats(tr, tr.windows[f"{gt.STEP_PREFIX}1"])
    assert s1["idle_fraction"] == 0 and s1["copy_overlap_fraction"] == 1
    total = gt.combine([s0, s1])
    assert total["wall_us"] == 200 and total["kernel_busy_us"] == 150
    assert total["idle_fraction"] == pytest.approx(0.25)
    assert total["copy_overlap_fraction"] == pytest.approx(40 / 50)  # from the sums, not the mean of 0.75 and 1
    assert total["copy_bytes"]["HtoD"] == 3_000_008
    windows = list(tr.windows.values())
    assert [k["name"] for k in gt.top_kernels(tr, windows)] == ["sm90_gemm", "flash_fwd"]  # "late" is outside
    assert gt.top_kernels(tr, windows)[0] == {"name": "sm90_gemm", "us": 130, "calls": 2}
    kinds = {c["name"]: c for c in gt.copy_kinds(tr, windows)}
    assert kinds["Memcpy HtoD (Pageable -> Device)"]["bytes"] == 8


def test_verdict_asserts_the_overlap():
    tr = gt.classify(_trace())
    total = gt.combine([gt.window_stats(tr, w) for w in tr.windows.values()])
    assert gt.verdict(total, 0.5, max_exposed=0)[0] and not gt.verdict(total, 0.9, max_exposed=0)[0]
    exposed = (total["host_device_copy_us"] - total["copy_overlap_us"]) / total["wall_us"]
    assert gt.verdict(total, 0.9, max_exposed=exposed)[0] and not gt.verdict(total, 0.9, max_exposed=exposed * 0.99)[0]
    assert "no kernel covered" in gt.verdict(total, 0.9, max_exposed=0)[1]
    no_copies = gt.combine([gt.window_stats(gt.classify([_x("kernel", "k", 0, 5)]), (0, 10))])
    ok, why = gt.verdict(no_copies, 0.0)
    assert not ok and "no host<->device copy" in why  # nothing to assert about: a failure, not a pass


def test_the_script_refuses_to_run_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the benchmark runs in gpu_suite.sh")
    assert gt.main(["--steps", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_report_is_written_as_json_and_markdown(tmp_path):
    tr = gt.classify(_trace())
    windows = [tr.windows[f"{gt.STEP_PREFIX}{k}"] for k in range(2)]
    steps = [gt.window_stats(tr, w) for w in windows]
    total = gt.combine(steps)
    passed, why = gt.verdict(total, 0.5)
    report = {"environment": {"date": "2026-01-01T00:00:00", "command": "gpu_timeline.py", "torch": "2.13.0",
                              "cuda": "12.8", "gpu": "NVIDIA H100"},
              "model": {"preset": "125m", "n_layer": 12, "d_model": 768, "params": 124_000_000},
              "settings": {"batch": 8, "seq": 1024, "dtype": "bf16", "act_policy": "plan", "cpu_mem": "16GiB",
                           "warmup": 3, "steps": 2, "min_overlap": 0.5},
              "activations": {"policy": "plan", "swap": [], "tiers": {"keep": 12, "cpu": 0, "ssd": 0}},
              "engine_steps": [{"step": k, "lanes": {"gpu": 0.1, "param_wait": 0.25}} for k in (1, 2, 3)],
              "unprofiled_step_s_median": 0.5, "profiled_step_s": [0.6, 0.61], "per_step": steps, "total": total,
              "top_kernels": gt.top_kernels(tr, windows), "copy_kinds": gt.copy_kinds(tr, windows),
              "passed": passed, "verdict": why}
    out = tmp_path / "gpu_timeline.json"
    gt.write_report(report, out)
    md = out.with_suffix(".md").read_text()
    assert "**PASS**" in md and "| all | 0.2 | 0.1 | 25.0% |" in md and "80.0%" in md
    assert '"copy_overlap_fraction": 0.8' in out.read_text()
    assert "| 3 | 0.100 | 0.250 | 0.000 |" in md and "| 1 | 0.100" not in md  # the profiled steps' lanes
