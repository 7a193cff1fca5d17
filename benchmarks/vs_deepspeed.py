"""lohan against DeepSpeed ZeRO-Offload, ZeRO-Infinity and plain PyTorch on the same model, data and settings.

    .venv/bin/python benchmarks/vs_deepspeed.py --quick     # every system runs: seq 256, 1 + 2 steps, one round (~5 min)
    .venv/bin/python benchmarks/vs_deepspeed.py             # the measurement: seq 512, steps 3-9, 3 rounds, fp32 + auto
    .venv/bin/python benchmarks/vs_deepspeed.py --dtypes fp32 --rounds 5 --systems lohan,torch
    .venv/bin/python benchmarks/vs_deepspeed.py --tune      # first tune each peer on a small grid of its knobs

What one measurement is. Each system runs in a child process of its own (`--child SYSTEM`): it builds the
model from a local Hugging Face directory (random weights, `scripts/make_tiny_hf.py --size 110m|350m`, made in
`benchmarks/scratch/vs_deepspeed/` on first use), then trains on the same random token batches (a fixed seed;
batch k is the same tensor on every side) for `--warmup` discarded and `--steps` timed steps (full: 2 + 7, so
steps 3-9 are timed, batch 1 x 512). The systems and dtypes run interleaved in `--rounds` rounds (`schedule`:
every pair once a round, each round rotated), and a system's s/step is the median of its timed steps over all
rounds. Every compute dtype of `--dtypes` (default `fp32,auto`) is measured on every system: `fp32` is
everything fp32; `bf16` is bf16 compute with fp32 master weights and fp32 Adam states; `auto` is bf16 on CUDA
and on CPUs with native bf16 (the `avx512_bf16` or `amx_bf16` flag of /proc/cpuinfo), fp32 elsewhere, where
torch's bf16 matmuls have no fast kernel and every system's step is ~10x its fp32 one. lohan gets the resolved
dtype as its `compute_dtype` explicitly. Everywhere: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay
0.01 on matrices and embeddings and none on norm weights (lohan's and the HF Trainer's groups), global gradient
clipping at 1.0, constant learning rate, the mean cross entropy over all targets, torch threads = cores. The
clock of a step covers the whole step (forward, backward, clipping, optimizer, every SSD transfer it waits for).

- ``lohan``: `lohan.runtime.hf_engine.init_from_hf` with `finetune.py`'s defaults (`EngineConfig()` but for the
  compute dtype), states on `--scratch`. Not tuned.
- ``lohan-lean`` (on request, `--systems`): the same with `resident_mem: 0`, only the record pool, lohan's
  leanest setting; its keys get a `_lean` suffix (information, not the targets).
- ``zero-offload``: ZeRO-2 with `offload_optimizer` on the CPU (fp32 master and Adam states in RAM),
  DeepSpeedCPUAdam.
- ``zero-infinity``: ZeRO-3 with `offload_param` and `offload_optimizer` on NVMe (libaio), the model built
  by transformers' `from_pretrained` under an `HfDeepSpeedConfig` (needs accelerate, in the dev extra):
  partitioned under `zero.Init`, each parameter loaded gathered; DeepSpeedCPUAdam (AdamW mode).
- ``torch``: the whole model in RAM; in bf16 `bf16-master` (bf16 model for compute, fp32 master copy, fused
  AdamW on the fp32 master, clip_grad_norm_ on fp32 gradients) or `autocast` (fp32 model under CPU bf16
  autocast); in fp32 a plain fp32 loop. Skipped when its estimated footprint does not fit the free memory.

DeepSpeed on a machine without a GPU: `DS_ACCELERATOR=cpu`, one process, gloo on 127.0.0.1 (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK set by the parent, no launcher); it JIT-builds its cpu_adam and
shm_comm ops on first use (~1.5 min each on 2 cores, cached under `TORCH_EXTENSIONS_DIR`, default
`<venv>/torch_extensions` like io_engine's aio op). What makes ZeRO-Infinity run here: `stage3_max_reuse_distance:
0` (else "Not enough buffers 0 for swapping"), parameter swap buffers of at least the largest parameter's
(the embedding's) element count, `pin_memory: false`. A system that fails is reported with the line that says
why (its exception), and the others are measured.

Measured per system: s/step (median), tokens/s, peak RSS (the child's VmHWM, reset when the steps start, so
model loading and store creation are not counted; the highest round's; the whole-life VmHWM and an outside
psutil sample every 0.1 s are kept too), disk bytes read and written per step (the child's /proc/self/io
read_bytes/write_bytes around each timed step: what reached the block layer, O_DIRECT included; writes as the
mean over the timed steps, so a run that writes its states every N steps is priced per step), the losses (equal
weights and data: the first step's loss matches across systems), where the time goes (forward / backward /
optimizer for the DeepSpeed and torch loops, the engine's lanes for lohan), and the CPU the process used per step
(user + system seconds of all its threads, getrusage) and the share of the machine's cores that is.

Tuning (`--tune`): for each peer and dtype, coordinate descent over `TUNE_GRID` (declared below): start from
the settings in `SETTINGS`, try each other value of one knob at a time with short runs (1 warm-up + 2 timed
steps), keep it when its median step is over 3 % faster (one short trial is noisy), go on to the next knob.
Every trial and the chosen settings go into the report; the measurement then uses the chosen settings.
Without `--tune`, `SETTINGS` holds the winners of an earlier tuning on the development machine.

Keys (issue 39; lohan at its defaults, first model, per dtype under `keys_by_dtype`, at the top level for the
machine's auto dtype): `speed_vs_torch` = s/step of torch / lohan's (target >= 0.95),
`speedup_vs_zero_offload` = ZeRO-Offload's / lohan's (>= 1.2), `speedup_vs_zero_infinity` (reported),
`rss_ratio_vs_torch` = peak RSS of lohan / torch's (<= 1.15), `disk_write_gb_per_step` (lohan's, 1e9 bytes;
reported). Reports: `benchmarks/results/vs_deepspeed[/<variant>]/<machine>.{json,md,png}`, the variant made of
`quick`, the dtype when one dtype ran, and `peers_heap_reuse` (benchmarks/README.md "Result files"). lohan keeps freed memory in glibc's heap by default (`engine.heap_reuse`);
`--peers-heap-reuse` gives the peers the same malloc setting through the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from bench_env import (  # sibling module (the script's own directory)
    batches,
    portable,
    reset_peak_rss,
    result_fields,
    result_path,
    shared_environment,
    status_bytes,
)

REPO = Path(__file__).resolve().parent.parent
GiB, MiB = 1 << 30, 1 << 20

SYSTEMS = ("lohan", "lohan-lean", "zero-infinity", "zero-offload", "torch")
DEFAULT_SYSTEMS = ("lohan", "torch", "zero-offload", "zero-infinity")  # lohan-lean on request (--systems)
LOHANS = ("lohan", "lohan-lean")  # lohan-lean: no optimizer records kept in RAM beyond the pool (resident_mem: 0)
MODELS = ("110m", "350m")  # scripts/make_tiny_hf.py --size
DTYPES = ("auto", "bf16", "fp32")  # auto: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere (resolve_dtype)
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
# full: steps 3-9 timed (issue 39's measurement); quick: every system runs, in minutes, not a measurement
QUICK = {"models": ["110m"], "warmup": 1, "steps": 2, "seq": 256, "rounds": 1}
FULL = {"models": ["110m"], "warmup": 2, "steps": 7, "seq": 512, "rounds": 3}
TUNE_STEPS = {"warmup": 1, "steps": 2}
TUNE_MARGIN = 0.03  # a knob's new value is kept only when its trial is this much faster than the best so far
# The report's keys (issue 39, item 4), on lohan at its defaults; None: reported without a target
TARGETS: dict[str, tuple[str, float] | None] = {
    "speed_vs_torch": (">=", 0.95), "speedup_vs_zero_offload": (">=", 1.2), "speedup_vs_zero_infinity": None,
    "rss_ratio_vs_torch": ("<=", 1.15), "disk_write_gb_per_step": None}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs whose bf16 matmuls are fast

# Settings of each system (what `--tune` starts from and, without it, what is measured). The DeepSpeed
# ones are the winners of `--tune` for the 110m model on the development VM (results/vs_deepspeed/cpu2-xeon.md,
# "Tuning": aio queue depth 32 for ZeRO-Infinity, 5e7-element buckets for ZeRO-Offload; the 350m model's
# ZeRO-Infinity winner differs: sub_group_size 1e9, max_in_cpu 0). lohan: finetune.py's defaults, not tuned.
SETTINGS: dict[str, dict[str, Any]] = {
    "lohan": {},
    "lohan-lean": {"resident_mem": 0},  # the record pool only: lohan's leanest memory
    "zero-infinity": {
        "sub_group_size": 10_000_000,    # elements per optimizer swap unit (DeepSpeed default 1e9)
        "aio_block_size": 1 << 20,       # aio: block_size, queue_depth, intra_op_parallelism (DeepSpeed's docs)
        "aio_queue_depth": 32,
        "aio_intra_op_parallelism": 1,
        "param_buffer_count": 5,         # offload_param.buffer_count
        "param_buffer_size": None,       # None: the largest parameter's element count (the embedding)
        "max_in_cpu": 1_000_000_000,     # offload_param.max_in_cpu (DeepSpeed default: see the README)
        "optimizer_buffer_count": 4,     # offload_optimizer.buffer_count
        "pipeline": False,               # offload_optimizer.pipeline_read / pipeline_write (with >= 16 buffers)
    },
    "zero-offload": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                     "reduce_bucket_size": 50_000_000},
    "torch": {"variant": "bf16-master", "fused": True},
}

# Knobs tried by `--tune`, one at a time, in this order (coordinate descent from SETTINGS).
TUNE_GRID: dict[str, list[tuple[str, list[Any]]]] = {
    "lohan": [],
    "lohan-lean": [],
    "zero-infinity": [
        ("sub_group_size", [10_000_000, 100_000_000, 1_000_000_000]),
        ("max_in_cpu", [1_000_000_000, 0]),
        ("aio_queue_depth", [8, 32]),
        ("aio_intra_op_parallelism", [1, 2]),
        ("aio_block_size", [1 << 20, 8 << 20]),
        ("pipeline", [False, True]),
    ],
    "zero-offload": [
        ("overlap_comm", [False, True]),
        ("reduce_bucket_size", [500_000_000, 50_000_000]),
    ],
    "torch": [
        ("variant", ["bf16-master", "autocast"]),
        ("fused", [True, False]),
    ],
}


# lohan's engine.heap_reuse (lohan/runtime/heap.py: mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB) as glibc's environment
PEER_HEAP_REUSE_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


# ------------------------------------------------------------------------------------------ child
def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, _, v in (ln.partition(": ") for ln in f.read().splitlines())}


def _decay_groups(named: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """AdamW groups as lohan's default `no_decay=(bias, norm)`: norm weights (and biases, none in Llama)
    undecayed, every matrix and the (tied) embedding decayed."""
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def _loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_lohan(model_dir: Path, work: Path, s: dict[str, Any], dtype: str):
    sys.path.insert(0, str(REPO))
    from lohan.config import EngineConfig
    from lohan.runtime.hf_engine import init_from_hf

    base = dict(lr=LR, warmup_steps=0, total_steps=None, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                max_grad_norm=MAX_GRAD_NORM, compute_dtype=dtype)
    cfg = EngineConfig(nvme=(str(work / "nvme"),), **{**base, **s})  # --lohan-set may override (ablations)
    eng = init_from_hf(model_dir, cfg, overwrite=True)

    def step(idx: Any, targets: Any, nxt: Any = None) -> tuple[float, dict[str, Any]]:
        loss = eng.step((idx, targets), next_batch=nxt)  # told the next batch, as finetune.py's loop does
        m = eng.last_stats
        return loss, {"engine_step_s": m.step_s, "lanes": m.lanes, "grad_norm": m.grad_norm,
                      "ssd_read_bytes": m.ssd_read_bytes, "ssd_write_bytes": m.ssd_write_bytes}

    vol = eng.store.volume
    info = {"io_backend": f"{vol.backend.name} ({vol.backend_reason})", "cpu_mem_bytes": int(eng.cfg.cpu_mem),
            "act_policy": eng.cfg.act_policy, "mode": eng.cfg.mode, "resident_mem": eng.cfg.resident_mem,
            "resident_records": f"{len(eng.offloader.resident)} of {len(eng.store.layout.blocks)} blocks",
            "resident_bytes": eng.memory_plan["resident"]}
    return step, eng.close, info


def build_torch(model_dir: Path, work: Path, s: dict[str, Any], dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    fused = bool(s["fused"])
    kw = {"fused": True} if fused else {"foreach": True}
    variant = s["variant"] if dtype == "bf16" else "fp32"  # fp32: one way, no variant
    if variant in ("autocast", "fp32"):  # fp32 model (bf16 matmuls under autocast, or plain fp32)
        opt = torch.optim.AdamW(_decay_groups(list(model.named_parameters())), lr=LR, betas=BETAS, eps=EPS, **kw)
        params = [p for p in model.parameters()]

        def step(idx: Any, targets: Any, nxt: Any = None) -> tuple[float, dict[str, Any]]:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast"):
                loss = _loss(model(input_ids=idx).logits, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            return loss.item(), {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                                 "grad_norm": float(norm)}
    else:  # bf16 model for compute, fp32 master weights (and gradients) for clipping and AdamW
        named = list(model.named_parameters())
        master = [p.detach().clone() for _, p in named]
        for m in master:
            m.grad = torch.zeros_like(m)
        groups = _decay_groups([(n, m) for (n, _), m in zip(named, master)])
        opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **kw)
        model.to(torch.bfloat16)
        params = [p for _, p in named]
        grads = [m.grad for m in master]

        def step(idx: Any, targets: Any, nxt: Any = None) -> tuple[float, dict[str, Any]]:
            t0 = time.perf_counter()
            loss = _loss(model(input_ids=idx).logits, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            with torch.no_grad():
                torch._foreach_copy_(grads, [p.grad for p in params])
                for p in params:
                    p.grad = None
                norm = torch.nn.utils.clip_grad_norm_(master, MAX_GRAD_NORM)
                opt.step()
                torch._foreach_copy_(params, master)
            t3 = time.perf_counter()
            return loss.item(), {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                                 "grad_norm": float(norm)}

    return step, lambda: None, {"variant": variant, "optimizer": f"torch.optim.AdamW({next(iter(kw))}=True)"}


def ds_config(system: str, s: dict[str, Any], nvme: Path, batch: int, largest_numel: int,
              dtype: str = "bf16") -> dict[str, Any]:
    """The DeepSpeed config of `system` with settings `s` (JSON-able: it goes into the report)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM, "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }
    if system == "zero-infinity":
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                              "buffer_count": s["param_buffer_count"],
                              "buffer_size": max(int(s["param_buffer_size"] or 0), largest_numel),
                              "max_in_cpu": s["max_in_cpu"]},
            # the pipelined swapper holds two sub-groups' states at once: with fewer than 16 buffers it fails
            # ("PipelinedOptimizerSwapper ran out of swap buffers" / `assert new_alloc_buffers is not None`)
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                                  "buffer_count": max(s["optimizer_buffer_count"], 16 if s["pipeline"] else 0),
                                  "pipeline_read": s["pipeline"],
                                  "pipeline_write": s["pipeline"]},
            # with the default (1e9) a parameter fetched again within the distance stays out of the swap
            # buffers' accounting and the swapper fails with "Not enough buffers 0 for swapping"
            "stage3_max_reuse_distance": 0,
            "sub_group_size": s["sub_group_size"],
        }
        cfg["aio"] = {"block_size": s["aio_block_size"], "queue_depth": s["aio_queue_depth"],
                      "intra_op_parallelism": s["aio_intra_op_parallelism"], "single_submit": False,
                      "overlap_events": True}
    elif system == "zero-offload":
        cfg["zero_optimization"] = {
            "stage": s["stage"], "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "overlap_comm": s["overlap_comm"], "contiguous_gradients": s["contiguous_gradients"],
            "reduce_bucket_size": s["reduce_bucket_size"], "allgather_bucket_size": s["reduce_bucket_size"],
        }
    else:
        raise ValueError(system)
    return cfg


