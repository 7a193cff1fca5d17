"""One rank of a data-parallel engine run, for tests/integration/test_parallel.py (launched there like torchrun does: RANK,
WORLD_SIZE, MASTER_ADDR/PORT in the environment). `python dp_worker.py SPEC.json`: trains `steps` steps of
the batches of `batches()` (resuming when asked, from the committed step), then rank 0 saves the losses and
the fp32 weights (`state_dict_fp32`, gathered from every rank) to `out`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys

import torch
import torch.distributed as dist

import lohan
from lohan.config import EngineConfig, get_model_config
from lohan.runtime.parallel import leave_group


def batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 120)))
    mcfg = get_model_config("tiny", **spec["model"])
    cfg = EngineConfig(**{**spec["engine"], "nvme": tuple(spec["engine"]["nvme"])})
    data = list(batches(spec["steps"], spec["batch"], mcfg.seq_len, mcfg.vocab_size))
    losses = []
    with lohan.init(mcfg, cfg, resume=spec.get("resume", False)) as engine:
        start = engine.step_count
        for s in range(start, spec["steps"]):
            nxt = data[s + 1] if spec.get("next_batch") and s + 1 < spec["steps"] else None
            losses.append(engine.step(data[s], next_batch=nxt))
        metrics = engine.last_stats
        if hasattr(engine, "lora"):  # a LoRA run (tests/unit/runtime/test_lora.py): its adapters are what trains
            eval_loss = engine.evaluate(data[0])
            adapters = [p.detach().cpu() for p in engine.lora.params]
            if dist.get_rank() == 0:
                torch.save({"losses": losses, "adapters": adapters, "start": start, "eval": eval_loss}, spec["out"])
            leave_group(True)
            return
        # what this rank's host pools were budgeted and took (tests/unit/plan/test_memory_model.py)
        scratch = engine.offloader._upcast
        memory = {"plan": dataclasses.asdict(engine.host_memory),
                  "pools": {name: getattr(engine, name).stats() for name in ("params_pool", "grads_pool", "records_pool")},
                  "upcast": 0 if scratch is None else scratch.numel() * scratch.element_size()}
        eval_loss = engine.evaluate(data[0])
        weights = engine.state_dict_fp32()
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "weights": weights, "start": start, "eval": eval_loss,
                    "lanes": metrics.lanes, "tokens": metrics.tokens,
                    "network_bytes": metrics.network_bytes, "memory": memory}, spec["out"])
    leave_group(True)


if __name__ == "__main__":
    main(sys.argv[1])
