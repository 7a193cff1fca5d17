"""lohan's LoRA step against its full fine-tuning step and against plain PEFT in RAM (issue 41, item 7).

    .venv/bin/python benchmarks/lora_bench.py                   # 110M Llama, batch 2 x 256, fp32, 2 rounds
    .venv/bin/python benchmarks/lora_bench.py --dtype bf16 --tag bf16
    .venv/bin/python benchmarks/lora_bench.py --model-dir DIR --tag 1b  # any local HF Llama directory
    .venv/bin/python benchmarks/lora_bench.py --smoke           # the tiny model, 1 warm-up + 1 step, 1 round

What one measurement is. Each system runs in a child process of its own (`--child SYSTEM`) on a Hugging Face Llama
directory (random weights, `scripts/make_tiny_hf.py --size SIZE`, made under `--scratch` on first use, or
`--model-dir`), for `--warmup` discarded and `--steps` measured steps on the same random token batches
(`bench_env.batches`). Every system: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, global
clipping at 1.0, `--dtype` compute. The LoRA systems: rank `--rank`, alpha `--alpha`, dropout 0, every linear
projection of the decoder layers (PEFT's ``all-linear``, lohan's default targets). Rounds (`--rounds`) run every
system once, in an order rotated by the round; a system's figure is the median of its measured steps over all
rounds.

- ``lora_stream``: `init_from_hf` with ``lora_r``, its store on `--nvme`, ``cpu_mem`` = `--cpu-mem` (small by
  default; `--stream-set` adds engine settings), so that the parameter pool holds only the blocks in flight and
  the frozen base is read from the SSDs in forward and again in backward, every step. The pool never holds fewer
  than (prefetch_depth + 3) of the biggest block (`LoraEngine._build`), so on a small model with a big embedding
  (the 110M: 4 x 98 MB in fp32 at prefetch_depth 1, for a base of 438 MB) it keeps most or all of the base; the
  report gives the pool's size against the base's and the base reads per step, and does not judge the bytes key
  where the pool held the whole base.
- ``full``: lohan's full fine-tuning (`Engine`), every record on `--nvme` (``resident_mem`` 0: its P16, master
  weights and moments are read and written every step), ``cpu_mem`` = `--full-cpu-mem` (its pools of records in
  flight need more than the LoRA pool: 1.21 GiB at 110M), the same model and data.
- ``lora``: lohan's LoRA at `EngineConfig()`'s defaults (the base stays in main memory where it fits).
- ``peft``: the HF model in RAM, `peft.get_peft_model` (the same rank, alpha, targets), `torch.optim.AdamW` over
  the adapters, `clip_grad_norm_`; bf16: the base in bf16 and the forward under autocast, the adapters fp32 (as
  PEFT keeps them, and as lohan does).

Keys: ``lora_vs_full_step`` = full step / lora_stream step (reported); ``lora_bytes_per_param_step`` = what the
lora_stream run reads from and writes to the SSDs per measured step (the engine's ``last_stats.ssd_read_bytes``
and ``ssd_write_bytes``, plus its per-step adapter commit, ``<name>.lora.<step % 2>``) / the model's parameter count
(target <= 4.5: a bf16 base read twice is 4 B a parameter; an fp32 run stores its base in fp32, 8 B);
``lora_speed_vs_peft_in_ram`` = peft step / lora step (target >= 0.9). Report:
`benchmarks/results/lora_bench[/<tag>]/<machine>.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module
    batches,
    portable,
    reset_peak_rss,
    result_fields,
    result_path,
    shared_environment,
    status_bytes,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf import SIZES  # noqa: E402  (the named shapes the model can have)

GiB = 1 << 30
# Shapes beyond make_tiny_hf's named ones, as its flags: "1b", TinyLlama-1.1B's layout (22 layers at 2048, GQA with
# 4 key/value heads, MLP 5632, untied 32000-token embedding and head): ~1.1B parameters, a base of 4.4 GB in fp32.
SHAPES: dict[str, list[str]] = {
    "tiny": [], **{k: ["--size", k] for k in SIZES},
    "1b": ["--layers", "22", "--hidden", "2048", "--heads", "32", "--kv-heads", "4", "--intermediate", "5632",
           "--vocab", "32000", "--model-vocab", "32000", "--no-tie"]}
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
SYSTEMS = ("lora_stream", "full", "lora", "peft")
TARGETS = {"lora_bytes_per_param_step": ("<=", 4.5), "lora_speed_vs_peft_in_ram": (">=", 0.9),
           "lora_vs_full_step": None}


# ------------------------------------------------------------------------------------- the systems (children)
def build_lohan(a: argparse.Namespace, work: Path):
    sys.path.insert(0, str(REPO))
    from lohan.config import EngineConfig
    from lohan.runtime.hf_engine import init_from_hf
    from lohan.runtime.lora_commit import commit_paths

    lora = a.child != "full"
    # full: every record on the SSDs (none resident), at the cpu_mem its plan needs (pools of records in flight);
    # lora_stream: a parameter pool too small to keep the base; lora: the defaults
    kw: dict[str, Any] = ({"lora_r": a.rank, "lora_alpha": a.alpha} if lora
                          else {"resident_mem": 0, "cpu_mem": a.full_cpu_mem})
    if a.child == "lora_stream":
        kw.update(cpu_mem=a.cpu_mem, **a.stream_set)
    cfg = EngineConfig(nvme=(str(work / "nvme"),), lr=LR, warmup_steps=0, total_steps=None, betas=BETAS, eps=EPS,
                       weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, compute_dtype=a.dtype, **kw)
    eng = init_from_hf(a.model_dir, cfg, overwrite=True)
    layout = eng.store.layout

    def step(idx: Any, targets: Any, nxt: Any = None) -> dict[str, Any]:
        loss = eng.step((idx, targets), next_batch=nxt)
        s = eng.last_stats
        # the LoRA engine's stats count the SSD reads only; its per-step commit of the adapters is written too
        commit = os.path.getsize(commit_paths(eng.cfg.nvme, eng.cfg.name)[eng.step_count % 2]) if lora else 0
        return {"loss": loss, "read_bytes": s.ssd_read_bytes, "write_bytes": s.ssd_write_bytes + commit,
                "commit_bytes": commit, "lanes": dict(s.lanes)}

    info = {"param_count": layout.param_count, "base_bytes": sum(b.p16_bytes for b in layout.blocks),
            "trainable": eng.lora.numel if lora else layout.param_count, "cpu_mem": str(eng.cfg.cpu_mem),
            "compute_dtype": eng.cfg.compute_dtype}
    if lora:
        info["params_pool_bytes"] = eng.params_pool.stats()["budget_bytes"]
    return step, eng.close, info


def build_peft(a: argparse.Namespace, work: Path):
    import peft
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    low = torch.bfloat16 if a.dtype == "bf16" else None
    if low is not None:
        model = model.to(low)
    pcfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules="all-linear",
                           bias="none", task_type="CAUSAL_LM")
    pmodel = peft.get_peft_model(model, pcfg)
    pmodel.train()
    trainable = [p for p in pmodel.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def step(idx: Any, targets: Any, nxt: Any = None) -> dict[str, Any]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low is not None):
            logits = pmodel(input_ids=idx).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss.item(), "read_bytes": 0, "write_bytes": 0, "commit_bytes": 0}

    info = {"param_count": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "trainable": sum(p.numel() for p in trainable), "compute_dtype": a.dtype}
    return step, lambda: None, info


def child(a: argparse.Namespace) -> int:
    import torch
    import transformers  # noqa: F401  (every system imports it before its model is built)

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    work = Path(a.work)
    step, close, info = (build_peft if a.child == "peft" else build_lohan)(a, work)
    vocab = json.loads((Path(a.model_dir) / "config.json").read_text())["vocab_size"]
    data = batches(vocab, a.batch, a.seq, a.seed)
    reset = reset_peak_rss()
    pending, steps = next(data), []
    for k in range(a.warmup + a.steps):
        (idx, targets), pending = pending, next(data)
        t0 = time.perf_counter()
        rec = step(idx, targets, pending)
        rec.update(step_s=time.perf_counter() - t0, warmup=k < a.warmup)
        steps.append(rec)
        print(f"[{a.child}] step {k + 1}: {rec['step_s']:.2f} s, loss {rec['loss']:.4f}, read "
              f"{rec['read_bytes'] / GiB:.3f} GiB, written {rec['write_bytes'] / GiB:.4f} GiB", flush=True)
    close()
    out = {"system": a.child, "steps": steps, "peak_rss_steps_bytes": status_bytes("VmHWM") if reset else None,
           **info}
    Path(a.result).write_text(json.dumps(out, default=str) + "\n")
    return 0


# ------------------------------------------------------------------------------------- the parent
def ensure_model(scratch: Path, size: str) -> Path:
    """The model directory for `size` ("tiny": make_tiny_hf's defaults) under `scratch`, made on first use."""
    path = scratch / "models" / f"llama-{size}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_hf.py"), str(path), *SHAPES[size]],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return path