def build_deepspeed(system: str, model_dir: Path, work: Path, s: dict[str, Any], batch: int, dtype: str):
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    largest = hf_cfg.vocab_size * hf_cfg.hidden_size  # the embedding (tied with the head)
    nvme = work / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    cfg = ds_config(system, s, nvme, batch, largest, dtype)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    hf_ds = None
    if cfg["zero_optimization"]["stage"] == 3:
        # transformers' own ZeRO-3 build (what the HF Trainer does): while an HfDeepSpeedConfig (from accelerate) is
        # alive, from_pretrained builds the model partitioned under zero.Init (parameters go to the NVMe swap files
        # as they are made, no random init) and loads each parameter gathered. transformers 5.x's plain
        # from_config under a bare zero.Init fails in its weight init (IndexError on the embedding's padding row,
        # a partitioned empty tensor). torch._dynamo, first imported by transformers' masking utilities when the
        # model class loads, refuses to import under zero.Init, which replaces torch.Tensor.__new__ while it is
        # open ("Signature mismatch ... tensor_pynew"): import both before
        import torch._dynamo  # noqa: F401
        import transformers.masking_utils  # noqa: F401
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig(cfg)  # kept referenced until the engine is built (transformers holds a weakref)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_decay_groups(list(model.named_parameters())),
                                           config=cfg)
    del hf_ds

    def step(idx: Any, targets: Any, nxt: Any = None) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        loss = _loss(engine(input_ids=idx).logits, targets)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        norm = engine.get_global_grad_norm()
        return loss.item(), {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                             "grad_norm": None if norm is None else float(norm)}

    def close() -> None:
        engine.destroy() if hasattr(engine, "destroy") else None

    info = {"deepspeed_config": json.loads(json.dumps(cfg, default=str)),
            "optimizer": type(engine.optimizer).__name__,
            "inner_optimizer": type(getattr(engine.optimizer, "optimizer", None)).__name__}
    return step, close, info


