"""Data parallelism (lohan/runtime/parallel.py): N ranks on gloo over loopback, launched as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR/PORT), each a `tests/integration/dp_worker.py` process.

Exactness: two ranks on a global batch B equal one process with batch B and micro_batches=2 bit for bit
(fp32, every offloading mode, clipping on), because the one-process engine sums the two micro-batches'
gradients as g0 + g1 and the all-reduce of two ranks computes the same sum. Both sides run one intra-op
thread (torchrun's default): the reductions inside autograd depend on the thread count. Three ranks sum
three gradients in gloo's order, which may differ from ((g0 + g1) + g2): see `test_three_ranks...`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import lohan
from lohan.app.fit import Machine, data_parallel_machine
from lohan.config import EngineConfig, get_model_config
from lohan.models.adapter import GPTBlocks
from lohan.models.gpt import build_model
from lohan.plan.planner import Hardware
from lohan.runtime.parallel import (
    SHARD_ALIGN,
    network_bytes_per_step,
    read_decision,
    shard_bounds,
    shard_layout,
)
from lohan.store.states import BlockLayout, ParamSpec, StoreLayout, plan_layout

sys.path.insert(0, os.path.dirname(__file__))
from dp_worker import batches  # noqa: E402

WORKER = Path(__file__).with_name("dp_worker.py")
MODEL = dict(vocab_size=256, n_layer=2, d_model=64, n_head=4, seq_len=32)
STEPS = 6


def engine_kw(nvme: str, **kw) -> dict:
    base = dict(nvme=[nvme], cpu_mem=512 << 20, compute_dtype="fp32", lr=1e-2, warmup_steps=3, total_steps=STEPS,
                weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, seed=5, backend="threads", max_grad_norm=1.0)
    base.update(kw)
    return base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, world: int, engine: dict, steps: int = STEPS, batch: int = 4, resume: bool = False,
           next_batch: bool = False, crash: dict[int, str] | None = None, tag: str = "run") -> tuple[list[int], str]:
    """Run `world` worker processes; when one fails the others are killed (as torchrun does). Returns the
    exit codes and the workers' stderr."""
    spec = dict(model=MODEL, engine=engine, steps=steps, batch=batch, resume=resume, next_batch=next_batch,
                out=str(tmp / f"{tag}.pt"), timeout=60)
    path = tmp / f"{tag}.json"
    path.write_text(json.dumps(spec))
    port = _free_port()
    procs, logs = [], []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", LOHAN_DEVICE="cpu")
        env.pop("LOHAN_CRASH_AT", None)
        if crash and r in crash:
            env["LOHAN_CRASH_AT"] = crash[r]
        log = open(tmp / f"{tag}.rank{r}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(path)], env=env, stdout=log, stderr=log))
    deadline = time.monotonic() + 300
    while [p.poll() for p in procs].count(None):  # (poll every process: returncode is set by poll)
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    out = ""
    for log in logs:
        log.seek(0)
        out += log.read()
        log.close()
    return [p.returncode for p in procs], out


def single_process(nvme: str, engine: dict, steps: int = STEPS, batch: int = 4, micro_batches: int = 2,
                   evaluate: bool = False):
    """One process, micro_batches = the ranks' count, one intra-op thread: losses and fp32 weights (and the
    evaluation loss of the first batch after training, as the workers take it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = EngineConfig(**{**engine, "nvme": (nvme,), "betas": tuple(engine["betas"]), "micro_batches": micro_batches})
        with lohan.init(get_model_config("tiny", **MODEL), cfg) as e:
            data = list(batches(steps, batch, MODEL["seq_len"], MODEL["vocab_size"]))
            losses = [e.step(b) for b in data]
            out = (losses, e.state_dict_fp32())
            return (*out, e.evaluate(data[0])) if evaluate else out
    finally:
        torch.set_num_threads(threads)


def assert_same(result: dict, losses: list[float], weights: dict) -> None:
    assert result["losses"] == losses
    bad = [k for k in weights if not torch.equal(weights[k], result["weights"][k])]
    assert not bad, f"weights differ: {bad}"


# --------------------------------------------------------------- layout
def _block(sizes: list[int]) -> BlockLayout:
    specs, off = [], 0
    for k, n in enumerate(sizes):
        specs.append(ParamSpec(f"p{k}", (n,), off, n))
        off += n
    return BlockLayout(0, "b", tuple(specs), off, 2, 0)


def test_shards_cover_each_block_once_aligned_and_small_blocks_are_replicated():
    block = _block([40960, 64, 24576, 128])
    for world in (2, 3, 4):
        bounds = shard_bounds(block, world)
        assert bounds is not None and bounds[0] == 0 and bounds[-1] == block.numel
        assert all(b % SHARD_ALIGN == 0 for b in bounds[:-1]) and all(a < b for a, b in zip(bounds, bounds[1:]))
        full = StoreLayout((block,), "bf16", 2)
        pieces = [shard_layout(full, [bounds], r).blocks[0] for r in range(world)]
        assert sum(p.numel for p in pieces) == block.numel
        for r, p in enumerate(pieces):  # pieces tile the shard, and name where they come from
            assert sum(s.numel for s in p.params) == p.numel == bounds[r + 1] - bounds[r]
            assert all(s.name.split("[")[0] in {"p0", "p1", "p2", "p3"} for s in p.params)
    assert shard_bounds(_block([1000]), 2) is None  # too small for two non-empty shards
    assert shard_bounds(block, 1) is None
    # a cut off a parameter's 64-element grid would change fused AdamW's rounding: replicated instead
    assert shard_bounds(_block([33, 40960]), 2) is None
    # 8-bit moments: a cut on the 64 grid but off a parameter's 256 grid would split a quantization block
    off256 = _block([64, 40960])
    assert shard_bounds(off256, 2) is not None
    assert shard_bounds(replace(off256, fmt="8bit-moments"), 2) is None
    assert shard_bounds(replace(_block([256, 40960]), fmt="8bit-moments"), 2) is not None
    sharded = shard_layout(StoreLayout((replace(block, fmt="bf16-master"),), "bf16", 2), [shard_bounds(block, 2)], 1)
    assert sharded.state_format == "bf16-master"  # a rank's store keeps the format


def test_one_ranks_plan_prices_its_share_of_the_machine():
    """fit_report of the whole model on `data_parallel_machine` prices one rank: 1/N of the states' traffic and
    AdamW work over 1/L of the machine's SSDs, CPU and RAM (L ranks per machine)."""
    hw = Hardware("box", thp_g=1e12, bw_g=1e10, bw_s2m=4e9, bw_m2s=3e9, mem_avail=2**34, ram=2**36,
                  ssd_bytes=10**12, cpu_adam_params_per_s=1e9)
    one = data_parallel_machine(Machine(hw, ()), 4, 4).hardware  # one machine, 4 GPUs: SSDs shared 4 ways
    assert (one.bw_s2m, one.bw_m2s, one.ssd_bytes, one.cpu_adam_params_per_s) == (4e9, 3e9, 10**12, 1e9)
    assert (one.ram, one.mem_avail, one.thp_g) == (2**34, 2**32, 1e12)
    two = data_parallel_machine(Machine(hw, (), device_is_host=True), 4, 2).hardware  # 2 machines x 2 ranks
    assert (two.bw_s2m, two.cpu_adam_params_per_s, two.ram, two.thp_g) == (8e9, 2e9, 2**35, 5e11)
    assert data_parallel_machine(Machine(hw, ()), 1, 1).hardware == hw
    p = 10**9  # 2 ranks: 4 bytes (fp32 gradient, all-reduced) + 2 bytes (bf16 P16, gathered twice) per parameter
    assert network_bytes_per_step(p, 2, 2) == 6 * p and network_bytes_per_step(p, 1, 2) == 0


# --------------------------------------------------------------- a rank's GPU
@pytest.fixture
def launched(monkeypatch):
    """torchrun's environment for local rank 1 of 2 on a machine with 2 (fake) GPUs; records, in order, the
    device set and the group joined (nothing real is touched)."""
    import lohan.runtime.parallel as parallel

    calls: list[tuple[str, object]] = []
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOHAN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend: calls.append(("join", backend)))
    return calls


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_a_rank_takes_its_local_gpu_before_joining_the_group(launched, device):
    from lohan.runtime.parallel import init_from_env

    assert init_from_env(device) is True
    assert launched == [("set_device", 1), ("join", "gloo")]  # before anything (the hardware probe) uses CUDA