def run_child(system: str, rnd: int, model_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.nvme) / f"{system}"
    work.mkdir(parents=True, exist_ok=True)
    result = work / f"result-{rnd}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system, "--model-dir", str(model_dir),
           "--work", str(work), "--result", str(result), "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--seed", str(a.seed), "--threads", str(a.threads),
           "--dtype", a.dtype, "--rank", str(a.rank), "--alpha", str(a.alpha), "--cpu-mem", a.cpu_mem,
           "--full-cpu-mem", a.full_cpu_mem, "--stream-set", json.dumps(a.stream_set)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"error: the {system} child failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-3000:]}")
    print(proc.stdout, end="", flush=True)
    return {"round": rnd, **json.loads(result.read_text())}


PATH_FLAGS = ("--nvme", "--scratch", "--model-dir", "--results")


def command(argv: list[str]) -> str:
    """The command line of the report, a path outside the checkout named by its flag's role (NVME, SCRATCH, ...):
    never the path it had on the machine that ran it (`portable` makes those inside it relative)."""
    out = ["benchmarks/lora_bench.py"]
    for i, x in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if flag in PATH_FLAGS and not Path(x).resolve().is_relative_to(REPO):
            x = flag.lstrip("-").replace("-", "_").upper()
        out.append(x)
    return " ".join(out)


