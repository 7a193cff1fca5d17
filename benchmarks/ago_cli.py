"""Active gradient offloading (AGO) measured through `finetune.py`, the path users take.

What it measures. `benchmarks/ago_bench.py` compares the optimizer pipelines (``--mode serial | naive |
optimized``) inside one process on one store; this script shows the same ordering through the command
line: every run is ``finetune.py`` started as a subprocess (the same Python, or ``--python``) on a fresh
store in its own scratch directory (``benchmarks/scratch/ago_cli/<run>/``) with its own per-step metrics
file (``--metrics``, one JSON record per step, written by ``lohan.app.metrics``). Runs are taken for every
(clipping case, mode) pair, interleaved in rounds: round r runs every pair in an order rotated by r, so the
disk's and the machine's drift hit every pair alike.

Cases (``--cases``): ``clipped`` is the CLI's default clipping (``--max-grad-norm`` left at its default,
1.0; from random initialization every step clips, which the report verifies from ``clip_coef`` < 1);
``noclip`` passes ``--max-grad-norm 0``; ``unclipped`` (optional) passes ``--max-grad-norm 1e6`` (clipping
on, the coefficient always 1). Every run uses synthetic data and ``--set engine.resident_mem=0`` (the modes
are compared on the optimizer records they stream, none kept in memory). The first ``--warmup`` steps of
each run (default 2: the first profiles the activation plan and touches the buffer pools) are left out of
the medians; their times are kept in the report.

Per (case, mode) the report gives the median seconds per step over the measured steps of every round,
every raw step time, the medians of the lanes (``optimizer_tail`` among them) and the fractions of steps
clipped, redone, deferred and whose next forward overlapped the optimizer pass (each None where the
metrics records lack the field); the keys ``speedup_vs_serial`` (clipped: serial / optimized median),
``speedup_vs_serial_noclip``, ``speedup_vs_naive`` and ``ordering_holds`` (optimized fastest in every
case measured). JSON (default ``benchmarks/results/ago_cli/<machine>.json``) plus a markdown summary beside it.

How long. With the defaults (350m, batch 1 x seq 512, 7 steps per run) one run takes about a minute on the
2-core development VM, including the store's initialization: 2 cases x 3 modes x 2 rounds = 12 runs,
about 12-15 minutes. The tiny preset takes a few seconds per run. Nothing else should use the machine
meanwhile. Each run's store (10.6 GB for 350m) is deleted as soon as the run ends, unless ``--keep``.

Run (from the repository root):
    .venv/bin/python benchmarks/ago_cli.py 2>&1 | tee benchmarks/scratch/ago_cli.log
    .venv/bin/python benchmarks/ago_cli.py --model tiny --steps 4 --rounds 1 --out benchmarks/scratch/ago_cli_tiny.json
Keys of the report: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    portable,
    result_fields,
    result_path,
    shared_environment,
)

REPO = Path(__file__).resolve().parent.parent
FINETUNE = REPO / "finetune.py"
ALL_MODES = ("serial", "naive", "optimized")
CASES: dict[str, list[str]] = {
    "clipped": [],  # the CLI's default: --max-grad-norm 1.0
    "noclip": ["--max-grad-norm", "0"],
    "unclipped": ["--max-grad-norm", "1e6"],
}
"""finetune.py flags of each clipping case."""
BOOL_FIELDS = {"redone": "redone", "deferred": "deferred", "next_forward_overlapped": "next_forward_overlapped",
               "skipped": "skipped"}
"""Report name -> boolean field of a metrics record whose share of the measured steps is reported."""
MAIN_LANES = ("gpu", "ssd", "ssd_read", "ssd_write", "cpu", "param_wait", "optimizer_tail")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (see the module docstring and benchmarks/README.md)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="350m", help="finetune.py --model (a preset or a model directory)")
    p.add_argument("--steps", type=int, default=7, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(ALL_MODES))
    p.add_argument("--cases", nargs="+", choices=tuple(CASES), default=["clipped", "noclip"])
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every (case, mode) once, rotated")
    p.add_argument("--cpu-mem", default="8GiB",
                   help="finetune.py --cpu-mem (default 8GiB, the engine's default and ago_bench's; the CLI's default "
                        "config, configs/tiny.yaml, gives 2 GiB, too little for 350m); 'none': leave it unset")
    p.add_argument("--extra", default="", help="more finetune.py arguments, one string (split like a shell)")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs finetune.py")
    p.add_argument("--scratch", default=str(REPO / "benchmarks" / "scratch" / "ago_cli"),
                   help="directory of the runs' stores, metrics files and logs")
    p.add_argument("--keep", action="store_true", help="keep the stores, metrics files and logs")
    p.add_argument("--pause", type=float, default=2.0, help="seconds of rest after each run's store is deleted")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before a run is killed")
    p.add_argument("--out", default=None, help="JSON report (default benchmarks/results/ago_cli/<machine>.json)")
    args = p.parse_args(argv)
    for key in ("seq_len", "batch_size", "rounds"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0: some steps must be measured")
    args.modes = list(dict.fromkeys(args.modes))
    args.cases = list(dict.fromkeys(args.cases))
    return args


# ------------------------------------------------------------------------------------------ runs
def schedule(cases: Sequence[str], modes: Sequence[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, case, mode) in the order they run: round r runs every pair, the list rotated by r."""
    pairs = [(c, m) for c in cases for m in modes]
    order = []
    for r in range(rounds):
        k = r % len(pairs)
        order += [(r, c, m) for c, m in pairs[k:] + pairs[:k]]
    return order


