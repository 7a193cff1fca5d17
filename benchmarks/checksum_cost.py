"""What checksums cost: step time with `engine.checksums` on vs off, measured side by side.

    .venv/bin/python benchmarks/checksum_cost.py            # ~4 min: the `make run` config, then an I/O-heavy one
    .venv/bin/python benchmarks/checksum_cost.py --quick    # ~1 min

Two engines are built on the same model, data and disk, one storing checksums and one not, and their
steps are interleaved (on, off, on, off, ...) so that machine noise hits both alike; after warm-up the
median step times are compared. The engine's `checksum` lane (seconds hashing per step: the optimizer
thread's READ checks and WRITE hashes, plus the streamed P16 checks) is reported too: it is the work the
checksums add; how much of it the step hides behind other lanes is what the ratio shows.

Configurations:
- `make-run`: configs/tiny.yaml's shape (1.9M params, batch 8 x 256, bf16, optimized mode).
- `io-heavy`: a 125m-width slice (d_model 768, 4 layers, 85M params with embeddings) at batch 1 x 64, so
  the step is dominated by streaming the states (14 bytes/param/step), which is where hashing shows most.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_env import cpu_model, package_version, portable, result_fields, result_path  # noqa: E402 (sibling module)

import lohan  # noqa: E402
from lohan.config import EngineConfig, get_model_config  # noqa: E402

CONFIGS = {
    "make-run": dict(model=dict(n_layer=6, d_model=160, n_head=5, vocab_size=256, seq_len=256), batch=8, seq=256,
                     engine=dict(cpu_mem="2GiB", compute_dtype="bf16", mode="optimized", lr=2e-3)),
    "io-heavy": dict(model=dict(name="125m", n_layer=4), batch=1, seq=64,
                     engine=dict(cpu_mem="4GiB", compute_dtype="bf16", mode="optimized", lr=1e-4,
                                 act_policy="interblock")),
}


def build(cfg: dict, root: Path, checksums: bool):
    mspec = dict(cfg["model"])
    base = mspec.pop("name", "tiny")
    mcfg = get_model_config(base, **mspec)
    ecfg = EngineConfig(nvme=(str(root / ("on" if checksums else "off")),), checksums=checksums, **cfg["engine"])
    return lohan.init(mcfg, ecfg, overwrite=True), mcfg


def measure(name: str, cfg: dict, steps: int, warmup: int, root: Path) -> dict:
    on, mcfg = build(cfg, root, True)
    off, _ = build(cfg, root, False)
    gen = torch.Generator().manual_seed(0)
    times = {"on": [], "off": []}
    hash_s = []
    try:
        for s in range(warmup + steps):
            x = torch.randint(0, mcfg.vocab_size, (cfg["batch"], cfg["seq"] + 1), generator=gen)
            batch = (x[:, :-1], x[:, 1:])
            order = (("on", on), ("off", off)) if s % 2 == 0 else (("off", off), ("on", on))
            for label, engine in order:
                engine.step(batch)
                if s >= warmup:
                    times[label].append(engine.last_stats.step_s)
                    if label == "on":
                        hash_s.append(engine.last_stats.lanes["checksum"])
    finally:
        on.close()
        off.close()
    med_on, med_off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"config": name, "model": cfg["model"], "batch": cfg["batch"], "seq": cfg["seq"], "engine": cfg["engine"],
            "steps": steps, "warmup": warmup, "step_s_on": times["on"], "step_s_off": times["off"],
            "median_step_s_on": med_on, "median_step_s_off": med_off,
            "overhead_pct": 100 * (med_on / med_off - 1),
            "median_checksum_lane_s": statistics.median(hash_s),
            "checksum_lane_pct_of_step": 100 * statistics.median(hash_s) / med_on}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir under benchmarks/scratch)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    steps, warmup = (8, 2) if args.quick else (30, 4)
    scratch = Path(args.dir or Path(__file__).resolve().parent / "scratch")
    scratch.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="checksum-", dir=scratch))
    results = []
    try:
        for name in args.configs:
            t0 = time.perf_counter()
            r = measure(name, CONFIGS[name], steps, warmup, root / name)
            results.append(r)
            print(f"{name:9s} step on {r['median_step_s_on']:.4f} s | off {r['median_step_s_off']:.4f} s | "
                  f"overhead {r['overhead_pct']:+.2f}% | hashing {r['median_checksum_lane_s'] * 1e3:.1f} ms/step "
                  f"({r['checksum_lane_pct_of_step']:.2f}% of the step) | {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": shlex.join(sys.argv),
              "cpu": cpu_model(), "python": platform.python_version(), "torch": package_version("torch"),
              "xxhash": package_version("xxhash"), "results": results,
              **result_fields("checksum_cost", {"quick": args.quick})}
    out = result_path("checksum_cost", {"quick": args.quick}, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Checksum cost (engine.checksums on vs off, interleaved steps)", "",
             f"`{report['command']}` on {report['cpu']}, torch {report['torch']}, xxhash {report['xxhash']}, "
             f"{report['date']}", "",
             "| config | median step on (s) | off (s) | overhead | hashing per step | hashing / step |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['config']} | {r['median_step_s_on']:.4f} | {r['median_step_s_off']:.4f} | "
                     f"{r['overhead_pct']:+.2f}% | {r['median_checksum_lane_s'] * 1e3:.1f} ms | "
                     f"{r['checksum_lane_pct_of_step']:.2f}% |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
