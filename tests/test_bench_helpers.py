"""benchmarks/duplex.py end to end on a few MiB, vs_deepspeed.py's CPU accounting (no DeepSpeed run), and
step_timeline.py's phase windows over synthetic /proc samples."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import duplex  # noqa: E402
import step_timeline as stl  # noqa: E402
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


def test_step_timeline_splits_a_step_into_phases_and_attributes_threads():
    """Counters that grow at known rates: each phase's window gives back those rates over its span."""
    import os
    hz, ncpu, pid = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1, 4242
    samples = []
    for k in range(101):  # every 10 ms for 1 s
        t = k / 100
        threads = {str(pid): ("python3", k, 0, 0),        # main: one tick per sample
                   "4243": ("python3", 2 * k, 0, 0),      # an unnamed (intra-op) thread
                   "4244": ("lohan-ago_0", 0, k, 10 * k)}  # the optimizer worker: system time, faults
        samples.append({"t": t, "disk": (int(t * 2e9), int(t * 1e9), t / 2),
                        "cpu": [k, 0, k, 2 * k, 0, 0, 0, 0], "threads": threads, "rss": 1000 + k})
    run = {"samples": samples, "pid": pid,
           "marks": [["_backward", 0.1, 0.5], ["_finish_updates", 0.55, 0.85], ["step", 0.1, 0.9]]}
    (step,) = stl.analyze(run)
    assert step["seconds"] == pytest.approx(0.8) and step["peak_rss_bytes"] == 1090
    bwd, gate, rest = step["backward"], step["after_gate"], step["rest"]
    assert (bwd["seconds"], gate["seconds"], rest["seconds"]) == pytest.approx((0.4, 0.3, 0.05))
    assert bwd["read_gb"] == pytest.approx(0.8) and bwd["write_gb"] == pytest.approx(0.4)
    assert bwd["disk_busy_s"] == pytest.approx(0.2)
    assert bwd["cores_user"] == pytest.approx(ncpu / 4) and bwd["cores_system"] == pytest.approx(ncpu / 4)
    assert bwd["thread_cpu_s"] == pytest.approx({"intra-op": 80 / hz, "main": 40 / hz, "lohan-ago": 40 / hz})
    assert bwd["process_system_cpu_s"] == pytest.approx(40 / hz) and bwd["minor_faults"] == 400
    summary = stl.summarize([step, step])
    assert summary["s_per_step"] == pytest.approx(0.8)
    assert summary["after_gate"]["read_gb"] == pytest.approx(0.6)
    assert summary["backward"]["thread_cpu_s"]["main"] == pytest.approx(40 / hz)


def test_vs_deepspeed_keys_for_the_defaults_and_for_the_lean_setting():
    def row(s, rss):
        return {"s_per_step": s, "peak_rss_bytes": rss, "peak_rss_whole_life_bytes": rss}

    rows = {"lohan": row(1.0, 2.0), "lohan-lean": row(0.8, 3.0), "zero-infinity": row(2.4, 4.0),
            "torch": row(0.72, 2.5)}
    k = vd.keys(rows)
    assert k["speedup_vs_zero_infinity"] == pytest.approx(2.4) and k["speed_vs_torch"] == pytest.approx(0.72)
    assert k["rss_ratio_vs_zero_infinity"] == pytest.approx(0.5)
    assert k["speedup_vs_zero_infinity_lean"] == pytest.approx(3.0)
    assert k["speed_vs_torch_lean"] == pytest.approx(0.9)
    assert k["rss_ratio_vs_zero_infinity_lean"] == pytest.approx(0.75)
    assert vd.passed(k) == {"speedup_vs_zero_infinity": True, "speed_vs_torch": False,
                            "rss_ratio_vs_zero_infinity": True}  # the targets judge the defaults only
    del rows["lohan-lean"]
    assert vd.keys(rows)["speed_vs_torch_lean"] is None


# ---------------------------------------------------------------- benchmarks/ago_cli.py (AGO through finetune.py)
import ago_cli  # noqa: E402


