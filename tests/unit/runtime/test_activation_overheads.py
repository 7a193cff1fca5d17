"""What the activation records cost a step beyond plain PyTorch's, and training stays bit-identical to it.

- Records keep only what a block's recompute reads (`activation_store.ReadWatch`): a block's first replay learns
  which recorded outputs autograd saves or a recomputed op reads; later records leave the others out and the
  replay hands back uninitialized memory in their place. Here that memory is NaN, so a left-out output that
  something did read would show in the losses and weights.
- The recording and replaying dispatch mode sees only the ops of the swapped sub-modules (`SelectiveMode.scoped`):
  the block's other ops run without a call into Python.
"""

from __future__ import annotations

import pytest
import torch

from lohan.runtime.activation_store import Dropped, OpTracker, ReadWatch, SelectiveMode
from lohan.runtime.hf_engine import init_from_hf

pytest.importorskip("transformers")
from tests.unit.models.test_hf import (  # noqa: E402
    STEPS,
    batches,
    engine_config,
    engine_hf_state,
    make_hf_dir,
    reference_run,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """hf_dir(family) -> a tiny random model directory of that family (tests/unit/models/test_hf.py's), made once."""
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_hf_dir(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get


def _nan_blank(self: Dropped, like: torch.Tensor) -> torch.Tensor:
    out = like.new_empty_strided(self.size, self.stride, dtype=self.dtype)
    return out.fill_(float("nan") if self.dtype.is_floating_point else -1)


@pytest.mark.parametrize("family,micro_batches", [("llama", 1), ("qwen2", 1), ("gpt2", 2)])
def test_records_leave_out_what_the_recompute_never_reads(hf_dir, make_dirs, monkeypatch, family, micro_batches):
    monkeypatch.setattr(Dropped, "blank", _nan_blank)
    path = hf_dir(family)
    ecfg = engine_config(make_dirs(2), act_policy="swap-all", micro_batches=micro_batches)
    ref_losses, ref_params = reference_run(path, ecfg, batches(STEPS))
    losses, stored = [], []
    with init_from_hf(path, ecfg) as engine:
        for batch in batches(STEPS):
            losses.append(engine.step(batch))
            stored.append(sum(engine.last_stats.activations["bytes"].values()))
        params = engine_hf_state(engine, engine.program)
    # the first step records everything (nothing is learned before a block's first replay), later ones less
    assert stored[1] < stored[0] and len(set(stored[1:])) == 1, stored
    assert losses == ref_losses
    for name, t in params.items():
        assert torch.equal(t, ref_params[name]), f"{name}: max |diff| {(t - ref_params[name]).abs().max():.3e}"


class _Block(torch.nn.Module):
    """a -> b = a * 2 (replayed; nothing saves b) -> c = b.exp() (replayed; exp saves its output), then d = c + 1
    outside the swapped op, and e = d * w (saves d)."""

    def __init__(self) -> None:
        super().__init__()
        self.op = _Op()
        self.w = torch.nn.Parameter(torch.full((4,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.op(x) + 1) * self.w


class _Op(torch.nn.Module):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return (a * 2).exp()


def test_read_watch_finds_what_autograd_saves_and_recomputed_ops_read():
    block = _Block()
    tracker = OpTracker([block])
    x = torch.arange(4.0)
    with torch.no_grad(), SelectiveMode(tracker, frozenset({"op"})) as rec:
        block(x)
    assert [len(r.leaves) for r in rec.records] == [1, 1]  # a * 2, then exp
    watch = ReadWatch()
    z = x.clone().requires_grad_()
    with watch.saved(), SelectiveMode(tracker, frozenset({"op"}), replay=rec.records, watch=watch):
        out = block(z)
    watch.mark(out)
    assert watch.unread(rec.records) == frozenset({0})  # b: only exp (replayed) takes it
    # recorded again without b: the replay's stand-in for it is never read, and the gradients are the same
    with torch.no_grad(), SelectiveMode(tracker, frozenset({"op"}), drop=frozenset({0})) as rec2:
        block(x)
    assert isinstance(rec2.records[0].leaves[0], Dropped) and isinstance(rec2.records[1].leaves[0], torch.Tensor)
    grads = []
    for records in (rec.records, rec2.records):
        z = x.clone().requires_grad_()
        with SelectiveMode(tracker, frozenset({"op"}), replay=records):
            out = block(z)
        grads.append(torch.autograd.grad(out.sum(), [z, block.w]))
    tracker.remove()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_only_the_swapped_ops_go_through_the_dispatch_mode(hf_dir, make_dirs, monkeypatch, family):
    seen: list[str | None] = []
    real = SelectiveMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(self.tracker.current)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(SelectiveMode, "__torch_dispatch__", counting)
    path = hf_dir(family)
    swap = "mlp" if family == "llama" else "mlp,attn"
    ecfg = engine_config(make_dirs(2), act_policy=f"ops:{swap}")
    with init_from_hf(path, ecfg) as engine:
        data = batches(3)
        engine.step(next(data))
        engine.step(next(data))  # (the first step's replays see every op: they learn what the block reads)
        seen.clear()
        engine.step(next(data))
        assert engine.last_stats.activations["swap"] == swap.split(",")
    assert seen and set(seen) <= set(swap.split(",")), sorted(set(map(str, seen)))


def test_a_scoped_mode_is_left_when_its_op_raises():
    block = _Block()
    tracker = OpTracker([block])
    mode = SelectiveMode(tracker, frozenset({"op"}))
    def boom(a: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    block.op.forward = boom
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), mode.scoped():
        block(torch.ones(4))
    assert tracker.mode is None and not tracker._entered
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None  # popped off the mode stack
    tracker.remove()


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_on_a_3d_input_is_recorded_once(bias):
    """A Linear on a 3-d input runs mm, then _unsafe_view back to 3-d: a view of the mm's output that its schema
    does not declare. The record holds the mm's output only (it held the view as a second tensor, twice the bytes)."""
    block = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=bias))
    tracker = OpTracker([block])
    with torch.no_grad(), SelectiveMode(tracker, frozenset({"0"})) as mode:
        out = block(torch.randn(2, 5, 8))
    tracker.remove()
    tensors = [t for r in mode.records for t in r.leaves if isinstance(t, torch.Tensor)]
    assert sum(t.numel() for t in tensors) == out.numel(), [(str(r.func), r.leaves[0].shape) for r in mode.records]
