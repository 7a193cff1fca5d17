"""One rank of a data-parallel engine run on the GPUs, for tests/gpu/test_cuda_dp.py (launched with `torchrun
--nproc-per-node 2`). `python dp_gpu_worker.py SPEC.json`: trains `steps` steps of dp_worker.py's batches
with `device: cuda` and writes what this rank saw to `<out_dir>/rank<r>.json`: its losses, which GPU it
computed on, the peak memory the caching allocator handed out on its own GPU and on every other one, and
(where nvidia-smi shows this process) the GPUs it holds a context on.

Nothing here touches CUDA before the engine is built: choosing the rank's GPU (LOCAL_RANK) is the engine's job,
and the test checks that it did.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import lohan
from lohan.config import EngineConfig, get_model_config
from lohan.runtime.parallel import leave_group

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "integration"))
from dp_worker import batches  # noqa: E402


def gpu_contexts() -> list[str] | None:
    """UUIDs (lower case, without 'GPU-') of the GPUs on which nvidia-smi lists this process; None when it
    lists no process of ours (no nvidia-smi, or a PID namespace it cannot see into)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    mine = [line.split(",")[1].strip().lower().removeprefix("gpu-") for line in out.splitlines()
            if line.count(",") >= 1 and line.split(",")[0].strip() == str(os.getpid())]
    return sorted(mine) or None


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 120)))
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    mcfg = get_model_config("tiny", **spec["model"])
    cfg = EngineConfig(**{**spec["engine"], "nvme": tuple(spec["engine"]["nvme"]), "device": "cuda"})
    data = list(batches(spec["steps"], spec["batch"], mcfg.seq_len, mcfg.vocab_size))
    losses = []
    math_sdpa = sdpa_kernel(SDPBackend.MATH) if spec.get("math_sdpa") else contextlib.nullcontext()
    with math_sdpa, lohan.init(mcfg, cfg) as engine:
        engine_device = str(engine.device.torch)
        for batch in data:
            losses.append(engine.step(batch))
        torch.cuda.synchronize()
    contexts = gpu_contexts()  # before anything below could touch another device
    n = torch.cuda.device_count()
    report = {
        "rank": rank, "local_rank": local, "engine_device": engine_device,
        "current_device": torch.cuda.current_device(), "losses": losses, "device_count": n,
        "max_allocated": {i: torch.cuda.max_memory_allocated(i) for i in range(n)},
        "allocated": {i: torch.cuda.memory_allocated(i) for i in range(n)},
        "uuids": {i: str(torch.cuda.get_device_properties(i).uuid).lower().removeprefix("gpu-") for i in range(n)},
        "contexts": contexts,
    }
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    out.write_text(json.dumps(report))
    leave_group(True)


if __name__ == "__main__":
    main(sys.argv[1])