def child(args: argparse.Namespace) -> int:
    import torch

    t_start = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    settings = json.loads(args.settings)
    work = Path(args.work)
    model_dir = Path(args.model_dir)
    if args.child in LOHANS:
        step, close, info = build_lohan(model_dir, work, settings, args.dtype)
    elif args.child == "torch":
        step, close, info = build_torch(model_dir, work, settings, args.dtype)
    else:
        step, close, info = build_deepspeed(args.child, model_dir, work, settings, args.batch, args.dtype)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    data = batches(vocab, args.batch, args.seq, args.seed)
    hwm_build = status_bytes("VmHWM")
    rss_ready = status_bytes("VmRSS")
    reset = reset_peak_rss()
    t_steps = time.monotonic()
    records = []
    total = args.warmup + args.steps
    pending = next(data)
    for k in range(total):
        idx, targets = pending
        # every timed step is told the next batch, the last one too, as in a long run (finetune.py's loop
        # leaves only the run's final step without one): each timed step then runs one forward and one backward
        pending = next(data)
        io0 = _proc_io()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        loss, parts = step(idx, targets, pending)
        dt_s = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        io1 = _proc_io()
        records.append({"step": k + 1, "warmup": k < args.warmup, "step_s": dt_s, "loss": loss,
                        "disk_read_bytes": io1["read_bytes"] - io0["read_bytes"],
                        "disk_write_bytes": io1["write_bytes"] - io0["write_bytes"],
                        "cpu_user_s": ru1.ru_utime - ru0.ru_utime, "cpu_sys_s": ru1.ru_stime - ru0.ru_stime,
                        "rss_end_bytes": status_bytes("VmRSS"), "t_end": time.monotonic(), **parts})
        print(f"[{args.child}] step {k + 1}{' (warm-up)' if k < args.warmup else ''}: {dt_s:.3f} s, loss "
              f"{loss:.4f}", flush=True)
    t_steps_end = time.monotonic()
    hwm_steps = status_bytes("VmHWM") if reset else None
    close()
    result = {"system": args.child, "settings": settings, "info": info, "records": records,
              "t_start": t_start, "t_steps_start": t_steps, "t_steps_end": t_steps_end,
              "peak_rss_steps_bytes": hwm_steps, "peak_rss_before_steps_bytes": hwm_build,
              "rss_before_steps_bytes": rss_ready, "torch_threads": torch.get_num_threads()}
    Path(args.result).write_text(json.dumps(result, default=str) + "\n")
    return 0


