"""What a periodic checkpoint (`--save-every`) costs a run: the 110M Llama of `scripts/make_tiny_hf.py`.

    .venv/bin/python benchmarks/checkpoint_cost.py               # 3 rounds, ~6 min on 2 cores
    .venv/bin/python benchmarks/checkpoint_cost.py --rounds 1 --steps 4

Each round runs `finetune.py` twice on the same model and data, in alternating order: once with
`--save-every 2 --export DIR` (fp32 checkpoints, then the bf16 ones with `--export-dtype bf16`) and once
without. From the metrics JSONL: the seconds each save took (`save_s`, training waits for it), and the median
step time of the steps after the first (the first profiles). A save's cost to the run is its `save_s`; the
step times show whether the steps around a save slow down too. Report: benchmarks/results/checkpoint_cost/<machine>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_env import result_fields, result_path  # sibling module (the script's own directory)

REPO = Path(__file__).resolve().parents[1]


def _run(model: Path, work: Path, steps: int, save: str | None) -> dict:
    """One finetune.py run; returns its save and step times."""
    metrics = work / "m.jsonl"
    cmd = [sys.executable, str(REPO / "finetune.py"), "--model", str(model), "--data", str(REPO / "data/corpus.txt"),
           "--steps", str(steps), "--batch-size", "2", "--seq-len", "256", "--lr", "1e-4",
           "--nvme", str(work / "nvme"), "--metrics", str(metrics), "--overwrite"]
    if save is not None:
        cmd += ["--save-every", "2", "--export", str(work / "export")]
        if save != "fp32":
            cmd += ["--export-dtype", save]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=work)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    # one checkpoint's size: the final export's weights (the step-N folders beside them hold the same amount)
    exported = sum(f.stat().st_size for f in (work / "export").glob("*.safetensors")) if save else 0
    shutil.rmtree(work / "nvme", ignore_errors=True)
    shutil.rmtree(work / "export", ignore_errors=True)
    return {"wall_s": wall, "step_s": [r["step_s"] for r in records[1:]],
            "save_s": [r["save_s"] for r in records if "save_s" in r], "export_bytes": exported}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps per run (a save every 2)")
    p.add_argument("--out", default=None, help="JSON report (default benchmarks/results/checkpoint_cost/<machine>.json)")
    args = p.parse_args(argv)
    scratch = REPO / "benchmarks/scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt.", dir=scratch))
    variants = ("none", "fp32", "bf16")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        model = work / "llama-110m"
        subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_hf.py"), str(model), "--size", "110m"],
                       check=True, stdout=subprocess.DEVNULL)
        for r in range(args.rounds):
            order = variants[r % 3:] + variants[:r % 3]  # rotated, so no variant always runs first
            for v in order:
                runs[v].append(_run(model, work, args.steps, None if v == "none" else v))
                print(f"round {r + 1} {v}: saves {[round(s, 2) for s in runs[v][-1]['save_s']]} s, "
                      f"steps {statistics.median(runs[v][-1]['step_s']):.2f} s (median)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {**_report(runs, args), **result_fields("checkpoint_cost")}
    out = result_path("checkpoint_cost", out=args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(report))
    print(out.with_suffix(".md").read_text())
    return 0


def _report(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    summary = {}
    for v, rs in runs.items():
        saves = [s for r in rs for s in r["save_s"]]
        summary[v] = {"save_s_median": statistics.median(saves) if saves else None,
                      "save_s": saves, "step_s_median": statistics.median(s for r in rs for s in r["step_s"]),
                      "export_gb": rs[0]["export_bytes"] / 1e9 if rs and rs[0]["export_bytes"] else None}
    return {"command": "benchmarks/checkpoint_cost.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "cpu": platform.processor() or platform.machine(), "rounds": args.rounds, "steps": args.steps,
            "model": "scripts/make_tiny_hf.py --size 110m (its fp32 weights, bf16 compute, batch 2 x 256, CPU)", "variants": summary}


def _markdown(report: dict) -> str:
    lines = ["# What a checkpoint costs (110M Llama, `--save-every 2`)", "",
             f"`{report['command'].strip()}`, {report['date']}, {report['rounds']} rounds of {report['steps']} steps "
             f"per run; {report['model']}.", "",
             "| checkpoints | checkpoint size (GB) | seconds per save (median) | step seconds (median, saves excluded) |",
             "|---|---|---|---|"]
    for v, s in report["variants"].items():
        size = "-" if s["export_gb"] is None else f"{s['export_gb']:.2f}"
        save = "-" if s["save_s_median"] is None else f"{s['save_s_median']:.2f}"
        lines.append(f"| {v} | {size} | {save} | {s['step_s_median']:.2f} |")
    lines += ["", "A save blocks training for its seconds (reported per save as `save_s` in the metrics and on its "
              "log line); the steps themselves are compared across the variants."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
