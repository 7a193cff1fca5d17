"""benchmarks/duplex.py end to end on a few MiB, vs_deepspeed.py's pure parts (CPU accounting, keys, dtype,
rounds, arguments; no DeepSpeed run),
step_timeline.py's phase windows over synthetic /proc samples, ago_bench.py's summaries over synthetic step
records and end to end on the tiny preset, and lora_bench.py's keys and markdown over synthetic runs (its --smoke run:
slow)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import ago_bench  # noqa: E402
import bench_env  # noqa: E402
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
    assert (report["benchmark"], report["machine"], report["variant"]) == ("duplex", bench_env.machine_id(), {})


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


def _vd_row(s, rss, write=0.0):
    return {"s_per_step": s, "peak_rss_bytes": rss, "peak_rss_whole_life_bytes": rss,
            "disk_write_bytes_per_step_mean": write}


def test_vs_deepspeed_keys_for_the_defaults_and_for_the_lean_setting():
    rows = {"lohan": _vd_row(1.0, 2.0, 1.5e9), "lohan-lean": _vd_row(0.8, 3.0), "zero-infinity": _vd_row(2.4, 4.0),
            "zero-offload": _vd_row(1.3, 2.5), "torch": _vd_row(0.96, 1.6)}
    k = vd.keys(rows)
    assert k["speed_vs_torch"] == pytest.approx(0.96) and k["speedup_vs_zero_offload"] == pytest.approx(1.3)
    assert k["speedup_vs_zero_infinity"] == pytest.approx(2.4) and k["rss_ratio_vs_torch"] == pytest.approx(1.25)
    assert k["disk_write_gb_per_step"] == pytest.approx(1.5) and k["rss_ratio_vs_zero_infinity"] == pytest.approx(0.5)
    assert k["speed_vs_torch_lean"] == pytest.approx(1.2) and k["rss_ratio_vs_torch_lean"] == pytest.approx(1.875)
    assert vd.passed(k) == {"speed_vs_torch": True, "speedup_vs_zero_offload": True,
                            "rss_ratio_vs_torch": False}  # the targets judge the defaults; the others are reported
    rows["zero-infinity"] = {"system": "zero-infinity", "failed": True, "reason": "exit 1: IndexError: ..."}
    del rows["lohan-lean"]
    k = vd.keys(rows)
    assert k["speedup_vs_zero_infinity"] is None and k["speed_vs_torch"] == pytest.approx(0.96)
    assert "speed_vs_torch_lean" not in k


def test_vs_deepspeed_auto_dtype_from_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 avx512_bf16\n\nflags\t: fpu\n")
    flags = vd.cpu_flags(str(info))
    assert {"avx2", "amx_bf16", "avx512_bf16"} <= flags and len(flags) == 6  # the first CPU's line
    assert vd.resolve_dtype("auto", flags, cuda=False)[0] == "bf16"
    assert vd.resolve_dtype("auto", {"avx2", "avx512f"}, cuda=False) == (
        "fp32", "auto: the CPU has no native bf16 (none of avx512_bf16, amx_bf16)")
    assert vd.resolve_dtype("auto", set(), cuda=True)[0] == "bf16"
    assert vd.resolve_dtype("fp32", flags, cuda=True) == ("fp32", "given")
    assert vd.cpu_flags(str(tmp_path / "missing")) == set()


def test_vs_deepspeed_rounds_run_every_pair_once_in_rotated_orders():
    systems, dtypes = ["lohan", "torch", "zero-offload", "zero-infinity"], ["fp32", "bf16"]
    plan = vd.schedule(systems, dtypes, 3)
    assert len(plan) == 24
    for r in range(3):
        pairs = [(d, s) for rnd, d, s in plan if rnd == r]
        assert sorted(pairs) == sorted((d, s) for d in dtypes for s in systems)
    assert [s for _, _, s in plan[:4]] == systems and [d for _, d, _ in plan[:8]] == ["fp32"] * 4 + ["bf16"] * 4
    assert [s for _, _, s in plan[8:12]] == ["torch", "zero-offload", "zero-infinity", "lohan"]  # one later
    assert [d for _, d, _ in plan[8:16]] == ["bf16"] * 4 + ["fp32"] * 4  # the dtypes the other way round
    assert len({plan[8 * r][2] for r in range(3)}) == 3  # each round starts with another system


def test_vs_deepspeed_args_quick_defaults_and_dtypes(monkeypatch):
    monkeypatch.setattr(vd, "cpu_flags", lambda: {"avx2"})  # no native bf16: auto is fp32 and runs once
    monkeypatch.setattr(vd, "_has_cuda", lambda: False)
    a = vd.parse_args(["--quick"])
    assert (a.seq, a.warmup, a.steps, a.rounds, a.models) == (256, 1, 2, 1, ["110m"])
    assert a.systems == ["lohan", "torch", "zero-offload", "zero-infinity"]
    assert a.dtypes == ["fp32"] and a.auto_dtype == "fp32" and a.dtype_reasons["fp32"] == "given"
    a = vd.parse_args(["--dtypes", "auto,bf16", "--rounds", "2", "--lohan-set", "resident_mem=0"])
    assert (a.seq, a.warmup, a.steps, a.rounds) == (512, 2, 7, 2)  # full: steps 3-9 timed
    assert a.dtypes == ["fp32", "bf16"] and a.dtype_reasons["bf16"] == "given" and a.lohan_set == {"resident_mem": 0}
    for bad in (["--dtypes", "fp16"], ["--systems", "lohan,megatron"], ["--rounds", "0"], ["--lohan-set", "x"]):
        with pytest.raises(SystemExit):
            vd.parse_args(bad)


def test_vs_deepspeed_rounds_merge_into_one_row_and_failures_say_why():
    def run(step_s, hwm, writes, failed=False):
        if failed:
            return {"system": "lohan", "failed": True, "wall_s": 1.0, "reason": "exit 1: RuntimeError: boom"}
        recs = [{"step": 1, "warmup": True, "step_s": 9.0, "loss": 5.0, "disk_read_bytes": 0, "disk_write_bytes": 7}]
        recs += [{"step": k + 2, "warmup": False, "step_s": t, "loss": 4.0, "disk_read_bytes": 0,
                  "disk_write_bytes": w} for k, (t, w) in enumerate(zip(step_s, writes))]
        return {"system": "lohan", "settings": {}, "info": {}, "failed": False, "wall_s": 2.0, "records": recs,
                "peak_rss_steps_bytes": hwm, "sampled_peak_rss_steps_bytes": None, "peak_rss_before_steps_bytes": 1,
                "sampled_peak_rss_bytes": None, "samples": [(0.0, 1)]}
    a = argparse.Namespace(batch=1, seq=8, threads=2)
    # a run that persists every 2nd step: the disk key is the mean over the timed steps (all rounds), not a median
    runs = [run([1.0, 3.0], 10, [0, 4e9]), run([2.0, 2.5], 30, [0, 2e9]), run([], 0, [], failed=True)]
    out = vd.merge_rounds(runs, a)
    assert out["s_per_step"] == pytest.approx(2.25) and out["peak_rss_bytes"] == 30
    assert out["disk_write_bytes_per_step"] == 1e9 and out["disk_write_bytes_per_step_mean"] == pytest.approx(1.5e9)
    assert out["failed_rounds"] == 1 and [r["failed"] for r in out["per_round"]] == [False, False, True]
    assert out["wall_s"] == 5.0 and "samples" not in out
    assert vd.merge_rounds(runs[2:], a)["reason"] == "exit 1: RuntimeError: boom"
    log = "[rank0]: Traceback (most recent call last):\n[rank0]:   File x\n[rank0]: IndexError: index 0 is out\nbye\n"
    assert vd.failure_line(log) == "IndexError: index 0 is out"
    assert vd.failure_line("just this\n") == "just this" and vd.failure_line("") == "(no output)"


def test_vs_deepspeed_headline_keys_take_the_auto_dtype_and_note_failures():
    def dtype_part(speed):
        k = dict.fromkeys(vd.TARGETS, None) | {"speed_vs_torch": speed}
        return {"rows": [{"system": "zero-infinity", "failed": True, "reason": "exit 1: OSError: aio"}],
                "keys": k, "pass": vd.passed(k)}
    report = {"models": {"110m": {"dtypes": {"fp32": dtype_part(0.9), "bf16": dtype_part(1.0)}}}, "notes": []}
    vd.headline(report, argparse.Namespace(models=["110m"], auto_dtype="bf16"))
    assert report["keys_dtype"] == "bf16" and report["speed_vs_torch"] == 1.0
    assert report["keys_by_dtype"]["fp32"]["speed_vs_torch"] == 0.9 and set(report["keys_by_dtype"]["fp32"]) == set(
        vd.TARGETS)
    assert report["pass"]["speed_vs_torch"] is True and report["speedup_vs_zero_offload"] is None
    assert report["notes"] == [f"110m {d}: zero-infinity failed: exit 1: OSError: aio" for d in ("fp32", "bf16")]
    report = {"models": {"110m": {"dtypes": {"fp32": dtype_part(0.9)}}}, "notes": []}
    vd.headline(report, argparse.Namespace(models=["110m"], auto_dtype="bf16"))  # auto not measured: the first
    assert report["keys_dtype"] == "fp32" and report["speed_vs_torch"] == 0.9


@pytest.mark.slow
@pytest.mark.aio
def test_vs_deepspeed_zero_infinity_and_offload_train_the_checkpoint_s_weights(tmp_path):
    """The ZeRO-3 build loads the checkpoint (transformers 5 failed it under a bare zero.Init) and each DeepSpeed
    system's first loss is plain PyTorch's on the same weights and batch. Slow: DeepSpeed's imports and, on first
    use, its cpu_adam and shm_comm builds."""
    import subprocess
    repo = Path(__file__).resolve().parents[3]
    model = tmp_path / "llama"
    subprocess.run([sys.executable, str(repo / "scripts" / "make_tiny_hf.py"), str(model), "--layers", "2",
                    "--hidden", "64", "--heads", "2", "--vocab", "300"], check=True, cwd=repo, stdout=subprocess.DEVNULL)
    a = argparse.Namespace(batch=1, seq=16, seed=0, threads=2, peers_heap_reuse=False, interval=0.1)
    first = {}
    for system in ("torch", "zero-infinity", "zero-offload"):
        r = vd.run_child(system, model, tmp_path / "run" / system, vd.settings_for(system, "fp32"), a, "fp32", 0, 1,
                         print)
        assert not r["failed"], r["reason"] + "\n" + r["log_tail"]
        first[system] = r["losses"][0]
    assert first["zero-infinity"] == pytest.approx(first["torch"], rel=1e-5)
    assert first["zero-offload"] == pytest.approx(first["torch"], rel=1e-5)


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


@pytest.mark.slow  # two finetune.py processes, ~20 s: `make test-all`
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
    assert report["ordering_holds"] in (True, False) and report["versions"]["git_commit"]
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


# ---------------------------------------------------------------- benchmarks/lora_bench.py (LoRA vs full and PEFT)
import lora_bench  # noqa: E402


def _lora_run(system, rnd, times, read=0, write=0, commit=0, pool=None, base=4000, trainable=64):
    steps = [{"step_s": t, "warmup": k == 0, "loss": 1.0, "read_bytes": read, "write_bytes": write,
              "commit_bytes": commit} for k, t in enumerate(times)]
    return {"round": rnd, "system": system, "steps": steps, "peak_rss_steps_bytes": 1 << 30, "param_count": 1000,
            "trainable": trainable if system != "full" else 1000, "compute_dtype": "fp32", "base_bytes": base,
            "params_pool_bytes": pool, "cpu_mem": "256MiB"}


def _lora_runs(pool=1000):
    """Two rounds; the first step of every run is warm-up (9.0 s, left out)."""
    return [run for r in range(2) for run in (
        _lora_run("lora_stream", r, [9.0, 3.0, 2.0 + 3 * r], read=8000 if r else 9000, write=40, commit=40,
                  pool=pool),
        _lora_run("full", r, [9.0, 6.0, 6.0 + r], read=12000, write=12000),
        _lora_run("lora", r, [9.0, 1.0, 1.0]),
        _lora_run("peft", r, [9.0, 0.9 + r, 0.9]))]


def test_lora_bench_keys_from_the_medians_of_the_measured_steps():
    summary = lora_bench.summarize(_lora_runs())
    assert summary["lora_stream"]["measured_steps"] == 4 and summary["lora_stream"]["step_s"] == 3.0
    assert summary["full"]["step_s"] == 6.0 and summary["peft"]["step_s"] == 0.9
    k = lora_bench.keys(summary)
    assert k["lora_vs_full_step"] == {"value": 2.0, "target": None, "met": None}
    # (median read 8500 + written 40) / 1000 parameters
    assert k["lora_bytes_per_param_step"]["value"] == pytest.approx(8.54)
    assert k["lora_bytes_per_param_step"]["met"] is False and "note" not in k["lora_bytes_per_param_step"]
    assert k["lora_speed_vs_peft_in_ram"]["value"] == pytest.approx(0.9) and k["lora_speed_vs_peft_in_ram"]["met"]


def test_lora_bench_bytes_key_is_not_judged_when_the_pool_held_the_base():
    k = lora_bench.keys(lora_bench.summarize(_lora_runs(pool=4000)))  # a pool as big as the base: nothing streamed
    assert k["lora_bytes_per_param_step"]["met"] is None and "not streamed" in k["lora_bytes_per_param_step"]["note"]


def test_lora_bench_keys_without_a_system_are_none_and_rounds_rotate():
    summary = lora_bench.summarize([r for r in _lora_runs() if r["system"] != "peft"])
    assert lora_bench.keys(summary)["lora_speed_vs_peft_in_ram"] == {"value": None, "target": ">= 0.9", "met": None}
    order = lora_bench.schedule(2)
    assert [s for r, s in order if r == 0] == list(lora_bench.SYSTEMS)
    assert [s for r, s in order if r == 1] == [*lora_bench.SYSTEMS[1:], lora_bench.SYSTEMS[0]]


def test_lora_bench_markdown_names_the_keys_and_a_target_mismatch():
    summary = lora_bench.summarize(_lora_runs())
    rep = {"when": "now", "command": "benchmarks/lora_bench.py", "model": "llama-x", "param_count": 1000, "batch": 4,
           "seq": 64, "dtype": "fp32", "rank": 4, "alpha": 8.0, "rounds": 2, "warmup": 1, "steps": 2,
           "cpu_mem": "256MiB", "stream_set": {"prefetch_depth": 1}, "full_cpu_mem": "8GiB",
           "keys": lora_bench.keys(summary), "systems": summary,
           "environment": {"hardware": {"cpu_count": 2, "cpu_model": "cpu"}}}
    md = lora_bench.markdown(rep)
    assert "| `lora_bytes_per_param_step` | 8.540 | <= 4.5 | NO |" in md
    assert "| lora_stream | 3.000 |" in md and "trainable parameters equal" in md
    assert "full: cpu_mem 8GiB" in md and "cpu_mem 256MiB, {\"prefetch_depth\": 1}" in md
    assert "base reads per step 2.12" in md  # 8500 of a 4000-byte base
    rep["systems"]["peft"]["trainable"] = 65
    assert "trainable parameters differ" in lora_bench.markdown(rep)


@pytest.mark.slow  # four child processes (~40-50 s on 2 busy cores)
def test_lora_bench_smoke_run(tmp_path):
    rc = lora_bench.main(["--smoke", "--scratch", str(tmp_path / "scratch"), "--results", str(tmp_path)])
    assert rc == 0
    report = json.loads(bench_env.result_path("lora_bench", {"tag": "smoke"}, root=tmp_path).read_text())
    assert set(report["systems"]) == set(lora_bench.SYSTEMS) and set(report["keys"]) == set(lora_bench.TARGETS)
    losses = {r["system"]: r["steps"][0]["loss"] for r in report["runs"]}
    assert len(set(losses.values())) == 1  # the same model and first batch everywhere
    assert not any((tmp_path / "scratch" / "nvme").iterdir())  # every store removed


def test_lora_bench_command_names_paths_outside_the_checkout_by_their_role():
    cmd = lora_bench.command(["--nvme", "/mnt/ssd0/x", "--tag", "t", "--results", "benchmarks/results"])
    assert cmd == "benchmarks/lora_bench.py --nvme NVME --tag t --results benchmarks/results"


# ---------------------------------------------------------------- where a report goes (benchmarks/README.md "Result files")
@pytest.mark.parametrize("hardware, machine", [
    ({"cpu_count": 2, "cpu_model": "AMD EPYC", "gpu": None}, "cpu2-epyc"),
    ({"cpu_count": 2, "cpu_model": "Intel(R) Xeon(R) Processor"}, "cpu2-xeon"),
    ({"cpu_count": 64, "cpu_model": "AMD EPYC 7763 64-Core Processor"}, "cpu64-epyc7763"),
    ({"cpu_count": 112, "cpu_model": "Intel(R) Xeon(R) Platinum 8480C @ 2.00GHz"}, "cpu112-xeon8480c"),
    ({"cpu_count": 16, "cpu_model": "Intel(R) Xeon(R) Processor", "gpu": "NVIDIA H100 80GB HBM3"}, "h100"),
    ({"cpu_count": 32, "cpu_model": "AMD Ryzen 9 7950X", "gpu": "NVIDIA GeForce RTX 4090"}, "rtx4090"),
    ({"cpu_count": None, "cpu_model": None}, "cpu"),
])
def test_machine_id_names_the_box_by_its_gpu_else_its_cores_and_cpu(hardware, machine):
    assert bench_env.machine_id(hardware) == machine


def test_machine_id_of_this_box_reads_what_reports_record():
    assert bench_env.machine_id() == bench_env.machine_id(bench_env.shared_environment()["hardware"])


def test_result_path_names_benchmark_variant_and_machine_and_out_wins(tmp_path):
    hw = {"cpu_count": 2, "cpu_model": "AMD EPYC"}
    results = bench_env.REPO / "benchmarks" / "results"
    assert bench_env.result_path("ago_bench", {"quick": False}, hardware=hw) == results / "ago_bench" / "cpu2-epyc.json"
    assert bench_env.result_path("ago_bench", {"quick": True, "seq_len": 256}, hardware=hw) == \
        results / "ago_bench" / "quick-seq_len256" / "cpu2-epyc.json"
    assert bench_env.result_path("soak", {"config": "tiny", "steps": None, "malloc_trim": True}, hardware=hw,
                                 root=tmp_path) == tmp_path / "soak" / "tiny-malloc_trim" / "cpu2-epyc.json"
    assert bench_env.result_path("ago_bench", {"quick": True}, out="x/y.json", hardware=hw) == Path("x/y.json")
    assert bench_env.variant_name({"model": "llama-350m", "compare": "heap_reuse"}) == "llama_350m-heap_reuse"
    assert bench_env.result_fields("clip_bench", {"quick": True}, hw) == \
        {"benchmark": "clip_bench", "machine": "cpu2-epyc", "variant": {"quick": True}}


def test_scripts_route_their_default_path_through_the_helper():
    import compressed_states
    import soak

    here = bench_env.machine_id()
    assert compressed_states.parse_args(["--quick"]).out == bench_env.RESULTS / "compressed_states" / "quick" / f"{here}.json"
    assert compressed_states.parse_args(["--out", "r.json"]).out == Path("r.json")
    args = argparse.Namespace(quick=False, steps=40, legacy_upcast=False, malloc_trim="first")
    assert bench_env.variant_name(soak.variant(args, "llama110m", 40)) == "llama110m-steps40-malloc_trim_first"
    args = argparse.Namespace(quick=True, steps=None, legacy_upcast=False, malloc_trim=None)
    assert bench_env.variant_name(soak.variant(args, "tiny", soak.QUICK_STEPS)) == "tiny-quick"
