"""Data parallelism on two GPUs: `torchrun --nproc-per-node 2` of tests/gpu/dp_gpu_worker.py (the GPU twin of
tests/integration/test_parallel.py's CPU runs). Each rank must compute on its own GPU (LOCAL_RANK) and on no other: a
rank that allocates on, or merely opens a context on, its neighbour's GPU takes that GPU's memory (a CUDA
context alone is ~0.5 GiB) and shares its SMs. Checked from three sides: the engine's device and the current
device, the caching allocator's peak on every GPU, and nvidia-smi's list of processes per GPU (where it sees
this container's processes).

The ranks' losses are all-reduced, so they must be the same float on both ranks; and the run must train like
one process on one GPU with two micro-batches (fp32, MATH attention): bit for bit on the CPU
(tests/integration/test_parallel.py), within 1e-6 relative here (the GPUs' kernels are the same for the same shapes, but
two devices are not promised to round alike).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import lohan
from lohan.config import EngineConfig, get_model_config
from tests.integration.test_parallel import MODEL, engine_kw

pytestmark = [
    pytest.mark.gpu,  # skipped without CUDA (tests/conftest.py)
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORKER = Path(__file__).with_name("dp_gpu_worker.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_each_use_their_own_gpu_only(tmp_path):
    engine = engine_kw(str(tmp_path / "dp"), device="cuda")
    spec = dict(model=MODEL, engine=engine, steps=STEPS, batch=4, out_dir=str(tmp_path), math_sdpa=True, timeout=120)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOHAN_DEVICE", None)  # conftest pins 'auto' to the CPU; the worker asks for cuda itself anyway
    env.pop("LOHAN_CRASH_AT", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_free_port()), str(WORKER), str(spec_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    for r, rep in enumerate(ranks):
        own = str(rep["local_rank"])
        assert rep["local_rank"] == r and rep["current_device"] == r, rep
        assert rep["engine_device"] == f"cuda:{r}", rep
        assert rep["max_allocated"][own] > 0, f"rank {r} allocated nothing on GPU {r}: {rep['max_allocated']}"
        others = {i: v for i, v in rep["max_allocated"].items() if i != own and v > 0}
        assert not others, f"rank {r} allocated on other GPUs (peak bytes by index): {others}"
        assert all(v == 0 for i, v in rep["allocated"].items() if i != own), rep["allocated"]
        if rep["contexts"] is None:
            print(f"rank {r}: nvidia-smi does not list this container's processes; contexts not checked")
            continue
        assert len(rep["contexts"]) == 1, f"rank {r} holds CUDA contexts on {len(rep['contexts'])} GPUs: {rep}"
        if UUID.fullmatch(rep["uuids"][own]):
            assert rep["contexts"] == [rep["uuids"][own]], f"rank {r}'s context is not on GPU {r}: {rep}"

    print(f"peak bytes allocated per rank on its own GPU: {[rep['max_allocated'][str(r)] for r, rep in enumerate(ranks)]}")
    assert ranks[0]["losses"] == ranks[1]["losses"], (ranks[0]["losses"], ranks[1]["losses"])

    # one process on one GPU, two micro-batches: the same training
    cfg = EngineConfig(**{**engine, "nvme": (str(tmp_path / "one"),), "betas": tuple(engine["betas"]),
                          "micro_batches": 2, "device": "cuda"})
    sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
    from dp_worker import batches

    with sdpa_kernel(SDPBackend.MATH), lohan.init(get_model_config("tiny", **MODEL), cfg) as e:
        one = [e.step(b) for b in batches(STEPS, 4, MODEL["seq_len"], MODEL["vocab_size"])]
    assert ranks[0]["losses"] == pytest.approx(one, rel=1e-6), (ranks[0]["losses"], one)
