"""What the compressed state formats (and activation compression) buy and cost: bytes per step, speed where the
SSDs set the pace, and quality (issue "Compressed tiers"; README "Smaller states").

Three parts, all on this machine:

1. **Bytes.** Each format's SSD bytes read plus written per parameter per step, measured by the engine's volume
   counters in part 2's runs (the optimizer's records, and the P16 reads of forward and backward), beside what
   `lohan.plan.formats` prices.
2. **Speed, SSD-bound.** ssd_scaling's model (the 13b preset shrunk to 4 layers x d_model 512, vocab 1024: 13.3M
   parameters) at batch 1 x 256 on one SSD directory paced to ``--emulate-ssd-gbps`` (default 0.1 GB/s, reads and
   writes sharing it), ``resident_mem`` 0 so every record streams through the SSD, clipping on (the default). One
   engine per format; the formats run in interleaved rounds whose order rotates, and the first step of each
   engine (profiling) is discarded. Also measured alone: each format's CPU update rate (decode, AdamW, encode).
3. **Quality.** ``finetune.py`` fine-tunes the 110M Llama of ``scripts/make_tiny_hf.py --size 110m`` on the shipped
   corpus (``data/corpus.txt``) for ``--quality-steps`` steps (300; ``--quick``: 40) with a held-out split
   (``--eval-fraction``), once per variant: each state format, and ``exact`` with ``--act-compress int8``. Train
   and eval loss curves go on one plot; the gap is the relative difference of the final eval loss to exact's.

Keys (JSON): ``min_bytes_per_param_step`` (the most compressed format's measured bytes per parameter per step;
target <= 10, against 28 for exact), ``speedup_vs_exact_ssd_bound`` (exact's median step over the most compressed
format's; target >= 2.0) and ``max_eval_loss_gap`` (the largest relative gap in final eval loss over the variants;
target <= 0.01).

Run (from the repository root, alone: 2 cores make every timing sensitive to other processes):
    .venv/bin/python benchmarks/compressed_states.py --quick   # minutes -> benchmarks/results/compressed_states/quick/<machine>.*
    .venv/bin/python benchmarks/compressed_states.py           # ~1 h    -> benchmarks/results/compressed_states/<machine>.*
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_env import result_fields, result_path  # noqa: E402 (sibling module)

from lohan.plan.formats import FORMATS, state_format  # noqa: E402

SCRATCH = REPO / "benchmarks/scratch/compressed_states"
MOST_COMPRESSED = "bf16-master"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and quality steps (minutes)")
    p.add_argument("--rounds", type=int, default=None, help="speed rounds (default 3; --quick 2)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per format and round")
    p.add_argument("--emulate-ssd-gbps", type=float, default=0.1)
    p.add_argument("--quality-steps", type=int, default=None, help="fine-tune steps per variant (300; --quick 40)")
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--skip-quality", action="store_true", help="only bytes and speed")
    p.add_argument("--quality-from", type=Path, default=None,
                   help="take part 3 from an earlier result JSON of this benchmark instead of running it")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/compressed_states[/quick]/<machine>.json)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.quality_steps = args.quality_steps or (40 if args.quick else 300)
    args.out = result_path("compressed_states", {"quick": args.quick}, args.out)
    return args


# ----------------------------------------------------------------------------- speed and bytes
def update_rates(n: int = 1 << 22, compiled: bool = True) -> dict[str, float]:
    """Parameters per second of each format's CPU update (one block of `n` parameters, the engine's own code), on
    the compiled path (`format_kernel`) or the torch ops."""
    import os

    import torch

    from lohan.plan.records import BlockLayout, ParamSpec
    from lohan.runtime.format_adamw import adamw_unit_
    from lohan.runtime.optim import AdamWHyper, ParamRange, adamw_block_
    from lohan.store.states import unit_views

    hp, params, g = AdamWHyper(1e-4, 0.9, 0.95, 1e-8, 0.01), [ParamRange(0, n, (n,), True)], torch.randn(n)
    os.environ["LOHAN_FORMAT_KERNEL"] = "1" if compiled else "0"
    out = {}
    for fmt in FORMATS:
        b = BlockLayout(0, "b", (ParamSpec("w", (n,), 0, n),), n, 2, 0, fmt)
        v = unit_views(torch.zeros(b.record_bytes, dtype=torch.uint8), b, 0, n, torch.bfloat16)
        v.fill_initial(torch.randn(n))
        times = []
        for step in range(1, 5):
            t0 = time.perf_counter()
            if fmt == "exact":
                adamw_block_(v.master, g, v.m, v.v, v.p16, step, hp, params)
            else:
                adamw_unit_(v, g, step, hp, params, 0, seed=0, block=0, fp32=lambda x: x, limit=1 << 20)
            times.append(time.perf_counter() - t0)
        out[fmt] = n / statistics.median(times[1:])
    os.environ["LOHAN_FORMAT_KERNEL"] = "1"
    return out


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2 (and the bytes of part 1): every format on one paced SSD directory, interleaved rounds."""
    import torch

    import lohan
    from lohan.config import EngineConfig, get_model_config

    mcfg = get_model_config("13b", n_layer=4, d_model=512, n_head=8, vocab_size=1024, seq_len=256)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mcfg.vocab_size, (1, 257), generator=g)
    batch = (ids[:, :-1], ids[:, 1:])
    ssd = SCRATCH / "ssd0"
    ssd.mkdir(parents=True, exist_ok=True)
    engines, samples = {}, {f: [] for f in FORMATS}
    try:
        for fmt in FORMATS:
            ecfg = EngineConfig(nvme=(str(ssd),), name=f"cs-{fmt}", cpu_mem="4GiB", compute_dtype="bf16",
                                backend="auto", emulate_ssd_gbps=args.emulate_ssd_gbps, lr=1e-4, resident_mem=0,
                                state_format=fmt)
            engines[fmt] = lohan.init(mcfg, ecfg, overwrite=True)
            engines[fmt].step(batch, next_batch=batch)  # profiles and plans: not measured
        for r in range(args.rounds):
            order = list(FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)])
            for fmt in order:
                for _ in range(args.steps):
                    engines[fmt].step(batch, next_batch=batch)  # as finetune.py steps: told the next batch
                    m = engines[fmt].last_stats
                    samples[fmt].append({"round": r, "step_s": m.step_s, "read": m.ssd_read_bytes,
                                         "write": m.ssd_write_bytes, "lanes": m.lanes})
                last = samples[fmt][-args.steps:]
                print(f"round {r + 1}/{args.rounds} {fmt:<13} " + " ".join(f"{s['step_s']:.2f}" for s in last)
                      + " s/step", flush=True)
        params = engines["exact"].layout.param_count
    finally:
        for eng in engines.values():
            eng.close()
        shutil.rmtree(ssd, ignore_errors=True)
    return {"model": f"{mcfg.name}: 4 layers x d_model 512, vocab 1024, {params / 1e6:.1f}M params, batch 1 x 256",
            "params": params, "formats": {f: _summary(samples[f], params) for f in FORMATS}}


