"""A P16 block buffer's life in parameter streaming as named, checked states (p16_buffers.py, issue 38)."""

from __future__ import annotations

import pytest

import lohan
from lohan.runtime.p16_buffers import P16Buffer, P16State
from tests.unit.store.test_store import batch, ecfg, small_model


class FakeBuf:
    """An AlignedBuffer stand-in noting what happened to it."""

    def __init__(self) -> None:
        self.kept: tuple[int, int] | None = None
        self.released = False

    def keep(self, key: tuple[int, int]) -> None:
        self.kept = key

    def release(self) -> None:
        self.released = True


@pytest.mark.parametrize(("path", "bad", "verb"), [
    ([], P16State.IN_USE, "acquire"),  # used before its copy to the device started
    ([P16State.READING], P16State.KEPT, "release"),  # kept while its read is in flight
    ([P16State.FILLING], P16State.READING, "prefetch"),  # read over while the optimizer fills it
    ([P16State.READING, P16State.STAGED, P16State.DRAINING], P16State.IN_USE, "acquire"),
    ([P16State.READING, P16State.STAGED, P16State.IN_USE], P16State.STAGED, "stage"),
])
def test_an_illegal_transition_names_the_block_the_state_and_the_verb(path, bad, verb):
    entry = P16Buffer(5, 1, FakeBuf())
    for state in path:
        entry.to(state, "test")
    before = entry.state
    with pytest.raises(RuntimeError) as info:
        entry.to(bad, verb)
    msg = str(info.value)
    assert "block 5" in msg and before.name in msg and verb in msg and bad.name in msg
    assert entry.state is before  # nothing moved


def test_a_buffer_goes_back_to_its_pool_kept_under_block_and_slot_or_free():
    kept, freed = FakeBuf(), FakeBuf()
    P16Buffer(2, 1, kept).to(P16State.READING, "t").to(P16State.STAGED, "t").to(P16State.IN_USE, "t") \
        .to(P16State.KEPT, "release")
    assert kept.kept == (2, 1) and not kept.released
    P16Buffer(2, 0, freed).to(P16State.FILLING, "t").to(P16State.FREE, "release all")
    assert freed.released and freed.kept is None


def test_split_leaves_the_block_in_use_and_its_host_buffer_draining():
    buf = FakeBuf()
    entry = P16Buffer(4, 0, buf).to(P16State.READING, "t").to(P16State.STAGED, "t")
    twin = entry.split()
    assert entry.state is P16State.IN_USE and entry.buf is None
    assert twin.state is P16State.DRAINING and twin.buf is buf and twin.block == 4
    twin.to(P16State.KEPT, "reap")
    assert buf.kept == (4, 0)


def test_the_streamer_holds_one_entry_per_block_and_none_after_the_step(make_dirs):
    with lohan.init(small_model(), ecfg(make_dirs(1))) as engine:
        streamer = engine.streamer
        for s in range(2):
            engine.step(batch(s))
        assert all(e.state not in (P16State.KEPT, P16State.FREE) for e in streamer._blocks.values())
        assert set(streamer.resident) == {i for i, e in streamer._blocks.items() if e.state is P16State.IN_USE}
        with pytest.raises(RuntimeError, match="released while not streamed"):
            streamer.release(len(streamer.blocks) + 3)
