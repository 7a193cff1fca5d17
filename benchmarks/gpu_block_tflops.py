"""How close one transformer block gets to the GPU's measured matmul peak (the paper's "% of peak FLOPS").

    .venv/bin/python benchmarks/gpu_block_tflops.py                      # CUDA: 6b and 13b blocks, 8 x 2048 tokens
    .venv/bin/python benchmarks/gpu_block_tflops.py --models 6b --batch 4 --seq 1024
    .venv/bin/python benchmarks/gpu_block_tflops.py --allow-cpu          # tiny CPU run: checks the script only

Two numbers, measured on the same device in one run:
- the peak: bf16 square matmuls (``--matmul-n``, default 8192), ``2·n³`` FLOPs each, the median over
  ``--repeats`` timings of ``--matmul-iters`` back-to-back products (after warm-up). This is what the device
  sustains on the friendliest kernel, not the datasheet number.
- one transformer block of the project's own GPT (`lohan.models.gpt.Block`, the dims of a Table IV preset),
  bf16 parameters under bf16 autocast as the engine runs it, on ``--batch`` x ``--seq`` tokens:
  ``block_fwd_bwd`` is one forward with grad plus its backward; ``block_engine`` adds the no-grad forward
  that precedes it in the engine (which recomputes every block in backward). Model FLOPs are 3x the forward
  FLOPs counted by `torch.utils.flop_counter` (attention counted whole, no causal discount, as the
  profiler and the planner count it); the recomputation is work that earns no model FLOPs.

Reported: TFLOPS of each and their ratio to the measured peak, with the device, torch, CUDA and the command.
Results go to benchmarks/results/gpu_block_tflops/<machine>.{json,md} (``--out`` to change); without CUDA the script
says so and exits 0 without writing anything, unless ``--allow-cpu`` (tiny sizes, written to
benchmarks/scratch/ so CPU numbers never land among the results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_env import device_environment, portable, result_fields, result_path  # noqa: E402 (sibling module)

from lohan.config import get_model_config  # noqa: E402
from lohan.models.gpt import Block, init_block_  # noqa: E402
from lohan.runtime.profiler import _EXTRA_FLOPS  # noqa: E402 (the CPU flash-attention kernel's FLOPs)

HERE = Path(__file__).resolve().parent
CPU_SIZES = dict(models=["tiny"], batch=2, seq=128, matmul_n=512, repeats=3, warmup=1, matmul_iters=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["6b", "13b"], help="presets whose block dims are measured")
    p.add_argument("--batch", type=int, default=8, help="sequences per block call")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the square bf16 matmuls of the peak")
    p.add_argument("--matmul-iters", type=int, default=20, help="matmuls per timed repeat of the peak")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="discarded repeats before timing")
    p.add_argument("--out", help="JSON report path (a .md summary is written next to it); default "
                                 "benchmarks/results/gpu_block_tflops/<machine>.json")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run tiny sizes on the CPU to check the script (report goes to scratch/)")
    args = p.parse_args(argv)
    for name in ("batch", "seq", "matmul_n", "matmul_iters", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


class Timer:
    """Seconds of fn(), measured with CUDA events on a GPU (the host may run ahead) or perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def median_time(timer: Timer, fn: Callable[[], object], repeats: int, warmup: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        timer(fn)
    times = [timer(fn) for _ in range(repeats)]
    return statistics.median(times), times


def measure_peak(device: torch.device, n: int, iters: int, repeats: int, warmup: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)

    def run() -> None:
        for _ in range(iters):
            torch.mm(a, b, out=out)

    med, times = median_time(Timer(device), run, repeats, warmup)
    flops = 2.0 * n**3 * iters
    return {"n": n, "iters_per_repeat": iters, "flops_per_repeat": flops, "median_s": med, "times_s": times,
            "tflops": flops / med / 1e12}


def block_flops(block: Block, x: torch.Tensor) -> float:
    """Forward FLOPs of one block call, as the engine's profiler counts them."""
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16), \
            FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as fc:
        block(x)
    return float(fc.get_total_flops())


