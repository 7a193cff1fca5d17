"""Data-parallel scaling: tokens/s of one training run on 1, 2, ... ranks (lohan/runtime/parallel.py), same global batch.

What it does. For every rank count N of ``--ranks`` (default 1 2) it launches ``torchrun --nproc-per-node N``
on this script's worker, which builds the engine on a fresh store (``DIR/rank<r>`` per rank), trains
``--warmup`` steps, then ``--steps`` measured steps on the same global batch of ``--batch`` sequences (each
rank trains batch / N of them). The rank counts are interleaved over ``--rounds`` rounds, their order rotated
each round, so the machine's noise hits them alike. Per point: median step time, tokens/s of the group,
rank 0's SSD bytes per step and lanes (P16 all-gather time, gradient all-reduce wait), peak RSS per rank,
and the network bytes per step and rank, measured (the collectives' payload, as ring collectives send it)
beside `lohan.runtime.parallel.network_bytes_per_step` (the cost model's term).

Threads: the machine's cores are split among the ranks (``OMP_NUM_THREADS`` = cores / N, as torchrun would
leave to you), so one rank with all cores is compared with N ranks sharing them. On a CPU-only box the ranks
also share the one CPU that computes, so N ranks cannot be faster than one by more than the overlap they
add; on a GPU box each rank has its own GPU and the SSD and CPU-optimizer work per rank falls by N.

Run here (CPU, gloo on loopback)::

    .venv/bin/python benchmarks/dp_scaling.py            # 2 rounds of 1 and 2 ranks
    .venv/bin/python benchmarks/dp_scaling.py --quick    # one round, fewer steps

On a GPU box (one rank per GPU, each GPU's rank on its own SSD directories under the same ``--nvme``)::

    .venv/bin/python benchmarks/dp_scaling.py --device cuda --ranks 1 2 4 8 --nvme /mnt/nvme0/lohan \\
        /mnt/nvme1/lohan --model 1b --preset-dims --batch 32 --seq-len 1024 --cpu-mem 200GiB

Several machines: run the worker yourself on each with torchrun's rendezvous (``torchrun --nnodes 2
--nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 benchmarks/dp_scaling.py --worker
SPEC.json``, the spec as this script writes it under the results directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_env import REPO, cpu_model, package_version, result_fields, result_path, save_report  # noqa: E402


# ------------------------------------------------------------------------------------------- worker
def worker(spec_path: str) -> None:
    """One rank (under torchrun): train and, on rank 0, write the measured steps to the spec's `out`."""
    import psutil
    import torch
    import torch.distributed as dist

    import lohan
    from lohan.config import EngineConfig, get_model_config
    from lohan.runtime.parallel import init_from_env, leave_group

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    joined = init_from_env()
    rank = dist.get_rank() if dist.is_initialized() else 0
    mcfg = get_model_config(spec["model"], **spec["model_overrides"])
    cfg = EngineConfig(**{**spec["engine"], "nvme": tuple(spec["engine"]["nvme"])})
    g = torch.Generator().manual_seed(0)
    steps = spec["warmup"] + spec["steps"]
    data = []
    for _ in range(steps + 1):
        x = torch.randint(0, mcfg.vocab_size, (spec["batch"], spec["seq_len"] + 1), generator=g)
        data.append((x[:, :-1], x[:, 1:]))
    records, rss = [], 0
    with lohan.init(mcfg, cfg, overwrite=True) as engine:
        for s in range(steps):
            engine.step(data[s], next_batch=data[s + 1])
            m = engine.last_stats
            rss = max(rss, psutil.Process().memory_info().rss)
            if s >= spec["warmup"]:
                records.append({k: getattr(m, k) for k in ("step_s", "tokens", "ssd_read_bytes", "ssd_write_bytes",
                                                      "network_bytes", "lanes")})
    peak = [rss]
    if dist.is_initialized():
        peak = [None] * dist.get_world_size()
        dist.all_gather_object(peak, rss)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"records": records, "peak_rss": peak}))
    if joined:
        leave_group(True)


