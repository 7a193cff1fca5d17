"""Python's garbage collector off a step's critical path (lohan/runtime/gc_policy.py): automatic collection off
while an engine is open, young generations at each step's end, a full collection every gc_every steps of what
was made since the first step's freeze, Python's schedule given back by the last engine closed."""

from __future__ import annotations

import gc
import weakref

import pytest

import lohan
from lohan.runtime.gc_policy import StepGc
from tests.unit.runtime.test_clipping import batches, config, tiny_cfg


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _python_schedule():
    """Each test starts and ends with Python's own schedule (a failed test must not leave it off)."""
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


def test_schedule_off_while_open_and_given_back_by_the_last_engine():
    a, b = StepGc(5), StepGc(5)
    assert not gc.isenabled()
    a.step_done()
    assert gc.get_freeze_count() > 0  # what lives after the first step is frozen
    a.close()
    assert not gc.isenabled() and gc.get_freeze_count() > 0  # b is still open
    b.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    b.close()  # (twice: nothing more)
    assert gc.isenabled()


def test_a_process_that_had_it_off_keeps_it_off():
    gc.disable()
    s = StepGc(3)
    s.step_done()
    s.close()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_every_zero_leaves_python_alone():
    s = StepGc(0)
    s.step_done()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    s.close()
    assert gc.isenabled()
    with pytest.raises(ValueError, match="gc_every=-1"):
        StepGc(-1)


def test_young_cycles_at_each_step_end_old_ones_every_n_steps():
    s = StepGc(3)
    try:
        s.step_done()  # step 1: the freeze
        young = _Node()
        ref = weakref.ref(young)
        del young
        assert ref() is not None  # nothing collects it mid-step
        s.step_done()  # step 2: generation 1
        assert ref() is None
        old = _Node()
        ref = weakref.ref(old)
        gc.collect(1)  # survives two young collections: generation 2 now
        del old
        s.step_done()  # step 3: a full collection (3 % 3 == 0)
        assert ref() is None
        old = _Node()
        ref = weakref.ref(old)
        gc.collect(1)
        del old
        s.step_done()  # step 4: young generations only
        assert ref() is not None
    finally:
        s.close()


def test_engine_steps_without_automatic_collection_and_gives_it_back(make_dirs):
    mcfg, data = tiny_cfg(n_layer=2), list(batches(3))
    seen = []
    with lohan.init(mcfg, config(make_dirs(1), gc_every=2)) as engine:
        for batch, target in data:
            engine.step((batch, target))
            seen.append(gc.isenabled())
        assert gc.get_freeze_count() > 0
    assert seen == [False] * 3
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with lohan.init(mcfg, config(make_dirs(1), gc_every=0), overwrite=True) as engine:
        engine.step(data[0])
        assert gc.isenabled()


def test_config_refuses_a_negative_interval(make_dirs):
    with pytest.raises(ValueError, match="gc_every=-2 must be an integer >= 0"):
        config(make_dirs(1), gc_every=-2)
