"""The optimizer pipeline's record buffers as named states (lohan/runtime/record_buffers.py): an illegal transition is
refused with the unit and the states, every buffer is back in the pool (or resident) when a pass is over, and a
write-behind pass leaves its tail WRITING until it is drained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import lohan
from lohan.runtime.record_buffers import BufState, Ledger, RecordBuffer
from tests.unit.runtime.test_clipping import batches, config, tiny_cfg


def _buffer(unit=(3, 0, 8), resident: bool = False):
    released = []
    buf = SimpleNamespace(release=lambda: released.append(1), capacity=4096)
    return RecordBuffer(unit, buf, Ledger(), resident=resident), released


def test_an_illegal_transition_is_refused_and_names_the_unit_and_the_states():
    rb, released = _buffer()
    with pytest.raises(RuntimeError, match=r"unit \(3, 0, 8\).*FREE -> WRITING.*HELD or UPDATING"):
        rb.to(BufState.WRITING)  # a WRITE of bytes never read nor updated
    assert rb.state is BufState.FREE and not rb.ledger.moves
    rb.to(BufState.READING)
    with pytest.raises(RuntimeError, match=r"READING -> UPDATING.*READY"):
        rb.to(BufState.UPDATING)  # updating a buffer whose READ may still be in flight
    with pytest.raises(RuntimeError, match="retired while READING"):
        rb.retire()
    rb.abandon()  # a failed pass gives back what it holds, from any state
    assert rb.state is BufState.FREE and released == [1]
    with pytest.raises(RuntimeError, match="abandoned while FREE"):
        rb.abandon()  # never twice to the pool
    assert released == [1]


def test_a_buffer_goes_round_its_lifecycle_and_the_ledger_counts_it():
    rb, released = _buffer()
    ledger = rb.ledger
    for state in (BufState.READING, BufState.READY, BufState.UPDATING, BufState.HELD, BufState.WRITING):
        rb.to(state)
        assert ledger.counts() == {state.value: 1}
    rb.handle = SimpleNamespace(wait=lambda: None, done=lambda: True)
    rb.retire()
    assert rb.state is BufState.FREE and rb.handle is None and released == [1] and ledger.counts() == {}
    assert sum(ledger.moves.values()) == 6
    res, released = _buffer(resident=True)  # a resident record rests in RESIDENT, and skips a READ it needs not
    res.to(BufState.READY).to(BufState.UPDATING).to(BufState.WRITING).retire()
    assert res.state is BufState.RESIDENT and not released and res.ledger.counts() == {"resident": 1}


@pytest.mark.parametrize("mode", ["serial", "naive", "optimized"])
def test_every_buffer_is_back_after_a_step(make_dirs, mode):
    data = list(batches(2))
    with lohan.init(tiny_cfg(), config(make_dirs(1), mode=mode)) as engine:
        ago = engine.offloader
        units = sum(len(ago.units(i)) for i in range(len(engine.layout.blocks)))
        assert ago.resident  # the pool holds the tiny model: its records stay from step to step
        for k, batch in enumerate(data):
            before = dict(ago.buffers.moves)
            engine.step(batch)
            moves = {key: n - before.get(key, 0) for key, n in ago.buffers.moves.items()}
            # nothing READING, READY, UPDATING, HELD or WRITING once the step is over
            assert ago.buffers.counts() == {"resident": len(ago.resident)}
            assert moves.get((BufState.UPDATING, BufState.WRITING), 0) == units
            assert moves.get((BufState.RESIDENT, BufState.READY), 0) == ago.resident_hits
            # the first step reads them all (those the CPU computes on in place: before its pass, `load_records`)
            assert ago.resident_hits == (len(ago.resident) if k else len(engine.run_plan.zero_copy))


def test_a_write_behind_pass_leaves_its_tail_writing_until_it_is_drained(make_dirs):
    data = list(batches(2))
    # a deferred pass followed by the next forward, and a pool that holds the model: every write ends in the tail
    # (held while READs were still to come, issued at once after the last one, none reaped before the next pass)
    with lohan.init(tiny_cfg(), config(make_dirs(1), clip_mode="defer", max_inflight_blocks=8)) as engine:
        ago = engine.offloader
        engine.step(data[0], next_batch=data[1])
        assert engine.store.staged and not ago.tail_done.is_set()
        tail = len(ago.behind.tail)
        assert tail == len(engine.layout.blocks)
        assert ago.buffers.counts().get("writing") == tail
        held, direct = (ago.buffers.moves.get((BufState.UPDATING, to), 0) for to in (BufState.HELD, BufState.WRITING))
        assert held + direct == tail and direct >= 1
        ago.drain_tail()
        assert ago.tail_done.is_set() and not ago.behind.tail
        assert ago.buffers.counts() == ({"resident": len(ago.resident)} if ago.resident else {})
        engine.flush()
        assert engine.committed_step == 1