def schedule(rounds: int, systems: tuple[str, ...] = SYSTEMS) -> list[tuple[int, str]]:
    """(round, system) in the order they run: round r runs every system once, the list rotated by r."""
    order = []
    for r in range(rounds):
        shift = r % len(systems)
        order += [(r, s) for s in systems[shift:] + systems[:shift]]
    return order


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: the median measured step (warm-up left out, every round), the median SSD bytes read and
    written per measured step, and what every run of it shares (parameter count, trainable, ...)."""
    out: dict[str, dict[str, Any]] = {}
    for s in SYSTEMS:
        mine = [r for r in runs if r["system"] == s]
        if not mine:
            continue
        measured = [st for r in mine for st in r["steps"] if not st["warmup"]]
        out[s] = {"step_s": statistics.median(st["step_s"] for st in measured),
                  "read_bytes": statistics.median(st["read_bytes"] for st in measured),
                  "write_bytes": statistics.median(st["write_bytes"] for st in measured),
                  "commit_bytes": statistics.median(st["commit_bytes"] for st in measured),
                  "measured_steps": len(measured),
                  "peak_rss_steps_bytes": max(r["peak_rss_steps_bytes"] or 0 for r in mine),
                  **{k: mine[0][k] for k in ("param_count", "trainable", "compute_dtype", "base_bytes",
                                             "params_pool_bytes", "cpu_mem") if k in mine[0]}}
    return out


def keys(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's keys from the summary, each with its target and whether it is met (None: no target, or a
    system it needs did not run)."""
    def ratio(num: str, den: str, field: str = "step_s") -> float | None:
        return summary[num][field] / summary[den][field] if num in summary and den in summary else None

    ls = summary.get("lora_stream")
    # a parameter pool that holds the whole base keeps it after the first step: nothing streams, no measurement
    streamed = bool(ls) and ls["params_pool_bytes"] < ls["base_bytes"]
    values = {"lora_vs_full_step": ratio("full", "lora_stream"),
              "lora_bytes_per_param_step": (ls["read_bytes"] + ls["write_bytes"]) / ls["param_count"] if ls else None,
              "lora_speed_vs_peft_in_ram": ratio("peft", "lora")}
    out = {}
    for k, v in values.items():
        t = TARGETS[k]
        met = None if t is None or v is None else (v <= t[1] if t[0] == "<=" else v >= t[1])
        out[k] = {"value": v, "target": None if t is None else f"{t[0]} {t[1]}", "met": met}
    if ls and not streamed:
        out["lora_bytes_per_param_step"].update(met=None, note="the parameter pool held the whole base: it was "
                                                "not streamed (a bigger model, or a smaller --cpu-mem, streams it)")
    return out