def finetune_command(args: argparse.Namespace, case: str, mode: str, run_dir: Path) -> list[str]:
    """The finetune.py command line of one run, its store and metrics file in `run_dir`."""
    cmd = [args.python, str(FINETUNE), "--model", args.model, "--data", "synthetic", "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--mode", mode,
           "--nvme", str(run_dir / "nvme"), "--overwrite", "--metrics", str(run_dir / "metrics.jsonl"),
           "--set", "engine.resident_mem=0", *CASES[case]]
    if args.cpu_mem and args.cpu_mem != "none":
        cmd += ["--cpu-mem", args.cpu_mem]
    return cmd + shlex.split(args.extra)


def load_records(path: Path) -> list[dict[str, Any]]:
    """The per-step records of a metrics JSONL file, in step order (lines without a step time skipped)."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step_s"), int | float)]
    return sorted(rows, key=lambda r: r.get("step", 0))


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_one(args: argparse.Namespace, rnd: int, case: str, mode: str) -> dict[str, Any]:
    """Run finetune.py once on a fresh store; its records, exit status and wall time. The store is deleted
    afterwards unless --keep; the output goes to ``finetune.log`` in the run's directory."""
    run_dir = Path(args.scratch) / f"r{rnd}-{case}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)  # ours (named by us): a fresh store, an empty metrics file
    run_dir.mkdir(parents=True)
    cmd = finetune_command(args, case, mode, run_dir)
    log = run_dir / "finetune.log"
    t0 = time.perf_counter()
    try:
        with log.open("w") as out:
            rc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=args.run_timeout,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    wall = time.perf_counter() - t0
    result = {"round": rnd, "case": case, "mode": mode, "command": shlex.join(cmd), "rc": rc, "wall_s": wall,
              "records": load_records(run_dir / "metrics.jsonl")}
    if rc != 0:
        result["log_tail"] = _tail(log)
    if not args.keep:
        shutil.rmtree(run_dir / "nvme", ignore_errors=True)
        os.sync()  # the deleted store's blocks are released before the next run's clock starts
        time.sleep(args.pause)
    return result


# ------------------------------------------------------------------------------------- summary
def _median(xs: Sequence[float]) -> float | None:
    return float(f"{statistics.median(xs):.6g}") if xs else None  # 6 digits, as the metrics records


def _share(records: Sequence[dict], field: str, test: Callable[[Any], bool] = bool) -> float | None:
    """Share of `records` for which `test(record[field])` holds; None where no record has the field."""
    if not records or not any(field in r for r in records):
        return None
    return sum(1 for r in records if field in r and test(r[field])) / len(records)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_clipped(coef: Any) -> bool:
    return _is_number(coef) and coef < 1


