"""State formats' bytes (lohan/plan/formats.py), what the planner will price each format by."""

from __future__ import annotations

import pytest

from lohan.plan import formats
from lohan.runtime import quant


def test_exact_moves_28_bytes_per_parameter_a_step_as_the_cost_model_counts():
    exact = formats.state_format("exact")
    assert exact.at_rest() == 14 and exact.record() == 12
    assert exact.per_step() == 12 + 14 + 2  # read P32, m, v; write them and P16; read P16 for the compute
    # fp32 compute: no copy is stored or written, the master is read as the P16 (it was a copy bit for bit)
    assert exact.per_step(p16_bytes=4) == 12 + 12 + 4 and exact.at_rest(4) == 12
    assert not exact.keeps_p16(4) and exact.keeps_p16(2)


def test_each_compressed_format_weighs_less_and_bf16_master_has_no_separate_copy():
    sizes = [formats.state_format(name).at_rest() for name in formats.FORMATS]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 14
    master = formats.state_format("bf16-master")
    assert master.at_rest() == pytest.approx(2 + 2 * (1 + 4 / 256)) and not master.separate_p16
    # the next forward beside the update takes the new weights from it: nothing read for the compute
    assert master.per_step(p16_read=False) == pytest.approx(2 * master.record()) and master.per_step() <= 10.1
    assert formats.QBLOCK == quant.QBLOCK


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="choose one of exact, bf16-moments, 8bit-moments, bf16-master"):
        formats.state_format("int4")
