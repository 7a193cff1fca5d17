"""Write-behind: a deferred pass that the next forward follows holds its writes back for the READs that forward
waits for, and its last writes and its commit complete during the next step's backward. The same bits as plain
PyTorch; a step is durable once the next one has begun (or at flush / close); a failed write of that tail drops
the step, never commits it."""

from __future__ import annotations

import json
import os
import time

import pytest

import lohan
import lohan.runtime.engine
from io_engine.faults import inject_faults
from lohan.runtime.engine import Engine
from lohan.runtime.offload import UpdatePass
from lohan.runtime.record_buffers import WriteBehind
from lohan.store.states import StateStore
from tests.unit.runtime.test_clipping import STEPS, batches, config, reference, same_weights, tiny_cfg


def _commit_on_disk(dirs) -> int:
    with open(os.path.join(dirs[0], "lohan.commit.json")) as f:
        return json.load(f)["step"]


@pytest.mark.parametrize("inflight,write_behind", [(1, True), (3, True), (1, False)])
def test_write_behind_is_bit_exact_with_small_pools(make_dirs, monkeypatch, inflight, write_behind):
    """Record and parameter pools far smaller than the model: held writes go out early to make room for
    READs, and the next backward reads parameters from the slot whose last writes are still in flight.
    (A pool of one record used to hang a deferred pass: the read ahead of its first block waited for a
    buffer only that pass could free.)"""
    waited, forced = [], []
    real_await, real_release = Engine._await_tail, UpdatePass.release_held

    def await_tail(self, slot, *block):
        waited.append(self.store.staged and slot == self.store.slot and not self.offloader.tail_done.is_set())
        return real_await(self, slot, *block)

    def release_held(self, *args, **kwargs):
        forced.append(self.gate.deferred is False)
        return real_release(self, *args, **kwargs)

    def retire(self, rbs):  # a slow disk: the next backward's reads come while the tail is in flight
        if rbs:
            time.sleep(0.1)
        return real_retire(self, rbs)

    real_retire = WriteBehind._retire
    monkeypatch.setattr(Engine, "_await_tail", await_tail)
    monkeypatch.setattr(UpdatePass, "release_held", release_held)
    monkeypatch.setattr(WriteBehind, "_retire", retire)
    mcfg = tiny_cfg(n_layer=6)
    ecfg = config(make_dirs(2), clip_mode="defer", prefetch_depth=1, max_inflight_blocks=inflight,
                  write_behind=write_behind, resident_mem=0)  # small pools: READs wait for the room
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    with lohan.init(mcfg, ecfg) as engine:
        assert engine.memory_plan["params"] < sum(b.p16_bytes for b in engine.layout.blocks)
        losses = []
        for k, batch in enumerate(data):
            losses.append(engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None))
            if k + 1 < len(data):  # staged: the next step's backward makes it durable
                assert engine.store.staged == write_behind
                assert engine.committed_step == engine.step_count - write_behind
        assert not engine.store.staged  # the last step had no next batch: committed before it returned
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    same_weights(params, ref_params)
    assert bool(forced and any(waited)) == write_behind, (len(forced), sum(waited))


def test_a_staged_step_is_durable_after_flush_or_close(make_dirs):
    dirs = make_dirs(1)
    mcfg, ecfg = tiny_cfg(), config(dirs, clip_mode="defer")
    data = list(batches(3))
    engine = lohan.init(mcfg, ecfg)
    try:
        engine.step(data[0], next_batch=data[1])
        assert engine.step_count == 1 and engine.committed_step == 0 and _commit_on_disk(dirs) == 0
        engine.flush()
        assert engine.committed_step == 1 and _commit_on_disk(dirs) == 1
        engine.step(data[1], next_batch=data[2])
        assert _commit_on_disk(dirs) == 1
        engine.evaluate(data[2])  # reads the committed slot: its writes are waited for first
        assert _commit_on_disk(dirs) == 2
        engine.step(data[2], next_batch=data[0])
        assert _commit_on_disk(dirs) == 2
    finally:
        engine.close()
    assert _commit_on_disk(dirs) == 3
    store = StateStore.open(dirs, backend="threads")
    try:
        assert store.step == 3 and not store.verify()
    finally:
        store.close()


def test_write_behind_off_commits_every_step_before_it_returns(make_dirs):
    dirs = make_dirs(1)
    data = list(batches(2))
    with lohan.init(tiny_cfg(), config(dirs, clip_mode="defer", write_behind=False)) as engine:
        engine.step(data[0], next_batch=data[1])
        assert engine.last_stats.next_forward_overlapped
        assert not engine.store.staged and _commit_on_disk(dirs) == 1


def test_a_failed_tail_write_drops_the_step_and_training_goes_on_exactly(make_dirs):
    """The 2nd step's writes, all held to its end (the record pool holds the model), fail while the 3rd step
    runs: the 3rd step fails, the 2nd is dropped (the commit on disk and in memory stays at 1), and training
    from there matches plain PyTorch on the batches trained."""
    dirs = make_dirs(1)
    mcfg, ecfg = tiny_cfg(), config(dirs, clip_mode="defer", max_inflight_blocks=8)
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data[:1] + data[2:])  # batch 1 never trained on
    with lohan.init(mcfg, ecfg) as engine:
        losses = [engine.step(data[0], next_batch=data[1])]
        engine.flush()
        faulty = inject_faults(engine.store.volume, "write#1+:EIO")
        engine.step(data[1], next_batch=data[2])  # returns: its writes are its tail
        assert engine.store.staged and engine.step_count == 2
        # (the CPU, which computes on the records, finds the failed writes before the pass does when it loads the
        # records they left stale: `Engine.load_records`)
        with pytest.raises(RuntimeError, match="optimizer pipeline failed|last step's optimizer pass failed"):
            engine.step(data[2], next_batch=data[3])
        assert faulty.plan.fired
        engine.store.volume.backend = faulty.inner
        assert engine.step_count == 1 and engine.committed_step == 1 and _commit_on_disk(dirs) == 1
        for k in range(2, len(data)):
            losses.append(engine.step(data[k], next_batch=data[k + 1] if k + 1 < len(data) else None))
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    same_weights(params, ref_params)


def test_ctrl_c_after_the_commit_is_staged_drops_the_step(make_dirs, monkeypatch):
    """A step that raises is not committed, even when it was interrupted after its commit was staged."""
    dirs = make_dirs(1)
    data = list(batches(3))
    with lohan.init(tiny_cfg(), config(dirs, clip_mode="defer")) as engine:
        engine.step(data[0], next_batch=data[1])

        def interrupted(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(lohan.runtime.engine, "measure", interrupted)  # what the step measured, after its commit
        with pytest.raises(KeyboardInterrupt):
            engine.step(data[1], next_batch=data[2])
        monkeypatch.undo()
        assert engine.step_count == 1 and not engine.store.staged
        engine.step(data[1], next_batch=data[2])
        assert engine.step_count == 2
    assert _commit_on_disk(dirs) == 2


def test_config_refuses_a_non_boolean_write_behind():
    with pytest.raises(ValueError, match="write_behind"):
        lohan.config.EngineConfig(write_behind="yes")
