"""``exact`` states computed in fp32 keep no P16 copy: the fp32 master is what the compute reads (it was a copy bit
for bit). 4 bytes a parameter less in the record pool (every record resident: the model's whole copy, 0.41 GiB of
a 110M model's peak RSS), on the SSDs and written each step; the same bits as plain PyTorch; a store laid out
before it (a P16 section of its own) resumes as it was laid out."""

from __future__ import annotations

import lohan
import lohan.store.states as states
from io_engine.base import ALIGN, align_up
from lohan.config import get_model_config
from lohan.plan.pools import model_geometry, plan_host_memory, pool_config
from lohan.plan.records import layout_of
from tests.unit.runtime.test_clipping import STEPS, batches, check, reference, same_weights, tiny_cfg
from tests.unit.runtime.test_clipping import config as _config


def config(dirs, **kw):
    return _config(dirs, **{"resident_mem": "all", **kw})


def test_fp32_records_are_p32_m_v_only_and_the_record_pool_shrinks_by_a_quarter():
    n = 1_000_000
    fp32, bf16 = layout_of([n, 3 * n], "fp32"), layout_of([n, 3 * n], "bf16")
    assert [b.record_bytes for b in fp32.blocks] == [3 * align_up(4 * k) for k in (n, 3 * n)]
    assert fp32.p16_offset(1, 0) == fp32.record_offset(1, 0)  # the P16 is read from the master
    assert [b.record_bytes for b in bf16.blocks] == [3 * align_up(4 * k) + align_up(2 * k) for k in (n, 3 * n)]
    # the 110M Llama's shape with every record resident: the record pool holds P32, m and v, 12 B a parameter
    mcfg = get_model_config("tiny", vocab_size=32000, n_layer=12, d_model=768, n_head=12, seq_len=512)
    geometry = model_geometry(mcfg, "fp32", align=ALIGN)
    plan = plan_host_memory(geometry, pool_config("fp32", resident_mem="all", clip=True, cpu_mem=8 << 30))
    records = sum(b.record_bytes for b in geometry.store.blocks)
    assert len(plan.resident_blocks) == len(geometry.store.blocks)
    assert plan.records + plan.resident == records <= 12 * mcfg.param_count() + 3 * ALIGN * len(geometry.store.blocks)


def test_fp32_training_without_the_copy_is_bit_exact(make_dirs):
    ecfg = config(make_dirs(1), mode="optimized", clip_mode="speculate")
    check(tiny_cfg(tie_embeddings=True), ecfg, lookahead=True)
    with lohan.init(tiny_cfg(), ecfg, overwrite=True) as engine:
        assert not any(b.has_p16 for b in engine.store.layout.blocks)
        assert engine.records_pool.budget_bytes == sum(b.record_bytes for b in engine.store.layout.blocks)


def test_a_store_laid_out_with_a_p16_copy_resumes_with_it_bit_exactly(make_dirs, monkeypatch):
    mcfg, ecfg = tiny_cfg(), config(make_dirs(1), clip_mode="defer")
    data = list(batches(STEPS))
    with monkeypatch.context() as m:  # a store as lohan laid out fp32 records before: P32, m, v and P16
        m.setattr(states, "shares_p16", lambda fmt, dtype: False)
        with lohan.init(mcfg, ecfg) as engine:
            assert all(b.has_p16 for b in engine.store.layout.blocks)
            for batch in data[:3]:
                engine.step(batch)
    with lohan.init(mcfg, ecfg, resume=True) as engine:  # today's lohan: the layout the store has, not today's
        assert all(b.has_p16 for b in engine.store.layout.blocks) and engine.step_count == 3
        losses = [engine.step(batch) for batch in data[3:]]
        params = engine.state_dict_fp32()
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    assert [str(x) for x in losses] == [str(x) for x in ref_losses[3:]]
    same_weights(params, ref_params)