# ------------------------------------------------------------------------------------ orchestration
def _spec(args: argparse.Namespace, ranks: int, out: Path) -> dict:
    overrides = {"seq_len": args.seq_len}
    if not args.preset_dims:
        overrides.update(n_layer=args.layers, d_model=args.d_model, n_head=args.d_model // 64, vocab_size=args.vocab)
    engine = {"nvme": [str(d) for d in args.nvme], "cpu_mem": args.cpu_mem, "compute_dtype": args.dtype,
              "device": args.device, "lr": 1e-4, "max_grad_norm": 1.0, "name": f"dpscale-{ranks}",
              "total_steps": 10**6}
    return {"model": args.model, "model_overrides": overrides, "engine": engine, "batch": args.batch,
            "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps,
            "threads": max(1, (os.cpu_count() or 1) // ranks) if args.device == "cpu" else 1, "out": str(out)}


def launch(args: argparse.Namespace, ranks: int, tmp: Path, tag: str) -> dict:
    out = tmp / f"{tag}.json"
    spec = _spec(args, ranks, out)
    path = tmp / f"{tag}.spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(29500 + ranks + 10 * (os.getpid() % 500)), str(Path(__file__).resolve()), "--worker", str(path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{ranks} rank(s) failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    got = json.loads(out.read_text())
    got["wall_s"] = time.perf_counter() - t0
    return got


def summarize(ranks: int, runs: list[dict], args: argparse.Namespace, param_count: int) -> dict:
    from lohan.runtime.parallel import network_bytes_per_step

    recs = [r for run in runs for r in run["records"]]
    step_s = statistics.median(r["step_s"] for r in recs)
    tokens = recs[0]["tokens"]

    def med(key: str) -> float:
        return statistics.median(float(r[key] or 0) for r in recs)

    lanes = {k: statistics.median(r["lanes"].get(k, 0.0) for r in recs) for k in recs[0]["lanes"]}
    itemsize = 4 if args.dtype == "fp32" else 2
    return {"ranks": ranks, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "round_medians_s": [statistics.median(r["step_s"] for r in run["records"]) for run in runs],
            "ssd_read_bytes_rank0": med("ssd_read_bytes"), "ssd_write_bytes_rank0": med("ssd_write_bytes"),
            "network_bytes_measured": med("network_bytes") if ranks > 1 else 0.0,
            "network_bytes_model": network_bytes_per_step(param_count, ranks, itemsize),
            "peak_rss_gib_per_rank": [max(run["peak_rss"][r] for run in runs) / 2**30 for r in range(ranks)],
            "lanes_rank0": lanes}


def write_markdown(report: dict, path: Path) -> None:
    rows = ["| ranks | s/step | tokens/s | scaling | rank 0 SSD read + write / step | network / step / rank "
            "(measured, model) | gather, reduce wait (s) | peak RSS / rank |", "|---|---|---|---|---|---|---|---|"]
    base = report["points"][0]["tokens_per_s"]
    for p in report["points"]:
        lanes = p["lanes_rank0"]
        rows.append(
            f"| {p['ranks']} | {p['step_s']:.3f} | {p['tokens_per_s']:.0f} | {p['tokens_per_s'] / base:.2f} | "
            f"{p['ssd_read_bytes_rank0'] / 1e9:.3f} + {p['ssd_write_bytes_rank0'] / 1e9:.3f} GB | "
            f"{p['network_bytes_measured'] / 1e9:.3f}, {p['network_bytes_model'] / 1e9:.3f} GB | "
            f"{lanes.get('gather', 0):.3f}, {lanes.get('reduce_wait', 0):.3f} | "
            f"{', '.join(f'{g:.2f}' for g in p['peak_rss_gib_per_rank'])} GiB |")
    env = report["env"]
    text = [f"# Data-parallel scaling ({report['label']})", "",
            f"`{report['command']}`", "",
            f"Model: {report['model']} ({report['param_count'] / 1e6:.1f}M parameters), global batch "
            f"{report['batch']} x {report['seq_len']}, {report['dtype']}, device {report['device']}; "
            f"{report['rounds']} round(s) of {report['steps']} measured steps after {report['warmup']} warm-up, rank "
            f"counts interleaved. Threads per rank: cores / ranks. Machine: {env['cpu']}, {env['cores']} cores; "
            f"torch {env['torch']}.", "", *rows, "",
            f"`scaling_2_ranks` = {report['scaling_2_ranks']:.3f} (tokens/s of 2 ranks / of 1)"
            if report.get("scaling_2_ranks") else "", "",
            report["note"], ""]
    path.write_text("\n".join(text))


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["points"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(p["ranks"]) for p in pts], [p["tokens_per_s"] for p in pts], color="tab:blue")
    ax.set_xlabel("ranks")
    ax.set_ylabel("tokens/s (group)")
    ax.set_title(f"lohan data parallel, {report['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one round, 2 warm-up + 4 measured steps")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model", default="13b", help="preset whose shape family is used (default 13b, shrunk)")
    ap.add_argument("--preset-dims", action="store_true", help="keep the preset's dimensions (no shrinking)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step, split over the ranks)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cpu-mem", default="4GiB", help="the machine's budget, shared by its ranks")
    ap.add_argument("--nvme", nargs="+", default=[str(REPO / "benchmarks" / "scratch" / "dp_scaling")])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 4, 2
    import torch

    from lohan.config import get_model_config

    bad = [n for n in args.ranks if args.batch % n]
    if bad:
        ap.error(f"--batch {args.batch} does not split over {bad} ranks")
    spec = _spec(args, 1, Path("unused"))
    param_count = get_model_config(args.model, **spec["model_overrides"]).param_count()
    label = "quick" if args.quick else "full"
    out = result_path("dp_scaling", {"quick": args.quick}, args.out)
    tmp = REPO / "benchmarks" / "scratch" / "dp_scaling_runs"
    tmp.mkdir(parents=True, exist_ok=True)
    runs: dict[int, list[dict]] = {n: [] for n in args.ranks}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        order = args.ranks[r % len(args.ranks):] + args.ranks[:r % len(args.ranks)]
        for n in order:
            got = launch(args, n, tmp, f"r{r}-n{n}")
            runs[n].append(got)
            med = statistics.median(x["step_s"] for x in got["records"])
            print(f"round {r + 1}/{args.rounds}: {n} rank(s): {med:.3f} s/step ({got['wall_s']:.0f} s)", flush=True)
    points = [summarize(n, runs[n], args, param_count) for n in args.ranks]
    by = {p["ranks"]: p for p in points}
    report = {
        "label": label, "command": " ".join(["python", "benchmarks/dp_scaling.py", *sys.argv[1:]]),
        "model": args.model, "param_count": param_count, "batch": args.batch, "seq_len": args.seq_len,
        "dtype": args.dtype, "device": args.device, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "points": points,
        "scaling_2_ranks": by[2]["tokens_per_s"] / by[1]["tokens_per_s"] if 1 in by and 2 in by else None,
        "env": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                "deepspeed": package_version("deepspeed")},
        "note": ("Each rank reads and writes 1/N of the optimizer states and of the P16 (its shards), so rank 0's "
                 "SSD bytes fall by about N; the network bytes are the gradient all-reduce (fp32, 2(N-1)/N of it) "
                 "and the P16 all-gathers (forward and backward, (N-1)/N each). On a CPU-only machine the ranks "
                 "split the same cores, so the group cannot compute faster than one process; the scaling here "
                 "shows what data parallelism costs, not what GPUs gain."),
        "wall_s": time.perf_counter() - t0, **result_fields("dp_scaling", {"quick": args.quick}),
    }
    report = save_report(report, out, write_markdown, write_plot)
    sc = report["scaling_2_ranks"]
    print(f"scaling_2_ranks {sc if sc is None else round(sc, 3)} -> {out}")


if __name__ == "__main__":
    main()