def test_a_cpu_run_and_an_unlaunched_process_select_no_gpu(launched, monkeypatch):
    from lohan.runtime.parallel import init_from_env, select_local_device

    assert init_from_env() is True and launched == [("join", "gloo")]  # the default: the CPU
    monkeypatch.delenv("LOCAL_RANK")
    assert select_local_device("cuda") is None and launched == [("join", "gloo")]


def test_local_cuda_index_maps_ranks_to_gpus_and_says_how_to_fix_too_many():
    from lohan.runtime.parallel import local_cuda_index

    assert [local_cuda_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert local_cuda_index(3, 1) == 0  # one visible GPU (CUDA_VISIBLE_DEVICES per rank, or shared)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but torch sees 2 CUDA devices.*--nproc-per-node 2"):
        local_cuda_index(2, 2)
    with pytest.raises(ValueError, match="no CUDA device"):
        local_cuda_index(0, 0)


# --------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", ["serial", "naive", "optimized"])
def test_two_ranks_equal_one_process_with_two_micro_batches(tmp_path, mode):
    engine = engine_kw(str(tmp_path / "dp"), mode=mode)
    codes, out = launch(tmp_path, 2, engine)
    assert codes == [0, 0], out
    result = torch.load(tmp_path / "run.pt")
    losses, weights, eval_loss = single_process(str(tmp_path / "one"), engine, evaluate=True)
    assert_same(result, losses, weights)
    assert result["eval"] == eval_loss  # evaluate: each rank its slice, the mean over both
    assert result["tokens"] == 4 * MODEL["seq_len"]  # metrics count the global batch
    assert {"gather", "reduce_wait"} <= set(result["lanes"])
    # the cost model's network bytes: every block gathered in forward and backward; blocks that stay resident
    # across the turn (the last layers, the tied embedding) are gathered once, and small ones never
    model = network_bytes_per_step(sum(w.numel() for w in weights.values()), 2, 4)
    assert 0.6 * model <= result["network_bytes"] <= model


@pytest.mark.parametrize("fmt", ["bf16-moments", "8bit-moments", "bf16-master"])
def test_two_ranks_in_a_compressed_state_format_equal_one_process(tmp_path, monkeypatch, fmt):
    """Each rank keeps its shards' states in the format (8-bit moments: shards cut only on the 256 grid of each
    parameter, so no quantization block is split; blocks that cannot be cut so are replicated); bf16-master's
    rounding noise is indexed in the whole block, so the ranks round as one process does."""
    engine = engine_kw(str(tmp_path / "dp"), state_format=fmt, max_grad_norm=0.5,
                       compute_dtype="bf16" if fmt == "bf16-master" else "fp32")
    if fmt != "bf16-moments":  # a model whose parameters start on the 256 grid, so its layers are sharded
        model = {**MODEL, "d_model": 256, "n_layer": 1}
        monkeypatch.setattr(sys.modules[__name__], "MODEL", model)
        program = GPTBlocks(build_model(get_model_config("tiny", **model), device="meta"))
        layout = plan_layout(program.modules, program.names, "bf16", 2, fmt)
        assert any(shard_bounds(b, 2) for b in layout.blocks)
    codes, out = launch(tmp_path, 2, engine)
    assert codes == [0, 0], out
    assert_same(torch.load(tmp_path / "run.pt"), *single_process(str(tmp_path / "one"), engine))


def test_two_ranks_deferred_updates_with_the_next_forward_beside_them(tmp_path):
    """Clipping deferred to the end of backward, the next step's forward run during the optimizer pass on
    the blocks it provides (each rank provides its shard; the forward gathers them)."""
    engine = engine_kw(str(tmp_path / "dp"), clip_mode="defer", max_grad_norm=0.5)
    codes, out = launch(tmp_path, 2, engine, next_batch=True)
    assert codes == [0, 0], out
    assert_same(torch.load(tmp_path / "run.pt"), *single_process(str(tmp_path / "one"), engine))


def test_three_ranks_match_within_reduction_order_tolerance(tmp_path):
    """Three ranks sum three gradients in gloo's order; one process sums (g0 + g1) + g2. The sums differ by
    a rounding (|error| <= 2 x 2^-24 x (|g0| + |g1| + |g2|) per element). AdamW divides by sqrt(v), so where
    a gradient nearly cancels out the rounding can move that element's update by up to its size (lr per
    step); elsewhere it stays at fp32 resolution. Bounds, in units of the largest possible change
    (lr x steps): the worst element within 1e-2, the mean within 1e-5 (measured here: 5e-4 and 2e-7). A
    rank's gradient lost or counted twice moves most elements by ~1 of that unit. Losses agree to 1e-6."""
    lr, steps = 1e-2, 4
    engine = engine_kw(str(tmp_path / "dp"), max_grad_norm=0.0, lr=lr)
    codes, out = launch(tmp_path, 3, engine, steps=steps, batch=6)
    assert codes == [0, 0, 0], out
    result = torch.load(tmp_path / "run.pt")
    losses, weights = single_process(str(tmp_path / "one"), engine, steps=steps, batch=6, micro_batches=3)
    assert result["losses"] == pytest.approx(losses, rel=1e-6)
    diffs = torch.cat([(result["weights"][k] - w).abs().reshape(-1) for k, w in weights.items()]) / (lr * steps)
    print(f"3 ranks vs one process, in units of lr x steps: worst {float(diffs.max()):.2e}, "
          f"mean {float(diffs.mean()):.2e}")
    assert 0 < float(diffs.max()) <= 1e-2  # (0 would mean the three-way sums were not exercised)
    assert float(diffs.mean()) <= 1e-5


# --------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("crash", [
    {1: "engine.dp_local_commit:3"},    # rank 1 committed step 3 locally, the group had not decided it
    {0: "json.rename:lohan.dp.json:3"},  # rank 0 dies writing the decision of step 2 (the 3rd, after step 0's)
    {1: "engine.backward:9"},            # rank 1 dies inside a backward
])
def test_a_killed_rank_resumes_bit_identically(tmp_path, crash):
    engine = engine_kw(str(tmp_path / "dp"))
    codes, _ = launch(tmp_path, 2, engine, crash=crash, tag="killed")
    assert any(c != 0 for c in codes)
    decided = read_decision([str(tmp_path / "dp")], "lohan")
    assert decided is not None and decided["world"] == 2 and decided["step"] < STEPS
    codes, out = launch(tmp_path, 2, engine, resume=True)
    assert codes == [0, 0], out
    result = torch.load(tmp_path / "run.pt")
    assert result["start"] == decided["step"]
    losses, weights = single_process(str(tmp_path / "one"), engine)
    assert_same(result, losses[decided["step"]:], weights)


