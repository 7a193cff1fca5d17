"""Peak RSS of lohan at its defaults against plain PyTorch in RAM, on the same model and data (issue 39, item 3).

    .venv/bin/python benchmarks/mem_bench.py                     # 110M Llama, batch 1 x 512, fp32, 4 steps each
    .venv/bin/python benchmarks/mem_bench.py --seq 128 --steps 3 # a cheaper look while iterating

What one measurement is. Each system runs in a child process of its own (`--child torch|lohan`) on a Hugging Face
Llama directory (random weights, `scripts/make_tiny_hf.py --size 110m`, made under `--scratch` on first use) and
trains `--steps` steps on the same random token batches; its peak RSS is the kernel's high-water mark (VmHWM) of
the whole life (model loading and store creation included) and of the steps alone (VmHWM reset when they start,
proc(5) clear_refs 5). Both sides: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on matrices
and embeddings, global clipping at 1.0, `--dtype` compute (fp32 by default, fp32 master and Adam states either way).

- ``torch``: the fp32 model, `torch.optim.AdamW(fused=True)`, `clip_grad_norm_`: the whole model in RAM.
- ``lohan``: `lohan.runtime.hf_engine.init_from_hf` with `EngineConfig()`'s defaults (every record resident
  where they fit, as here), its states on `--scratch`. The child also reports the engine's memory plan (every
  pool's planned bytes), what each pool allocated at its peak, and the RSS once the engine was built.

Key: `rss_ratio_vs_torch` = lohan's peak RSS of the steps / torch's (target <= 1.15), and the same for the whole
life. Report: `benchmarks/results/mem_bench[/<tag>]/<machine>.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    batches,
    reset_peak_rss,
    result_fields,
    result_path,
    status_bytes,
)

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
TARGET = 1.15


def build_torch(model_dir: Path, work: Path, dtype: str):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    params = [p for _, p in named]

    def step(idx: Any, targets: Any, nxt: Any = None) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(input_ids=idx).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def info() -> dict[str, Any]:
        # what the whole model in RAM holds from step to step: weights, gradients (kept until zero_grad, so at
        # the peak), AdamW's m and v, all fp32
        return {"states_bytes": 16 * sum(p.numel() for p in params)}

    return step, lambda: None, info


def build_lohan(model_dir: Path, work: Path, dtype: str, overrides: dict[str, Any] | None = None):
    sys.path.insert(0, str(REPO))
    from lohan.config import EngineConfig
    from lohan.runtime.hf_engine import init_from_hf

    cfg = EngineConfig(nvme=(str(work / "nvme"),), lr=LR, warmup_steps=0, total_steps=None, betas=BETAS, eps=EPS,
                       weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, compute_dtype=dtype,
                       **(overrides or {}))
    eng = init_from_hf(model_dir, cfg, overwrite=True)

    def step(idx: Any, targets: Any, nxt: Any = None) -> float:
        return eng.step((idx, targets), next_batch=nxt)  # told the next batch, as finetune.py's loop does

    def info() -> dict[str, Any]:
        pools = {"params": eng.params_pool, "grads": eng.grads_pool, "records": eng.records_pool}
        return {"memory_plan": dict(eng.memory_plan), "plan": eng.host_memory.describe(),
                "pool_allocated": {k: p.stats()["allocated"] for k, p in pools.items()},
                "pool_peak_allocated": {k: p.stats()["peak_allocated"] for k, p in pools.items()},
                "resident_blocks": f"{len(eng.offloader.resident)} of {len(eng.store.layout.blocks)}",
                # the activation records the plan keeps in main memory (its CPU tier), at their peak
                "activation_tier_bytes": int(((eng.last_stats.to_dict() if eng.last_stats else {})
                                              .get("activations") or {}).get("peak_cpu_bytes") or 0)}

    return step, eng.close, info


def child(a: argparse.Namespace) -> int:
    import torch
    import transformers  # noqa: F401  (both sides import it: the process before any model is built)

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rss_imports = status_bytes("VmRSS")
    work, model_dir = Path(a.work), Path(a.model_dir)
    if a.child == "lohan":
        step, close, info = build_lohan(model_dir, work, a.dtype, a.lohan_set)
    else:
        step, close, info = build_torch(model_dir, work, a.dtype)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    data = batches(vocab, a.batch, a.seq, a.seed)
    hwm_build, rss_ready = status_bytes("VmHWM"), status_bytes("VmRSS")
    ready = info()  # (lohan: the pools allocated before the first step; the process is the RSS less those)
    reset = reset_peak_rss()
    print(f"[{a.child}] built: RSS {rss_ready / GiB:.2f} GiB (peak {hwm_build / GiB:.2f})", flush=True)
    pending, losses, times = next(data), [], []
    for k in range(a.steps):
        (idx, targets), pending = pending, next(data)
        t0 = time.perf_counter()
        losses.append(step(idx, targets, pending))
        times.append(time.perf_counter() - t0)
        print(f"[{a.child}] step {k + 1}: {times[-1]:.2f} s, loss {losses[-1]:.4f}, "
              f"RSS {status_bytes('VmRSS') / GiB:.2f} GiB (peak {status_bytes('VmHWM') / GiB:.2f})", flush=True)
    hwm_steps = status_bytes("VmHWM") if reset else None
    extra = info()
    close()
    out = {"system": a.child, "losses": losses, "step_s": times, "rss_ready_bytes": rss_ready,
           "peak_rss_build_bytes": hwm_build, "peak_rss_steps_bytes": hwm_steps,
           "peak_rss_bytes": max(hwm_build, hwm_steps or 0), "rss_imports_bytes": rss_imports, "ready": ready,
           **extra}
    Path(a.result).write_text(json.dumps(out, default=str) + "\n")
    return 0


def ensure_model(scratch: Path, size: str) -> Path:
    path = scratch / "models" / f"llama-{size}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_hf.py"), str(path), "--size", size],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return path


def run_child(system: str, model_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    work = a.scratch / f"run-{system}"
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system, "--model-dir", str(model_dir),
           "--work", str(work), "--result", str(result), "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--seed", str(a.seed), "--threads", str(a.threads), "--dtype", a.dtype,
           "--lohan-set", json.dumps(a.lohan_set)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"error: the {system} child failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-3000:]}")
    print(proc.stdout, end="", flush=True)
    return json.loads(result.read_text())


def command(argv: list[str], scratch: Path) -> str:
    """The command line of the report, with the scratch directory relative to the checkout, or named by its role
    (SCRATCH) outside it: never the path it had on the machine that ran it."""
    where = scratch.resolve()
    named = str(where.relative_to(REPO)) if where.is_relative_to(REPO) else "SCRATCH"
    return " ".join(["benchmarks/mem_bench.py", *(named if x == str(scratch) else x for x in argv)])


def accounting(rep: dict[str, Any]) -> list[tuple[str, float, float]]:
    """Peak RSS of the steps in parts, GiB, (part, torch, lohan). States: torch's fp32 weights, gradients, m and v
    (16 B a parameter); lohan's pools at their peak (records: P32, m, v and P16 of each resident block). Process:
    the RSS once built, before the first step (lohan's less the pools then allocated). torch's weights are mapped
    from the checkpoint and mostly not yet touched then (its RSS grew 0.12 GiB over the imports' here, as lohan's
    did for its meta-device skeleton): what of them is resident is counted twice, so torch's process is an upper
    bound and lohan's excess there a lower one. Activation records: what lohan's plan keeps in main memory at
    their peak (on a CPU device the outputs of the ops it does not recompute; torch's saved tensors are in its
    rest). The rest: the step's working set (autograd's temporaries, the block being recomputed, the loss) and
    what the allocator keeps, by difference."""
    th, lo = rep["runs"]["torch"], rep["runs"]["lohan"]
    pools = lo["pool_peak_allocated"]
    lo_process = lo["rss_ready_bytes"] - sum(lo["ready"]["pool_allocated"].values())
    acts = lo.get("activation_tier_bytes") or 0
    rows = [("records pool (P32, m, v; P16 where kept)", 0.75 * th["states_bytes"], pools["records"]),
            ("params pool (P16)", 0.0, pools["params"]),
            ("grads pool (with the stash)", 0.25 * th["states_bytes"], pools["grads"]),
            ("process", th["rss_ready_bytes"], lo_process),
            ("activation records in RAM (lohan's CPU tier)", 0.0, acts)]
    rest = [r["peak_rss_steps_bytes"] - s for r, s in ((th, th["states_bytes"] + th["rss_ready_bytes"]),
                                                        (lo, sum(pools.values()) + lo_process + acts))]
    rows.append(("working set + allocator (the rest; torch's activations)", *rest))
    rows.append(("peak RSS of the steps", th["peak_rss_steps_bytes"], lo["peak_rss_steps_bytes"]))
    return [(k, t / GiB, v / GiB) for k, t, v in rows]


def markdown(rep: dict[str, Any]) -> str:
    rows = [f"| {r['system']} | {r['peak_rss_steps_bytes'] / GiB:.2f} | {r['peak_rss_bytes'] / GiB:.2f} | "
            f"{r['rss_ready_bytes'] / GiB:.2f} | {sorted(r['step_s'])[len(r['step_s']) // 2]:.2f} |"
            for r in rep["runs"].values()]
    lo = rep["runs"]["lohan"]
    plan = ", ".join(f"{k} {v / GiB:.3f}" for k, v in lo["memory_plan"].items())
    peaks = ", ".join(f"{k} {v / GiB:.3f}" for k, v in lo["pool_peak_allocated"].items())
    return "\n".join([
        f"# mem_bench: peak RSS, lohan defaults vs plain PyTorch ({rep['when']})", "",
        f"`{rep['command']}`", "",
        f"Model: {rep['model']}, batch {rep['batch']} x {rep['seq']}, {rep['dtype']}, {rep['steps']} steps; "
        f"{rep['host']}.", "",
        "| system | peak RSS, steps (GiB) | peak RSS, whole life (GiB) | RSS before the steps (GiB) | s/step |",
        "|---|---|---|---|---|", *rows, "",
        f"**rss_ratio_vs_torch = {rep['rss_ratio_vs_torch']:.3f}** (target <= {TARGET}; whole life "
        f"{rep['rss_ratio_vs_torch_whole_life']:.3f})", "",
        f"lohan's memory plan (GiB): {plan}; pools' peak allocated (GiB): {peaks}; resident records: "
        f"{lo['resident_blocks']}.", "",
        "Where the peak goes (GiB; torch's weights and m, v are under 'records', its gradients under 'grads'; "
        "`accounting` says how each part is measured):", "",
        "| part | torch | lohan | lohan - torch |", "|---|---|---|---|",
        *(f"| {k} | {t:.3f} | {v:.3f} | {v - t:+.3f} |" for k, t, v in accounting(rep)), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", choices=("torch", "lohan"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--size", default="110m", help="scripts/make_tiny_hf.py --size (default 110m)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=4, help="steps per system (the peak is reached by the second)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "scratch" / "mem_bench")
    p.add_argument("--tag", default="", help="the variant's name: the report goes to results/mem_bench/<tag>/<machine>.json")
    p.add_argument("--lohan-set", default={}, type=json.loads,
                   help='engine settings over the defaults, as JSON (e.g. \'{"resident_mem": 0}\'): a diagnosis')
    p.add_argument("--systems", default="torch,lohan", help="which to run (default both; the ratio needs both)")
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    model_dir = ensure_model(a.scratch, a.size)
    runs = {s: run_child(s, model_dir, a) for s in a.systems.split(",")}
    if set(runs) != {"torch", "lohan"}:
        return 0
    th, lo = runs["torch"], runs["lohan"]
    rep = {"when": dt.datetime.now().isoformat(timespec="seconds"),
           "command": command(argv if argv is not None else sys.argv[1:], a.scratch),
           "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "model": f"llama-{a.size}", "batch": a.batch, "seq": a.seq, "dtype": a.dtype, "steps": a.steps,
           "rss_ratio_vs_torch": lo["peak_rss_steps_bytes"] / th["peak_rss_steps_bytes"],
           "rss_ratio_vs_torch_whole_life": lo["peak_rss_bytes"] / th["peak_rss_bytes"], "runs": runs,
           **result_fields("mem_bench", {"tag": a.tag})}
    out = result_path("mem_bench", {"tag": a.tag}).with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(rep))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
