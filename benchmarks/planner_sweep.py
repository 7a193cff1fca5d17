"""Traffic-aware activation planner vs measurement (LoHan paper Fig. 9b): swapped volume sweep.

What it does. One model's states are laid out once on `--nvme`. A calibration step measures the
profile the planner uses (per-op FLOPs and output bytes of a block, THP from the block's measured
forward + backward, copy and SSD bandwidths through io_engine; DESIGN.md §4.5), and Algorithm 1 is run
on it. Then every point of the planner's walk, from ``interblock`` (block inputs only) through each
op added in decreasing offload benefit to ``swap-all``, is forced with ``act_policy="ops:..."`` and the
step time measured, next to the time the cost model predicts for that point from the same profile.
Points are interleaved in rounds (order rotated per round) because the disk is noisy; the first step
after each switch re-plans and is discarded.

The machine balance. The cost model trades recomputation (GPU FLOPs) against transfers (PCIe, SSD).
On the 2-core development VM the "GPU" is the CPU, ~0.1-0.2 TFLOP/s, about a thousand times slower than
the paper's RTX 4090, while its one disk is as fast as one of the paper's twelve SSDs; swapping to
the SSD would always win and the optimum would sit at ``swap-all`` (case 2). The default run therefore
keeps no activations in main memory (``--act-mem 0``: every block but the last goes through the SSD
tier) and paces the SSD directory to ``--emulate-ssd-gbps 0.3`` for all traffic, states included, so the
compute : SSD balance gives an interior optimum (case 3) as in the paper's Fig. 9b. Results measured so
are labelled emulated in the report.

Headline keys: ``choice_over_best`` (measured step time at the planner's choice / the best measured
point) and ``mean_abs_prediction_error`` (mean over points of |predicted - measured| / measured); per
point: the prediction, the measurement, the error, and the engine's lanes to explain it.

Run (from the repository root; nothing else should use the disk meanwhile):
    .venv/bin/python benchmarks/planner_sweep.py --quick
    .venv/bin/python benchmarks/planner_sweep.py
Writes the JSON, a markdown summary and a PNG plot (same stem). The slab files are deleted at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    cpu_model,
    package_version,
    result_fields,
    result_path,
    save_report,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

STORE_NAME = "sweep"
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(rounds=3, steps=2),
    "quick": dict(rounds=2, steps=1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 10 min)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--act-mem", default="0", help="main memory for swapped activations (0: all to SSD)")
    p.add_argument("--emulate-ssd-gbps", type=float, default=0.3,
                   help="pace each SSD directory to this bandwidth; 0 = the disk's own speed")
    p.add_argument("--rounds", type=int, help="rounds; each measures every point once")
    p.add_argument("--steps", type=int, help="measured steps per point per round")
    p.add_argument("--nvme", nargs="+", default=[str(REPO / "benchmarks" / "scratch" / "sweep")],
                   help="SSD directories (one per SSD)")
    p.add_argument("--backend", choices=("auto", "aio", "threads"), default="auto")
    p.add_argument("--out", help="JSON report path (default benchmarks/results/planner_sweep[/quick]/<machine>.json)")
    args = p.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    return args


def policy_of(swap: tuple[str, ...]) -> str:
    return "ops:" + ",".join(swap) if swap else "interblock"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import lohan
    from lohan.config import EngineConfig, get_model_config
    from lohan.plan.planner import algorithm1

    mcfg = get_model_config("tiny", vocab_size=args.vocab, n_layer=args.layers, d_model=args.d_model,
                            n_head=args.heads, seq_len=args.seq_len)
    ecfg = EngineConfig(nvme=tuple(args.nvme), cpu_mem="8GiB", compute_dtype=args.compute_dtype,
                        act_policy="interblock", act_mem=args.act_mem, backend=args.backend, name=STORE_NAME,
                        emulate_ssd_gbps=args.emulate_ssd_gbps or None, lr=1e-4,
                        resident_mem=0)  # the states stream through the SSDs, as the planner prices them
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
    batch = (ids[:, :-1], ids[:, 1:])
    t0 = time.perf_counter()
    engine = lohan.init(mcfg, ecfg, overwrite=True)
    init_s = time.perf_counter() - t0
    try:
        engine.step(batch)  # calibration: profile measured here, on this model, data shape and disk
        profile = engine.activations.profile
        plan = algorithm1(profile)
        print(plan.format_table(), flush=True)
        points = list(plan.points)
        samples: list[list[float]] = [[] for _ in points]
        lanes: list[list[dict]] = [[] for _ in points]
        acts: list[dict] = [{} for _ in points]
        for r in range(args.rounds):
            order = list(range(len(points)))
            k = r % len(order)
            order = order[k:] + order[:k] if r % 2 == 0 else list(reversed(order[k:] + order[:k]))
            for i in order:
                engine.activations.set_policy(policy_of(points[i].swap))
                engine.step(batch)  # re-plans; discarded
                for _ in range(args.steps):
                    engine.step(batch)
                    m = engine.last_stats
                    samples[i].append(m.step_s)
                    a = m.activations
                    lanes[i].append({**m.lanes, "act_ssd_read": a.get("ssd_read_s", 0.0),
                                     "act_ssd_write": a.get("ssd_write_s", 0.0)})
                    acts[i] = m.activations
                print(f"round {r + 1}/{args.rounds} point {i}: {policy_of(points[i].swap):<40} "
                      f"measured {samples[i][-1]:.3f} s  predicted {points[i].t_iter:.3f} s", flush=True)
    finally:
        engine.close()
        for d in args.nvme:
            for f in Path(d).glob(f"{STORE_NAME}*"):
                f.unlink()

    measured = [statistics.median(s) for s in samples]
    best = min(range(len(points)), key=measured.__getitem__)
    rows = []
    for i, (e, meas) in enumerate(zip(points, measured)):
        med_lanes = {k: statistics.median(ln[k] for ln in lanes[i]) for k in lanes[i][0]}
        rows.append({
            "point": i, "policy": policy_of(e.swap), "swap": list(e.swap),
            "a_g2m_bytes": e.a_g2m, "to_ssd_bytes": e.alpha_bytes, "flop_r": e.flop_r,
            "predicted_s": e.t_iter, "predicted_t_f": e.t_f, "predicted_t_b": e.t_b,
            "predicted_bottleneck": f"{e.bottleneck_f}/{e.bottleneck_b}",
            "lanes_f": e.lanes_f, "lanes_b": e.lanes_b,
            "measured_s": meas, "samples_s": samples[i], "measured_lanes": med_lanes,
            "act_bytes": acts[i].get("bytes"), "tiers": acts[i].get("tiers"),
            "prediction_error": (e.t_iter - meas) / meas,
        })
    return {
        "benchmark": "planner_sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "environment": {"python": platform.python_version(), "torch": package_version("torch"),
                        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "emulated_ssd_gbps": args.emulate_ssd_gbps or None, "nvme_dirs": len(args.nvme)},
        "config": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "vocab": args.vocab, "compute_dtype": args.compute_dtype,
                   "act_mem": args.act_mem, "rounds": args.rounds, "steps": args.steps, "backend": args.backend,
                   "store_init_s": init_s},
        "profile": profile.to_dict(),
        "plan_case": plan.case,
        "choice": plan.chosen,
        "best_measured": best,
        "choice_over_best": measured[plan.chosen] / measured[best],
        "mean_abs_prediction_error": statistics.fmean(abs(r["prediction_error"]) for r in rows),
        "points": rows,
        "plan_table": plan.format_table(),
    }


def write_markdown(report: dict[str, Any], path: Path) -> None:
    env, cfg = report["environment"], report["config"]
    lines = [
        "# planner_sweep: predicted vs measured step time along Algorithm 1's walk", "",
        f"`{report['command']}` on {env['cpu']} ({env['cores']} cores), torch {env['torch']}, "
        f"{env['nvme_dirs']} SSD dir(s), SSD emulated at {env['emulated_ssd_gbps']} GB/s per dir"
        if env["emulated_ssd_gbps"] else f"`{report['command']}`, real disk speed", "",
        f"Model: d_model {cfg['d_model']}, {cfg['layers']} layers, seq {cfg['seq_len']}, batch {cfg['batch_size']}, "
        f"{cfg['compute_dtype']}; act_mem {cfg['act_mem']}; {cfg['rounds']} rounds x {cfg['steps']} steps per point.", "",
        f"**choice_over_best = {report['choice_over_best']:.3f}** (planner's choice: point {report['choice']}, "
        f"best measured: point {report['best_measured']}; case {report['plan_case']}), "
        f"**mean_abs_prediction_error = {report['mean_abs_prediction_error']:.3f}**", "",
        "| # | swapped (beyond block inputs) | A_G2M GB | to SSD GB | predicted s | measured s | error | "
        "predicted bottleneck f/b | compute s | states read/write s | activations read/write s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["points"]:
        mark = " (choice)" if r["point"] == report["choice"] else ""
        mark += " (best)" if r["point"] == report["best_measured"] else ""
        ml = r["measured_lanes"]
        lines.append(
            f"| {r['point']}{mark} | {', '.join(r['swap']) or '-'} | {r['a_g2m_bytes'] / 1e9:.3f} | "
            f"{r['to_ssd_bytes'] / 1e9:.3f} | {r['predicted_s']:.2f} | {r['measured_s']:.2f} | "
            f"{r['prediction_error']:+.1%} | {r['predicted_bottleneck']} | {ml['compute']:.2f} | "
            f"{ml['ssd_read']:.2f} / {ml['ssd_write']:.2f} | {ml['act_ssd_read']:.2f} / {ml['act_ssd_write']:.2f} |")
    lines += ["", "Plan table (from the calibration profile):", "", "```", report["plan_table"], "```", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib unavailable: no plot", file=sys.stderr)
        return False
    pts = report["points"]
    x = [p["a_g2m_bytes"] / 1e9 for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [p["measured_s"] for p in pts], "o-", label="measured (median)")
    ax.plot(x, [p["predicted_s"] for p in pts], "s--", label="predicted (cost model)")
    c, b = report["choice"], report["best_measured"]
    ax.plot([x[c]], [pts[c]["measured_s"]], "*", markersize=16, color="tab:red", label="planner's choice")
    ax.plot([x[b]], [pts[b]["measured_s"]], "o", markersize=12, mfc="none", color="k", label="best measured")
    for p, xi in zip(pts, x):
        ax.annotate(",".join(p["swap"][-1:]) or "inputs", (xi, p["measured_s"]), fontsize=7,
                    textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xlabel("activations swapped out per step, A_G2M (GB)")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"planner sweep: choice/best = {report['choice_over_best']:.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for d in args.nvme:
        os.makedirs(d, exist_ok=True)
    out = result_path("planner_sweep", {"quick": args.quick}, args.out)
    t0 = time.perf_counter()
    report = {**run(args), **result_fields("planner_sweep", {"quick": args.quick})}
    report["wall_s"] = time.perf_counter() - t0
    report = save_report(report, out, write_markdown, write_plot)
    print(f"choice_over_best {report['choice_over_best']:.3f}  mean_abs_prediction_error "
          f"{report['mean_abs_prediction_error']:.3f}  ({report['wall_s']:.0f} s) -> {out}")
    if all(not any(Path(d).iterdir()) for d in args.nvme if Path(d).exists()):
        for d in args.nvme:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