def test_resume_with_another_world_size_is_refused(tmp_path):
    engine = engine_kw(str(tmp_path / "dp"))
    codes, out = launch(tmp_path, 2, engine, steps=2)
    assert codes == [0, 0], out
    codes, out = launch(tmp_path, 3, engine, steps=3, batch=6, resume=True, tag="three")
    assert all(c != 0 for c in codes)
    assert "run on 2 ranks, and this run has 3" in out
    assert read_decision([str(tmp_path / "dp")], "lohan") == {"world": 2, "step": 2}  # nothing was touched


# --------------------------------------------------------------- the CLI under torchrun
def test_torchrun_finetune_exports_what_one_process_with_two_micro_batches_exports(tmp_path):
    """`torchrun --nproc-per-node 2 finetune.py ...` with the same flags as one process with micro_batches=2
    (fp32, one intra-op thread each, as torchrun sets): the exported weights, and the checkpoint of step 2
    (--save-every 2), are the same bytes, rank 0 alone writes the metrics and the export, and each rank's store
    is under DIR/rank<r>."""
    from safetensors.torch import load_file

    def cli(nvme: Path, export: Path, extra: list[str]) -> list[str]:
        return ["finetune.py", "--config", "configs/tiny.yaml", "--nvme", str(nvme), "--steps", "3", "--batch-size",
                "4", "--seq-len", "64", "--export", str(export), "--set", "engine.compute_dtype=fp32",
                "--set", "engine.total_steps=3", "--set", "engine.cpu_mem=1GiB", "--save-every", "2", *extra]

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOHAN_DEVICE="cpu")
    env.pop("LOHAN_CRASH_AT", None)
    dp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-port", str(_free_port()), *cli(tmp_path / "dp", tmp_path / "dp-out", [])],
                        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert dp.returncode == 0, dp.stdout + dp.stderr
    assert dp.stdout.count("run summary") == 1  # rank 0 speaks for the group
    assert "data parallel: 2 ranks" in dp.stdout
    assert (tmp_path / "dp" / "rank0" / "lohan.store.json").exists()
    assert (tmp_path / "dp" / "rank1" / "lohan.store.json").exists()
    verify = subprocess.run([sys.executable, "finetune.py", "--config", "configs/tiny.yaml", "--nvme",
                             str(tmp_path / "dp"), "--verify"], cwd=root, env=env, capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stdout.count("match their checksums") == 2, verify.stdout
    # the metrics: one file (with the store: DIR/<name>.metrics.jsonl), one record per step, the group's tokens
    records = [json.loads(line) for line in (tmp_path / "dp" / "lohan.metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and {r["tokens"] for r in records} == {4 * 64}
    assert all(r["network_bytes"] > 0 for r in records)
    one = subprocess.run([sys.executable, *cli(tmp_path / "one", tmp_path / "one-out",
                                               ["--set", "engine.micro_batches=2"])],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stdout + one.stderr
    assert [r["step"] for r in records if "save_s" in r] == [2]
    for folder in ("", "step-2"):
        shards = sorted(p.name for p in (tmp_path / "one-out" / folder).glob("*.safetensors"))
        assert shards and shards == sorted(p.name for p in (tmp_path / "dp-out" / folder).glob("*.safetensors"))
        for name in shards:
            a, b = load_file(tmp_path / "one-out" / folder / name), load_file(tmp_path / "dp-out" / folder / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, name)