def summarize_pair(runs: Sequence[dict], warmup: int) -> dict[str, Any]:
    """Statistics of one (case, mode) over its successful runs: the first `warmup` records of each run are
    warm-up, the rest measured."""
    measured = [r for run in runs for r in run["records"][warmup:]]
    by_round = {str(run["round"]): [r["step_s"] for r in run["records"][warmup:]] for run in runs}
    lane_names = list(dict.fromkeys(n for r in measured for n in r.get("lanes", {})))
    lanes = {n: _median([r["lanes"][n] for r in measured if n in r.get("lanes", {})]) for n in lane_names}
    out = {
        "median_s_per_step": _median([r["step_s"] for r in measured]),
        "step_s_all": [r["step_s"] for r in measured],
        "step_s_by_round": by_round,
        "warmup_step_s": [[r["step_s"] for r in run["records"][:warmup]] for run in runs],
        "n_measured_steps": len(measured),
        "runs": len(runs),
        "median_tokens_per_s": _median([r["tokens_per_s"] for r in measured if "tokens_per_s" in r]),
        "lanes": lanes,
        "optimizer_tail_s": lanes.get("optimizer_tail"),
        "frac_clipped": _share(measured, "clip_coef", _is_clipped),
        **{f"frac_{name}": _share(measured, field) for name, field in BOOL_FIELDS.items()},
        "median_grad_norm": _median([r["grad_norm"] for r in measured if _is_number(r.get("grad_norm"))]),
        "median_clip_coef": _median([r["clip_coef"] for r in measured if _is_number(r.get("clip_coef"))]),
    }
    out["fields_missing"] = [f for f in ("clip_coef", *BOOL_FIELDS.values()) if not any(f in r for r in measured)]
    return out


def summarize(runs: Sequence[dict], warmup: int) -> dict[str, dict[str, dict]]:
    """{case: {mode: summarize_pair(...)}} over the runs that exited 0, cases and modes in the order seen."""
    ok = [run for run in runs if run["rc"] == 0 and len(run["records"]) > warmup]
    out: dict[str, dict[str, dict]] = {}
    for case in dict.fromkeys(run["case"] for run in runs):
        for mode in dict.fromkeys(run["mode"] for run in runs):
            pair = [run for run in ok if run["case"] == case and run["mode"] == mode]
            if pair:
                out.setdefault(case, {})[mode] = summarize_pair(pair, warmup)
    return out


def _ratio(summary: dict, case: str, base: str, target: str = "optimized") -> float | None:
    modes = summary.get(case, {})
    if base not in modes or target not in modes:
        return None
    return modes[base]["median_s_per_step"] / modes[target]["median_s_per_step"]


def keys(summary: dict[str, dict[str, dict]]) -> dict[str, Any]:
    """The headline keys: speedups of optimized (ratio of median s/step; the clipped case unsuffixed, the
    others suffixed ``_<case>``), whether optimized is the fastest mode in each case, and the share of
    clipped steps in the clipped case."""
    out: dict[str, Any] = {}
    for case in dict.fromkeys(("clipped", "noclip", *summary)):
        suffix = "" if case == "clipped" else f"_{case}"
        out[f"speedup_vs_serial{suffix}"] = _ratio(summary, case, "serial")
        out[f"speedup_vs_naive{suffix}"] = _ratio(summary, case, "naive")
    by_case = {}
    for case, modes in summary.items():
        others = [s["median_s_per_step"] for m, s in modes.items() if m != "optimized"]
        by_case[case] = (all(modes["optimized"]["median_s_per_step"] < o for o in others)
                         if "optimized" in modes and others else None)
    judged = [v for v in by_case.values() if v is not None]
    out["ordering_holds"] = all(judged) if judged else None
    out["ordering_by_case"] = by_case
    clipped = summary.get("clipped", {})
    steps = sum(s["n_measured_steps"] for s in clipped.values())
    fracs = [(s["frac_clipped"], s["n_measured_steps"]) for s in clipped.values() if s["frac_clipped"] is not None]
    out["clipped_fraction"] = sum(f * n for f, n in fracs) / steps if fracs and steps else None
    return out