def _ago_cli_run(rnd, case, mode, times, rc=0):
    recs = [{"step": k + 1, "step_s": t, "tokens_per_s": 512 / t, "grad_norm": 3.0,
             "clip_coef": (0.25 if case == "clipped" else None), "redone": k == 3, "skipped": False,
             "lanes": {"compute": t / 2, "optimizer_tail": t / 10}} for k, t in enumerate(times)]
    if mode == "optimized" and case == "clipped":
        for r in recs:
            r["deferred"] = True
    return {"round": rnd, "case": case, "mode": mode, "command": f"finetune.py --mode {mode}", "rc": rc,
            "wall_s": 1.0, "records": recs}


def test_ago_cli_summary_leaves_warmup_out_and_keys_judge_the_ordering():
    base = {"serial": 4.0, "naive": 3.0, "optimized": 2.0}
    runs = [_ago_cli_run(r, c, m, [9.0, 8.0, base[m] + 0.1 * r, base[m] + 0.2 * r])
            for r in range(2) for c in ("clipped", "noclip") for m in base]
    runs.append(_ago_cli_run(1, "noclip", "optimized", [9.0, 9.0, 0.1], rc=1))  # failed: not summarized
    summary = ago_cli.summarize(runs, warmup=2)
    opt = summary["clipped"]["optimized"]
    assert opt["step_s_all"] == [2.0, 2.0, 2.1, 2.2] and opt["median_s_per_step"] == pytest.approx(2.05)
    assert opt["step_s_by_round"] == {"0": [2.0, 2.0], "1": [2.1, 2.2]}
    assert opt["warmup_step_s"] == [[9.0, 8.0], [9.0, 8.0]] and opt["runs"] == 2
    assert opt["optimizer_tail_s"] == pytest.approx(0.205) and opt["lanes"]["compute"] == pytest.approx(1.025)
    assert opt["frac_clipped"] == 1.0 and opt["frac_redone"] == 0.5 and opt["frac_deferred"] == 1.0
    assert opt["frac_next_forward_overlapped"] is None and "next_forward_overlapped" in opt["fields_missing"]
    assert summary["clipped"]["serial"]["frac_deferred"] is None
    assert summary["noclip"]["naive"]["frac_clipped"] == 0.0 and summary["noclip"]["optimized"]["runs"] == 2
    k = ago_cli.keys(summary)
    assert k["speedup_vs_serial"] == pytest.approx(4.05 / 2.05)
    assert k["speedup_vs_naive"] == pytest.approx(3.05 / 2.05)
    assert k["speedup_vs_serial_noclip"] == pytest.approx(4.05 / 2.05)
    assert k["ordering_holds"] is True and k["ordering_by_case"] == {"clipped": True, "noclip": True}
    assert k["clipped_fraction"] == 1.0
    summary["noclip"]["naive"]["median_s_per_step"] = 2.0  # optimized no longer fastest there
    assert ago_cli.keys(summary)["ordering_holds"] is False
    del summary["clipped"]
    k = ago_cli.keys(summary)
    assert k["speedup_vs_serial"] is None and k["clipped_fraction"] is None
    assert ago_cli.schedule(["a", "b"], ["x", "y"], 2) == [
        (0, "a", "x"), (0, "a", "y"), (0, "b", "x"), (0, "b", "y"),
        (1, "a", "y"), (1, "b", "x"), (1, "b", "y"), (1, "a", "x")]


def test_ago_cli_runs_finetune_on_the_tiny_preset(tmp_path, capsys):
    out, scratch = tmp_path / "res" / "ago_cli.json", tmp_path / "scratch"
    rc = ago_cli.main(["--model", "tiny", "--steps", "3", "--seq-len", "32", "--rounds", "1", "--cases", "clipped",
                       "--modes", "serial", "optimized", "--pause", "0", "--scratch", str(scratch), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert len(report["commands"]) == 2 and all("--mode" in c and "engine.resident_mem=0" in c
                                                for c in report["commands"])
    for mode in ("serial", "optimized"):
        s = report["cases"]["clipped"][mode]
        assert s["n_measured_steps"] == 1 and len(s["warmup_step_s"][0]) == 2 and s["median_s_per_step"] > 0
        assert "optimizer_tail" in s["lanes"]
    assert report["clipped_fraction"] == 1.0  # random init: every step clips at the default norm 1.0
    assert report["ordering_holds"] in (True, False) and report["git_commit"]
    assert "## clipped" in out.with_suffix(".md").read_text()
    assert not scratch.exists()  # stores, metrics files and logs removed
    assert "run 2/2" in capsys.readouterr().out