# ----------------------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_model(size: str, scratch: Path, made: list[Path]) -> Path:
    """The HF model of `size` under `scratch`, made by scripts/make_tiny_hf.py if missing (then added to
    `made`, so the run deletes it at the end). A folder with a config but no weights (a clean-up cut short) is made
    again."""
    path = scratch / "models" / f"llama-{size}"
    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        made.append(path)
        if path.exists():
            shutil.rmtree(path)
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_hf.py"), str(path), "--size", size],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return path


def n_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def torch_fits(params: int, batch: int, seq: int, vocab: int) -> tuple[bool, int, int]:
    """Does plain PyTorch fit the free memory? Estimated bytes: bf16-master 18 B/param (bf16 params and
    grads, fp32 master, its gradient, m, v), autocast 18 (fp32 params, grads, m, v, autocast's bf16 weight
    cache) + logits + 1 GiB of activations and process, against 90 % of the available memory."""
    import psutil

    need = 18 * params + batch * seq * vocab * 10 + GiB
    avail = psutil.virtual_memory().available
    return need <= 0.9 * avail, need, avail


def _remove_shm_buffers(port: int) -> None:
    """DeepSpeed's shm_comm op leaves its all-reduce buffer (67 MB at the default size) in /dev/shm when a
    process exits; left there they hold main memory until reboot (117 runs had pinned 7.6 GiB). The name
    carries the child's MASTER_PORT, so only that child's files are removed."""
    for f in Path("/dev/shm").glob(f"deepspeed_*_127.0.0.1_{port}_*"):
        with contextlib.suppress(OSError):
            f.unlink()