def markdown(rep: dict[str, Any]) -> str:
    """The report's summary: the systems' medians, the keys, what the streaming runs held in memory."""
    def fmt(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    rows = [f"| {s} | {fmt(r['step_s'])} | {r['measured_steps']} | {fmt(r['read_bytes'] / GiB, '.4f')} | "
            f"{fmt(r['write_bytes'] / GiB, '.4f')} | {r['trainable']:,} | "
            f"{fmt(r['peak_rss_steps_bytes'] / GiB, '.2f')} |"
            for s, r in rep["systems"].items()]
    krows = [f"| `{k}` | {fmt(v['value'])} | {v['target'] or '(reported)'} | "
             f"{'-' if v['met'] is None else ('yes' if v['met'] else 'NO')} | {v.get('note', '')} |"
             for k, v in rep["keys"].items()]
    trainable = {s: r["trainable"] for s, r in rep["systems"].items() if s != "full"}
    ls = rep["systems"].get("lora_stream", {})
    pool, base = ls.get("params_pool_bytes"), ls.get("base_bytes")
    reads = ls["read_bytes"] / base if ls and base else None
    stream_set = f", {json.dumps(rep['stream_set'])}" if rep.get("stream_set") else ""
    return "\n".join([
        f"# lora_bench: lohan LoRA vs full fine-tuning and vs PEFT in RAM ({rep['when']})", "",
        f"`{rep['command']}`", "",
        f"Model: {rep['model']} ({rep['param_count']:,} parameters), batch {rep['batch']} x {rep['seq']}, "
        f"{rep['dtype']} compute, LoRA rank {rep['rank']} alpha {rep['alpha']} (all-linear), {rep['rounds']} "
        f"round(s) x ({rep['warmup']} warm-up + {rep['steps']} measured) steps per system; "
        f"{rep['environment']['hardware']['cpu_count']} cores, {rep['environment']['hardware']['cpu_model']}.", "",
        "| system | s/step (median) | measured steps | SSD read/step (GiB) | SSD written/step (GiB) | trainable | "
        "peak RSS, steps (GiB) |", "|---|---|---|---|---|---|---|", *rows, "",
        "| key | value | target | met | note |", "|---|---|---|---|---|", *krows, "",
        "The LoRA systems train the same adapters (trainable parameters equal)." if len(set(trainable.values())) == 1
        else f"**The LoRA systems' trainable parameters differ: {trainable}.**", "",
        f"lora_stream: cpu_mem {rep['cpu_mem']}{stream_set}; its parameter pool "
        f"{fmt(pool / GiB if pool else None)} GiB for a base of {fmt(base / GiB if base else None)} GiB; base "
        f"reads per step {fmt(reads, '.2f')} (2: forward and backward each read it; less: the pool kept part of "
        f"it). full: cpu_mem {rep.get('full_cpu_mem')}, no record kept in main memory (resident_mem 0): its P16, "
        "master weights and moments are read and written every step. lora and peft run at their defaults (the base "
        "in RAM where it fits).", ""])


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child:
        return child(a)
    env = shared_environment(packages=("torch", "transformers", "peft"))
    model_dir = Path(a.model_dir) if a.model_dir else ensure_model(Path(a.scratch), a.size)
    with tempfile.TemporaryDirectory(prefix="lora_bench-", dir=a.nvme) as nvme:
        a.nvme = nvme  # each child's store under a directory of its own, all removed at the end
        runs = [run_child(s, r, model_dir, a) for r, s in schedule(a.rounds, a.systems)]
    summary = summarize(runs)
    rep = {"when": dt.datetime.now().isoformat(timespec="seconds"),
           "command": command(argv if argv is not None else sys.argv[1:]),
           "model": Path(a.model_dir).name if a.model_dir else f"llama-{a.size}",
           "param_count": next(iter(summary.values()))["param_count"], "batch": a.batch, "seq": a.seq,
           "dtype": a.dtype, "rank": a.rank, "alpha": a.alpha, "rounds": a.rounds, "warmup": a.warmup,
           "steps": a.steps, "cpu_mem": a.cpu_mem, "stream_set": a.stream_set, "full_cpu_mem": a.full_cpu_mem,
           "keys": keys(summary), "systems": summary, "runs": runs, "environment": env,
           **result_fields("lora_bench", {"tag": a.tag}, env["hardware"])}
    rep = portable(rep)
    out = result_path("lora_bench", {"tag": a.tag}, hardware=env["hardware"], root=a.results).with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(rep))
    print(markdown(rep))
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help="a local HF Llama directory (default: make_tiny_hf.py --size SIZE)")
    p.add_argument("--size", choices=tuple(SHAPES), default="110m",
                   help="the model's shape (SHAPES: make_tiny_hf.py's defaults, its --size, or 1b; default 110m)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1, help="steps per run left out of the medians")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every system once, rotated")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--cpu-mem", default="256MiB",
                   help="cpu_mem of lora_stream: small, so that its parameter pool holds the blocks in flight only")
    p.add_argument("--stream-set", default={}, type=json.loads,
                   help='more engine settings of lora_stream, as JSON (e.g. \'{"prefetch_depth": 1}\': a smaller '
                        "pool of blocks in flight, where the default one holds a small model's whole base)")
    p.add_argument("--full-cpu-mem", default="8GiB",
                   help="cpu_mem of full (its pools of records in flight; every record is on the SSDs)")
    p.add_argument("--nvme", default=None, help="directory for the stores (default: a scratch directory on disk)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "scratch" / "lora_bench")
    p.add_argument("--tag", default="", help="suffix of the report's file names")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results",
                   help="the results folder: the report goes to lora_bench[/<tag>]/<machine>.json in it")
    p.add_argument("--systems", type=lambda v: tuple(v.split(",")), default=SYSTEMS,
                   help=f"which to run, comma-separated (default {','.join(SYSTEMS)}; a key needs its two)")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 1 warm-up + 1 step, 1 round (for tests)")
    a = p.parse_args(argv)
    if a.smoke:
        a.size, a.warmup, a.steps, a.rounds, a.batch, a.seq, a.rank = "tiny", 1, 1, 1, 2, 32, 4
        a.tag = a.tag or "smoke"
    if not a.child:
        if bad := set(a.systems) - set(SYSTEMS):
            p.error(f"--systems: unknown {sorted(bad)}; choose among {','.join(SYSTEMS)}")
        a.nvme = a.nvme or str(Path(a.scratch) / "nvme")
        Path(a.nvme).mkdir(parents=True, exist_ok=True)
    return a


if __name__ == "__main__":
    sys.exit(main())