def _summary(s: list[dict[str, Any]], params: int) -> dict[str, Any]:
    moved = [(x["read"] + x["write"]) / params for x in s]
    return {"step_s": statistics.median(x["step_s"] for x in s), "samples_s": [x["step_s"] for x in s],
            "bytes_per_param_step": statistics.median(moved),
            "read_per_param": statistics.median(x["read"] / params for x in s),
            "write_per_param": statistics.median(x["write"] / params for x in s),
            "lanes": {k: statistics.median(x["lanes"][k] for x in s) for k in s[0]["lanes"]}}


# ----------------------------------------------------------------------------- quality
VARIANTS = [(f, []) for f in FORMATS] + [("exact+act-int8", ["--act-compress", "int8"])]


def quality(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: one finetune.py run per variant on the 110M Llama; its train and eval losses."""
    model = SCRATCH / "llama110m"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_hf.py"), str(model), "--size", "110m"],
                       check=True, stdout=subprocess.DEVNULL)
    out = {}
    for name, extra in VARIANTS:
        fmt = name.split("+")[0]
        work = SCRATCH / f"q-{name}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        metrics = work / "m.jsonl"
        every = max(5, args.quality_steps // 6)
        cmd = [sys.executable, str(REPO / "finetune.py"), "--model", str(model), "--data", str(REPO / "data/corpus.txt"),
               "--steps", str(args.quality_steps), "--batch-size", "2", "--seq-len", "256", "--lr", "3e-4",
               "--warmup-ratio", "0.05", "--eval-fraction", str(args.eval_fraction), "--eval-every", str(every),
               "--state-format", fmt, "--nvme", str(work / "nvme"), "--metrics", str(metrics), *extra]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=work)
        if done.returncode:
            raise RuntimeError(f"{name}: finetune.py failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        out[name] = {"wall_s": time.perf_counter() - t0,
                     "train": [[r["step"], r["loss"]] for r in records if "loss" in r],
                     "eval": [[r["step"], r["eval_loss"]] for r in records if r.get("eval_loss") is not None],
                     "step_s": statistics.median(r["step_s"] for r in records[1:])}
        print(f"quality {name:<15} final eval {out[name]['eval'][-1][1]:.4f} in {out[name]['wall_s']:.0f} s",
              flush=True)
        shutil.rmtree(work / "nvme", ignore_errors=True)
    base = out["exact"]["eval"][-1][1]
    for v in out.values():
        v["eval_gap"] = abs(v["eval"][-1][1] - base) / base
    return out


# ----------------------------------------------------------------------------- report
def report(args: argparse.Namespace) -> dict[str, Any]:
    from lohan.runtime import format_kernel

    compiled = format_kernel.kernel() is not None
    rates, torch_rates = update_rates(compiled=compiled), update_rates(compiled=False)
    print("CPU update rates: " + ", ".join(f"{f} {r / 1e6:.0f} M params/s" for f, r in rates.items())
          + f" ({'compiled' if compiled else 'torch ops'}); torch ops: "
          + ", ".join(f"{f} {r / 1e6:.0f}" for f, r in torch_rates.items()), flush=True)
    fast = speed(args)
    fmts = fast["formats"]
    out: dict[str, Any] = {
        "settings": {"quick": args.quick, "rounds": args.rounds, "steps": args.steps,
                     "emulate_ssd_gbps": args.emulate_ssd_gbps, "quality_steps": args.quality_steps,
                     "eval_fraction": args.eval_fraction, "speed_model": fast["model"]},
        "priced_bytes_per_param_step": {f: state_format(f).per_step() for f in FORMATS},
        "update_rate_params_per_s": rates, "update_rate_torch_params_per_s": torch_rates,
        "update_path": "compiled" if compiled else "torch ops",
        "update_cost": {f: rates["exact"] / rates[f] for f in FORMATS}, "speed": fmts,
        "min_bytes_per_param_step": fmts[MOST_COMPRESSED]["bytes_per_param_step"],
        "speedup_vs_exact_ssd_bound": fmts["exact"]["step_s"] / fmts[MOST_COMPRESSED]["step_s"],
        "speedups": {f: fmts["exact"]["step_s"] / fmts[f]["step_s"] for f in FORMATS},
    }
    if args.quality_from is not None:
        q = json.loads(args.quality_from.read_text())["quality"]
        out["quality"] = q
        out["max_eval_loss_gap"] = max(v["eval_gap"] for v in q.values())
    elif not args.skip_quality:
        q = quality(args)
        out["quality"] = q
        out["max_eval_loss_gap"] = max(v["eval_gap"] for v in q.values())
    return out


def write_markdown(r: dict[str, Any], path: Path) -> None:
    s = r["settings"]
    lines = [f"# Compressed state formats{' (quick)' if s['quick'] else ''}", "",
             f"`benchmarks/compressed_states.py{' --quick' if s['quick'] else ''}`. Speed: {s['speed_model']}, one SSD "
             f"directory emulated at {s['emulate_ssd_gbps']} GB/s, resident_mem 0, {s['rounds']} interleaved rounds "
             f"x {s['steps']} steps.", "",
             f"- `min_bytes_per_param_step` = **{r['min_bytes_per_param_step']:.2f}** (bf16-master; target <= 10)",
             f"- `speedup_vs_exact_ssd_bound` = **{r['speedup_vs_exact_ssd_bound']:.2f}** (target >= 2.0)"]
    if "max_eval_loss_gap" in r:
        lines.append(f"- `max_eval_loss_gap` = **{r['max_eval_loss_gap']:.4f}** over {s['quality_steps']} steps "
                     "(target <= 0.01)")
    lines += ["", f"| format | bytes/param/step measured | priced (P16 read back) | step (s) | vs exact | CPU update, {r['update_path']} "
                  "(M params/s) | torch ops |", "|---|---|---|---|---|---|---|"]
    for f, v in r["speed"].items():
        lines.append(f"| {f} | {v['bytes_per_param_step']:.2f} | {r['priced_bytes_per_param_step'][f]:.2f} | "
                     f"{v['step_s']:.2f} | {r['speedups'][f]:.2f}x | {r['update_rate_params_per_s'][f] / 1e6:.0f} | "
                     f"{r['update_rate_torch_params_per_s'][f] / 1e6:.0f} |")
    if "quality" in r:
        lines += ["", f"Quality: 110M Llama (`scripts/make_tiny_hf.py --size 110m`), data/corpus.txt, "
                      f"{s['quality_steps']} steps, batch 2 x 256, lr 3e-4, {s['eval_fraction']:.0%} held out.", "",
                  "| variant | final train loss | final eval loss | gap to exact | s/step |", "|---|---|---|---|---|"]
        for name, v in r["quality"].items():
            lines.append(f"| {name} | {v['train'][-1][1]:.4f} | {v['eval'][-1][1]:.4f} | {v['eval_gap']:.4f} | "
                         f"{v['step_s']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(r: dict[str, Any], path: Path) -> None:
    if "quality" not in r:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for k, (name, v) in enumerate(r["quality"].items()):
        color = f"C{k}"
        ax.plot(*zip(*v["train"]), color=color, alpha=0.35, lw=0.8)
        ax.plot(*zip(*v["eval"]), color=color, marker="o", lw=1.6, label=f"{name} (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (thin: train, dots: held-out eval)")
    ax.set_title("110M Llama: state formats and activation compression against exact")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = {**report(args), **result_fields("compressed_states", {"quick": args.quick})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=1))
    write_markdown(r, args.out.with_suffix(".md"))
    write_plot(r, args.out.with_suffix(".png"))
    keys = ["min_bytes_per_param_step", "speedup_vs_exact_ssd_bound", "max_eval_loss_gap"]
    print(json.dumps({k: r[k] for k in keys if k in r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
