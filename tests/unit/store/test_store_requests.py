"""`check_request`: the one place that refuses what the NVMe directories cannot give a run (a new run over a
store, a resume of nothing, the wrong number of ranks), used by the command line, `lohan.init` and a torchrun
group alike; each refusal says why and what to do, and touches nothing."""

from __future__ import annotations

import os

import pytest

import lohan
from lohan.store.group import decision_path
from lohan.store.integrity import write_json_atomic
from lohan.store.opening import CLI, StoreExistsError, StoreRequestError, check_request
from tests.integration.test_engine_equivalence import engine_config, tiny_cfg


def fake_group(base: str, world: int, step: int = 3) -> None:
    """The commit record a torchrun group of `world` ranks leaves (its stores live under rank<r>/)."""
    os.makedirs(os.path.dirname(decision_path([base], "lohan")), exist_ok=True)
    write_json_atomic(decision_path([base], "lohan"), {"world": world, "step": step})


def test_an_empty_directory_may_start_or_be_resumed_by_the_api(tmp_path):
    d = [str(tmp_path)]
    assert check_request(d, "lohan", resume=False, overwrite=False).state == "none"
    assert check_request(d, "lohan", resume=True, overwrite=False).state == "none"  # the API starts a new store
    with pytest.raises(StoreRequestError, match="nothing to resume .* drop --resume"):
        check_request(d, "lohan", resume=True, overwrite=False, must_exist=True, asked=CLI)


def test_a_group_resumed_with_another_world_size_is_refused(tmp_path):
    fake_group(str(tmp_path), world=2)
    with pytest.raises(StoreRequestError, match="run on 2 ranks, and this run has 3"):
        check_request([str(tmp_path)], "lohan", resume=True, overwrite=False, world=3, rank=0)
    assert check_request([str(tmp_path)], "lohan", resume=True, overwrite=False, world=2, rank=0).state == "none"


def test_a_group_store_is_not_taken_for_an_empty_directory_by_one_process(tmp_path, make_dirs):
    base = make_dirs(1)[0]
    fake_group(base, world=2)
    with pytest.raises(StoreRequestError, match=r"run on 2 ranks \(under rank0 .. rank1\); launch it as it was"):
        check_request([base], "lohan", resume=False, overwrite=True)
    # lohan.init said nothing before and laid a single-process store out beside the group's
    before = sorted(os.listdir(base))
    with pytest.raises(StoreRequestError, match="launch it as it was: torchrun"):
        lohan.init(tiny_cfg(n_layer=2), engine_config([base]))
    assert sorted(set(os.listdir(base)) - {".lohan.lock"}) == before  # (the directory lock lohan takes)


def test_a_single_process_store_is_not_resumed_by_a_group(make_dirs):
    dirs = make_dirs(1)
    with lohan.init(tiny_cfg(n_layer=2), engine_config(dirs)):
        pass
    with pytest.raises(StoreRequestError, match="single-process run; resume it without torchrun"):
        check_request(dirs, "lohan", resume=True, overwrite=False, world=2, rank=0)


def test_a_new_run_over_a_store_is_refused_in_the_callers_words(make_dirs):
    dirs = make_dirs(1)
    with lohan.init(tiny_cfg(n_layer=2), engine_config(dirs)):
        pass
    with pytest.raises(StoreExistsError, match=r"pass resume=True to continue it, or overwrite=True"):
        check_request(dirs, "lohan", resume=False, overwrite=False)
    with pytest.raises(StoreExistsError, match=r"Pass --resume to continue it, or --overwrite to discard it"):
        check_request(dirs, "lohan", resume=False, overwrite=False, asked=CLI)
    assert check_request(dirs, "lohan", resume=True, overwrite=False).state == "complete"
