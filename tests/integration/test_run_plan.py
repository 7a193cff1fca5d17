"""One RunPlan (issue 40): the pre-flight, the dry run and the engine price memory from the same inputs.

The dry run rebuilt the engine's settings from a dozen keyword arguments that dropped ``max_inflight_blocks``,
``opt_chunk_bytes`` and ``mode``: a serial 125m run with ``max_inflight_blocks=8`` was priced "cpu 4.31 GB of
22.75 GB ok" and then refused by the engine ("the engine needs 5.09 GiB"). Here the run driver's own planning
stage (`preflight.plan_fit`, on a tiny preset) is checked against the engine over a grid of mode x max_inflight_blocks x
opt_chunk_bytes x resident records x clipping x state format x world size: the pools the dry run prices are the
pools the engine allocates, and the dry run refuses a cpu_mem exactly when the engine does, in the same words.
A rank of two is planned and opened with a `DataParallel` of this process (no processes, no store: the engine
is stopped where it would open its directories).
"""

from __future__ import annotations

import functools
import itertools
import os
import re

import psutil
import pytest
from rich.console import Console

import lohan
from lohan.app import preflight
from lohan.app.fit import detect_hardware
from lohan.app.train import _plan, _preflight
from lohan.config import EngineConfig, RunConfig, get_model_config
from lohan.plan.pools import MemoryPlanError
from lohan.runtime import engine as engine_module
from lohan.runtime.engine import Engine, preset_program
from lohan.runtime.parallel import DataParallel

MODEL = dict(vocab_size=512, n_layer=2, d_model=64, n_head=4, seq_len=32)
FREE = 64 << 30  # the machine's available memory, as the pre-flight and the engine see it (auto rooms)
MODES = ("serial", "naive", "optimized")
INFLIGHT = (1, 8)
CHUNKS = (64 << 10, 512 << 20)  # 64 KiB: every record updated in chunks of 4096 elements
RESIDENT = (True, False)
CLIPS = (0.0, 1.0)
FORMATS = ("exact", "bf16-moments")


class Stopped(Exception):
    """The engine got past its memory plan and would open its directories now."""


@pytest.fixture
def machine(monkeypatch):
    """This machine with FREE bytes available, detected once for the module's runs."""
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=FREE))
    monkeypatch.setattr(preflight, "detect_hardware", functools.lru_cache(maxsize=None)(detect_hardware))


def settings(dirs, mode="optimized", inflight=3, chunk=512 << 20, resident=True, clip=0.0, fmt="exact",
             cpu_mem=256 << 20) -> EngineConfig:
    return EngineConfig(nvme=tuple(dirs), cpu_mem=cpu_mem, backend="threads", compute_dtype="fp32", device="cpu",
                        mode=mode, max_inflight_blocks=inflight, opt_chunk_bytes=chunk, resident_records=resident,
                        max_grad_norm=clip, state_format=fmt, total_steps=2, seed=5, heap_reuse=False)


def dry_run(ecfg: EngineConfig, dp: DataParallel | None = None):
    """What `finetune.py --dry-run` plans for the tiny preset with `ecfg`: (its report, the run plan)."""
    run = RunConfig(model="tiny", model_overrides=MODEL, data="synthetic", steps=2, batch_size=4, seq_len=32,
                    engine=ecfg)
    ctx = _preflight(run, True, None, None, None, Console(quiet=True), dp)
    report = _plan(ctx, None, True)
    return report, ctx.run_plan


def pool_parts(report) -> dict[str, int]:
    """The engine's pools among the dry run's main-memory parts (the rest: activations, the device's share)."""
    keys = ("params", "grads", "optimizer", "resident", "grad_stash", "readahead")
    return {k: v for k, v in report.capacity.cpu_parts.items() if k in keys and (v or k != "resident")}


def pairwise(*values: tuple) -> list[tuple]:
    """A small set of combinations in which every pair of values of any two factors appears (greedy)."""
    want = {(i, a, j, b) for i, j in itertools.combinations(range(len(values)), 2)
            for a in values[i] for b in values[j]}
    rows: list[tuple] = []
    candidates = list(itertools.product(*values))
    while want:
        best = max(candidates, key=lambda c: sum((i, c[i], j, c[j]) in want
                                                 for i, j in itertools.combinations(range(len(c)), 2)))
        rows.append(best)
        want -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
    return rows


GRID = pairwise(MODES, INFLIGHT, CHUNKS, RESIDENT, CLIPS, FORMATS)


def test_the_grid_covers_every_pair():
    assert 6 <= len(GRID) <= 12
    values = (MODES, INFLIGHT, CHUNKS, RESIDENT, CLIPS, FORMATS)
    for i, j in itertools.combinations(range(len(values)), 2):
        assert {(c[i], c[j]) for c in GRID} == set(itertools.product(values[i], values[j])), (i, j)


@pytest.mark.parametrize("mode,inflight,chunk,resident,clip,fmt", GRID)
def test_the_dry_run_prices_the_pools_the_engine_allocates(machine, make_dirs, mode, inflight, chunk, resident,
                                                           clip, fmt):
    ecfg = settings(make_dirs(1), mode, inflight, chunk, resident, clip, fmt)
    report, plan = dry_run(ecfg)
    assert report.fits, report.format()
    with lohan.init(get_model_config("tiny", **MODEL), ecfg) as engine:  # planned by itself, from the same inputs
        assert engine.run_plan == plan
        assert pool_parts(report) == {k: v for k, v in engine.memory_plan.items() if v or k != "resident"}
        allocated = {"params": engine.params_pool.budget_bytes, "grads": engine.grads_pool.budget_bytes,
                     "records": engine.records_pool.budget_bytes}
        assert allocated == plan.pools()
        assert tuple(engine.offloader.resident) == plan.resident_blocks
        assert engine.store.chunk_elems == plan.chunk_elems
        assert (engine.stash is not None) == plan.stash


