"""A single process is a data-parallel group of one (`lohan.runtime.parallel.Group`): the engine and the run driver
hold a group always and call it at the points a data-parallel rank does, its collectives identities; nothing
outside the parallel module asks whether there is a group (the gloo runs of tests/test_parallel.py go through the
same code, `DataParallel` answering the same calls with real collectives)."""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lohan
from lohan.runtime import parallel
from lohan.runtime.parallel import DataParallel, Group
from tests.unit.runtime.test_clipping import batches, config, tiny_cfg

REPO = Path(__file__).resolve().parents[3]
PARALLEL = REPO / "lohan" / "runtime" / "parallel.py"


def _is_group(node: ast.AST) -> bool:
    """`dp` or `x.dp`: the process's data-parallel group."""
    return isinstance(node, ast.Name) and node.id == "dp" or isinstance(node, ast.Attribute) and node.attr == "dp"


def dp_branches(source: str, where: str = "<source>") -> list[str]:
    """The places in `source` that branch on whether there is a data-parallel group: `dp is None` / `is not None`,
    a group taken as a truth value (`if dp`, `x if self.dp else y`, `dp and ...`, `not dp`), and the `_Whole`
    stand-in for a group's whole model."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tests: list[ast.AST] = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests.append(node.operand)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif (isinstance(node, ast.Compare) and _is_group(node.left)
              and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops)
              and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)):
            found.append(f"{where}:{node.lineno}: compares the group with None")
        elif isinstance(node, (ast.Name, ast.Attribute, ast.ClassDef)) and "_Whole" in (
                getattr(node, "id", None), getattr(node, "attr", None), getattr(node, "name", None)):
            found.append(f"{where}:{node.lineno}: _Whole")
        found += [f"{where}:{t.lineno}: takes the group as a truth value" for t in tests if _is_group(t)]
    return found


def test_no_branch_on_a_data_parallel_group_outside_the_parallel_module():
    found = []
    for path in sorted((REPO / "lohan").rglob("*.py")):
        if path != PARALLEL:
            found += dp_branches(path.read_text(), str(path.relative_to(REPO)))
    assert not found, ("a single process is a group of one (parallel.Group): call the group, put a choice that "
                       "differs in a Group method, rather than branch on dp:\n  " + "\n  ".join(found))


@pytest.mark.parametrize("code", ["if dp:\n    x = 1\n", "y = a if self.dp else b\n", "ok = dp and dp.is_main\n",
                                  "ok = not ctx.dp\n", "if self.dp is None:\n    pass\n", "w = dp is not None\n",
                                  "w = _Whole(e)\n", "class _Whole:\n    pass\n"])
def test_the_check_finds_each_kind_of_branch(code):
    assert dp_branches(code)


def test_the_check_lets_calls_on_the_group_through():
    assert not dp_branches("loss = self.dp.sum(loss)\nif not dp.is_main:\n    pass\nr = dp.rank if bd else 0\n")


@dataclasses.dataclass
class CountingGroup(Group):
    """A group of one that counts the calls made on it."""

    calls: Counter = dataclasses.field(default_factory=Counter)


for _name in ("rank_config", "device_name", "check_store", "join", "reduce_gradient", "sum", "commit", "recommit"):
    def _counted(self, *args, _name=_name, **kwargs):
        self.calls[_name] += 1
        return getattr(Group, _name)(self, *args, **kwargs)
    setattr(CountingGroup, _name, _counted)


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_a_single_process_calls_its_group_of_one_and_makes_no_collective(make_dirs, monkeypatch, device):
    """The engine of one process opens, steps, evaluates and reads its weights through the group's methods, as a
    rank does (`DataParallel` overrides them), and none of it reaches torch.distributed: no process group, no
    collective, no bytes counted, no network in its stats. A block's gradient goes through the group's
    `reduce_gradient` where it is copied to a host buffer (a separate device); on the CPU the optimizer takes
    autograd's own gradients (`pools.hands_over_grads`: one process), with no buffer for a group to sum."""
    def collective(*args, **kwargs):
        raise AssertionError("a single process made a torch.distributed call")
    for name in ("init_process_group", "new_group", "all_reduce", "all_gather_into_tensor", "all_gather_object",
                 "broadcast_object_list", "barrier", "monitored_barrier"):
        monkeypatch.setattr(dist, name, collective)
    group = CountingGroup()
    monkeypatch.setattr(DataParallel, "detect", staticmethod(lambda: group))
    mcfg, steps = tiny_cfg(), 2
    data = list(batches(steps))
    with lohan.init(mcfg, config(make_dirs(1), total_steps=steps, device=device)) as engine:
        assert engine.dp is group and engine.world == 1 and group.alone
        for batch in data:
            engine.step(batch)
            assert engine.last_stats.network_bytes is None
            assert not {"gather", "reduce_wait"} & set(engine.last_stats.lanes)
        engine.evaluate(data[0])
        weights = engine.whole.read_params(0)
        n = len(engine.layout.blocks)
    assert all(torch.isfinite(t).all() for t in weights)
    assert not dist.is_initialized()
    assert group.reduced_bytes == group.gathered_bytes == 0
    reduced = 0 if device == "cpu" else steps * n
    assert group.calls == Counter(rank_config=1, device_name=1, check_store=1, join=1, reduce_gradient=reduced,
                                  sum=steps + 1, commit=steps)


def test_a_group_of_one_is_what_a_process_not_launched_as_a_group_gets(monkeypatch):
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("a group of one created a process group"))
    group = parallel.current_group()
    assert type(group) is Group and group.rank == 0 and group.world == 1 and group.is_main
    assert group.rank_dirs(["/a", "/b"]) == group.main_dirs(["/a", "/b"]) == ("/a", "/b")
    assert group.store_rank is None and group.sum(1.5) == 1.5 and group.broadcast("x") == "x"
    rank = DataParallel(rank=1, world=2)
    assert not rank.alone and rank.store_rank == 1 and rank.rank_dirs(["/a"]) == (str(Path("/a") / "rank1"),)
