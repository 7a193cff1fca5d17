"""Back-pressure and tails (issue 38): optimized mode's gradient pool holds every block's gradient, as serial
mode's, where cpu_mem allows it (backward no longer waits for an optimizer that fell behind), and the next
optimizer pass waits for the last pass's write-behind tail per buffer instead of draining it whole first."""

from __future__ import annotations

import pytest

from io_engine.align import ALIGN, align_up
from lohan.config import EngineConfig, get_model_config
from lohan.plan.pools import model_geometry, plan_host_memory

GiB = 1 << 30


def _plan(mode: str, cpu_mem: int, **kw):
    ecfg = EngineConfig(compute_dtype="bf16", cpu_mem=cpu_mem, mode=mode, nvme=("unused",), max_grad_norm=0.0,
                        **kw)
    return plan_host_memory(model_geometry(get_model_config("350m"), "bf16", 2, align=ALIGN), ecfg, check=False)


@pytest.mark.parametrize("kw", [dict(clip_mode="speculate"), dict(clip_mode="speculate", resident_mem=0)])
def test_optimized_grads_pool_is_at_least_serials_where_memory_allows(kw):
    """350m, bf16, clipping off, 8 GiB: optimized's grads pool was two block buffers (0.20 GiB) against serial's
    every block (0.66 GiB), and backward waited for the optimizer to give one back."""
    serial, optimized = _plan("serial", 8 * GiB, **kw), _plan("optimized", 8 * GiB, **kw)
    assert optimized.grads + optimized.grad_stash >= serial.grads
    assert not optimized.grads_short and "short" not in optimized.describe()
    assert optimized.total <= optimized.budget


def test_where_cpu_mem_does_not_allow_the_pool_stays_and_the_plan_says_so():
    tight = _plan("optimized", 3 * GiB, clip_mode="speculate", resident_mem=0)
    serial = _plan("serial", 8 * GiB, clip_mode="speculate", resident_mem=0)
    two = 2 * max(_block_grads())
    assert tight.grads == two < serial.grads and tight.total <= tight.budget
    assert tight.grads_short == serial.grads - two
    assert "short of every block's gradient" in tight.describe()


def _block_grads() -> list[int]:
    layout = model_geometry(get_model_config("350m"), "bf16", 2, align=ALIGN).layout
    return [align_up(2 * b.numel) for b in layout.blocks]  # bf16 gradients, one buffer a block
