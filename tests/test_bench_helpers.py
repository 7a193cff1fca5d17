"""benchmarks/duplex.py end to end on a few MiB, and vs_deepspeed.py's CPU accounting (no DeepSpeed run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import duplex  # noqa: E402
import vs_deepspeed as vd  # noqa: E402


def test_duplex_measures_three_ways_and_leaves_no_slab(tmp_path):
    out = tmp_path / "duplex.json"
    rc = duplex.main(["--dir", str(tmp_path / "ssd"), "--size-gib", str(4 / 1024), "--request-mib", "1",
                      "--rounds", "3", "--backend", "threads", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    r = report["result"]
    assert set(r["seconds"]) == {"read", "write", "both"} and all(len(v) == 3 for v in r["seconds"].values())
    m = r["median_s"]
    assert r["overlap"] == pytest.approx((m["read"] + m["write"] - m["both"]) / min(m["read"], m["write"]))
    assert report["args"]["size_gib"] == pytest.approx(4 / 1024)
    assert "overlap =" in out.with_suffix(".md").read_text()
    assert list((tmp_path / "ssd").iterdir()) == []  # the test volume is removed


def test_duplex_rejects_zero_rounds(tmp_path):
    with pytest.raises(SystemExit):
        duplex.main(["--dir", str(tmp_path), "--rounds", "0", "--out", str(tmp_path / "d.json")])


def test_vs_deepspeed_cpu_seconds_and_busy_share(monkeypatch):
    monkeypatch.setattr(vd.os, "cpu_count", lambda: 2)
    recs = [{"step": 1, "warmup": True, "step_s": 9.0, "loss": 1.0, "cpu_user_s": 9.0, "cpu_sys_s": 9.0}]
    recs += [{"step": k + 2, "warmup": False, "step_s": 1.0, "loss": 1.0, "cpu_user_s": 1.2 + 0.1 * k,
              "cpu_sys_s": 0.3} for k in range(3)]
    res = {"records": recs, "peak_rss_steps_bytes": 1, "sampled_peak_rss_steps_bytes": None,
           "peak_rss_before_steps_bytes": 1, "sampled_peak_rss_bytes": None}
    out = vd.summarize(res, argparse.Namespace(batch=1, seq=8, threads=2))
    assert out["cpu_s_per_step"] == pytest.approx(1.6)  # the median step, warm-up left out
    assert out["cpu_user_s_per_step"] == pytest.approx(1.3)
    assert out["cpu_busy"] == pytest.approx(0.8)  # 1.6 core-seconds over 1 s of 2 cores
    assert vd._cpu_cell(out) == "1.60 (1.30 + 0.30), 80%"
    old = vd.summarize({**res, "records": [{k: v for k, v in r.items() if not k.startswith("cpu")} for r in recs]},
                       argparse.Namespace(batch=1, seq=8, threads=2))
    assert old["cpu_s_per_step"] is None and vd._cpu_cell(old) == "-"
