"""benchmarks/duplex.py end to end on a few MiB, vs_deepspeed.py's CPU accounting (no DeepSpeed run),
step_timeline.py's phase windows over synthetic /proc samples, and ago_bench.py's summaries over synthetic step
records and end to end on the tiny preset."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ago_bench  # noqa: E402
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


def _ago_record(case, mode, rnd, step_s, warmup=False, coef=None, deferred=False, redone=False, overlapped=False):
    """A step record as ago_bench.timed_step writes it, with made-up figures."""
    lanes = dict.fromkeys(ago_bench.LANES, 0.1) | {"gpu": step_s / 2}
    return {"case": case, "mode": mode, "round": rnd, "index": 0, "warmup": warmup, "step": 1, "loss": 10.0,
            "grad_norm": 2.0, "clip_coef": coef, "deferred": deferred, "redone": redone,
            "next_forward_overlapped": overlapped, "skipped": False, "step_s": step_s, "wall_s": step_s,
            "tokens_per_s": 512 / step_s, "tflops": None, "ssd_read_gbps": 1.0, "ssd_write_gbps": 1.0,
            "ssd_read_bytes": 10**9, "ssd_write_bytes": 10**9, "lanes": lanes, "overlap_efficiency": 0.5,
            "compute_thread": {"grad_buffer_wait_s": 0.0, "param_buffer_wait_s": 0.0, "commit_s": 0.0,
                               "unaccounted_s": 0.0},
            "ago": {"grad_wait_s": 0.0, "read_wait_s": 0.0, "busy_s": 1.0}, "disk_busy_s": 1.0,
            "other_disk_bytes": 0, "cpu": {"proc_busy": 0.9, "other_busy": 0.0, "idle": 0.1},
            "rss_peak_bytes": 2 << 30}


def test_ago_bench_summaries_per_case_with_a_missing_mode():
    """Speedups are per case (ratio of medians, per-round pairs), the clipping shares cover every mode's measured
    steps, a step that did not clip in the clipped case gets a note, and what was not run is None."""
    times = {("noclip", "serial"): (6.0, 6.4), ("noclip", "optimized"): (4.0, 4.0),
             ("clipped", "serial"): (7.0, 7.0), ("clipped", "optimized"): (5.0, 5.6)}
    recs = []
    for (case, mode), per_round in times.items():
        clipped = case == "clipped"
        for rnd, t in enumerate(per_round):
            recs.append(_ago_record(case, mode, rnd, 99.0, warmup=True, coef=0.01 if clipped else None))
            # one step of the clipped case did not clip, and its update was speculated rather than deferred
            miss = clipped and mode == "optimized" and rnd == 1
            recs.append(_ago_record(case, mode, rnd, t, coef=(1.0 if miss else 0.02) if clipped else None,
                                    deferred=clipped and not miss, overlapped=clipped and not miss))
    cases = {c: ago_bench.case_summary(recs, c, ["serial", "naive", "optimized"],
                                       ago_bench.case_overrides(c, 0.05)) for c in ("noclip", "clipped")}
    noclip, clipped = cases["noclip"], cases["clipped"]
    assert set(noclip["modes"]) == {"serial", "optimized"}  # naive did not run
    assert noclip["modes"]["serial"]["step_s"] == pytest.approx(6.2)  # warm-up steps left out
    assert noclip["speedups"]["optimized_vs_serial"]["ratio_of_medians"] == pytest.approx(6.2 / 4.0)
    assert noclip["speedups"]["optimized_vs_serial"]["paired_all"] == pytest.approx([1.5, 1.6])
    assert noclip["speedups"]["optimized_vs_naive"] is None and noclip["speedups"]["naive_vs_serial"] is None
    assert clipped["speedups"]["optimized_vs_serial"]["ratio_of_medians"] == pytest.approx(7.0 / 5.3)
    assert clipped["overrides"] == {"max_grad_norm": 0.05} and noclip["overrides"] == {"max_grad_norm": 0.0}
    assert clipped["clipped_fraction"] == pytest.approx(0.75) and clipped["deferred_fraction"] == pytest.approx(0.75)
    assert clipped["next_forward_overlapped_fraction"] == pytest.approx(0.75) and clipped["redone_fraction"] == 0
    assert noclip["clipped_fraction"] == 0 and noclip["deferred_fraction"] == 0
    assert clipped["modes"]["optimized"]["clip"]["clipped_fraction"] == pytest.approx(0.5)
    notes = ago_bench.check_case("clipped", clipped)
    assert len(notes) == 2 and "clipped_fraction = 0.75" in notes[0] and "deferred_fraction" in notes[1]
    assert ago_bench.check_case("noclip", noclip) == []

    h = ago_bench.headline_keys(cases, peak_rss=3 << 30, limit=4 << 30)
    assert h["speedup_vs_serial"] == pytest.approx(7.0 / 5.3)  # the clipped case is the headline
    assert h["speedup_vs_serial_noclip"] == pytest.approx(6.2 / 4.0)
    assert h["speedup_vs_serial_paired"] == pytest.approx(statistics.median([7.0 / 5.0, 7.0 / 5.6]))
    assert h["speedup_vs_serial_unclipped"] is None and h["speedup_vs_serial_unclipped_paired"] is None
    assert h["speedup_vs_naive"] is None and h["clipped_fraction"] == pytest.approx(0.75)
    assert h["step_s_optimized"] == pytest.approx(5.3) and h["within_memory_budget"] is True
    assert h["ideal_step_s"] == pytest.approx(3.5)  # serial's compute lane, longer than optimized's disk_busy
    assert ago_bench.targets_met(h) == {"speedup_vs_serial>=1.25": True, "speedup_vs_serial_noclip>=1.3": True,
                                        "peak_rss<=cpu_mem+activations+baseline": True}
    del cases["clipped"]["modes"]["optimized"]
    cases["clipped"]["speedups"] = dict.fromkeys(cases["clipped"]["speedups"])
    h = ago_bench.headline_keys(cases, peak_rss=5 << 30, limit=4 << 30)
    assert h["speedup_vs_serial"] is None and h["overlap_efficiency"] is None and h["efficiency_vs_ideal"] is None
    assert h["peak_rss_gib"] == pytest.approx(5.0) and h["within_memory_budget"] is False
    assert ago_bench.targets_met(h)["speedup_vs_serial>=1.25"] is None
    assert "| clipped | 0.05 | 7.00 | n/a | n/a | n/a | n/a | n/a | 0.75 |" in ago_bench.case_table(cases)


def test_ago_bench_rounds_run_every_pair_once_in_rotated_orders():
    pairs = [(c, m) for c in ago_bench.DEFAULT_CASES for m in ago_bench.ALL_MODES]
    orders = [ago_bench.round_order(pairs, r, 3) for r in range(3)]
    assert all(sorted(o) == sorted(pairs) for o in orders)
    assert len({o[0] for o in orders}) == 3 and len({o[-1] for o in orders}) == 3
    assert len({o[0][0] for o in orders}) == 3  # 9 pairs over 3 rounds: each round starts with another case


def test_ago_bench_end_to_end_on_the_tiny_preset(tmp_path):
    """Every case and mode on one store (max_grad_norm changes between openings of it), the report's keys, the
    cases verified from the engine's own step stats, and the store removed at the end."""
    out, nvme = tmp_path / "r.json", tmp_path / "nvme"
    assert ago_bench.main(["--model", "tiny", "--seq-len", "32", "--rounds", "1", "--steps", "1",
                           "--warmup-steps", "1", "--backend", "threads", "--cpu-mem", "2GiB",
                           "--cases", *ago_bench.ALL_CASES, "--nvme", str(nvme), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for key in ("speedup_vs_serial", "speedup_vs_serial_noclip", "speedup_vs_serial_unclipped", "speedup_vs_naive",
                "speedup_vs_serial_paired", "overlap_efficiency", "peak_rss_gib", "within_memory_budget",
                "speedup_vs_serial_noclip_in_backward"):
        assert report[key] == report["headline"][key] and report[key] is not None, key
    cases = report["cases"]
    assert list(cases) == ["noclip", "clipped", "unclipped", "noclip-backward"]
    assert all(set(cs["modes"]) == {"serial", "naive", "optimized"} for cs in cases.values())
    assert cases["clipped"]["clipped_fraction"] == 1 and cases["clipped"]["deferred_fraction"] == 1
    assert cases["unclipped"]["redone_fraction"] == 0 and cases["unclipped"]["clipped_fraction"] == 0
    # (clipping off, where an optimized or naive update runs is auto's choice, measured: serial never defers)
    assert cases["noclip"]["clipped_fraction"] == 0 and cases["noclip"]["redone_fraction"] == 0
    assert cases["noclip-backward"]["deferred_fraction"] == 0
    assert not [n for n in report["notes"] if "expected" in n]
    steps = report["records"]
    assert len(steps) == 12 * 2 and [r["batch_index"] for r in steps] == list(range(24))  # distinct batches
    plan = cases["clipped"]["modes"]["optimized"]["memory_plan"]
    assert plan["total"] == sum(v for k, v in plan.items() if k != "total") and "grad_stash" in plan
    assert "| case | max_grad_norm |" in out.with_suffix(".md").read_text()
    assert [p.name for p in nvme.iterdir() if p.name.startswith(ago_bench.STORE_NAME)] == []  # the run's files


def test_ago_bench_notes_measured_steps_under_different_activation_plans():
    plan = {"policy": "plan", "swap": ["fc"], "tiers": {"keep": 0, "cpu": 12, "ssd": 0}}
    recs = [_ago_record("noclip", m, 0, 1.0) | {"activation_plan": plan} for m in ("serial", "optimized")]
    assert ago_bench.check_activation_plans(recs) == []
    recs.append(_ago_record("clipped", "naive", 0, 1.0) | {"activation_plan": plan | {"swap": []}})
    recs.append(_ago_record("clipped", "serial", 0, 1.0, warmup=True) | {"activation_plan": plan | {"swap": ["x"]}})
    (note,) = ago_bench.check_activation_plans(recs)  # the warm-up step's plan does not count
    assert note.startswith("the measured steps ran under 2 activation plans") and "noclip/optimized, noclip/serial" in note


# ---------------------------------------------------------------- benchmarks/ago_cli.py (AGO through finetune.py)
import ago_cli  # noqa: E402


def _ago_cli_run(rnd, case, mode, times, rc=0):
    recs = [{"step": k + 1, "step_s": t, "tokens_per_s": 512 / t, "grad_norm": 3.0,
             "clip_coef": (0.25 if case == "clipped" else None), "redone": k == 3, "skipped": False,
             "lanes": {"gpu": t / 2, "optimizer_tail": t / 10}} for k, t in enumerate(times)]
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
    assert opt["optimizer_tail_s"] == pytest.approx(0.205) and opt["lanes"]["gpu"] == pytest.approx(1.025)
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


GB = 10**9


def test_ago_bench_counts_other_disk_traffic_over_the_measured_steps_not_per_step():
    """Write-behind completes a step's last writes in the next one: per step the disk and the engine disagree,
    over the steps they agree; only traffic beyond the engine's is another process's."""
    def rec(own_w, disk):
        return {"ssd_read_bytes": 4 * GB, "ssd_write_bytes": own_w, "disk_bytes": disk}
    shifted = [rec(6 * GB, 7 * GB), rec(1 * GB, 8 * GB)]  # the first step's tail lands in the second
    sm = {"other_disk_bytes": ago_bench._other_disk_bytes(shifted), "other_busy_max": 0.0}
    assert sm["other_disk_bytes"] == {"other": 0, "own": 15 * GB}
    assert ago_bench.check_machine("clipped", "optimized", sm) == []
    sm["other_disk_bytes"] = ago_bench._other_disk_bytes([rec(6 * GB, 9 * GB), rec(1 * GB, 8 * GB)])
    assert "2.0 GB of other disk traffic" in ago_bench.check_machine("clipped", "optimized", sm)[0]
    assert ago_bench._other_disk_bytes([rec(1, None)]) is None