def _engine_verdict(ecfg: EngineConfig, dp: DataParallel | None, monkeypatch) -> str | None:
    """The engine's refusal of `ecfg` (None: it would open the store), stopped before anything is written."""
    def stop(*args, **kwargs):
        raise Stopped
    monkeypatch.setattr(engine_module, "_open_store", stop)
    program = preset_program(get_model_config("tiny", **MODEL))
    try:
        Engine(program, ecfg, {}, lambda i: [], dp=dp)
    except MemoryPlanError as err:
        return str(err)
    except Stopped:
        return None
    raise AssertionError("the engine neither refused nor went on to open its store")


@pytest.mark.parametrize("world", (1, 2))
def test_the_dry_run_refuses_exactly_when_the_engine_does(machine, make_dirs, monkeypatch, world):
    """At the least cpu_mem the dry run accepts, and a byte below it, for every combination of the grid's factors:
    the engine accepts and refuses the same, with the dry run's words; a rank of two plans its own shards."""
    dp = DataParallel(rank=0, world=2, local_rank=0, local_world=2) if world == 2 else None
    dirs = make_dirs(1)
    for case in itertools.product(MODES, INFLIGHT, CHUNKS, RESIDENT, CLIPS, FORMATS):
        tight = settings(dirs, *case, cpu_mem=64 << 10)
        _, plan = dry_run(tight, dp)
        assert plan.refusal is not None and plan.world == world, case
        need = plan.host.total * (2 if dp else 1)  # (two ranks on this machine share cpu_mem)
        for cpu_mem in (need - (2 if dp else 1), need):
            ecfg = tight.with_overrides(cpu_mem=cpu_mem)
            report, plan = dry_run(ecfg, dp)
            refusal = _engine_verdict(ecfg, dp, monkeypatch)
            assert (refusal is None) == (cpu_mem == need), (case, cpu_mem, refusal)
            assert plan.refusal == refusal, case
            assert report.fits == (refusal is None), (case, report.capacity.reasons)
            if refusal is not None:
                assert report.capacity.reasons[0] == refusal, case
    assert os.listdir(dirs[0]) == []  # nothing was written


def test_a_ranks_dry_run_prices_its_own_pools(machine, make_dirs):
    """Data parallel: the plan printed is one rank's, of its shards with fp32 gradients (summed over the ranks)
    and its share of cpu_mem, as its engine allocates them, not the whole model's."""
    dp = DataParallel(rank=0, world=2, local_rank=0, local_world=2)
    ecfg = settings(make_dirs(1), clip=1.0)
    report, plan = dry_run(ecfg, dp)
    one, _ = dry_run(ecfg)
    assert plan.world == 2 and plan.host.grad_itemsize == 4 and plan.host.budget == ecfg.cpu_mem // 2
    assert pool_parts(report) == {k: v for k, v in plan.host.parts().items() if v or k != "resident"}
    assert pool_parts(report) != pool_parts(one)


def test_the_run_is_handed_the_plan_its_dry_run_printed(machine, make_dirs, monkeypatch):
    """The real run's engine executes the pre-flight's plan (its figures, not a second plan made later)."""
    handed = []
    real = Engine.__init__

    def spy(self, *args, **kwargs):
        handed.append(kwargs.get("plan"))
        real(self, *args, **kwargs)
    monkeypatch.setattr(Engine, "__init__", spy)
    dirs = make_dirs(1)
    from lohan.app.cli import main

    args = ["--model", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "32", "--steps", "1",
            "--backend", "threads", "--compute-dtype", "fp32", "--device", "cpu", "--nvme", dirs[0],
            "--set", "model_overrides.n_layer=2", "--set", "engine.max_inflight_blocks=8", "--mode", "serial"]
    assert main(args) == 0
    assert len(handed) == 1 and handed[0] is not None and handed[0].engine.max_inflight_blocks == 8


def test_a_dry_run_prices_max_inflight_blocks_and_mode_as_the_run_refuses_them(make_dirs, capsys):
    """The issue's reproduction, on the tiny preset: serial mode with max_inflight_blocks=8 needs more cpu_mem than
    the defaults; the dry run says so in the words the run refuses with, and nothing is written."""
    from lohan.app.cli import main

    dirs = make_dirs(1)
    base = ["--model", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "32", "--steps", "1",
            "--backend", "threads", "--compute-dtype", "fp32", "--device", "cpu", "--nvme", dirs[0],
            "--set", "model_overrides.n_layer=2", "--mode", "serial", "--set", "engine.max_inflight_blocks=8",
            "--set", "engine.resident_mem=0", "--cpu-mem", "3MiB"]
    assert main(base + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "cpu_mem=3.00 MiB is too small for this model" in out
    # the cpu row judges the need against cpu_mem too, not only against the machine's RAM (which holds it)
    assert re.search(r"^  cpu .* over cpu_mem \(", out, re.M), out
    said = next(line.strip()[2:] for line in out.splitlines() if "cpu_mem=3.00 MiB is too small" in line)
    assert main(base) == 2
    err = capsys.readouterr().out
    assert f"error: {said}" in " ".join(err.split())
    assert os.listdir(dirs[0]) == []
