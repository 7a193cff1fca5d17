"""State store: commit semantics under a crash mid-step, bounded memory, refusing to clobber data."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

import lohan
import lohan.runtime.offload
from lohan.config import EngineConfig, get_model_config
from lohan.plan.pools import MemoryPlanError
from lohan.store.states import StateStore


def small_model(**kw):
    base = dict(vocab_size=256, n_layer=3, d_model=64, n_head=4, seq_len=32)
    base.update(kw)
    return get_model_config("tiny", **base)


def ecfg(dirs, **kw):
    base = dict(nvme=tuple(dirs), cpu_mem="256MiB", compute_dtype="fp32", backend="threads", lr=1e-2)
    base.update(kw)
    return EngineConfig(**base)


def batch(seed=0):
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def test_crash_mid_step_leaves_last_commit_intact(make_dirs, monkeypatch):
    dirs = make_dirs(2)
    with lohan.init(small_model(), ecfg(dirs)) as engine:
        engine.step(batch(0))
        engine.step(batch(1))
        before = engine.state_dict_fp32()
        fail_on_call(monkeypatch, 3)  # the process "dies" after two blocks were updated and written
        with pytest.raises(RuntimeError, match="optimizer pipeline failed"):
            engine.step(batch(2))
    store = StateStore.open(dirs, backend="threads")
    try:
        assert store.step == 2
        for b in store.layout.blocks:
            for spec, t in zip(b.params, store.read_params(b.index)):
                assert torch.equal(t, before[f"{b.name}.{spec.name}"]), f"{b.name}.{spec.name} changed"
    finally:
        store.close()
    monkeypatch.undo()
    # and training continues from there exactly as if the failed step never happened
    with lohan.init(small_model(), ecfg(dirs), resume=True) as engine:
        assert engine.step_count == 2
        engine.step(batch(2))
        assert engine.step_count == 3


def fail_on_call(monkeypatch, n: int) -> None:
    """Make the n-th AdamW block update (1-based) raise, as a crash in the optimizer would (whichever update
    function the pipeline calls: fp32 gradients, or bf16 / clipped ones through the upcast scratch)."""
    calls = []

    def failing(real):
        def update(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise OSError("simulated failure")
            return real(*args, **kwargs)
        return update

    for name in ("adamw_block_", "adamw_chunk_", "adamw_upcast_"):
        monkeypatch.setattr(lohan.runtime.offload, name, failing(getattr(lohan.runtime.offload, name)))


def test_in_place_store_detects_interrupted_step(make_dirs, monkeypatch):
    dirs = make_dirs(1)
    with lohan.init(small_model(), ecfg(dirs, slots=1)) as engine:
        engine.step(batch(0))
        fail_on_call(monkeypatch, 1)  # before any block was rewritten: the states are intact
        with pytest.raises(RuntimeError):
            engine.step(batch(1))
        monkeypatch.undo()
        engine.step(batch(1))
        fail_on_call(monkeypatch, 2)  # after the head was rewritten in place: mixed states
        with pytest.raises(RuntimeError, match="optimizer pipeline failed"):
            engine.step(batch(2))
        with pytest.raises(RuntimeError, match="mixed"):
            engine.step(batch(2))
    with pytest.raises(RuntimeError, match="in place.*checkpoint"):
        StateStore.open(dirs, backend="threads")


def test_block_by_block_init_stays_within_memory(make_dirs):
    """~40M parameters = ~640 MB of states: initialization must not hold them all in memory."""
    mcfg = small_model(n_layer=12, d_model=512, n_head=8)
    states = 16 * mcfg.param_count()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    peak = [rss0]

    def progress(done, total):
        peak.append(proc.memory_info().rss)

    with lohan.init(mcfg, ecfg(make_dirs(1), cpu_mem="1GiB", slots=1), progress=progress) as engine:
        assert engine.store.layout.param_count == mcfg.param_count()
    assert max(peak) - rss0 < states / 3, f"init grew RSS by {(max(peak) - rss0) / 2**20:.0f} MiB"


def test_resident_blocks_are_bounded_and_reported(make_dirs):
    with lohan.init(small_model(n_layer=6), ecfg(make_dirs(1), prefetch_depth=1)) as engine:
        engine.step(batch())
        # current + 1 prefetched + 1 kept over the forward/backward turn + the tied embedding
        assert 2 <= engine.last_stats.max_resident_blocks <= 2 * 1 + 1 + 1
        assert engine.streamer.resident == []


def test_memory_budget_too_small_is_refused_before_writing(make_dirs):
    dirs = make_dirs(1)
    with pytest.raises(MemoryPlanError, match="Raise cpu_mem to at least"):
        lohan.init(small_model(), ecfg(dirs, cpu_mem="64KiB"))
    assert os.listdir(dirs[0]) == []


def test_existing_store_is_not_overwritten_silently(make_dirs):
    dirs = make_dirs(1)
    with lohan.init(small_model(), ecfg(dirs)) as engine:
        engine.step(batch())
    with pytest.raises(FileExistsError, match="resume=True.*overwrite=True"):
        lohan.init(small_model(), ecfg(dirs))
    with pytest.raises(ValueError, match="another model"):
        lohan.init(small_model(d_model=128), ecfg(dirs), resume=True)
    with lohan.init(small_model(), ecfg(dirs), resume=True) as engine:
        assert engine.step_count == 1
    with lohan.init(small_model(), ecfg(dirs), overwrite=True) as engine:
        assert engine.step_count == 0


def test_bad_batches_are_rejected(make_dirs):
    with lohan.init(small_model(), ecfg(make_dirs(1), micro_batches=2)) as engine:
        idx, tgt = batch()
        with pytest.raises(ValueError, match="equal shape"):
            engine.step((idx, tgt[:, :-1]))
        with pytest.raises(ValueError, match="divisible by micro_batches=2"):
            engine.step((idx[:1], tgt[:1]))
        engine.step((idx, tgt))  # still usable afterwards
        assert engine.step_count == 1


def test_error_inside_the_step_does_not_hang_and_leaves_the_commit(make_dirs):
    """A failure in forward (token id past the vocabulary) must surface, not deadlock the optimizer worker."""
    dirs = make_dirs(1)
    for mode in ("optimized", "naive", "serial"):
        with lohan.init(small_model(), ecfg(dirs, mode=mode), overwrite=True) as engine:
            engine.step(batch())
            idx, tgt = batch()
            idx[0, 0] = 10_000
            with pytest.raises(IndexError):
                engine.step((idx, tgt))
            assert engine.step_count == 1
            engine.step(batch(1))  # the engine is still usable
            assert engine.step_count == 2


def test_init_from_an_initialized_model_uses_its_weights(make_dirs):
    from lohan.models.gpt import build_model

    model = build_model(small_model(), device="cpu", seed=77)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with lohan.init(model, ecfg(make_dirs(1))) as engine:
        got = engine.state_dict_fp32()
    assert all(p.is_meta for p in model.parameters()), "the caller's copy is released to the meta device"
    for name, t in got.items():
        block, _, rest = name.partition(".")
        ref = expected[f"blocks.{block[5:]}.{rest}" if block.startswith("block") else name]
        assert torch.equal(t, ref), name


def test_records_bigger_than_the_staging_budget_are_written_in_pieces(make_dirs):
    """A block whose record exceeds the staging budget is initialized section by section in pieces
    (how a 175B layer initializes in a few GB); the bytes on disk equal a whole-record write."""
    from lohan.models.adapter import GPTBlocks
    from lohan.models.gpt import build_model
    from lohan.store.states import RecordView, plan_layout

    mcfg = small_model(d_model=96, n_head=4)
    model = build_model(mcfg, device="cpu", seed=3)
    program = GPTBlocks(model)
    layout = plan_layout(program.modules, program.names, "bf16", 1)

    def init_block(i):
        return [p.detach().clone() for p in program.modules[i].parameters()]

    stores = []
    for budget, name in ((1 << 30, "whole"), (3 * 4096 * 4, "pieces")):
        store = StateStore.create(make_dirs(1, name), layout, {"m": 1}, init_block, staging_budget=budget,
                                  backend="threads", name=name)
        raw = torch.empty(layout.slot_bytes, dtype=torch.uint8)
        store.volume.read_into(raw, 0).wait()
        stores.append(raw)
        store.close()
    assert max(b.record_bytes for b in layout.blocks) > 3 * 4096 * 4  # the pieces path was taken
    for b in layout.blocks:  # every section equal (the padding between sections is not data)
        whole, pieces = (RecordView(raw[b.offset:b.offset + b.record_bytes], b, torch.bfloat16) for raw in stores)
        for section in ("p32", "m", "v", "p16"):
            assert torch.equal(getattr(whole, section), getattr(pieces, section)), (b.name, section)
        assert torch.equal(whole.p32, torch.cat([p.reshape(-1) for p in init_block(b.index)]))