# -------------------------------------------------------------------------------------- report
def environment() -> dict[str, Any]:
    """Git commit, versions and hardware of this machine."""
    return shared_environment(dirty_paths=("lohan", "io_engine", "finetune.py", "benchmarks"))


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return _f(v) if isinstance(v, float) or v is None else str(v)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def case_table(modes: dict[str, dict]) -> str:
    """Markdown table of one case: a row per mode."""
    head = ["mode", "median s/step", "tokens/s", *MAIN_LANES, "clipped", "deferred", "redone", "next fwd overlapped"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, s in modes.items():
        cells = [mode, _f(s["median_s_per_step"]), _f(s["median_tokens_per_s"], ".1f"),
                 *(_f(s["lanes"].get(n)) for n in MAIN_LANES), _pct(s["frac_clipped"]), _pct(s["frac_deferred"]),
                 _pct(s["frac_redone"]), _pct(s["frac_next_forward_overlapped"])]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def markdown(report: dict) -> str:
    """The report's markdown summary."""
    st = report["settings"]
    lines = [f"# ago_cli — {report['timestamp']}", "", f"`{report['command']}`", "",
             f"finetune.py runs: model {st['model']}, batch {st['batch_size']} x seq {st['seq_len']}, {st['steps']} "
             f"steps per run ({st['warmup']} warm-up left out), {st['rounds']} round(s), synthetic data, "
             f"engine.resident_mem=0, cpu_mem {st['cpu_mem'] or 'the CLI default'}; commit "
             f"{report['versions']['git_commit']}; {report['hardware']['cpu_count']} CPUs; wall time "
             f"{report['wall_seconds']:.0f} s.", "", "| key | value |", "|---|---|"]
    for k, v in report["keys"].items():
        lines.append(f"| {k} | {_cell(v)} |")
    for case, modes in report["cases"].items():
        lines += ["", f"## {case} (`{' '.join(CASES[case]) or 'default --max-grad-norm'}`)", "",
                  "Medians over the measured steps of every round, in seconds; lanes are the engine's busy "
                  "seconds per step; shares of the measured steps ('-': not in the metrics records).", "",
                  case_table(modes), "", "Raw measured step times (s), by round:", ""]
        for mode, s in modes.items():
            lines.append(f"- {mode}: " + "; ".join(f"r{r}: " + ", ".join(f"{x:.3f}" for x in xs)
                                                   for r, xs in s["step_s_by_round"].items()))
    lines += ["", "## Commands", "", *(f"- `{c}`" for c in report["commands"])]
    if report["failed_runs"]:
        lines += ["", "## Failed runs", "", *(f"- {f['case']} {f['mode']} round {f['round']}: rc {f['rc']}"
                                             for f in report["failed_runs"])]
    return "\n".join(lines) + "\n"


def build_report(args: argparse.Namespace, runs: list[dict], argv: Sequence[str], wall: float) -> dict[str, Any]:
    """The JSON report (machine paths not yet removed: see bench_env.portable)."""
    summary = summarize(runs, args.warmup)
    headline = keys(summary)
    settings = {k: getattr(args, k) for k in ("model", "steps", "warmup", "seq_len", "batch_size", "modes", "cases",
                                              "rounds", "cpu_mem", "extra", "python")}
    return {
        **{k: v for k, v in headline.items() if k != "ordering_by_case"},
        "keys": headline,
        "cases": summary,
        "case_flags": {c: CASES[c] for c in args.cases},
        "settings": settings,
        "commands": [run["command"] for run in runs],
        "failed_runs": [{k: run.get(k) for k in ("round", "case", "mode", "rc", "log_tail")}
                        for run in runs if run["rc"] != 0],
        "runs": runs,
        **environment(),
        "command": shlex.join([sys.executable, str(Path(__file__).resolve()), *argv]),
        "timestamp": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_seconds": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run every (case, mode) in rounds, write the report; 1 if a run failed, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    plan = schedule(args.cases, args.modes, args.rounds)
    print(f"ago_cli: {len(plan)} runs of finetune.py ({args.model}, {args.steps} steps, {args.warmup} warm-up) "
          f"in {args.scratch}", flush=True)
    runs = []
    try:
        for i, (rnd, case, mode) in enumerate(plan, 1):
            run = run_one(args, rnd, case, mode)
            runs.append(run)
            med = _median([r["step_s"] for r in run["records"][args.warmup:]])
            clipped = _share(run["records"][args.warmup:], "clip_coef", _is_clipped)
            print(f"[{time.perf_counter() - t_start:7.1f}s] run {i}/{len(plan)} round {rnd} {case:9s} {mode:9s} "
                  f"rc {run['rc']}: median {_f(med)} s/step over {len(run['records'][args.warmup:])} steps, "
                  f"clipped {_pct(clipped)}, run {run['wall_s']:.1f} s", flush=True)
            if run["rc"] != 0:
                print(run.get("log_tail", ""), flush=True)
    finally:
        if not args.keep:
            _cleanup(Path(args.scratch), plan)
    report = portable({**build_report(args, runs, argv, time.perf_counter() - t_start), **result_fields("ago_cli")})
    out = result_path("ago_cli", out=args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    for k, v in report["keys"].items():
        print(f"{k:28s} {_cell(v)}")
    print(f"wrote {out} and {out.with_suffix('.md')} ({report['wall_seconds']:.0f} s)", flush=True)
    return 1 if report["failed_runs"] else 0


def _cleanup(scratch: Path, plan: Sequence[tuple[int, str, str]]) -> None:
    """Delete the run directories this benchmark made, then `scratch` itself if that left it empty."""
    for rnd, case, mode in plan:
        shutil.rmtree(scratch / f"r{rnd}-{case}-{mode}", ignore_errors=True)
    try:
        scratch.rmdir()
    except OSError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
