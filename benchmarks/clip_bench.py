"""What exact gradient clipping costs under active gradient offloading, and how often it redoes a step.

    .venv/bin/python benchmarks/clip_bench.py                 # make-run config, 150 steps (+ the 110M Llama, 30)
    .venv/bin/python benchmarks/clip_bench.py --quick         # 40 + 10 steps
    .venv/bin/python benchmarks/clip_bench.py --llama-steps 150   # the Llama for as long as the tiny run

Two engines train the same model on the same batches, one with `max_grad_norm=1.0` (clip_mode auto: an
update is speculated with coefficient 1 when the previous step was not clipped, and redone from the
previous slot if the step's norm says otherwise; after a clipped step the update is deferred until the norm
is known; a pass that runs after backward, deferred or redone, has the next step's forward run beside it)
and one without clipping; their steps are interleaved so machine noise hits both alike, and each step is
told the next batch, as finetune.py does. Both are in the optimized offloading mode. Reported per
configuration: the overhead of clipping on the total time of the timed steps (the headline), on the median
step and on the median of paired neighbouring steps; the share of steps clipped, redone (a speculation
that guessed wrong), deferred, and run with the next forward beside their optimizer pass; and the bytes
the gradient stash spilled to the SSDs.

Configurations:
- `make-run`: `configs/tiny.yaml` (1.9M-param GPT, batch 8 x 256, bf16, lr 2e-3 warmup 15, the shipped
  corpus), 150 steps: a real run, in which the clipped share is what it is.
- `llama-110m`: a 109.5M-param Llama (hidden 768, 12 layers, ffn 2048, vocab 32000, tied; random weights,
  `scripts/make_tiny_hf.py --size 110m`) at batch 1 x 512 random tokens, lr 1e-4, fp32 compute by default
  (`--llama-dtype bf16` for bf16: on CPUs without AVX-512 torch's bf16 matmuls are ~5x slower than fp32).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_env import cpu_model, package_version, portable, result_fields, result_path  # noqa: E402 (sibling module)

import lohan  # noqa: E402
from lohan.config import EngineConfig, get_model_config  # noqa: E402
from lohan.data import BatchIterator, ByteTokenizer, TokenDataset, synthetic_batches  # noqa: E402


def make_run_engines(root: Path, steps: int):
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    mcfg = get_model_config(raw["model"], **raw["model_overrides"])
    e = dict(raw["engine"], total_steps=steps)
    e.pop("nvme")
    engines = {label: lohan.init(mcfg, EngineConfig(nvme=(str(root / label),), max_grad_norm=norm, **e),
                                 overwrite=True)
               for label, norm in (("clip", 1.0), ("noclip", 0.0))}
    ds = TokenDataset.from_file(ROOT / raw["data"], seq_len=mcfg.seq_len, tokenizer=ByteTokenizer())
    return engines, BatchIterator(ds, raw["batch_size"], seed=0)


def llama_engines(root: Path, steps: int, dtype: str = "fp32"):
    from lohan.runtime.hf_engine import init_from_hf

    model = root / "llama-110m"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_hf.py"), str(model), "--size", "110m"],
                   check=True, capture_output=True)
    e = dict(cpu_mem="6GiB", compute_dtype=dtype, mode="optimized", lr=1e-4, warmup_steps=0, total_steps=steps)
    engines = {label: init_from_hf(model, EngineConfig(nvme=(str(root / label),), max_grad_norm=norm, **e),
                                   overwrite=True)
               for label, norm in (("clip", 1.0), ("noclip", 0.0))}
    vocab = engines["clip"].program.vocab_size
    return engines, synthetic_batches(vocab, 1, 512, seed=0)


def measure(name: str, build, steps: int, root: Path) -> dict:
    engines, data = build(root, steps)
    batches = [next(data) for _ in range(steps)]  # each step is told the next batch, as finetune.py does
    times: dict[str, list[float]] = {"clip": [], "noclip": []}
    rec: list[dict] = []
    warmup = 2
    try:
        for s in range(steps):
            batch, nxt = batches[s], batches[s + 1] if s + 1 < steps else None
            order = ("clip", "noclip") if s % 2 == 0 else ("noclip", "clip")
            for label in order:
                engines[label].step(batch, next_batch=nxt)
                m = engines[label].last_stats
                if s >= warmup:
                    times[label].append(m.step_s)
                if label == "clip":
                    rec.append({"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm,
                                "clip_coef": m.clip_coef, "redone": m.redone, "step_s": m.step_s,
                                "deferred": m.deferred,
                                "next_forward_overlapped": m.next_forward_overlapped})
        spilled = engines["clip"].stash.spilled_total if engines["clip"].stash else 0
    finally:
        for e in engines.values():
            e.close()
    on, off = statistics.median(times["clip"]), statistics.median(times["noclip"])
    paired = statistics.median(a / b for a, b in zip(times["clip"], times["noclip"]))
    n = len(rec)
    return {"config": name, "steps": steps, "warmup_excluded": warmup,
            "median_step_s_clip": on, "median_step_s_noclip": off,
            # the headline: all the time the run took (slow deferred or redone steps count in full)
            "overhead_pct": 100 * (sum(times["clip"]) / sum(times["noclip"]) - 1),
            "overhead_median_pct": 100 * (on / off - 1),
            # each step against its neighbour in time: robust to a load that drifts during the run
            "overhead_paired_pct": 100 * (paired - 1),
            "next_forward_overlapped_share": sum(r["next_forward_overlapped"] for r in rec) / n,
            "clipped_share": sum(r["clip_coef"] < 1 for r in rec) / n, "redone_share": sum(r["redone"] for r in rec) / n,
            "deferred_share": sum(r["deferred"] for r in rec) / n, "stash_spilled_bytes": spilled,
            "step_s_clip": times["clip"], "step_s_noclip": times["noclip"], "clip_steps": rec}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="make-run steps (default 150, quick 40; 0 skips)")
    ap.add_argument("--llama-steps", type=int, default=None, help="llama-110m steps (default 30, quick 10; 0 skips)")
    ap.add_argument("--llama-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="compute dtype of the llama-110m run (default fp32: on CPUs without AVX-512, torch's bf16 "
                         "matmuls are ~5x slower than fp32 and a step takes ~40 s)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (40 if args.quick else 150)
    llama = args.llama_steps if args.llama_steps is not None else (10 if args.quick else 30)
    scratch = ROOT / "benchmarks" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="clip-", dir=scratch))
    results = []
    try:
        llama_build = lambda root, n: llama_engines(root, n, args.llama_dtype)  # noqa: E731
        for name, build, n in (("make-run", make_run_engines, steps), ("llama-110m", llama_build, llama)):
            if n <= 0:
                continue
            t0 = time.perf_counter()
            r = measure(name, build, n, root / name)
            results.append(r)
            print(f"{name:10s} {n} steps | step clip {r['median_step_s_clip']:.4f} s, off {r['median_step_s_noclip']:.4f}"
                  f" s | overhead {r['overhead_pct']:+.2f}% (median {r['overhead_median_pct']:+.2f}%, paired "
                  f"{r['overhead_paired_pct']:+.2f}%) | clipped {100 * r['clipped_share']:.0f}% | redone "
                  f"{100 * r['redone_share']:.1f}% | deferred {100 * r['deferred_share']:.0f}% | "
                  f"{time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "command": shlex.join(["python", "benchmarks/clip_bench.py", *sys.argv[1:]]), "cpu": cpu_model(),
              "python": platform.python_version(), "torch": package_version("torch"), "results": results,
              **result_fields("clip_bench", {"quick": args.quick})}
    out = result_path("clip_bench", {"quick": args.quick}, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Exact clipping under overlapped updates: cost and redo rate", "",
             f"`{report['command']}` on {report['cpu']}, torch {report['torch']}, {report['date']}", "",
             "| config | steps | median step, clip 1.0 (s) | no clip (s) | overhead (total time) | median | paired "
             "| clipped | redone | deferred | next forward overlapped |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['config']} | {r['steps']} | {r['median_step_s_clip']:.4f} | {r['median_step_s_noclip']:.4f} | "
                     f"{r['overhead_pct']:+.2f}% | {r['overhead_median_pct']:+.2f}% | {r['overhead_paired_pct']:+.2f}% | "
                     f"{100 * r['clipped_share']:.0f}% | {100 * r['redone_share']:.1f}% | "
                     f"{100 * r['deferred_share']:.0f}% | {100 * r['next_forward_overlapped_share']:.0f}% |")
    lines += ["", "overhead: clipping on against off over all timed steps; median: of the step times; paired: the "
              "median of each step's ratio to its neighbour in time. Both engines train the same batches, "
              "interleaved, and each step is told the next batch as finetune.py does."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
