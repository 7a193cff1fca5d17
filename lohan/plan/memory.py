"""Main-memory accounting of a run: the bound on its peak RSS that the plan states (`train._header`),
checked by `benchmarks/soak.py` and `tests/integration/test_memory.py`.

    peak RSS <= cpu_mem + overhead

`cpu_mem` bounds what the engine allocates on purpose: its buffer pools (`pools.plan_host_memory`, hard
budgets, which the upcast scratch the optimizer allocates itself is counted in) and the activation records the plan keeps in main memory (the CPU tier: a hard-budgeted pool
sized from what `cpu_mem` leaves after the pools). The overhead is what no budget covers:

- process: the RSS measured once the engine is built, before the first step: Python, torch and the
  libraries, the model skeleton, tokenizer and data, the store's metadata, what initializing the store
  left in the allocator (0.34 GiB for the tiny preset, 0.54 GiB for a 110M HF Llama here);
- device working set, only when the device is the CPU (with a GPU it is device memory): what a step
  holds beyond the block parameters (those are views of the params pool's buffers, no copy): the block
  being recomputed (its activations and their gradients), autograd's gradients of a block, the tied
  embedding's borrowed gradients, the records the plan keeps on the device and the head's loss, after the
  capacity planner's device-memory model of a CPU device (`planner.gpu_need(host=True)`: one block of autograd's
  gradients, or the fp32 upcast of the largest parameter the norms take; less its `HOST_SHARED_PARTS`);
- allocator slack: memory glibc keeps in its arenas after it is freed (fragmentation of the per-step
  temporaries), the first step's profiling and SSD probe, and what the analytic model leaves out.
  benchmarks/soak.py measured peak RSS minus (process + pool bytes allocated + activation tier) at
  0.19 GiB for the tiny preset (analytic working set 0.03 GiB) and 0.34 GiB for the 110M Llama at
  batch 1 x seq 512 (working set 0.15 GiB);
  working set + `SLACK_BYTES` + `SLACK_FACTOR` x working set gives 0.31 and 0.55 GiB. Peak RSS was
  0.58 GiB against a stated 2.64 GiB (tiny, cpu_mem 2 GiB, pools 0.02 GiB) and 2.05 against 3.08 GiB
  (110M, pools 1.60 GiB). Those figures predate the device model's counting of the loss's peak (~4
  logit-sized tensors where it counted 2) and of the gradients: it is larger now, and the bound looser.
"""

from __future__ import annotations

from lohan.config import ModelConfig
from lohan.plan.planner import HOST_SHARED_PARTS, Hardware, analytic_profile, gpu_need

SLACK_BYTES = 1 << 28  # 256 MiB
SLACK_FACTOR = 1.0
"""Allocator slack = SLACK_BYTES + SLACK_FACTOR x the device working set (see the module docstring)."""

_BYTES_ONLY = Hardware("bytes-only", thp_g=1.0, bw_g=1.0, bw_s2m=1.0, bw_m2s=1.0, mem_avail=0)
"""The planner's byte counts do not depend on the machine; its profile wants one all the same."""


def device_working_set(mcfg: ModelConfig, batch: int, seq: int, micro_batches: int, compute_dtype: str,
                       prefetch_depth: int, act_policy: str) -> int:
    """Bytes the compute device holds during a step beyond the block parameters (analytic)."""
    need = gpu_need(mcfg, batch, seq, _BYTES_ONLY, compute_dtype, micro_batches, prefetch_depth, (), host=True)
    ws = sum(v for k, v in need.items() if k not in HOST_SHARED_PARTS)
    if act_policy == "recompute-all":  # every block's input stays on the device, not only the last one's
        ws += (mcfg.n_layer - 1) * analytic_profile(mcfg, batch, seq, _BYTES_ONLY, compute_dtype).input_bytes
    return ws


def rss_overhead(process_rss: int, mcfg: ModelConfig, batch: int, seq: int, micro_batches: int, compute_dtype: str,
                 prefetch_depth: int, act_policy: str, device_is_cpu: bool) -> dict[str, int]:
    """The parts of the peak RSS beyond `cpu_mem`: `process` (measured, passed in), `device working set`
    (0 with a GPU) and `allocator slack`; their sum is the overhead of `peak RSS <= cpu_mem + overhead`."""
    ws = (device_working_set(mcfg, batch, seq, micro_batches, compute_dtype, prefetch_depth, act_policy)
          if device_is_cpu else 0)
    return {"process": int(process_rss), "device working set": ws, "allocator slack": int(SLACK_BYTES + SLACK_FACTOR * ws)}
