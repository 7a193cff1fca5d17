"""lohan against DeepSpeed ZeRO-Infinity, ZeRO-Offload and plain PyTorch on the same model, data and settings.

    .venv/bin/python benchmarks/vs_deepspeed.py --quick           # 110M Llama, 2 warm-up + 4 timed steps per system
    .venv/bin/python benchmarks/vs_deepspeed.py                   # 110M and 350M, 3 warm-up + 10 timed steps
    .venv/bin/python benchmarks/vs_deepspeed.py --quick --tune    # first tune each peer on a small grid of its knobs
    .venv/bin/python benchmarks/vs_deepspeed.py --systems lohan,zero-infinity --models 110m

What one measurement is. Each system runs in a child process of its own (`--child SYSTEM`): it builds the
model from a local Hugging Face directory (random weights, `scripts/make_tiny_hf.py --size 110m|350m`, made in
`benchmarks/scratch/vs_deepspeed/` on first use), then trains on the same random token batches (a fixed seed;
batch k is the same tensor on every side) for `--warmup` discarded and `--steps` timed steps. Everywhere: bf16
compute with fp32 master weights and fp32 Adam states (`--dtype fp32`: everything fp32; the default `auto`
takes fp32 where bf16 matmuls are over 4x slower than fp32: on CPUs without AVX-512 torch's bf16 fallback
kernel makes every system's step ~50x longer and the comparison meaningless), AdamW lr 1e-4, betas (0.9,
0.999), eps 1e-8, weight decay 0.01 on matrices and embeddings and none on norm weights (lohan's and the HF
Trainer's groups), global gradient clipping at 1.0, constant learning rate, the mean cross entropy over all
targets, torch threads = cores. The clock of a step covers the whole step (forward, backward, clipping,
optimizer, every SSD transfer it waits for); the median of the timed steps is reported.

- ``lohan``: `lohan.runtime.hf_engine.init_from_hf` with `finetune.py`'s defaults (`EngineConfig()`: the activation
  planner, optimized offloading, 8 GiB `cpu_mem`, aio backend when built), states on `--scratch`. Not tuned.
  The defaults keep as many optimizer records in RAM from step to step as half of what `cpu_mem` leaves
  allows (`resident_mem: auto`; all of them for these models), still writing them to the SSD every step.
- ``lohan-lean``: the same with `resident_mem: 0`: only the record pool, lohan's leanest setting (its
  memory against ZeRO-Infinity's leanest). Its keys are reported beside the defaults' with a `_lean`
  suffix (information, not the targets).
- ``zero-infinity``: ZeRO-3 with `offload_param` and `offload_optimizer` on NVMe (libaio), the model built
  partitioned under `zero.Init` and its weights loaded parameter by parameter under `GatheredParameters`
  (what `from_pretrained` does with transformers' `HfDeepSpeedConfig`, which needs accelerate),
  DeepSpeedCPUAdam (AdamW mode).
- ``zero-offload``: ZeRO-2 with `offload_optimizer` on the CPU (fp32 master and Adam states in RAM).
- ``torch``: the whole model in RAM; `bf16-master` (bf16 model for compute, fp32 master copy, fused AdamW on
  the fp32 master, clip_grad_norm_ on fp32 gradients) or `autocast` (fp32 model under CPU bf16 autocast).
  Skipped when its estimated footprint does not fit the free memory.

DeepSpeed on a machine without a GPU: `DS_ACCELERATOR=cpu`, one process, gloo on 127.0.0.1 (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK set by the parent, no launcher); it JIT-builds its cpu_adam and
shm_comm ops on first use (~1.5 min each on 2 cores, cached under `TORCH_EXTENSIONS_DIR`, default
`<venv>/torch_extensions` like io_engine's aio op). What makes ZeRO-Infinity run here: `stage3_max_reuse_distance:
0` (else "Not enough buffers 0 for swapping"), parameter swap buffers of at least the largest parameter's
(the embedding's) element count, `pin_memory: false`.

Measured per system: s/step (median), tokens/s, peak RSS (the child's VmHWM, reset when the steps start, so
model loading and store creation are not counted; the whole-life VmHWM and an outside psutil sample every 0.1 s
are kept too), disk bytes read and written per step (the child's /proc/self/io read_bytes/write_bytes around
each timed step: what reached the block layer, O_DIRECT included), the losses (equal weights and data: the
first step's loss matches across systems), and where the time goes (forward / backward / optimizer for the
DeepSpeed and torch loops, the engine's lanes for lohan), and the CPU the process used per step (user +
system seconds of all its threads, getrusage) and the share of the machine's cores that is: on a box whose
cores also do the model's compute, the work beside it (optimizer, checksums, I/O in the kernel) and the
cores left idle show there.

Tuning (`--tune`): for each peer, coordinate descent over `TUNE_GRID` (declared below): start from the
settings in `SETTINGS`, try each other value of one knob at a time with short runs (1 warm-up + 2 timed
steps), keep it when its median step is over 3 % faster (one short trial is noisy), go on to the next
knob. Every trial (settings, s/step, peak RSS) and the chosen settings go into the report; the measurement
then uses the chosen settings. Without `--tune`, `SETTINGS` holds the winners of the last tuning on the
development machine (2 cores, one disk).

Keys (computed on the first model, 110m): `speedup_vs_zero_infinity` = s/step of ZeRO-Infinity / lohan's
(target >= 2.0), `speed_vs_torch` = s/step of torch / lohan's (>= 0.8), `rss_ratio_vs_zero_infinity` = peak
RSS of lohan / ZeRO-Infinity's (<= 0.75). Reports: `benchmarks/results/vs_deepspeed[_quick][_fp32][_peers_heap_reuse]
.{json,md,png}`. lohan keeps freed memory in glibc's heap by default (`engine.heap_reuse`); `--peers-heap-reuse`
gives the peers the same malloc setting through the environment, which makes them ~15-20% faster here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
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
from bench_env import cpu_model, package_version, portable  # sibling module (the script's own directory)

REPO = Path(__file__).resolve().parent.parent
GiB, MiB = 1 << 30, 1 << 20

SYSTEMS = ("lohan", "lohan-lean", "zero-infinity", "zero-offload", "torch")
LOHANS = ("lohan", "lohan-lean")  # lohan-lean: no optimizer records kept in RAM beyond the pool (resident_mem: 0)
MODELS = ("110m", "350m")  # scripts/make_tiny_hf.py --size
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
QUICK = {"models": ["110m"], "warmup": 2, "steps": 4}
FULL = {"models": ["110m", "350m"], "warmup": 3, "steps": 10}
TUNE_STEPS = {"warmup": 1, "steps": 2}
TUNE_MARGIN = 0.03  # a knob's new value is kept only when its trial is this much faster than the best so far
TARGETS = {"speedup_vs_zero_infinity": (">=", 2.0), "speed_vs_torch": (">=", 0.8),
           "rss_ratio_vs_zero_infinity": ("<=", 0.75)}

# Settings of each system (what `--tune` starts from and, without it, what is measured). The DeepSpeed
# ones are the winners of `--tune` for the 110m model on the development VM (results/vs_deepspeed.md,
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


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (proc(5), clear_refs "5")."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def batches(vocab: int, batch: int, seq: int, seed: int):
    """Batch k: (ids, targets) [batch, seq], targets shifted by one; depends only on (seed, k)."""
    import torch

    k = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        w = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield w[:, :-1].contiguous(), w[:, 1:].contiguous()
        k += 1


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
    if cfg["zero_optimization"]["stage"] == 3:
        # What from_pretrained does under transformers' HfDeepSpeedConfig (which needs accelerate, not installed
        # here): build the model partitioned under zero.Init (parameters go to the NVMe swap files as they are
        # made) with RoPE's arange left alone, then load each parameter gathered (DeepSpeed's documented way).
        # zero.Init replaces torch.Tensor.__new__ while it is open; torch._dynamo, first imported by
        # transformers' masking utilities when the model class loads, refuses to import under that
        # ("Signature mismatch ... tensor_pynew"): import both before
        import torch._dynamo  # noqa: F401
        import transformers.masking_utils  # noqa: F401
        from safetensors import safe_open
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_cfg)]  # loads the model's module now
        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=cfg):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch_dtype)
        files = sorted(model_dir.glob("*.safetensors"))
        handles = [safe_open(f, "pt") for f in files]
        where = {k: h for h in handles for k in h.keys()}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.copy_(where[name].get_tensor(name))
        del handles, where
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_decay_groups(list(model.named_parameters())),
                                           config=cfg)

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
    hwm_build = _status_bytes("VmHWM")
    rss_ready = _status_bytes("VmRSS")
    reset = _reset_peak_rss()
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
                        "rss_end_bytes": _status_bytes("VmRSS"), "t_end": time.monotonic(), **parts})
        print(f"[{args.child}] step {k + 1}{' (warm-up)' if k < args.warmup else ''}: {dt_s:.3f} s, loss "
              f"{loss:.4f}", flush=True)
    t_steps_end = time.monotonic()
    hwm_steps = _status_bytes("VmHWM") if reset else None
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
    `made`, so the run deletes it at the end)."""
    path = scratch / "models" / f"llama-{size}"
    if not (path / "config.json").exists():
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
              warmup: int, steps: int, log: Any) -> dict[str, Any]:
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
           "--seed", str(a.seed), "--threads", str(a.threads), "--dtype", a.dtype]
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
                "log_tail": text[-3000:]}
    res = json.loads(result_path.read_text())
    res.update(returncode=rc, wall_s=wall, failed=False)
    in_steps = [r for t, r in samples if res["t_steps_start"] <= t <= res["t_steps_end"]]
    res["sampled_peak_rss_steps_bytes"] = max(in_steps, default=None)
    res["sampled_peak_rss_bytes"] = max((r for _, r in samples), default=None)
    res["samples"] = [(round(t - t0, 2), r) for t, r in samples[:: max(1, len(samples) // 400)]]
    res["log_tail"] = text[-1500:]
    return summarize(res, a)


def bf16_matmul_probe(threads: int) -> dict[str, float]:
    """Seconds of one [512, 2048] @ [2048, 768] matmul (both row-major, as a Linear's input gradient) in fp32 and
    bf16: on CPUs without AVX-512 torch's bf16 fallback is an order of magnitude slower than fp32."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for name, dtype in (("fp32_s", torch.float32), ("bf16_s", torch.bfloat16)):
        x, w = torch.randn(512, 2048, dtype=dtype), torch.randn(2048, 768, dtype=dtype)
        x @ w
        t0 = time.perf_counter()
        x @ w
        out[name] = time.perf_counter() - t0
    out["slowdown_vs_fp32"] = out["bf16_s"] / out["fp32_s"]
    return out


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

    res.update(
        s_per_step=med, tokens_per_s=tokens / med, step_s_all=[r["step_s"] for r in timed],
        peak_rss_bytes=res["peak_rss_steps_bytes"] or res["sampled_peak_rss_steps_bytes"],
        peak_rss_whole_life_bytes=max(res["peak_rss_before_steps_bytes"], res["peak_rss_steps_bytes"] or 0,
                                      res["sampled_peak_rss_bytes"] or 0),
        disk_read_bytes_per_step=med_of("disk_read_bytes"), disk_write_bytes_per_step=med_of("disk_write_bytes"),
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


def tune(system: str, model_dir: Path, scratch: Path, a: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Coordinate descent over TUNE_GRID[system] from SETTINGS[system], short runs; every trial is kept."""
    best = settings_for(system, a.dtype)
    trials: list[dict[str, Any]] = []
    cache: dict[str, dict[str, Any]] = {}

    def trial(s: dict[str, Any]) -> float:
        key = json.dumps(s, sort_keys=True)
        if key not in cache:
            r = run_child(system, model_dir, scratch / "tune" / system, s, a, TUNE_STEPS["warmup"],
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


def keys(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def ok(name: str) -> dict[str, Any] | None:
        r = rows.get(name)
        return r if r and not r.get("failed") and not r.get("skipped") else None

    lo, zi, th, lr = ok("lohan"), ok("zero-infinity"), ok("torch"), ok("lohan-lean")
    return {
        "speedup_vs_zero_infinity": zi["s_per_step"] / lo["s_per_step"] if lo and zi else None,
        "speed_vs_torch": th["s_per_step"] / lo["s_per_step"] if lo and th else None,
        "rss_ratio_vs_zero_infinity": lo["peak_rss_bytes"] / zi["peak_rss_bytes"] if lo and zi else None,
        "rss_ratio_vs_zero_infinity_whole_life": (lo["peak_rss_whole_life_bytes"] / zi["peak_rss_whole_life_bytes"]
                                                  if lo and zi else None),
        # the same keys for lohan's leanest setting (info: the targets are for the defaults)
        **{f"{name}_lean": f(lr) if lr and other else None for name, other, f in (
            ("speedup_vs_zero_infinity", zi, lambda r: zi["s_per_step"] / r["s_per_step"]),
            ("speed_vs_torch", th, lambda r: th["s_per_step"] / r["s_per_step"]),
            ("rss_ratio_vs_zero_infinity", zi, lambda r: r["peak_rss_bytes"] / zi["peak_rss_bytes"]))},
    }


def passed(k: dict[str, float | None]) -> dict[str, bool | None]:
    out = {}
    for name, (op, target) in TARGETS.items():
        v = k.get(name)
        out[name] = None if v is None else (v >= target if op == ">=" else v <= target)
    return out


def environment() -> dict[str, Any]:
    import psutil

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "lohan", "io_engine", "benchmarks"],
                           capture_output=True, text=True)
    return {
        "hardware": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "ram_bytes": psutil.virtual_memory().total,
                     "kernel": platform.release()},
        "versions": {"python": platform.python_version(), **{p: package_version(p) for p in
                     ("torch", "transformers", "deepspeed", "psutil")},
                     "git_commit": commit.stdout.strip() or None,
                     "git_dirty_paths": dirty.stdout.split("\n")[:-1] if dirty.returncode == 0 else None},
    }


ROW_KEYS = ("system", "s_per_step", "tokens_per_s", "peak_rss_bytes", "peak_rss_whole_life_bytes",
            "cpu_s_per_step", "cpu_user_s_per_step", "cpu_sys_s_per_step", "cpu_busy",
            "disk_read_bytes_per_step", "disk_write_bytes_per_step", "settings")


def row_of(r: dict[str, Any]) -> dict[str, Any]:
    """The per-system row of the report (the full child result stays under `details`)."""
    if r.get("skipped") or r.get("failed"):
        return {k: r.get(k) for k in ("system", "settings", "skipped", "failed", "reason", "log_tail")
                if r.get(k) is not None}
    out = {k: r[k] for k in ROW_KEYS}
    out.update(first_loss=r["losses"][0], last_loss=r["losses"][-1], breakdown=r["breakdown"],
               step_s_all=r["step_s_all"])
    return out


def _cpu_cell(r: dict[str, Any]) -> str:
    if r.get("cpu_s_per_step") is None:
        return "-"
    return (f"{r['cpu_s_per_step']:.2f} ({r['cpu_user_s_per_step']:.2f} + {r['cpu_sys_s_per_step']:.2f}), "
            f"{100 * r['cpu_busy']:.0f}%")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# lohan vs DeepSpeed ZeRO-Infinity / ZeRO-Offload / PyTorch — {report['timestamp']}", "",
             f"`{report['command']}`", "",
             f"{report['hardware']['cpu_count']} CPUs ({report['hardware']['cpu_model']}), "
             f"{report['hardware']['ram_bytes'] / GiB:.1f} GiB RAM; torch {report['versions']['torch']}, "
             f"transformers {report['versions']['transformers']}, deepspeed {report['versions']['deepspeed']}; "
             f"batch {report['settings']['batch']} x seq {report['settings']['seq']}, {report['settings']['compute']}, "
             f"AdamW lr {LR}, clip {MAX_GRAD_NORM}; {report['settings']['warmup']} warm-up + "
             f"{report['settings']['steps']} timed steps (median).", ""]
    for size, m in report["models"].items():
        lines += [f"## {size} ({m['params'] / 1e6:.1f}M parameters)", "",
                  "| system | s/step | tokens/s | peak RSS (steps) GiB | peak RSS (whole life) GiB | disk read GB/step | "
                  "disk write GB/step | CPU s/step (user + sys), cores busy | first loss | where the time goes | "
                  "settings |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            if r.get("skipped") or r.get("failed"):
                why = r.get("reason") or "failed (see log_tail in the JSON)"
                lines.append(f"| {r['system']} | {'skipped' if r.get('skipped') else 'failed'}: {why} |"
                             + " |" * 9)
                continue
            b = r["breakdown"]
            if "lanes" in b:
                where = "lanes " + ", ".join(f"{k} {v:.2f}" for k, v in b["lanes"].items() if v)
            else:
                where = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in b.items() if k.endswith("_s"))
            sets = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "defaults"
            lines.append(f"| {r['system']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                         f"{r['peak_rss_bytes'] / GiB:.2f} | {r['peak_rss_whole_life_bytes'] / GiB:.2f} | "
                         f"{r['disk_read_bytes_per_step'] / 1e9:.2f} | {r['disk_write_bytes_per_step'] / 1e9:.2f} | "
                         f"{_cpu_cell(r)} | {r['first_loss']:.4f} | {where} | {sets} |")
        k, ok = m["keys"], m["pass"]
        lines += ["", "| key | value | target | met |", "|---|---|---|---|"]
        for name, (op, target) in TARGETS.items():
            v = k.get(name)
            lines.append(f"| `{name}` | {'n/a' if v is None else f'{v:.2f}'} | {op} {target} | "
                         f"{ {True: 'yes', False: 'NO', None: 'n/a'}[ok.get(name)] } |")
        for name in ("rss_ratio_vs_zero_infinity_whole_life", *(f"{t}_lean" for t in TARGETS)):
            v = k.get(name)
            lines.append(f"| `{name}` | {'n/a' if v is None else f'{v:.2f}'} | (info) | |")
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
              ("disk_write_bytes_per_step", "disk written (GB / step)", 1e9)]
    models = list(report["models"])
    fig, axes = plt.subplots(len(models), len(panels), figsize=(4.2 * len(panels), 3.2 * len(models)), squeeze=False)
    colors = {"lohan": "tab:green", "lohan-lean": "tab:olive", "zero-infinity": "tab:red", "zero-offload": "tab:orange", "torch": "tab:blue"}
    for i, size in enumerate(models):
        rows = [r for r in report["models"][size]["rows"] if r.get("s_per_step")]
        for j, (key, label, scale) in enumerate(panels):
            ax = axes[i][j]
            vals = [r[key] / scale for r in rows]
            ax.bar([r["system"] for r in rows], vals, color=[colors.get(r["system"], "grey") for r in rows])
            for x, v in enumerate(vals):
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{size}: {label}", fontsize=9)
            ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="110m only, 2 warm-up + 4 timed steps")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--models", default=None, help="comma-separated sizes (default 110m,350m; quick 110m)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--warmup", type=int, default=None, help="discarded steps per system (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (default 10, quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype on every side. bf16: bf16 compute, fp32 master weights; fp32: everything fp32; "
                        "auto (default): bf16 unless this CPU's bf16 matmuls are over 4x slower than fp32 (no AVX-512: "
                        "see bf16_matmul in the report), then fp32. fp32 reports get a _fp32 suffix")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: cores)")
    p.add_argument("--tune", action="store_true", help="tune each peer's knobs first (TUNE_GRID)")
    p.add_argument("--lohan-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for lohan (e.g. opt_chunk_bytes=128MiB, to trade speed for memory); "
                        "repeatable; the value is read as YAML")
    p.add_argument("--peers-heap-reuse", action="store_true",
                   help="give the peers lohan's heap-reuse malloc setting through glibc's environment, so the "
                        "comparison is on equal allocators (reports get a _peers_heap_reuse suffix)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between outside RSS samples")
    p.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "scratch" / "vs_deepspeed")
    p.add_argument("--keep-models", action="store_true", help="keep the generated HF models for the next run")
    p.add_argument("--out", type=Path, default=None, help="report path (.json; .md and .png next to it)")
    a = p.parse_args(argv)
    if a.child:
        return child(a)

    base = QUICK if a.quick else FULL
    models = a.models.split(",") if a.models else base["models"]
    systems = [s for s in a.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS] + [m for m in models if m not in MODELS]
    if bad:
        p.error(f"unknown system or model: {', '.join(bad)} (systems: {', '.join(SYSTEMS)}; models: "
                f"{', '.join(MODELS)})")
    try:
        lohan_set = {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in a.lohan_set)}
    except yaml.YAMLError as e:
        p.error(f"--lohan-set: {e}")
    if any(not k for k in lohan_set) or any("=" not in kv for kv in a.lohan_set):
        p.error("--lohan-set takes KEY=VALUE")
    warmup = a.warmup if a.warmup is not None else base["warmup"]
    steps = a.steps if a.steps is not None else base["steps"]
    a.scratch.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t_run = time.time()
    probe = bf16_matmul_probe(a.threads)
    slow_bf16 = probe["slowdown_vs_fp32"] > 4
    dtype_why = "given" if a.dtype != "auto" else (
        f"auto: bf16 matmuls {probe['slowdown_vs_fp32']:.0f}x slower than fp32 here" if slow_bf16 else "auto")
    if a.dtype == "auto":
        a.dtype = "fp32" if slow_bf16 else "bf16"
    log(f"compute dtype {a.dtype} ({dtype_why}); bf16 matmul probe: {json.dumps(probe, default=lambda x: round(x, 3))}")
    report: dict[str, Any] = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/vs_deepspeed.py", *(sys.argv[1:] if argv is None else argv)]),
        **environment(),
        "settings": {"batch": a.batch, "seq": a.seq, "warmup": warmup, "steps": steps, "seed": a.seed,
                     "threads": a.threads, "systems": systems, "models": models, "lr": LR, "betas": list(BETAS),
                     "peers_malloc_env": PEER_HEAP_REUSE_ENV if a.peers_heap_reuse else None,
                     "eps": EPS, "weight_decay": WEIGHT_DECAY, "no_decay": "norm weights (1-D parameters)",
                     "max_grad_norm": MAX_GRAD_NORM, "dtype": a.dtype, "dtype_reason": dtype_why,
                     "compute": ("bf16, fp32 master weights and Adam states" if a.dtype == "bf16"
                                 else "fp32 parameters, gradients, Adam states"),
                     "peak_rss": "VmHWM of the child, reset (clear_refs 5) just before its first step",
                     "disk_bytes": "median over timed steps of the child's /proc/self/io read_bytes / write_bytes "
                                   "deltas around the step"},
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "bf16_matmul": probe, "models": {}, "tuning": {}, "notes": [],
    }
    if slow_bf16:
        report["notes"].append(
            f"bf16 matmuls are {probe['slowdown_vs_fp32']:.0f}x slower than fp32 on this CPU and torch (A @ B with both "
            "row-major, the input gradient of every Linear): torch uses oneDNN for bf16 matmuls only on CPUs with "
            "AVX-512 (or AMX), and its fallback kernel is slow in this layout, so every system's bf16 step is "
            "dominated by it (~200 s per step of the 110M Llama for lohan and torch alike)"
            + ("; measured in bf16 anyway (--dtype bf16)" if a.dtype == "bf16" else "; measured in fp32"))
        log("note: " + report["notes"][-1])
    made: list[Path] = []
    try:
        for size in models:
            model_dir = ensure_model(size, a.scratch, made)
            params = n_params(model_dir)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            log(f"== {size}: {params / 1e6:.1f}M parameters, batch {a.batch} x seq {a.seq}, {warmup} warm-up + "
                f"{steps} timed steps")
            rows: dict[str, dict[str, Any]] = {}
            for system in systems:
                settings = settings_for(system, a.dtype)
                if system in LOHANS:
                    settings.update(lohan_set)
                if system == "torch":
                    fits, need, avail = torch_fits(params, a.batch, a.seq, vocab)
                    if not fits:
                        rows[system] = {"system": system, "settings": settings, "skipped": True,
                                        "reason": f"needs ~{need / GiB:.1f} GiB, {avail / GiB:.1f} GiB available"}
                        log(f"  {system}: skipped ({rows[system]['reason']})")
                        continue
                if a.tune and TUNE_GRID[system]:
                    t = tune(system, model_dir, a.scratch, a, log)
                    report["tuning"][f"{size}/{system}"] = t
                    settings = t["chosen"]
                log(f"  {system}: {json.dumps(settings)}")
                r = run_child(system, model_dir, a.scratch / "run" / system, settings, a, warmup, steps, log)
                rows[system] = r
                if r["failed"]:
                    log(f"  {system}: FAILED (exit {r['returncode']}):\n{r['log_tail'][-2000:]}")
                else:
                    b = r["breakdown"]
                    log(f"  {system}: {r['s_per_step']:.3f} s/step ({min(r['step_s_all']):.3f}-"
                        f"{max(r['step_s_all']):.3f}), {r['tokens_per_s']:.0f} tok/s, peak RSS "
                        f"{r['peak_rss_bytes'] / GiB:.2f} GiB (whole life {r['peak_rss_whole_life_bytes'] / GiB:.2f}), "
                        f"disk {r['disk_read_bytes_per_step'] / 1e9:.2f} GB read + "
                        f"{r['disk_write_bytes_per_step'] / 1e9:.2f} GB written per step, CPU {_cpu_cell(r)}, loss "
                        f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, {r['wall_s']:.0f} s | "
                        + json.dumps({k: v for k, v in b.items() if k != "lanes"}, default=lambda x: round(x, 3)))
            k = keys(rows)
            report["models"][size] = {"params": params, "model": f"scripts/make_tiny_hf.py --size {size}",
                                      "rows": [row_of(rows[s]) for s in systems], "keys": k, "pass": passed(k),
                                      "details": {s: r for s, r in rows.items()}}
            log(f"  {size}: " + ", ".join(f"{n} {'n/a' if v is None else f'{v:.2f}'}" for n, v in k.items()))
    finally:  # what this run wrote: the states, logs and the models it made (kept with --keep-models)
        for d in [a.scratch / "run", a.scratch / "tune", *([] if a.keep_models else made)]:
            shutil.rmtree(d, ignore_errors=True)
        for d in (a.scratch / "models", a.scratch):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    first = report["models"].get(models[0], {})
    report.update({k: first.get("keys", {}).get(k) for k in TARGETS})
    report["pass"] = passed({k: report[k] for k in TARGETS})
    report["wall_seconds"] = time.time() - t_run
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1) + 1:
        report["notes"].append(f"load average at the end {load[0]:.1f} on {os.cpu_count()} cores: other work "
                               "shared the machine; compare with caution")
    suffix = ("_quick" if a.quick else "") + ("_fp32" if a.dtype == "fp32" else "") \
        + ("_peers_heap_reuse" if a.peers_heap_reuse else "")
    out = a.out or REPO / "benchmarks" / "results" / f"vs_deepspeed{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    png = plot(report, out.with_suffix(".png"))
    if png is None:
        report["notes"].append("matplotlib is not installed: no bar chart")
    report["png"] = png.name if png else None
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {out} and {out.with_suffix('.md').name}" + (f", {png.name}" if png else "") + ": "
        + ", ".join(f"{k} {'n/a' if report[k] is None else f'{report[k]:.2f}'}" for k in TARGETS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