def run_child(system: str, model_dir: Path, work: Path, settings: dict[str, Any], a: argparse.Namespace,
              dtype: str, warmup: int, steps: int, log: Any) -> dict[str, Any]:
    """One system in a child process, sampled from outside; returns the child's result plus the samples."""
    import psutil

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    result_path = work / "result.json"
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))  # as io_engine's aio op
    if a.peers_heap_reuse and system not in LOHANS:  # lohan sets it itself (engine.heap_reuse, lohan/runtime/heap.py)
        env.update(PEER_HEAP_REUSE_ENV)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system, "--model-dir", str(model_dir),
           "--work", str(work), "--settings", json.dumps(settings), "--result", str(result_path),
           "--batch", str(a.batch), "--seq", str(a.seq), "--warmup", str(warmup), "--steps", str(steps),
           "--seed", str(a.seed), "--threads", str(a.threads), "--dtype", dtype]
    log_path = work / "child.log"
    t0 = time.monotonic()
    samples: list[tuple[float, int]] = []
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        last = t0
        while proc.poll() is None:
            try:
                samples.append((time.monotonic(), ps.memory_info().rss))
            except psutil.Error:
                break
            if time.monotonic() - last > 60:
                last = time.monotonic()
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                log(f"    ... {last - t0:4.0f} s, RSS {samples[-1][1] / GiB:.2f} GiB | {tail[0][:100]}")
            time.sleep(a.interval)
        rc = proc.wait()
    wall = time.monotonic() - t0
    _remove_shm_buffers(port)
    text = log_path.read_text(errors="replace")
    if rc != 0 or not result_path.exists():
        return {"system": system, "settings": settings, "failed": True, "returncode": rc, "wall_s": wall,
                "reason": f"exit {rc}: {failure_line(text)}", "log_tail": text[-3000:]}
    res = json.loads(result_path.read_text())
    res.update(returncode=rc, wall_s=wall, failed=False)
    in_steps = [r for t, r in samples if res["t_steps_start"] <= t <= res["t_steps_end"]]
    res["sampled_peak_rss_steps_bytes"] = max(in_steps, default=None)
    res["sampled_peak_rss_bytes"] = max((r for _, r in samples), default=None)
    res["samples"] = [(round(t - t0, 2), r) for t, r in samples[:: max(1, len(samples) // 400)]]
    res["log_tail"] = text[-1500:]
    return summarize(res, a)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo); empty where it cannot be read."""
    try:
        with open(path) as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def resolve_dtype(name: str, flags: set[str], cuda: bool) -> tuple[str, str]:
    """(`bf16` or `fp32`, why) for `--dtypes` entry `name`. `auto` is bf16 on CUDA and on CPUs with native bf16
    (avx512_bf16, AMX), fp32 elsewhere: there torch's bf16 matmuls have no fast kernel and every system's
    bf16 step is ~10x its fp32 one (issue 39), which would compare nothing but that kernel."""
    if name != "auto":
        return name, "given"
    if cuda:
        return "bf16", "auto: CUDA"
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return "bf16", f"auto: the CPU has native bf16 ({', '.join(native)})"
    return "fp32", f"auto: the CPU has no native bf16 (none of {', '.join(NATIVE_BF16_FLAGS)})"


def schedule(systems: list[str], dtypes: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, dtype, system) in the order they run: every pair once per round; each round starts one system
    later and takes the dtypes in the other order, so no system always runs first (a cold page cache, a
    quiet disk) or always after the same neighbour, and a drift of the machine over the run falls on all."""
    out = []
    for r in range(rounds):
        k = r % len(systems)
        order = systems[k:] + systems[:k]
        for dtype in (dtypes if r % 2 == 0 else dtypes[::-1]):
            out += [(r, dtype, system) for system in order]
    return out


def failure_line(log_text: str) -> str:
    """The line that says why a child failed: the last exception line of its log (a traceback's last line), else
    its last line."""
    lines = [ln.removeprefix("[rank0]: ").strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception", "Interrupt"))]
    return (errors or lines or ["(no output)"])[-1][:500]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def summarize(res: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    timed = [r for r in res["records"] if not r["warmup"]]
    med = statistics.median(r["step_s"] for r in timed)
    for r in timed:  # (records of reports made before these were measured have none)
        if r.get("cpu_user_s") is not None:
            r["cpu_s"] = r["cpu_user_s"] + r["cpu_sys_s"]
            r["cpu_busy"] = r["cpu_s"] / (r["step_s"] * (os.cpu_count() or 1))
    tokens = a.batch * a.seq

    def med_of(key: str) -> float | None:
        vals = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def mean_of(key: str) -> float | None:
        vals = [r[key] for r in timed if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    res.update(
        s_per_step=med, tokens_per_s=tokens / med, step_s_all=[r["step_s"] for r in timed],
        peak_rss_bytes=res["peak_rss_steps_bytes"] or res["sampled_peak_rss_steps_bytes"],
        peak_rss_whole_life_bytes=max(res["peak_rss_before_steps_bytes"], res["peak_rss_steps_bytes"] or 0,
                                      res["sampled_peak_rss_bytes"] or 0),
        disk_read_bytes_per_step=med_of("disk_read_bytes"), disk_write_bytes_per_step=med_of("disk_write_bytes"),
        # the mean, not the median: a run that writes its states every N steps writes nothing on most steps
        disk_write_bytes_per_step_mean=mean_of("disk_write_bytes"),
        losses=[r["loss"] for r in res["records"]],
        cpu_s_per_step=med_of("cpu_s"), cpu_user_s_per_step=med_of("cpu_user_s"),
        cpu_sys_s_per_step=med_of("cpu_sys_s"), cpu_busy=med_of("cpu_busy"),
        breakdown={k: med_of(k) for k in ("forward_s", "backward_s", "optimizer_s", "engine_step_s") if med_of(k)},
    )
    lanes = [r["lanes"] for r in timed if r.get("lanes")]
    if lanes:
        res["breakdown"]["lanes"] = {k: statistics.median(ln[k] for ln in lanes) for k in lanes[0]
                                     if all(isinstance(ln.get(k), int | float) for ln in lanes)}
    return res


def tune(system: str, model_dir: Path, scratch: Path, a: argparse.Namespace, dtype: str,
         log: Any) -> dict[str, Any]:
    """Coordinate descent over TUNE_GRID[system] from SETTINGS[system], short runs; every trial is kept."""
    best = settings_for(system, dtype)
    trials: list[dict[str, Any]] = []
    cache: dict[str, dict[str, Any]] = {}

    def trial(s: dict[str, Any]) -> float:
        key = json.dumps(s, sort_keys=True)
        if key not in cache:
            r = run_child(system, model_dir, scratch / "tune" / system, s, a, dtype, TUNE_STEPS["warmup"],
                          TUNE_STEPS["steps"], log)
            row = {"settings": s, "failed": r["failed"], "s_per_step": r.get("s_per_step"),
                   "peak_rss_bytes": r.get("peak_rss_bytes"), "wall_s": r["wall_s"]}
            if r["failed"]:
                row["log_tail"] = r["log_tail"][-600:]
            trials.append(row)
            cache[key] = row
            log(f"  tune {system}: {json.dumps(s)} -> " + ("failed" if r["failed"] else
                f"{r['s_per_step']:.3f} s/step, peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB"))
        row = cache[key]
        return float("inf") if row["failed"] else row["s_per_step"]

    t_best = trial(best)
    for knob, values in TUNE_GRID[system]:
        if knob not in best:  # not a knob of this dtype (torch's variant in fp32)
            continue
        for v in values:
            if v == best[knob]:
                continue
            cand = {**best, knob: v}
            t = trial(cand)
            if t < t_best * (1 - TUNE_MARGIN):  # a clear win only: one short trial is noisy
                best, t_best = cand, t
    return {"method": "coordinate descent over TUNE_GRID from SETTINGS, "
                      f"{TUNE_STEPS['warmup']} warm-up + {TUNE_STEPS['steps']} timed steps per trial, a new value "
                      f"kept when over {TUNE_MARGIN:.0%} faster",
            "grid": [[k, v] for k, v in TUNE_GRID[system]], "trials": trials, "chosen": best,
            "chosen_s_per_step": t_best}


def settings_for(system: str, dtype: str) -> dict[str, Any]:
    """SETTINGS[system] as they apply to `dtype`: in fp32 torch runs one way (an fp32 model), no variant."""
    s = dict(SETTINGS[system])
    if system == "torch" and dtype == "fp32":
        s.pop("variant")
    return s


def merge_rounds(runs: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """One system's row from its runs in every round: s/step the median of all rounds' timed steps, peak RSS the
    highest round's, disk bytes over all timed steps; what each round gave is kept under `per_round`. A round
    that failed is counted; when all did, the row is the last failure."""
    ok = [r for r in runs if not r["failed"]]
    if not ok:
        return {**runs[-1], "failed_rounds": len(runs)}

    def peak(key: str) -> int | None:
        vals = [r[key] for r in ok if r.get(key) is not None]
        return max(vals) if vals else None

    merged = {**ok[0], "records": [dict(rec, round=i) for i, r in enumerate(ok) for rec in r["records"]],
              **{k: peak(k) for k in ("peak_rss_steps_bytes", "sampled_peak_rss_steps_bytes",
                                      "peak_rss_before_steps_bytes", "sampled_peak_rss_bytes")},
              "wall_s": sum(r["wall_s"] for r in runs), "failed_rounds": len(runs) - len(ok),
              "per_round": [{k: r.get(k) for k in ("s_per_step", "peak_rss_bytes", "disk_write_bytes_per_step_mean",
                                                   "wall_s", "failed", "reason")} for r in runs]}
    merged.pop("samples", None)  # each round's RSS samples stay in that round's run (not in the report)
    return summarize(merged, a)


def keys(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """TARGETS' keys for lohan at its defaults against each peer, plus the memory ratios to the DeepSpeed
    systems and, when `lohan-lean` ran, the speed and memory keys of that setting with a `_lean` suffix
    (information: the targets judge the defaults)."""
    def ok(name: str) -> dict[str, Any] | None:
        r = rows.get(name)
        return r if r and not r.get("failed") and not r.get("skipped") else None

    th, zo, zi = ok("torch"), ok("zero-offload"), ok("zero-infinity")

    def of(lo: dict[str, Any] | None) -> dict[str, float | None]:
        def speed(peer: dict[str, Any] | None) -> float | None:
            return peer["s_per_step"] / lo["s_per_step"] if lo and peer else None

        def rss(peer: dict[str, Any] | None, key: str = "peak_rss_bytes") -> float | None:
            return lo[key] / peer[key] if lo and peer else None

        return {"speed_vs_torch": speed(th), "speedup_vs_zero_offload": speed(zo),
                "speedup_vs_zero_infinity": speed(zi), "rss_ratio_vs_torch": rss(th),
                "disk_write_gb_per_step": (lo["disk_write_bytes_per_step_mean"] / 1e9
                                           if lo and lo.get("disk_write_bytes_per_step_mean") is not None else None),
                "rss_ratio_vs_torch_whole_life": rss(th, "peak_rss_whole_life_bytes"),
                "rss_ratio_vs_zero_offload": rss(zo), "rss_ratio_vs_zero_infinity": rss(zi)}

    out = of(ok("lohan"))
    if rows.get("lohan-lean"):
        out.update({f"{k}_lean": v for k, v in of(ok("lohan-lean")).items() if not k.endswith("_whole_life")})
    return out


def passed(k: dict[str, float | None]) -> dict[str, bool | None]:
    """Each targeted key against its target (None: not measured)."""
    out = {}
    for name, goal in TARGETS.items():
        if goal is None:
            continue
        op, target = goal
        v = k.get(name)
        out[name] = None if v is None else (v >= target if op == ">=" else v <= target)
    return out


def environment() -> dict[str, Any]:
    return shared_environment(("torch", "transformers", "deepspeed", "accelerate", "psutil"))


ROW_KEYS = ("system", "s_per_step", "tokens_per_s", "peak_rss_bytes", "peak_rss_whole_life_bytes",
            "cpu_s_per_step", "cpu_user_s_per_step", "cpu_sys_s_per_step", "cpu_busy",
            "disk_read_bytes_per_step", "disk_write_bytes_per_step", "disk_write_bytes_per_step_mean", "settings",
            "failed_rounds", "per_round")


def row_of(r: dict[str, Any]) -> dict[str, Any]:
    """The per-system row of the report (the full child result stays under `details`)."""
    if r.get("skipped") or r.get("failed"):
        return {k: r.get(k) for k in ("system", "settings", "skipped", "failed", "reason", "log_tail")
                if r.get(k) is not None}
    out = {k: r.get(k) for k in ROW_KEYS}
    out.update(first_loss=r["losses"][0], last_loss=r["losses"][-1], breakdown=r["breakdown"],
               step_s_all=r["step_s_all"])
    return out


def _cpu_cell(r: dict[str, Any]) -> str:
    if r.get("cpu_s_per_step") is None:
        return "-"
    return (f"{r['cpu_s_per_step']:.2f} ({r['cpu_user_s_per_step']:.2f} + {r['cpu_sys_s_per_step']:.2f}), "
            f"{100 * r['cpu_busy']:.0f}%")


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _row_line(r: dict[str, Any]) -> str:
    if r.get("skipped") or r.get("failed"):
        why = r.get("reason") or "failed (see log_tail in the JSON)"
        return f"| {r['system']} | {'skipped' if r.get('skipped') else 'failed'}: {why} |" + " |" * 9
    b = r["breakdown"]
    if "lanes" in b:
        where = "lanes " + ", ".join(f"{k} {v:.2f}" for k, v in b["lanes"].items() if v)
    else:
        where = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in b.items() if k.endswith("_s"))
    sets = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "defaults"
    return (f"| {r['system']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['peak_rss_bytes'] / GiB:.2f} | {r['peak_rss_whole_life_bytes'] / GiB:.2f} | "
            f"{r['disk_read_bytes_per_step'] / 1e9:.2f} | {r['disk_write_bytes_per_step_mean'] / 1e9:.2f} | "
            f"{_cpu_cell(r)} | {r['first_loss']:.4f} | {where} | {sets} |")


def markdown(report: dict[str, Any]) -> str:
    st = report["settings"]
    lines = [f"# lohan vs DeepSpeed ZeRO-Offload / ZeRO-Infinity / PyTorch — {report['timestamp']}", "",
             f"`{report['command']}`", "",
             f"{report['hardware']['cpu_count']} CPUs ({report['hardware']['cpu_model']}), "
             f"{report['hardware']['ram_bytes'] / GiB:.1f} GiB RAM; torch {report['versions']['torch']}, "
             f"transformers {report['versions']['transformers']}, deepspeed {report['versions']['deepspeed']}, "
             f"accelerate {report['versions']['accelerate']}; batch {st['batch']} x seq {st['seq']}, AdamW lr {LR}, "
             f"clip {MAX_GRAD_NORM}; {st['warmup']} warm-up + {st['steps']} timed steps per run, {st['rounds']} "
             f"round(s) interleaved (median of all timed steps). Compute dtypes: "
             + "; ".join(f"{d} ({why})" for d, why in st["dtypes"].items()) + ".", ""]
    if report.get("keys_dtype"):
        lines += [f"Headline keys: {report['models_measured'][0]}, {report['keys_dtype']}.", ""]
    for size, m in report["models"].items():
        for dtype, d in m["dtypes"].items():
            lines += [f"## {size} ({m['params'] / 1e6:.1f}M parameters), {dtype}", "",
                      "| system | s/step | tokens/s | peak RSS (steps) GiB | peak RSS (whole life) GiB | "
                      "disk read GB/step | disk write GB/step (mean) | CPU s/step (user + sys), cores busy | "
                      "first loss | where the time goes | settings |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            lines += [_row_line(r) for r in d["rows"]]
            lines += ["", "| key | value | target | met |", "|---|---|---|---|"]
            for name, v in d["keys"].items():
                goal = TARGETS.get(name)
                met = {True: "yes", False: "NO", None: "n/a"}[d["pass"].get(name)] if goal else ""
                lines.append(f"| `{name}` | {_fmt(v)} | {f'{goal[0]} {goal[1]}' if goal else '(report)'} | {met} |")
            lines.append("")
    if report.get("tuning"):
        lines += ["## Tuning", ""]
        for key, t in report["tuning"].items():
            lines += [f"- **{key}**: chosen {json.dumps(t['chosen'])} ({t['chosen_s_per_step']:.3f} s/step); "
                      f"{len(t['trials'])} trials:"]
            for tr in t["trials"]:
                lines.append(f"  - {json.dumps(tr['settings'])}: " + ("failed" if tr["failed"] else
                             f"{tr['s_per_step']:.3f} s/step, peak RSS {tr['peak_rss_bytes'] / GiB:.2f} GiB"))
        lines.append("")
    if report.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in report["notes"]], ""]
    if report.get("png"):
        lines += [f"![s/step, peak RSS and disk bytes per system]({report['png']})", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [("s_per_step", "s / step", 1), ("peak_rss_bytes", "peak RSS (GiB)", GiB),
              ("disk_write_bytes_per_step_mean", "disk written (GB / step)", 1e9)]
    cases = [(size, dtype, d) for size, m in report["models"].items() for dtype, d in m["dtypes"].items()]
    if not cases:
        return None
    fig, axes = plt.subplots(len(cases), len(panels), figsize=(4.2 * len(panels), 3.2 * len(cases)), squeeze=False)
    colors = {"lohan": "tab:green", "lohan-lean": "tab:olive", "zero-infinity": "tab:red", "zero-offload": "tab:orange",
              "torch": "tab:blue"}
    for i, (size, dtype, d) in enumerate(cases):
        rows = [r for r in d["rows"] if r.get("s_per_step")]
        for j, (key, label, scale) in enumerate(panels):
            ax = axes[i][j]
            vals = [r[key] / scale for r in rows]
            ax.bar([r["system"] for r in rows], vals, color=[colors.get(r["system"], "grey") for r in rows])
            for x, v in enumerate(vals):
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{size} {dtype}: {label}", fontsize=9)
            ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; a parent run gets its mode's defaults filled in and `dtypes` resolved."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["bf16", "fp32"], help=argparse.SUPPRESS)  # a child's (resolved) dtype
    p.add_argument("--quick", action="store_true",
                   help="check that every system runs: 110m, seq 256, 1 warm-up + 2 timed steps, one round (~5 min)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--models", default=None, help="comma-separated sizes of scripts/make_tiny_hf.py (default 110m)")
    p.add_argument("--dtypes", default="fp32,auto",
                   help="comma-separated compute dtypes, each measured on every system: fp32 (everything fp32), bf16 "
                        "(bf16 compute, fp32 master weights and Adam states), auto (bf16 on CUDA and on CPUs with "
                        "avx512_bf16 or amx_bf16, else fp32); a dtype named twice after resolving runs once")
    p.add_argument("--rounds", type=int, default=None, help="rounds, each running every system and dtype once, "
                   "in a rotated order (default 3, quick 1)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512, quick 256)")
    p.add_argument("--warmup", type=int, default=None, help="discarded steps per run (default 2, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 7: steps 3-9; quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: cores)")
    p.add_argument("--tune", action="store_true", help="tune each peer's knobs first (TUNE_GRID), per model and dtype")
    p.add_argument("--lohan-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for lohan (e.g. opt_chunk_bytes=128MiB, to trade speed for memory); "
                        "repeatable; the value is read as YAML")
    p.add_argument("--peers-heap-reuse", action="store_true",
                   help="give the peers lohan's heap-reuse malloc setting through glibc's environment, so the "
                        "comparison is on equal allocators (a variant of the report)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between outside RSS samples")
    p.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "scratch" / "vs_deepspeed")
    p.add_argument("--keep-models", action="store_true", help="keep the generated HF models for the next run")
    p.add_argument("--out", type=Path, default=None, help="report path (.json; .md and .png next to it)")
    a = p.parse_args(argv)
    if a.child:
        return a
    base = QUICK if a.quick else FULL
    for k in ("seq", "warmup", "steps", "rounds"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    a.models = a.models.split(",") if a.models else list(base["models"])
    a.systems = [s for s in a.systems.split(",") if s]
    names = [d for d in a.dtypes.split(",") if d]
    bad = ([s for s in a.systems if s not in SYSTEMS] + [m for m in a.models if m not in MODELS]
           + [d for d in names if d not in DTYPES])
    if bad or not a.systems or not names:
        p.error(f"unknown or missing system, model or dtype: {', '.join(bad) or '(empty list)'} (systems: "
                f"{', '.join(SYSTEMS)}; models: {', '.join(MODELS)}; dtypes: {', '.join(DTYPES)})")
    if min(a.rounds, a.steps, a.batch, a.seq) < 1 or a.warmup < 0:
        p.error("--rounds, --steps, --batch and --seq take a positive number, --warmup zero or more")
    if any(not kv.partition("=")[0] or "=" not in kv for kv in a.lohan_set):
        p.error("--lohan-set takes KEY=VALUE")
    try:
        a.lohan_set = {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in a.lohan_set)}
    except yaml.YAMLError as e:
        p.error(f"--lohan-set: {e}")
    flags, cuda = cpu_flags(), _has_cuda()
    a.dtype_reasons = {}
    for name in names:
        dtype, why = resolve_dtype(name, flags, cuda)
        a.dtype_reasons.setdefault(dtype, why)
    a.dtypes = list(a.dtype_reasons)
    a.auto_dtype = resolve_dtype("auto", flags, cuda)[0]
    return a


def measure(a: argparse.Namespace, report: dict[str, Any], log: Any) -> None:
    """Every model: every (round, dtype, system) of `schedule` in a child process, merged per dtype and system
    into `report["models"]`. Deletes what the runs wrote (and the models made here unless --keep-models)."""
    made: list[Path] = []
    try:
        for size in a.models:
            model_dir = ensure_model(size, a.scratch, made)
            params = n_params(model_dir)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            log(f"== {size}: {params / 1e6:.1f}M parameters, batch {a.batch} x seq {a.seq}, {a.warmup} warm-up + "
                f"{a.steps} timed steps, {a.rounds} round(s), dtypes {', '.join(a.dtypes)}")
            settings = {(d, s): dict(settings_for(s, d), **(a.lohan_set if s in LOHANS else {}))
                        for d in a.dtypes for s in a.systems}
            fits, need, avail = torch_fits(params, a.batch, a.seq, vocab)
            if a.tune:
                for (dtype, system) in settings:
                    if TUNE_GRID[system] and (system != "torch" or fits):
                        t = tune(system, model_dir, a.scratch, a, dtype, log)
                        report["tuning"][f"{size}/{dtype}/{system}"] = t
                        settings[dtype, system] = t["chosen"]
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in settings}
            plan = schedule(a.systems, a.dtypes, a.rounds)
            for i, (rnd, dtype, system) in enumerate(plan):
                head = f"  [{i + 1}/{len(plan)}] round {rnd + 1}, {dtype}, {system}"
                if system == "torch" and not fits:
                    runs[dtype, system].append({"system": system, "settings": settings[dtype, system], "skipped": True,
                                                "failed": True, "wall_s": 0.0,
                                                "reason": f"needs ~{need / GiB:.1f} GiB, {avail / GiB:.1f} available"})
                    log(f"{head}: skipped ({runs[dtype, system][-1]['reason']})")
                    continue
                log(f"{head}: {json.dumps(settings[dtype, system])}")
                r = run_child(system, model_dir, a.scratch / "run" / system, settings[dtype, system], a, dtype,
                              a.warmup, a.steps, log)
                runs[dtype, system].append(r)
                log(f"{head}: " + (f"FAILED ({r['reason']})" if r["failed"] else _run_line(r)))
            report["models"][size] = {"params": params, "model": f"scripts/make_tiny_hf.py --size {size}",
                                      "dtypes": {}}
            for dtype in a.dtypes:
                rows = {s: merge_rounds(runs[dtype, s], a) for s in a.systems}
                k = keys(rows)
                report["models"][size]["dtypes"][dtype] = {
                    "rows": [row_of(rows[s]) for s in a.systems], "keys": k, "pass": passed(k),
                    "details": {s: [{kk: v for kk, v in r.items() if kk != "samples"} for r in runs[dtype, s]]
                                for s in a.systems}}
                log(f"  {size} {dtype}: " + ", ".join(f"{n} {_fmt(k.get(n))}" for n in TARGETS))
    finally:  # what this run wrote: the states, logs and the models it made (kept with --keep-models)
        for d in [a.scratch / "run", a.scratch / "tune", *([] if a.keep_models else made)]:
            shutil.rmtree(d, ignore_errors=True)
        for d in (a.scratch / "models", a.scratch):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()


def _run_line(r: dict[str, Any]) -> str:
    return (f"{r['s_per_step']:.3f} s/step ({min(r['step_s_all']):.3f}-{max(r['step_s_all']):.3f}), "
            f"{r['tokens_per_s']:.0f} tok/s, peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB (whole life "
            f"{r['peak_rss_whole_life_bytes'] / GiB:.2f}), disk {r['disk_read_bytes_per_step'] / 1e9:.2f} GB read + "
            f"{r['disk_write_bytes_per_step_mean'] / 1e9:.2f} GB written per step, CPU {_cpu_cell(r)}, loss "
            f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, {r['wall_s']:.0f} s")


def headline(report: dict[str, Any], a: argparse.Namespace) -> None:
    """The report's top-level keys: those of the first model in the machine's auto dtype when it ran (else the
    first dtype), and `keys_by_dtype` for every dtype of that model."""
    first = report["models"].get(a.models[0], {}).get("dtypes", {})
    report["models_measured"] = list(report["models"])
    report["keys_dtype"] = a.auto_dtype if a.auto_dtype in first else next(iter(first), None)
    report["keys_by_dtype"] = {d: {k: v["keys"].get(k) for k in TARGETS} for d, v in first.items()}
    top = report["keys_by_dtype"].get(report["keys_dtype"], {})
    report.update({k: top.get(k) for k in TARGETS})
    report["pass"] = passed({k: report[k] for k in TARGETS})
    for size, m in report["models"].items():
        for dtype, d in m["dtypes"].items():
            for r in d["rows"]:
                if r.get("failed") and not r.get("skipped"):
                    report["notes"].append(f"{size} {dtype}: {r['system']} failed: {r.get('reason')}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child(a)
    a.scratch.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t_run = time.time()
    for d, why in a.dtype_reasons.items():
        log(f"compute dtype {d} ({why})")
    report: dict[str, Any] = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/vs_deepspeed.py", *(sys.argv[1:] if argv is None else argv)]),
        **environment(),
        "settings": {"batch": a.batch, "seq": a.seq, "warmup": a.warmup, "steps": a.steps, "rounds": a.rounds,
                     "seed": a.seed, "threads": a.threads, "systems": a.systems, "models": a.models,
                     "dtypes": a.dtype_reasons, "lr": LR, "betas": list(BETAS),
                     "peers_malloc_env": PEER_HEAP_REUSE_ENV if a.peers_heap_reuse else None,
                     "eps": EPS, "weight_decay": WEIGHT_DECAY, "no_decay": "norm weights (1-D parameters)",
                     "max_grad_norm": MAX_GRAD_NORM,
                     "compute": {"bf16": "bf16 compute, fp32 master weights and Adam states",
                                 "fp32": "fp32 parameters, gradients, Adam states"},
                     "order": "rounds of every (dtype, system) pair, each round rotated (schedule())",
                     "s_per_step": "median of every round's timed steps",
                     "peak_rss": "VmHWM of the child, reset (clear_refs 5) just before its first step; the highest "
                                 "round's",
                     "disk_bytes": "the child's /proc/self/io read_bytes / write_bytes deltas around each timed step: "
                                   "read the median, write the mean (disk_write_gb_per_step: lohan's, in 1e9 bytes)"},
        "targets": {k: (f"{v[0]} {v[1]}" if v else "report") for k, v in TARGETS.items()},
        "models": {}, "tuning": {}, "notes": [],
    }
    if a.quick:
        report["notes"].append("--quick: a check that every system runs (few steps, one round, a shorter sequence), "
                               "not a measurement to quote")
    measure(a, report, log)
    headline(report, a)
    report["wall_seconds"] = time.time() - t_run
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1) + 1:
        report["notes"].append(f"load average at the end {load[0]:.1f} on {os.cpu_count()} cores: other work "
                               "shared the machine; compare with caution")
    variant = {"quick": a.quick, "dtype": a.dtypes[0] if len(a.dtypes) == 1 else None,
               "peers_heap_reuse": a.peers_heap_reuse}
    report.update(result_fields("vs_deepspeed", variant))
    out = result_path("vs_deepspeed", variant, a.out)
    write_report(report, out, log)
    return 0


def write_report(report: dict[str, Any], out: Path, log: Any) -> None:
    """The report as `out` (JSON) with its markdown table and bar chart beside it, no path of this machine in it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)
    png = plot(report, out.with_suffix(".png"))
    if png is None:
        report["notes"].append("matplotlib is not installed: no bar chart")
    report["png"] = png.name if png else None
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {out} and {out.with_suffix('.md').name}" + (f", {png.name}" if png else "") + f" ({report['keys_dtype']}): "
        + ", ".join(f"{k} {_fmt(report[k])}" for k in TARGETS))


if __name__ == "__main__":
    sys.exit(main())