def measure_block(name: str, device: torch.device, batch: int, seq: int, repeats: int, warmup: int) -> dict:
    cfg = get_model_config(name, seq_len=max(seq, get_model_config(name).seq_len))
    with torch.device("meta"):
        block = Block(cfg)
    block.to_empty(device=device)
    init_block_(block, cfg, torch.Generator().manual_seed(0))
    block.to(torch.bfloat16)  # the engine's P16: bf16 parameters, computed under bf16 autocast
    x = torch.randn(batch, seq, cfg.d_model, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    fwd = block_flops(block, x)
    params = list(block.parameters())

    def no_grad_forward() -> None:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            block(x)

    def forward_backward() -> None:
        z = x.detach().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = block(z)
        torch.autograd.grad(out, [z, *params], grad_outputs=grad)

    timer = Timer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fb_s, fb_times = median_time(timer, forward_backward, repeats, warmup)
    nf_s, nf_times = median_time(timer, no_grad_forward, repeats, warmup)
    model_flops = 3 * fwd
    return {"model": name, "d_model": cfg.d_model, "n_head": cfg.n_head, "mlp_hidden": cfg.mlp_hidden,
            "batch": batch, "seq": seq, "block_params": cfg.block_param_count(), "forward_flops": fwd,
            "model_flops": model_flops, "fwd_bwd_median_s": fb_s, "fwd_bwd_times_s": fb_times,
            "nograd_fwd_median_s": nf_s, "nograd_fwd_times_s": nf_times,
            "block_fwd_bwd_tflops": model_flops / fb_s / 1e12,
            "block_engine_tflops": model_flops / (fb_s + nf_s) / 1e12,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def environment(device: torch.device) -> dict:
    """This machine and `device` (`bench_env.device_environment`)."""
    return device_environment(device)


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=1) + "\n")
    env, peak = report["environment"], report["peak"]
    where = env.get("gpu") or f"CPU ({env['cpu']})"
    lines = ["# One transformer block vs the measured matmul peak", "",
             f"`{env['command']}` on {where}, torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
             + f", {env['date']}", "",
             f"Measured peak: {peak['tflops']:.4g} TFLOPS (bf16 {peak['n']}^3 matmuls, median of "
             f"{len(peak['times_s'])} repeats).", "",
             "| block of | d_model | tokens | fwd+bwd (ms) | TFLOPS | % of peak | with the no-grad forward "
             "(engine) TFLOPS | % of peak | peak mem (GiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["blocks"]:
        if "error" in r:
            lines.append(f"| {r['model']} | | | {r['error']} | | | | | |")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(f"| {r['model']} | {r['d_model']} | {r['batch']}x{r['seq']} | {r['fwd_bwd_median_s'] * 1e3:.2f} | "
                     f"{r['block_fwd_bwd_tflops']:.3g} | {r['fwd_bwd_pct_of_peak']:.1f}% | "
                     f"{r['block_engine_tflops']:.4g} | {r['engine_pct_of_peak']:.1f}% | {mem} |")
    lines += ["", "Model FLOPs = 3 x forward FLOPs (torch.utils.flop_counter, attention without causal discount). "
              "The engine's column adds the no-grad forward the engine runs before recomputing each block in "
              "backward; that work earns no model FLOPs."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
        out = result_path("gpu_block_tflops", out=args.out)
    elif args.allow_cpu:
        device = torch.device("cpu")
        for k, v in CPU_SIZES.items():
            setattr(args, k, v)
        out = Path(args.out) if args.out else HERE / "scratch" / "gpu_block_tflops_cpu.json"
        print("no CUDA: running tiny sizes on the CPU to check the script (the numbers mean nothing)")
    else:
        print("gpu_block_tflops: no CUDA device here (torch.cuda.is_available() is False); nothing measured, "
              "nothing written. Run it on a GPU machine (bash benchmarks/gpu_suite.sh), or pass --allow-cpu "
              "to check the script on tiny sizes.")
        return 0
    env = environment(device)
    print(f"device: {env.get('gpu', 'cpu')} | torch {env['torch']}")
    peak = measure_peak(device, args.matmul_n, args.matmul_iters, args.repeats, args.warmup)
    print(f"peak: {peak['tflops']:.4g} TFLOPS (bf16 {args.matmul_n}^3 matmuls)")
    blocks = []
    for name in args.models:
        try:
            r = measure_block(name, device, args.batch, args.seq, args.repeats, args.warmup)
        except torch.cuda.OutOfMemoryError as e:
            blocks.append({"model": name, "error": f"out of memory at {args.batch}x{args.seq}: {str(e)[:120]}"})
            print(f"{name}: out of memory at batch {args.batch} x seq {args.seq}; lower --batch or --seq")
            torch.cuda.empty_cache()
            continue
        r["fwd_bwd_pct_of_peak"] = 100 * r["block_fwd_bwd_tflops"] / peak["tflops"]
        r["engine_pct_of_peak"] = 100 * r["block_engine_tflops"] / peak["tflops"]
        blocks.append(r)
        print(f"{name} block (d_model {r['d_model']}, {args.batch}x{args.seq} tokens): fwd+bwd "
              f"{r['fwd_bwd_median_s'] * 1e3:.2f} ms, {r['block_fwd_bwd_tflops']:.4g} TFLOPS = "
              f"{r['fwd_bwd_pct_of_peak']:.1f}% of peak | with the engine's no-grad forward "
              f"{r['block_engine_tflops']:.4g} TFLOPS = {r['engine_pct_of_peak']:.1f}%")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report({"environment": env, "peak": peak, "blocks": blocks, **result_fields("gpu_block_tflops")}, out)
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
